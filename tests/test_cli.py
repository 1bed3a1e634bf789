"""The bagserve command: train on real data, evaluate, predict, list, demo, errors."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pytest
from bagserve.core import load, read_manifest
from bagserve.core.demo import DEMO_MODELS, demo_samples
from bagserve.core.training import GridEdgeWarning

from bagserve.cli import main
from bagserve.cli.local import predict_files
from bagserve.cli.models import list_models

from .conftest import SHARED_DATA

ROOT = Path(__file__).resolve().parents[1]
YEAST = SHARED_DATA / "cytoflow_yeast" / "dose_response"
GVHD = SHARED_DATA / "flowcap1_gvhd"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _toml_value(v) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def write_toml(path: Path, config: dict) -> Path:
    """A small TOML writer for the test configs (tables of scalars, lists, inline tables)."""
    lines = []
    for table, body in config.items():
        nested = {k: v for k, v in body.items() if isinstance(v, dict) and "class" in v}
        lines.append(f"[{table}]")
        lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in body.items() if k not in nested]
        for k, v in nested.items():
            lines.append(f"[{table}.{k}]")
            lines += [f"{json.dumps(kk)} = {_toml_value(vv)}" for kk, vv in v.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def example(name: str, tmp_path: Path, **overrides: dict) -> Path:
    """The shipped example config, with absolute data paths and optional overrides."""
    src = ROOT / "examples" / name / "train.toml"
    config = tomllib.loads(src.read_text())
    base = src.parent
    data = config["data"]
    for key in ("files", "labels", "cell_label_files"):
        if key in data:
            data[key] = (
                str((base / data[key]).resolve()) if key != "files" else str(base / data[key])
            )
    config["model"]["output"] = str(tmp_path / "models")
    for table, values in overrides.items():
        config.setdefault(table, {}).update(values)
    return write_toml(tmp_path / f"{name}.toml", config)


def test_train_yeast_example_on_real_fcs(tmp_path, capsys):
    cfg = example("yeast_dose", tmp_path)
    with pytest.warns(GridEdgeWarning, match=r"(gamma|alpha) = "):  # the grid-edge report
        code, out, err = run(capsys, "train", str(cfg), "--quiet")
    assert code == 0, err
    summary = json.loads(out)
    path = Path(summary["model"])
    # Dose is a property of the whole sample: cross-validated R² well above 0.
    assert summary["cv"]["r2"] > 0.8
    manifest = read_manifest(path)
    meta = manifest["metadata"]
    assert meta["panel"]["markers"] == ["FSC-A", "SSC-A", "FITC-A"]
    assert meta["preprocessing"]["transform"] == "arcsinh"
    assert len(meta["training_data_sha256"]) == 64 and len(meta["training_files"]) == 21
    for f in ("report/metrics.json", "report/predicted_vs_true.png", "report/cv_curve.png"):
        assert f in manifest["files"]
        assert (path / f).read_bytes()[:4] in (b"\x89PNG", b"{\n  ")
    # One self-contained HTML report: tables and plots, no external resource.
    page = (path / "report" / "report.html").read_text()
    assert page.count("<img") == 3 and "http" not in page.replace("data:image/png", "")
    # What a reviewer signs against heads the report; the card gives the values used.
    assert f"<b>training data sha256</b>: {meta['training_data_sha256']}" in page
    assert "<b>libraries</b>: bagserve " in page
    chosen = summary["best_params"]
    assert isinstance(chosen["gamma"], float) and isinstance(chosen["alpha"], float)
    card = (path / "card.md").read_text()
    assert f"gamma = {chosen['gamma']:.4g}" in card and f"alpha = {chosen['alpha']:.4g}" in card
    still = [e["parameter"] for e in meta["grid_edges"] if e["still_on_edge"]]
    assert ("still at the edge" in card) == bool(still)
    report = json.loads((path / "report" / "metrics.json").read_text())
    number = r"(-?[0-9.]+(?:e-?[0-9]+)?)"
    rows = re.findall(
        rf"<tr><td>(Yeast_\w+\.fcs)</td><td>([0-6])</td><td>{number}</td><td>{number}</td>"
        rf"<td>{number}</td></tr>",
        page,
    )
    assert len(rows) == 21  # one per training well: fold, label, CV prediction, residual
    for _, _, label, pred, residual in rows:  # shown to 4 significant digits
        assert float(label) - float(pred) == pytest.approx(float(residual), abs=2e-3)
    # Every well in the fold that held it out: 7 folds of 3 wells.
    assert sorted(int(r[1]) for r in rows) == sorted(list(range(7)) * 3)
    # Per-fold RMSEs recombine into the cross-validated RMSE (7 folds of 3 bags).
    folds = report["per_fold"]
    assert [f["bags"] for f in folds] == [3] * 7
    pooled = np.sqrt(np.mean([f["rmse"] ** 2 for f in folds]))
    assert pooled == pytest.approx(report["cv"]["rmse"], rel=1e-9)
    # Evaluating on the training bags is refused unless asked for, and then labelled.
    code, _, err = run(capsys, "evaluate", str(path), str(cfg), "--quiet")
    assert code == 1 and "--include-training" in err
    code, out, _ = run(capsys, "evaluate", str(path), str(cfg), "--quiet", "--include-training")
    report = json.loads(out)
    assert code == 0 and report["r2"] > 0.95 and report["n_overlapping"] == 21
    # predict agrees with the library and says how close each file is to the training bags.
    files = [str(YEAST / "Yeast_B1_B01.fcs"), str(YEAST / "Yeast_C9_C09.fcs")]
    code, out, _ = run(capsys, "predict", str(path), *files)
    result = json.loads(out)
    assert result["model"]["name"] == "yeast-dose"
    high, low = (r["prediction"] for r in result["results"])
    assert high > low
    assert high == pytest.approx(predict_files(path, files)["results"][0]["prediction"])
    for r in result["results"]:
        # These two files are training bags: in range, nearest to themselves, by name.
        assert r["domain"]["out_of_range"] is False
        # Training samples are named as stored at training: the file's name, no path.
        assert r["domain"]["nearest"][0] == Path(r["file"]).name
        assert r["status"] == "final"
        assert r["input_sha256"] == hashlib.sha256(Path(r["file"]).read_bytes()).hexdigest()
    # The CSV a lab scripts carries every trust field, the same as the JSON.
    code, out, err = run(capsys, "predict", str(path), *files, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == [
        "id",
        "prediction",
        "interval_lo",
        "interval_hi",
        "status",
        "out_of_range",
        "domain_score",
        "withheld_reason",
        "input_sha256",
        "model_sha256",
        "warnings",
        "error",
    ]
    assert code == 0 and err == "" and len(rows) == 2
    for row, r in zip(rows, result["results"], strict=True):
        # Named by the file's name, as an upload of the file is named.
        assert row["id"] == Path(r["file"]).name and float(row["prediction"]) == r["prediction"]
        assert [float(row["interval_lo"]), float(row["interval_hi"])] == r["interval"]
        assert float(row["interval_lo"]) <= r["prediction"] <= float(row["interval_hi"])
        assert (row["out_of_range"], row["status"]) == ("0", "final")
        assert float(row["domain_score"]) == r["domain"]["score"]
        assert row["input_sha256"] == r["input_sha256"]
        assert row["withheld_reason"] == row["warnings"] == row["error"] == ""
        assert row["model_sha256"] == read_manifest(path)["manifest_sha256"]
        assert row["model_sha256"] == result["model"]["sha256"]


def test_train_gvhd_example_cell_level(tmp_path, capsys):
    # The shipped config, on 4 samples, its search made small (the full one runs in
    # make bench / by hand).
    files = [str(GVHD / f"sample{k}.csv.gz") for k in (1, 2, 3, 4)]
    cfg = example(
        "gvhd",
        tmp_path,
        data={"files": files},
        estimator={"cv": 2, "perturbations": 2, "embedding_points": 300, "n_components": 64},
        cv={"n_splits": 2},
    )
    # Marginal transfer chooses among named calibrations and cell models, never along
    # a numeric grid: nothing is reported as a grid edge.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = run(capsys, "train", str(cfg), "--quiet")
    assert not [w for w in caught if issubclass(w.category, GridEdgeWarning)]
    assert code == 0, err
    summary = json.loads(out)
    assert summary["cv"]["scheme"] == "leave-tasks-out"
    assert summary["cv"]["accuracy"] > 0.6
    path = Path(summary["model"])
    assert "report/confusion_matrix.png" in read_manifest(path)["files"]
    # The report's tables agree with its metrics, recomputed from them independently.
    tables = json.loads((path / "report" / "metrics.json").read_text())
    page = (path / "report" / "report.html").read_text()
    assert "Per class" in page and "each row normalised" in page and "sample1.csv.gz" in page
    per_fold = tables["per_fold"]
    assert [f["bags"] for f in per_fold] == [2, 2]
    cm = np.asarray(summary_cm := tables["cv"]["confusion_matrix"], dtype=float)
    assert summary_cm and np.isclose(
        np.trace(cm) / cm.sum(), summary["cv"]["accuracy"]
    )  # the confusion matrix counts every cell once
    # Population frequencies per sample agree with that confusion matrix: its row sums
    # are the true cells per class, its column sums the predicted ones.
    labels = tables["cv"]["labels"]
    cells = {r["file"]: r["cells"] for r in tables["per_sample"]}
    freq = tables["frequencies"]
    assert len(freq) == len(cells) * len(labels)
    for k, label in enumerate(labels):
        of = [r for r in freq if r["class"] == label]
        true = sum(r["true_percent"] * cells[r["file"]] / 100 for r in of)
        predicted = sum(r["predicted_percent"] * cells[r["file"]] / 100 for r in of)
        assert true == pytest.approx(cm[k].sum()) and predicted == pytest.approx(cm[:, k].sum())
    for r in tables["per_sample"]:
        mine = [f for f in freq if f["file"] == r["file"]]
        assert sum(f["predicted_percent"] for f in mine) == pytest.approx(100)
        # Each misclassified cell moves one count between two classes.
        moved = sum(abs(f["difference"]) for f in mine)
        assert moved <= 2 * 100 * (1 - r["accuracy"]) + 1e-9
    agreement = tables["cv"]["frequency_agreement"]
    # Bland-Altman per population over the samples (pooled, the bias is 0 by design).
    for a, label in zip(agreement["per_class"], labels, strict=True):
        d = np.array([f["difference"] for f in freq if f["class"] == label])
        assert a["class"] == label and a["n"] == len(cells) == d.size
        assert a["bias"] == pytest.approx(d.mean())
        assert a["upper"] == pytest.approx(d.mean() + 1.96 * d.std(ddof=1))
        assert a["lower"] == pytest.approx(d.mean() - 1.96 * d.std(ddof=1))
    d_all = np.array([f["difference"] for f in freq])
    assert abs(d_all.mean()) < 1e-9  # why not pooled
    worst = max(freq, key=lambda f: abs(f["difference"]))
    assert agreement["worst_pair"] == worst
    recall = np.diag(cm) / cm.sum(axis=1)
    weakest = labels[int(np.argmin(recall))]
    assert agreement["weakest_class"] == {"class": weakest, "recall": pytest.approx(recall.min())}
    assert "report/bland_altman.png" in read_manifest(path)["files"]
    card = (path / "card.md").read_text()
    assert f"Weakest class: `{weakest}`" in card and "95 % limits of agreement" in card
    assert "Population frequencies: Bland–Altman" in page and "Weak spots" in page
    model = load(path)
    # [labels] unassigned = "other": those cells are the rest class, "unassigned".
    assert set(model.classes_) == {"gate 1", "gate 3", "gate 4", "unassigned"}
    assert model.unassigned == "unassigned" and "reject_threshold" in model.selection_
    assert "unassigned" in labels and "unassigned" in page
    code, out, _ = run(
        capsys, "predict", str(path), str(GVHD / "sample5.csv.gz"), "--format", "csv"
    )
    (row,) = list(csv.DictReader(io.StringIO(out)))
    # The population summary per file, a column per class, with the trust fields; every
    # cell with --cells.
    classes = ["gate 1", "gate 3", "gate 4", "unassigned"]
    assert list(row)[:10] == [
        "id",
        "n_cells",
        *(f"count_{c}" for c in classes),
        *(f"percent_{c}" for c in classes),
    ]
    n_cells = int(row["n_cells"])
    assert sum(int(row[f"count_{c}"]) for c in classes) == n_cells
    assert sum(float(row[f"percent_{c}"]) for c in classes) == pytest.approx(100)
    assert row["status"] in {"final", "preliminary"} and row["input_sha256"]
    code, out, _ = run(
        capsys, "predict", str(path), str(GVHD / "sample5.csv.gz"), "--format", "csv", "--cells"
    )
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0][:3] == ["id", "cell", "label"] and len(rows) == 1 + n_cells > 10_000


def test_demo_models_and_list(tmp_path, capsys):
    code, out, _ = run(capsys, "demo", "--models", str(tmp_path))
    assert code == 0
    assert [Path(p).parts[-2] for p in out.split()] == list(DEMO_MODELS)
    rows = list_models(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert rows[0]["metrics"]["holdout_rmse"] < 0.25 * rows[0]["metrics"]["dose_std"]
    assert rows[1]["metrics"]["holdout_cell_accuracy"] > 0.9
    # A second run keeps the existing models.
    code, out, _ = run(capsys, "demo", "--models", str(tmp_path))
    assert code == 0 and out == ""
    bags, y, _ = demo_samples("gating", 1, 5)
    model = load(tmp_path / "demo-gating" / "1")
    assert np.mean(model.predict(bags) == y) > 0.9
    # A tampered model is reported, and the listing exits non-zero.
    victim = sorted((tmp_path / "demo-dose" / "1" / "arrays").glob("*.npy"))[0]
    victim.write_bytes(victim.read_bytes()[:-4])
    code, out, _ = run(capsys, "models", "list", str(tmp_path))
    assert code == 1 and "FAILED" in out and "demo-gating/1" in out


def test_errors_are_one_line_and_exit_non_zero(tmp_path, capsys):
    code, _, err = run(capsys, "predict", str(tmp_path / "none"), "x.csv")
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1
    bad = tmp_path / "bad.toml"
    bad.write_text("[data]\nfiles = 'nothing/*.fcs'\n[estimator]\nclass = 'DistributionRidge'\n")
    code, _, err = run(capsys, "train", str(bad))
    assert code == 1 and "nothing matches" in err
    bad.write_text("[data]\nfiles = 'x'\n[estimator]\nclass = 'os.system'\n")
    code, _, err = run(capsys, "train", str(bad))
    assert code == 1 and "class must be one of" in err
    bad.write_text("[data\n")
    code, _, err = run(capsys, "train", str(bad))
    assert code == 1 and "invalid TOML" in err
    shutil.copy(YEAST / "Yeast_B1_B01.fcs", tmp_path / "cells.fcs")
    run(capsys, "demo", "--models", str(tmp_path / "m"))
    code, _, err = run(
        capsys, "predict", str(tmp_path / "m" / "demo-dose" / "1"), str(tmp_path / "cells.fcs")
    )
    assert code == 1 and "missing marker(s) ['GFP']" in err
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2


def test_entry_point_is_installed():
    exe = Path(sys.executable).parent / "bagserve"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True)
    assert "train" in out.stdout and "predict" in out.stdout
