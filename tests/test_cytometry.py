"""Cytometry-native preprocessing: compensation, logicle/hyperlog, per-marker overrides,
calibrated class probabilities and population summaries of per-cell models.

Oracles: the spillover model ``observed = true · S`` multiplied forward (and numpy's
solve), the compensated and logicle-transformed copy of a real FCS file made upstream by
FlowSOM (flowCore), the closed-form biexponential and hyperlog functions of GatingML 2.0
evaluated here and inverted, and naive per-bag counts.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import flowio
import numpy as np
import pytest
from bagserve.core import Bags, MarginalTransferClassifier
from bagserve.core.calibration import fit_temperature, probabilities
from bagserve.core.datasets import make_batched_cytometry_tasks, make_cytometry_tasks
from bagserve.core.errors import DataError
from bagserve.core.io import (
    Compensation,
    Panel,
    Preprocessing,
    Sample,
    Spillover,
    read_sample,
    read_spillover_csv,
)
from bagserve.core.io.compensation import parse_spillover_keyword
from bagserve.core.results import CellPrediction
from bagserve.core.runtime import ModelRuntime
from scipy.optimize import brentq

from .conftest import SHARED_DATA

FLOWSOM = SHARED_DATA / "flowsom_example"
SCATTER = ["Time", "FSC-A", "FSC-H", "FSC-W", "SSC-A", "SSC-H", "SSC-W"]


def spillover(rng: np.random.Generator, n: int) -> np.ndarray:
    """A plausible spillover matrix: 1 on the diagonal, 0-30 % into other detectors."""
    s = rng.uniform(0.0, 0.3, size=(n, n)) * (rng.random((n, n)) < 0.5)
    np.fill_diagonal(s, 1.0)
    return s


def write_fcs(path: Path, points: np.ndarray, names: list[str], spill: str | None) -> Path:
    meta = {"SPILLOVER": spill} if spill is not None else None
    with open(path, "wb") as fh:
        flowio.create_fcs(fh, points.astype(np.float32).ravel(), names, metadata_dict=meta)
    return path


def spill_keyword(names: list[str], s: np.ndarray) -> str:
    return ",".join([str(len(names)), *names, *[repr(float(v)) for v in s.ravel()]])


# ------------------------------------------------------------------ compensation
def test_compensation_undoes_the_spillover_model(rng):
    true = rng.gamma(2.0, 500.0, size=(3000, 4))
    s = spillover(rng, 4)
    observed = true @ s
    time = np.arange(3000.0)[:, None]
    # The matrix lists its channels in another order than the sample's columns.
    order = [2, 0, 3, 1]
    names = ["Time", "B-A", "D-A", "A-A", "C-A"]
    points = np.hstack([time, observed[:, [1, 3, 0, 2]]])
    sample = Sample(points, names, names, "s.fcs")
    chans = tuple(["A-A", "B-A", "C-A", "D-A"][i] for i in order)
    s_ordered = s[np.ix_(order, order)]
    comp = Compensation("matrix", Spillover(chans, s_ordered))
    out = comp.apply(sample).points
    np.testing.assert_allclose(out[:, 0], time[:, 0])  # not a spillover channel
    np.testing.assert_allclose(out[:, 1:], true[:, [1, 3, 0, 2]], rtol=1e-10)
    # numpy's solve with the matrix, the oracle the issue names.
    cols = [names.index(c) for c in chans]
    solved = np.linalg.solve(s_ordered.T, points[:, cols].T).T
    np.testing.assert_allclose(out[:, cols], solved, rtol=1e-12)
    # The input is not modified.
    assert np.array_equal(sample.points, points)


def test_the_fcs_files_own_matrix_reproduces_flowcores_compensated_logicle_copy():
    """ff.fcs is not_preprocessed.fcs compensated with its SPILL keyword and logicle
    transformed by flowCore (T=262144, W=0.5, M=4.5, A=0; flowCore scales by M)."""
    raw = read_sample(FLOWSOM / "not_preprocessed.fcs")
    done = read_sample(FLOWSOM / "ff.fcs")
    assert raw.spillover is not None and raw.spillover.startswith("11,FITC-A")
    pre = Preprocessing(
        compensation="file",
        transform="logicle",
        markers={name: {"transform": "none"} for name in SCATTER},
    )
    panel = Panel(tuple(raw.alt_names))
    x = pre.transform_points(panel.select(pre.compensate(raw)), panel.markers)
    fluor = slice(len(SCATTER), None)
    # ff.fcs stores float32: 4.5 * 1 at full scale has a spacing of 5e-7.
    np.testing.assert_allclose(4.5 * x[:, fluor], done.points[:, fluor], atol=1e-6)
    np.testing.assert_array_equal(x[:, : len(SCATTER)], done.points[:, : len(SCATTER)])
    # The compensation step alone against numpy's solve with the parsed keyword.
    spill = parse_spillover_keyword(raw.spillover, raw.alt_names)
    cols = [raw.alt_names.index(c) for c in spill.channels]
    solved = np.linalg.solve(spill.matrix.T, raw.points[:, cols].T).T
    np.testing.assert_allclose(pre.compensate(raw).points[:, cols], solved, rtol=1e-12)


def test_spillover_keyword_forms():
    names = ["FL1-A", "FL2-A"]
    full = parse_spillover_keyword("2,FL1-A,FL2-A,1,0.1,0.02,1", names)
    assert full.channels == ("FL1-A", "FL2-A")
    np.testing.assert_array_equal(full.matrix, [[1, 0.1], [0.02, 1]])
    # FCS 3.0 $COMP without names: the first n channels.
    bare = parse_spillover_keyword("2,1,0.1,0.02,1", names)
    assert bare.channels == ("FL1-A", "FL2-A")
    with pytest.raises(DataError, match="expected 6"):
        parse_spillover_keyword("2,FL1-A,FL2-A,1,0.1", names, source="x.fcs")
    with pytest.raises(DataError, match="'abc' is not a number"):
        parse_spillover_keyword("2,FL1-A,FL2-A,1,abc,0.02,1", names)


def test_spillover_csv_with_and_without_row_names(tmp_path):
    plain = tmp_path / "plain.csv"
    plain.write_text("FL1-A,FL2-A\n1,0.1\n0.02,1\n")
    named = tmp_path / "named.csv"
    named.write_text(",FL1-A,FL2-A\nFL1-A,1,0.1\nFL2-A,0.02,1\n")
    for path in (plain, named):
        s = read_spillover_csv(path)
        assert s.channels == ("FL1-A", "FL2-A")
        np.testing.assert_array_equal(s.matrix, [[1, 0.1], [0.02, 1]])
    bad = tmp_path / "bad.csv"
    bad.write_text("FL1-A,FL2-A\n1,0.1\n")
    with pytest.raises(DataError, match=r"bad.csv: the matrix must be square"):
        read_spillover_csv(bad)
    worse = tmp_path / "worse.csv"
    worse.write_text("FL1-A,FL2-A\n1,x\n0.02,1\n")
    with pytest.raises(DataError, match=r"row 2, channel 'FL2-A': 'x' is not a number"):
        read_spillover_csv(worse)
    swapped = tmp_path / "swapped.csv"
    swapped.write_text(",FL1-A,FL2-A\nFL2-A,1,0.1\nFL1-A,0.02,1\n")
    with pytest.raises(DataError, match="row names"):
        read_spillover_csv(swapped)


def test_compensation_errors_name_the_sample_and_the_channel(rng):
    pts = rng.random((10, 2))
    csv_sample = Sample(pts, ["FL1-A", "FL2-A"], ["FL1-A", "FL2-A"], "patient-7.csv")
    with pytest.raises(DataError, match=r"patient-7.csv: .*own\s+spillover matrix"):
        Compensation("file").apply(csv_sample)
    comp = Compensation("matrix", Spillover(("FL1-A", "FL3-A"), np.eye(2)))
    with pytest.raises(DataError, match=r"patient-7.csv: spillover channel\(s\) \['FL3-A'\]"):
        comp.apply(csv_sample)
    with pytest.raises(ValueError, match="singular"):
        Compensation("matrix", Spillover(("a", "b"), np.ones((2, 2))))
    with pytest.raises(ValueError, match="compensation must be"):
        Compensation("auto")  # type: ignore[arg-type]


def test_compensation_round_trips_through_the_manifest_form(rng, tmp_path):
    s = spillover(rng, 3)
    path = tmp_path / "spill.csv"
    path.write_text("a,b,c\n" + "\n".join(",".join(repr(float(v)) for v in row) for row in s))
    comp = Compensation.from_config("spill.csv", tmp_path)
    assert comp.mode == "matrix" and comp.source == "spill.csv"
    pre = Preprocessing(compensation=comp, transform="logicle", markers={"b": {"W": 1.0}})
    again = Preprocessing.from_json(json.loads(json.dumps(pre.to_json())))
    assert again.compensation.spillover is not None
    np.testing.assert_array_equal(again.compensation.spillover.matrix, s)
    assert again.compensation.spillover.channels == ("a", "b", "c")
    assert again.column_specs(["a", "b"]) == pre.column_specs(["a", "b"])
    assert Preprocessing.from_json({"transform": "none"}).compensation.mode == "none"


# ------------------------------------------------------------------ transforms
def _symmetric(f, y, x1):
    """Both scales are odd about ``x1`` (zero data): ``x(y) = -x(2 x1 - y)`` below it."""
    y = np.asarray(y, dtype=np.float64)
    return np.where(y >= x1, f(y), -f(2 * x1 - y))


def _gatingml_logicle_inverse(y, T, W, M, A):
    """x = a e^{by} - c e^{-dy} - f above x1 (Moore & Parks 2012; GatingML 2.0)."""
    w, x2 = W / (M + A), A / (M + A)
    x1, x0 = x2 + w, x2 + 2 * w
    b = (M + A) * np.log(10.0)
    d = b if w == 0 else brentq(lambda d: 2 * (np.log(d) - np.log(b)) + w * (b + d), 1e-12, b)
    ca = np.exp(x0 * (b + d))
    fa = np.exp(b * x1) - ca * np.exp(-d * x1)
    a = T / (np.exp(b) - fa - ca * np.exp(-d))
    return _symmetric(lambda t: a * np.exp(b * t) - ca * a * np.exp(-d * t) - fa * a, y, x1)


def _gatingml_hyperlog_inverse(y, T, W, M, A):
    """x = a e^{by} + c y - f above x1 (GatingML 2.0, hyperlog)."""
    w, x2 = W / (M + A), A / (M + A)
    x1, x0 = x2 + w, x2 + 2 * w
    b = (M + A) * np.log(10.0)
    e0 = np.exp(b * x0)
    ca = e0 / w
    fa = np.exp(b * x1) + ca * x1
    a = T / (np.exp(b) + ca - fa)
    return _symmetric(lambda t: a * np.exp(b * t) + ca * a * t - fa * a, y, x1)


@pytest.mark.parametrize(
    ("kind", "inverse"),
    [("logicle", _gatingml_logicle_inverse), ("hyperlog", _gatingml_hyperlog_inverse)],
)
@pytest.mark.parametrize(
    "params", [(262144.0, 0.5, 4.5, 0.0), (10000.0, 1.0, 4.0, 0.5), (1e6, 0.2, 5.0, -0.1)]
)
def test_logicle_and_hyperlog_invert_the_gatingml_functions(kind, inverse, params):
    T, W, M, A = params
    y = np.linspace(-0.05, 1.05, 201)
    x = inverse(y, T, W, M, A)
    assert np.all(np.diff(x) > 0)  # the oracle itself is monotone
    pre = Preprocessing(transform=kind, T=T, W=W, M=M, A=A)
    out = pre.transform_points(x[:, None], ["m"])[:, 0]
    np.testing.assert_allclose(out, y, atol=1e-9)
    # y = 1 at the top of the scale; zero maps to the linear region's centre.
    top = pre.transform_points(np.array([[T], [0.0]]), ["m"])[:, 0]
    np.testing.assert_allclose(top, [1.0, (W + A) / (M + A)], atol=1e-9)


def test_per_marker_transforms_and_checks(rng):
    x = rng.normal(1000.0, 3000.0, size=(500, 4))
    markers = ["FSC-A", "CD4", "CD8", "Time"]
    pre = Preprocessing(
        transform="logicle",
        cofactor=5.0,
        markers={
            "fsc a": {"transform": "none"},  # matched ignoring case and punctuation
            "CD8": {"transform": "arcsinh", "cofactor": 150.0},
            "Time": {"transform": "log"},
        },
    )
    out = pre.transform_points(x, markers)
    np.testing.assert_array_equal(out[:, 0], x[:, 0])
    np.testing.assert_allclose(
        out[:, 1], Preprocessing(transform="logicle").transform_points(x[:, [1]], ["c"])[:, 0]
    )
    np.testing.assert_allclose(out[:, 2], np.arcsinh(x[:, 2] / 150.0))
    np.testing.assert_allclose(out[:, 3], np.log10(np.maximum(x[:, 3], 1.0)))
    # A per-marker cofactor table (the older form) still applies.
    legacy = Preprocessing(transform="arcsinh", cofactor={"CD4": 150.0})
    np.testing.assert_allclose(
        legacy.transform_points(x[:, 1:3], ["CD4", "CD8"]),
        np.arcsinh(x[:, 1:3] / [150.0, 5.0]),
    )
    with pytest.raises(ValueError, match=r"override\(s\) for \['CD3'\]"):
        Preprocessing(markers={"CD3": {"transform": "none"}}).transform_points(x, markers)
    with pytest.raises(ValueError, match=r"markers.CD4: unknown key\(s\) \['t'\]"):
        Preprocessing(markers={"CD4": {"t": 1}})
    with pytest.raises(ValueError, match=r"logicle needs .* got T=262144.0, W=3.0"):
        Preprocessing(transform="logicle", W=3.0)
    with pytest.raises(ValueError, match=r"markers.CD4: cofactor must be > 0"):
        Preprocessing(transform="arcsinh", markers={"CD4": {"cofactor": 0}})
    with pytest.raises(ValueError, match="transform must be one of"):
        Preprocessing(transform="biexp")


# ------------------------------------------------ training and predicting with them
def _fcs_cohort(tmp_path: Path, rng: np.random.Generator, n: int = 8):
    """FCS files whose fluorescence spills (each file its own matrix); the label is
    the mean of the true (compensated) CD4 signal."""
    names = ["FSC-A", "FL1-A", "FL2-A", "FL3-A"]
    files, labels, true_cells = [], [], []
    for i in range(n):
        true = np.column_stack(
            [
                rng.normal(5e4, 1e4, 1500),
                rng.gamma(2.0, 200.0 + 150.0 * i, 1500),
                rng.gamma(2.0, 300.0, 1500),
                rng.gamma(2.0, 250.0, 1500),
            ]
        )
        s = spillover(rng, 3)
        observed = true.copy()
        observed[:, 1:] = true[:, 1:] @ s
        files.append(
            write_fcs(tmp_path / f"s{i}.fcs", observed, names, spill_keyword(names[1:], s))
        )
        true_cells.append(true.astype(np.float32).astype(np.float64))
        labels.append(float(np.arcsinh(true[:, 1] / 150.0).mean()))
    (tmp_path / "labels.csv").write_text(
        "file,label\n" + "".join(f"s{i}.fcs,{v}\n" for i, v in enumerate(labels))
    )
    return files, labels, true_cells, names


def _config(tmp_path: Path, streaming: bool) -> Path:
    cfg = tmp_path / f"train-{streaming}.toml"
    cfg.write_text(
        f"""
