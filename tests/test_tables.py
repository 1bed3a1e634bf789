"""The one results table: every CSV door writes the same columns, decided before any row.

Oracles: the layout of each kind of model and request written out by hand (the
documented schema); the JSON answer of the same request, bag by bag; the three doors
(HTTP ``text/csv``, ``bagserve predict --format csv`` locally and through a service,
``bagserve batch``) against each other; Python's csv reader for the quoting.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import numpy as np
import pytest
from bagserve.core import load, read_manifest, save
from bagserve.core.artifact_info import ArtifactInfo
from bagserve.core.demo import build_demo_models, demo_samples
from bagserve.core.io.spreadsheet import SafeWriter
from bagserve.core.results import RegressionPrediction
from bagserve.service.options import PredictOptions
from bagserve.service.tables import TRUST_COLUMNS, TableLayout

from bagserve.cli import main

from .service_harness import running_service

TRUST = list(TRUST_COLUMNS)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tables") / "models"
    build_demo_models(directory)
    for name in ("demo-dose", "demo-gating"):
        src = directory / name / "1"
        meta = dict(read_manifest(src)["metadata"])
        meta.update(name=f"{name}-withheld", serving={"out_of_domain": "withhold"})
        save(load(src), directory / f"{name}-withheld" / "1", **meta)
    return directory


@pytest.fixture(scope="module")
def url(models):
    with running_service(models) as url:
        yield url


def shape(models: Path, name: str) -> dict:
    return ArtifactInfo.read(models / name / "1").answer_shape()


def test_the_layout_follows_the_model_and_the_request_alone(models):
    """The documented schema, kind by kind (service/tables.py's docstring)."""
    dose, gating = shape(models, "demo-dose"), shape(models, "demo-gating")
    classes = gating["classes"]
    assert classes == ["B", "NK", "T cytotoxic", "T helper"]
    assert TRUST == [
        "status", "out_of_range", "domain_score", "withheld_reason", "input_sha256",
        "model_sha256", "warnings", "error",
    ]  # fmt: skip
    assert TableLayout.of(dose, PredictOptions()).columns == ["id", "prediction", *TRUST]
    assert TableLayout.of(dose, PredictOptions(coverage=0.9)).columns == [
        "id", "prediction", "interval_lo", "interval_hi", *TRUST,
    ]  # fmt: skip
    assert TableLayout.of(gating, PredictOptions()).columns == ["id", "cell", "label", *TRUST]
    assert TableLayout.of(gating, PredictOptions(probabilities=True)).columns == [
        "id", "cell", "label", *(f"p_{c}" for c in classes), *TRUST,
    ]  # fmt: skip
    assert TableLayout.of(gating, PredictOptions(cells=False)).columns == [
        "id", "n_cells", *(f"count_{c}" for c in classes), *(f"percent_{c}" for c in classes),
        *(f"mean_probability_{c}" for c in classes), *TRUST,
    ]  # fmt: skip
    # A rest class asked for: a column of its own, no mean probabilities (the model's
    # probabilities say nothing of that rule); named as the estimators name it.
    from bagserve.core.estimators.transfer.open_set import UNASSIGNED
    from bagserve.service import tables

    assert tables.UNASSIGNED == UNASSIGNED
    with_rest = [*classes, "unassigned"]
    assert TableLayout.of(gating, PredictOptions(cells=False, unassigned=0.999)).columns == [
        "id", "n_cells", *(f"count_{c}" for c in with_rest),
        *(f"percent_{c}" for c in with_rest), *TRUST,
    ]  # fmt: skip
    classifier = {"kind": "classification", "classes": ["high", "low"], "calibrated": True}
    assert TableLayout.of(classifier, PredictOptions(coverage=0.9)).columns == [
        "id", "prediction", "score_high", "score_low", "p_high", "p_low", "set", *TRUST,
    ]  # fmt: skip
    conditional = {"kind": "conditional", "n_outputs": 1, "calibrated": True}
    options = PredictOptions(quantiles=(0.05, 0.5), exceed=(2.0,), coverage=0.8)
    assert TableLayout.of(conditional, options).columns == [
        "id", "prediction", "q_0.05", "q_0.5", "p_gt_2", "interval_lo", "interval_hi", *TRUST,
    ]  # fmt: skip
    multi = {"kind": "regression", "n_outputs": 3}
    assert TableLayout.of(multi, PredictOptions()).values == [
        "prediction_0", "prediction_1", "prediction_2",
    ]  # fmt: skip


def test_an_answer_that_does_not_fit_its_columns_is_refused(models):
    """A table built for intervals never gets a row without one, nor a row of three
    outputs in one output's columns: a bug, raised, not a shifted row."""
    info = ArtifactInfo.read(models / "demo-dose" / "1")
    layout = TableLayout.of(info.answer_shape(), PredictOptions(coverage=0.9))
    plain = RegressionPrediction(values=np.array([0.5]), sizes=np.array([10]))
    with pytest.raises(ValueError, match="no interval"):
        list(layout.rows(plain, ["a"], info))
    wide = RegressionPrediction(
        values=np.ones((1, 3)), sizes=np.array([10]), interval=np.array([[0.0, 1.0]])
    )
    with pytest.raises(ValueError, match="3 outputs"):
        list(layout.rows(wide, ["a"], info))


def sample_files(
    folder: Path, kind: str, seed: int, n: int, shift_first: float = 0.0
) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    bags, _, markers = demo_samples(kind, n, seed)
    paths = []
    for i, b in enumerate(bags):
        points = np.asarray(b) + (shift_first if i == 0 else 0.0)
        rows = [",".join(markers), *(",".join(f"{v:.17g}" for v in r) for r in points)]
        path = folder / f"{chr(ord('a') + i)}-{kind}.csv"
        path.write_text("\n".join(rows) + "\n")
        paths.append(path)
    return paths


def read(text: str) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(io.StringIO(text, newline="")))
    return rows[0], rows[1:]


