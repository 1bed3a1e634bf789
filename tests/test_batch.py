"""``bagserve batch``: a folder of sample files into one table.

Oracles: each row against ``predict_files`` on that file alone (the one-file answer the
CLI and the service already test), hashlib on the file's bytes, the manifest's own
sha256; the Parquet table against the CSV one; the watched file's row against the
sha256 of the file as finally written.
"""

from __future__ import annotations

import csv
import hashlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from bagserve.core import read_manifest
from bagserve.core.demo import build_demo_models, demo_samples

from bagserve.batch import batch, sample_files
from bagserve.cli import main, predict_files

from .service_harness import running_service


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("batch") / "models"
    build_demo_models(directory)
    return directory


def write_csv(path: Path, points: np.ndarray, markers: list[str]) -> Path:
    rows = [",".join(markers), *(",".join(f"{v:.17g}" for v in r) for r in points)]
    path.write_text("\n".join(rows) + "\n")
    return path


def dose_folder(folder: Path, n: int = 3, seed: int = 4) -> list[Path]:
    folder.mkdir(exist_ok=True)
    bags, _, markers = demo_samples("dose", n, seed)
    return [
        write_csv(folder / f"tube-{seed}-{i}.csv", np.asarray(b), markers)
        for i, b in enumerate(bags)
    ]


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_folder_becomes_one_row_per_file_and_reruns_add_only_new_files(models, tmp_path, capsys):
    model = models / "demo-dose" / "1"
    folder = tmp_path / "drop"
    files = dose_folder(folder)
    (folder / "broken.csv").write_text("FSC-A,SSC-A\n")  # no cells, wrong markers
    (folder / ".hidden.csv").write_text("x\n")
    (folder / "copying.csv.part").write_text("x\n")
    (folder / "notes.pdf").write_text("not a sample\n")
    assert [p.name for p in sample_files(folder)] == [
        "broken.csv",
        *(p.name for p in files),
    ]
    out = tmp_path / "results.csv"
    code = main(["batch", str(model), str(folder), str(out), "--quiet"])
    assert code == 1  # one file failed; the others were predicted
    assert "3 predicted, 1 failed, 0 already" in capsys.readouterr().err
    rows = read_rows(out)
    assert list(rows[0]) == [
        "file",
        "file_sha256",
        "status",
        "prediction",
        "interval_lo",
        "interval_hi",
        "out_of_range",
        "domain_score",
        "model_sha256",
        "warnings",
        "error",
    ]
    by_name = {r["file"]: r for r in rows}
    assert set(by_name) == {"broken.csv", *(p.name for p in files)}
    assert by_name["broken.csv"]["error"] and by_name["broken.csv"]["prediction"] == ""
    assert str(folder) not in by_name["broken.csv"]["error"]  # the file, not the path
    sha = read_manifest(model)["manifest_sha256"]
    for path in files:
        row = by_name[path.name]
        (alone,) = predict_files(model, [path])["results"]
        assert float(row["prediction"]) == alone["prediction"]
        assert [float(row["interval_lo"]), float(row["interval_hi"])] == alone["interval"]
        assert row["status"] == alone["status"] and row["error"] == ""
        assert float(row["domain_score"]) == alone["domain"]["score"]
        assert row["out_of_range"] == str(int(alone["domain"]["out_of_range"]))
        assert row["file_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert row["model_sha256"] == sha
    # A rerun predicts only what is new (the failed file is tried again).
    (folder / "broken.csv").unlink()
    new = dose_folder(folder, n=1, seed=5)
    code = main(["batch", str(model), str(folder), str(out), "--quiet"])
    assert code == 0 and "1 predicted, 0 failed, 3 already" in capsys.readouterr().err
    assert [r["file"] for r in read_rows(out)][-1] == new[0].name
    assert len(read_rows(out)) == 5
    # Parquet when the name says so: the same table.
    pout = tmp_path / "results.parquet"
    assert main(["batch", str(model), str(folder), str(pout), "--quiet"]) == 0
    table = pq.read_table(pout).to_pylist()
    csv_rows = {r["file"]: r for r in read_rows(out) if not r["error"]}
    assert {r["file"] for r in table} == set(csv_rows)
    for r in table:
        assert float(r["prediction"]) == float(csv_rows[r["file"]]["prediction"])
        assert r["file_sha256"] == csv_rows[r["file"]]["file_sha256"]
    assert main(["batch", str(model), str(folder), str(pout), "--quiet"]) == 0
    assert len(pq.read_table(pout)) == 4  # nothing added the second time
    capsys.readouterr()
    # Another table is not overwritten.
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    assert main(["batch", str(model), str(folder), str(other), "--quiet"]) == 1
    assert "not a bagserve batch table" in capsys.readouterr().err
    assert other.read_text() == "a,b\n1,2\n"


def test_gating_model_rows_have_a_column_per_population(models, tmp_path):
    folder = tmp_path / "cells"
    folder.mkdir()
    tasks, _, markers = demo_samples("gating", 2, 3)
    paths = [write_csv(folder / f"p{i}.csv", np.asarray(t), markers) for i, t in enumerate(tasks)]
    out = tmp_path / "populations.csv"
    model = models / "demo-gating" / "1"
    counts = batch(lambda p: predict_files(model, [p]), folder, out, progress=False)
    assert counts == {"predicted": 2, "failed": 0, "skipped": 0}
    rows = read_rows(out)
    for path, row in zip(paths, rows, strict=True):
        (alone,) = predict_files(model, [path])["results"]
        assert int(row["n_cells"]) == alone["n_points"]
        for p in alone["population"]:
            assert int(row[f"count_{p['class']}"]) == p["count"]
            assert float(row[f"percent_{p['class']}"]) == p["percent"]
        total = sum(float(v) for k, v in row.items() if k.startswith("percent_"))
        assert total == pytest.approx(100)


def test_watch_takes_a_file_once_it_has_stopped_growing(models, tmp_path):
    model = models / "demo-dose" / "1"
    folder = tmp_path / "watched"
    folder.mkdir()
    bags, _, markers = demo_samples("dose", 1, 8)
    text = write_csv(tmp_path / "full.csv", np.asarray(bags[0]), markers).read_text()
    target = folder / "late.csv"

    def export() -> None:  # the cytometer's export: written in pieces
        time.sleep(0.5)
        half = len(text) // 2
        with target.open("w") as f:
            f.write(text[:half])
            f.flush()
            time.sleep(1.0)
            f.write(text[half:])

    writer = threading.Thread(target=export)
    writer.start()
    out = tmp_path / "watched.csv"
    counts = batch(
        lambda p: predict_files(model, [p]),
        folder,
        out,
        watch=True,
        poll=0.3,
        settle=2.0,  # longer than the export's pause
        idle_exit=6.0,
        progress=False,
    )
    writer.join()
    assert counts == {"predicted": 1, "failed": 0, "skipped": 0}
    (row,) = read_rows(out)
    assert row["file_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert row["error"] == ""


def test_batch_through_a_running_service_matches_the_local_table(models, tmp_path):
    """To the last bit, whatever BLAS threads the local command may use (the service's
    workers use one)."""
    from threadpoolctl import threadpool_limits

    folder = tmp_path / "remote"
    dose_folder(folder, n=2, seed=6)
    local, remote = tmp_path / "local.csv", tmp_path / "remote.csv"
    with threadpool_limits(2):
        assert (
            main(["batch", str(models / "demo-dose" / "1"), str(folder), str(local), "--quiet"])
            == 0
        )
    with running_service(models) as url:
        done = subprocess.run(
            [sys.executable, "-m", "bagserve", "batch", "demo-dose", str(folder), str(remote),
             "--url", url, "--quiet"],
            capture_output=True, text=True,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert read_rows(remote) == read_rows(local)
