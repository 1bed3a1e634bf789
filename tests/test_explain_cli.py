"""bagserve predict --explain: the explanation per result, and FCS files with a
contribution channel that FlowJo or FlowKit can gate on."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from bagserve.core import Bags, DistributionRidge, MeanEmbedding, explain, save
from bagserve.core.io import Panel, Preprocessing, read_sample

from bagserve.cli import main

from .conftest import SHARED_DATA

YEAST = SHARED_DATA / "cytoflow_yeast" / "dose_response"


@pytest.fixture(scope="module")
def yeast_model(tmp_path_factory):
    files = sorted(YEAST.glob("Yeast_B*.fcs"))
    panel = Panel(("FSC-A", "SSC-A", "FITC-A"), {"FITC-A": ("GFP",)})
    pre = Preprocessing(transform="arcsinh", cofactor=150.0)
    bags = pre.apply(
        Bags.from_arrays([panel.select(read_sample(f)) for f in files]), list(panel.markers)
    )
    rep = MeanEmbedding(method="rff", n_components=100, bandwidth=1.0, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = DistributionRidge(rep, kernel="linear").fit(
            bags, np.arange(len(files), dtype=float)
        )
    path = tmp_path_factory.mktemp("explain-cli") / "yeast" / "1"
    save(model, path, name="yeast", version="1", panel=panel.to_json(), preprocessing=pre.to_json())
    return path, model, panel, pre, files


def test_predict_explain_writes_explanations_and_fcs_with_contributions(
    yeast_model, tmp_path, capsys
):
    path, model, panel, pre, files = yeast_model
    out_dir = tmp_path / "fcs"
    chosen = files[:2]
    assert (
        main(["predict", str(path), *map(str, chosen), "--explain", "--fcs-dir", str(out_dir)]) == 0
    )
    answer = json.loads(capsys.readouterr().out)
    for f, result in zip(chosen, answer["results"], strict=True):
        sample = read_sample(f)
        cells = pre.apply(Bags.from_arrays([panel.select(sample)]), list(panel.markers))
        expected = explain(model, cells, markers=["FSC-A", "SSC-A", "FITC-A"])
        e = result["explanation"]
        assert e["method"] == "exact"
        assert abs(e["baseline"][0] + e["total"][0] - result["prediction"]) < 1e-9
        np.testing.assert_allclose(e["total"], expected.total, rtol=1e-12)
        written = read_sample(out_dir / f"{f.name}.explained.fcs")
        assert written.alt_names[-1] == "contribution"
        assert written.points.shape == (sample.points.shape[0], sample.points.shape[1] + 1)
        np.testing.assert_array_equal(
            written.points[:, :-1], sample.points.astype(np.float32).astype(np.float64)
        )
        np.testing.assert_allclose(
            written.points[:, -1], expected.contributions[:, 0], rtol=1e-6, atol=1e-12
        )


def test_fcs_dir_without_explain_is_refused(yeast_model, tmp_path):
    path, *_, files = yeast_model
    with pytest.raises(SystemExit, match="--explain"):
        main(["predict", str(path), str(files[0]), "--fcs-dir", str(tmp_path)])


def test_the_commands_hl7_message_carries_the_summary_the_service_adds(yeast_model):
    """``predict --explain --hl7``: the ORU^R01 the command sends carries each bag's
    one-line summary, as the service's ``?explain=true`` message does (one builder,
    ``oru_r01``, given the same explanation documents); without ``explain``, none."""
    from bagserve.service.explanations import summary_text

    from bagserve.cli.local import explanation_documents as _explanation_documents
    from bagserve.cli.local import oru_for_files
    from bagserve.cli.local import predict_local as _predict_local

    path, _, _, _, files = yeast_model
    refs = {"patient": "p-1", "orders": ["o-1"]}
    with_summary = oru_for_files(path, files[:1], refs=refs, explain=True)
    plain = oru_for_files(path, files[:1], refs=refs)
    *_, explained = _predict_local(
        path, files[:1], compensated=False, coverage=0.9, names=None, explain=True
    )
    (document,) = _explanation_documents(explained)
    line = summary_text(document)
    assert line in with_summary and line not in plain


def test_predict_explain_of_a_per_cell_model_gives_its_shares(tmp_path, capsys):
    """``predict --explain`` with a per-cell model: each result's explanation is the
    model's own (its shares of the sample's cells), and ``--fcs-dir`` writes its
    contributions as a channel."""
    from bagserve.core import load
    from bagserve.core.demo import build_demo_models, demo_samples

    build_demo_models(tmp_path / "models")
    path = tmp_path / "models" / "demo-gating" / "1"
    tasks, _, markers = demo_samples("gating", 1, 4)
    cells = np.asarray(tasks[0])
    sample = tmp_path / "patient.csv"
    rows = [",".join(markers)] + [",".join(f"{v:.17g}" for v in row) for row in cells]
    sample.write_text("\n".join(rows) + "\n")
    out_dir = tmp_path / "fcs"
    assert main(["predict", str(path), str(sample), "--explain", "--fcs-dir", str(out_dir)]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    expected = load(path).explain(cells, markers=markers)
    e = result["explanation"]
    assert e == expected.to_dict(top=10) and e["method"] == "assignment"
    counts = {row["class"]: row["count"] for row in result["population"]}
    assert e["prediction"] == [counts.get(c, 0) / cells.shape[0] for c in e["outputs"]]
    written = read_sample(out_dir / "patient.csv.explained.fcs")
    np.testing.assert_allclose(written.points[:, -1], expected.contributions[:, -1], rtol=1e-6)