@pytest.mark.parametrize(
    ("name", "kind", "params"),
    [
        ("demo-dose-withheld", "dose", {"interval": "0.9"}),
        ("demo-gating-withheld", "gating", {"cells": "false"}),
    ],
)
def test_every_csv_door_writes_one_table(models, url, tmp_path, capsys, name, kind, params):
    """HTTP text/csv, ``predict --format csv`` (local and through the service) and
    ``batch`` give the same header and the same rows for the same files, the first of
    them withheld (out of the domain): its value cells are empty, not missing."""
    import httpx

    files = sample_files(tmp_path / "in", kind, 21, 3, shift_first=50.0)
    multipart = [("files", (p.name, p.read_bytes(), "text/csv")) for p in files]
    r = httpx.post(
        f"{url}/v1/models/{name}/predict",
        params=params,
        files=multipart,
        headers={"accept": "text/csv"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    http_head, http_rows = read(r.text)
    expected = TableLayout.of(
        shape(models, name),
        PredictOptions(coverage=0.9) if kind == "dose" else PredictOptions(cells=False),
    ).columns
    assert http_head == expected
    withheld = dict(zip(http_head, http_rows[0], strict=True))
    assert withheld["status"] == "withheld" and withheld["withheld_reason"]
    assert all(withheld[c] == "" for c in http_head[1 : http_head.index("status")])
    json_answer = httpx.post(
        f"{url}/v1/models/{name}/predict", params=params, files=multipart, timeout=120
    ).json()["predictions"]
    for row, p in zip(http_rows[1:], json_answer[1:], strict=True):
        cells = dict(zip(http_head, row, strict=True))
        assert cells["status"] == p["status"] != "withheld"
        if kind == "dose":
            assert float(cells["prediction"]) == p["prediction"]
            assert [float(cells["interval_lo"]), float(cells["interval_hi"])] == p["interval"]
        else:
            for q in p["population"]:
                assert int(cells[f"count_{q['class']}"]) == q["count"]
                assert float(cells[f"percent_{q['class']}"]) == q["percent"]

    model = str(models / name / "1")
    capsys.readouterr()
    assert main(["predict", model, *map(str, files), "--format", "csv"]) == 0
    local_text = capsys.readouterr().out
    assert main(["predict", name, *map(str, files), "--format", "csv", "--url", url]) == 0
    remote_text = capsys.readouterr().out
    assert local_text == remote_text == r.text
    out = tmp_path / "batch.csv"
    assert main(["batch", model, str(files[0].parent), str(out), "--settle", "0"]) == 0
    assert out.read_text() == r.text


def test_a_carriage_return_cannot_start_a_formula_row(models, url):
    """A bare carriage return in an id is quoted: no reader ends the row there, and a
    cell that starts with one is escaped like any formula."""
    import httpx

    bags, _, markers = demo_samples("dose", 2, 3)
    ids = ['\r=HYPERLINK("http://x")', "a\r+1"]
    body = {
        "bags": [
            {"id": i, "markers": markers, "points": np.asarray(b).tolist()}
            for i, b in zip(ids, bags, strict=True)
        ]
    }
    r = httpx.post(
        f"{url}/v1/models/demo-dose/predict", json=body, headers={"accept": "text/csv"}, timeout=60
    )
    assert r.status_code == 200, r.text
    _, rows = read(r.text)
    assert len(rows) == 2 and [row[0] for row in rows] == ["'" + ids[0], ids[1]]
    # A reader that ends rows at bare carriage returns (as spreadsheets do) sees two
    # rows too: every CR is inside quotes.
    unquoted = r.text.split('"')[0::2]
    assert not any("\r" in part for part in unquoted)
    buf = io.StringIO()
    SafeWriter(buf).writerow(["\n=1+2", "x,y", 'q"', 1.5, None])
    assert buf.getvalue() == '"\'\n=1+2","x,y","q""",1.5,\r\n'


def test_the_batch_table_of_a_model_is_the_services_table(models, url, tmp_path):
    """``batch --url`` writes the service's rows under the header it knew before the
    first file (a per-cell model's populations from GET /v1/models)."""
    folder = tmp_path / "drop"
    sample_files(folder, "gating", 5, 2)
    local, remote = tmp_path / "local.csv", tmp_path / "remote.csv"
    model = str(models / "demo-gating" / "1")
    assert main(["batch", model, str(folder), str(local), "--settle", "0", "--quiet"]) == 0
    assert (
        main(["batch", "demo-gating", str(folder), str(remote), "--url", url, "--settle", "0",
              "--quiet"])
        == 0
    )  # fmt: skip
    assert remote.read_text() == local.read_text()
    assert os.path.getsize(remote) > 0