[model]
name = "comp"
version = "{int(streaming) + 1}"
output = "models"
[data]
files = "s*.fcs"
labels = "labels.csv"
[panel]
markers = ["FL1-A", "FL2-A", "FL3-A"]
[preprocessing]
compensation = "file"
transform = "arcsinh"
cofactor = 150
markers = {{ "FL3-A" = {{ transform = "logicle" }} }}
scale = "standard"
[estimator]
class = "DistributionRidge"
alpha = 1e-3
[estimator.representation]
class = "SlicedWasserstein"
n_directions = 10
n_levels = 10
random_state = 0
[cv]
n_splits = 4
[compute]
streaming = {str(streaming).lower()}
"""
    )
    return cfg


def test_training_compensates_and_the_model_applies_it_at_prediction(tmp_path, rng):
    from bagserve.core.training import train

    files, _, true_cells, names = _fcs_cohort(tmp_path, rng)
    memory = train(_config(tmp_path, False), progress=False)
    streamed = train(_config(tmp_path, True), progress=False)
    rt = ModelRuntime.open(memory.path)
    assert rt.info.metadata["preprocessing"]["compensation"] == "file"
    # Streaming compensates as it reads: the same scaling, learned from the same cells.
    np.testing.assert_allclose(
        ModelRuntime.open(streamed.path).info.preprocessing.mean_,
        rt.info.preprocessing.mean_,
        rtol=1e-12,
    )
    # Predicting the raw FCS files equals predicting their true cells, declared
    # compensated (to float32 storage of the files).
    from_files = rt.predict(rt.align([read_sample(f) for f in files[:3]])).estimate
    truth = [Sample(c, names, names, f"t{i}") for i, c in enumerate(true_cells[:3])]
    from_truth = rt.predict(rt.align(truth, compensated=True)).estimate
    np.testing.assert_allclose(from_files, from_truth, rtol=1e-4, atol=1e-4)
    # Without compensation the answer is different (the check can fail).
    raw = rt.predict(rt.align([read_sample(f) for f in files[:3]], compensated=True)).estimate
    assert np.max(np.abs(raw - from_truth)) > 10 * np.max(np.abs(from_files - from_truth))
    # A CSV of the raw cells carries no matrix: refused, naming the file.
    csv = tmp_path / "raw.csv"
    np.savetxt(
        csv, read_sample(files[0]).points, delimiter=",", header=",".join(names), comments=""
    )
    with pytest.raises(DataError, match=r"raw\.csv: the model compensates"):
        rt.align([read_sample(csv)])


def test_a_spillover_csv_in_the_config_is_stored_in_the_model(tmp_path, rng):
    from bagserve.core.training import train

    files, *_ = _fcs_cohort(tmp_path, rng, n=6)
    s = spillover(rng, 3)
    (tmp_path / "spill.csv").write_text(
        "FL1-A,FL2-A,FL3-A\n" + "\n".join(",".join(repr(float(v)) for v in r) for r in s)
    )
    cfg = _config(tmp_path, False)
    cfg.write_text(cfg.read_text().replace('compensation = "file"', 'compensation = "spill.csv"'))
    result = train(cfg, progress=False)
    (tmp_path / "spill.csv").unlink()  # the model no longer needs the file
    rt = ModelRuntime.open(result.path)
    stored = rt.info.preprocessing.compensation
    assert stored.mode == "matrix" and stored.source == "spill.csv"
    np.testing.assert_array_equal(stored.spillover.matrix, s)
    sample = read_sample(files[0])
    expected = sample.points.copy()
    expected[:, 1:] = np.linalg.solve(s.T, sample.points[:, 1:].T).T
    pre = rt.info.preprocessing
    np.testing.assert_allclose(
        rt.align([sample]).points,
        Panel(("FL1-A", "FL2-A", "FL3-A")).select(
            Sample(expected, sample.names, sample.alt_names, "x")
        ),
    )
    assert pre.column_specs(["FL1-A", "FL2-A", "FL3-A"])[2][0] == "logicle"


# ---------------------------------------------- probabilities and population summary
def test_temperature_scaling_recovers_a_known_temperature(rng):
    classes = np.array(["a", "b", "c"])
    logits = rng.normal(0.0, 2.0, size=(20000, 3))
    # Labels drawn from softmax(logits / 0.5): the scores' temperature is 0.5.
    p = probabilities(logits, 0.5)
    y = classes[(rng.random(20000)[:, None] > np.cumsum(p, axis=1)).sum(axis=1)]
    fit = fit_temperature(logits, y, classes)
    assert fit["temperature"] == pytest.approx(0.5, rel=0.05)
    assert fit["nll"] < fit["nll_at_1"]
    np.testing.assert_allclose(probabilities(logits, 1.0).sum(axis=1), 1.0)
    # Binary margins: P(classes[1]) = sigmoid(2 s / T).
    s = rng.normal(size=50)
    np.testing.assert_allclose(probabilities(s, 2.0)[:, 1], 1.0 / (1.0 + np.exp(-s)))


def test_population_summary_counts_and_mean_probabilities(tmp_path, rng):
    from bagserve.core import save

    tasks, y = make_cytometry_tasks(6, 300, n_markers=2, random_state=0)
    model = MarginalTransferClassifier(cell_model="kernel", random_state=0).fit(tasks, y)
    calibration = fit_temperature(model.decision_function(tasks), y, model.classes_)
    path = save(model, tmp_path / "m", probability_calibration=calibration)
    rt = ModelRuntime.open(path)
    new = make_cytometry_tasks(3, 250, n_markers=2, random_state=1)[0]
    result = rt.predict(new, probabilities=True)
    assert isinstance(result, CellPrediction)
    for i in range(3):
        labels = result.labels_of(i)
        rows = result.population(i)
        assert [r["class"] for r in rows] == model.classes_.tolist()
        assert [r["count"] for r in rows] == [int(np.sum(labels == c)) for c in model.classes_]
        assert sum(r["percent"] for r in rows) == pytest.approx(100.0)
        p = result.probabilities_of(i)
        expected = probabilities(
            model.decision_function(new[i : i + 1]), calibration["temperature"]
        )
        np.testing.assert_allclose(p, expected, rtol=1e-10)
        np.testing.assert_allclose([r["mean_probability"] for r in rows], expected.mean(axis=0))
        # The argmax of the probabilities is the label.
        np.testing.assert_array_equal(model.classes_[p.argmax(axis=1)], labels)
    # Round trip over the worker pipe's array form.
    from bagserve.core.results import prediction_from_arrays

    again = prediction_from_arrays("cell", result.to_arrays())
    assert again.population(2) == result.population(2)
    # A model saved without calibration gives counts but no probabilities.
    plain = ModelRuntime.open(save(model, tmp_path / "plain"))
    assert "mean_probability" not in plain.predict(new).population(0)[0]
    with pytest.raises(ValueError, match="no probability calibration"):
        plain.predict(new, probabilities=True)


@pytest.mark.filterwarnings("ignore::bagserve.core.training.GridEdgeWarning")
def test_training_calibrates_per_cell_probabilities_out_of_fold(tmp_path):
    from bagserve.core.training import train

    tasks, y = make_cytometry_tasks(6, 200, n_markers=2, random_state=0)
    for i in range(len(tasks)):
        lo, hi = tasks.offsets[i], tasks.offsets[i + 1]
        table = np.column_stack([tasks.points[lo:hi], y[lo:hi]])
        buf = io.StringIO()
        np.savetxt(buf, table, delimiter=",", header="m0,m1,label", comments="")
        (tmp_path / f"t{i}.csv").write_text(buf.getvalue())
    cfg = tmp_path / "cells.toml"
    cfg.write_text(
        """
[model]
name = "cells"
output = "models"
intended_use = "Research use: gating synthetic samples in the test suite."
[data]
files = "t*.csv"
cell_label_column = "label"
[estimator]
class = "MarginalTransferClassifier"
cell_model = "kernel"
random_state = 0
[cv]
n_splits = 3
"""
    )
    result = train(cfg, progress=False)
    cal = result.metrics["probability_calibration"]
    assert 1e-3 < cal["temperature"] < 1e2 and cal["cells"] == int(tasks.n_points)
    assert cal["nll"] <= cal["nll_at_1"] + 1e-12
    card = (result.path / "card.md").read_text()
    assert "Research use: gating synthetic samples" in card and "| leave-tasks-out |" in card
    # A per-cell model has no intervals: its calibration_ is that of new batches.
    assert "Intervals:" not in card
    # How every sample is calibrated and labelled, as the fitted model chose.
    line = next(x for x in card.splitlines() if x.startswith("- Every sample: calibrated"))
    # Landmarks are a classifier's one calibration without a control: nothing to choose.
    assert "its own populations where they show an instrument effect" in line
    assert "the marginal-transfer kernel" in line and "chosen on" not in line
    page = (result.path / "report" / "report.html").read_text()
    assert "Class probabilities" in page and f"{cal['cells']}" in page
    rt = ModelRuntime.open(result.path)
    assert rt.info.probability_temperature == pytest.approx(cal["temperature"])
    out = rt.predict(Bags.from_arrays([tasks.points[:50]]), probabilities=True)
    assert out.probabilities.shape == (50, np.unique(y).size)


def test_batched_cytometry_tasks_differ_by_batch_not_within():
    """The batch generator: shapes, batch ids, reproducible, and batch effects that a
    per-sample mean sees (samples of one batch closer than samples of two)."""
    tasks, y, batches = make_batched_cytometry_tasks(2, 5, 400, random_state=3, strength=2.0)
    assert len(tasks) == 10 and tasks.n_points == 4000 and y.shape == (4000,)
    assert batches.tolist() == [0] * 5 + [1] * 5
    again, y2, _ = make_batched_cytometry_tasks(2, 5, 400, random_state=3, strength=2.0)
    np.testing.assert_array_equal(np.asarray(again[7]), np.asarray(tasks[7]))
    np.testing.assert_array_equal(y2, y)

    # Per-population means (labels known here), so proportions do not blur the check.
    def centre(t: int) -> np.ndarray:
        x, lab = np.asarray(tasks[t]), y[tasks.offsets[t] : tasks.offsets[t + 1]]
        return np.concatenate([x[lab == k].mean(axis=0) for k in range(4)])

    centres = np.array([centre(t) for t in range(10)])
    d = np.linalg.norm(centres[:, None] - centres[None], axis=-1)
    within = d[:5, :5][np.triu_indices(5, 1)].max()
    between = d[:5, 5:].min()
    assert between > 2 * within
