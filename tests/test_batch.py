"""``bagserve batch``: a drop folder into one table, the folder as hostile input.

Oracles: each row against the service's own ``text/csv`` answer and ``predict_files``
for that file alone; hashlib on the file's bytes; the manifest's own sha256; the table's
columns against the layout written out by hand (``tests/test_tables.py`` checks every
door's); the Parquet table against the CSV one.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import flowio
import numpy as np
import pyarrow.parquet as pq
import pytest
from bagserve.core import load, read_manifest, save
from bagserve.core.demo import build_demo_models, demo_samples
from bagserve.core.io.sample import ReadLimits
from bagserve.service.options import PredictOptions
from bagserve.service.tables import TRUST_COLUMNS

from bagserve.batch import LocalPredictor, batch
from bagserve.cli import main
from bagserve.cli.local import predict_files

from .service_harness import running_service

DOSE_COLUMNS = ["id", "prediction", "interval_lo", "interval_hi", *TRUST_COLUMNS]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("batch") / "models"
    build_demo_models(directory)
    # The same models under the policy that withholds out-of-domain answers.
    for name in ("demo-dose", "demo-gating"):
        republish(directory / name / "1", directory / f"{name}-withheld" / "1")
    return directory


def republish(src: Path, dst: Path) -> Path:
    meta = dict(read_manifest(src)["metadata"])
    meta.update(name=dst.parent.name, serving={"out_of_domain": "withhold"})
    return save(load(src), dst, **meta)


def write_csv(path: Path, points: np.ndarray, markers: list[str]) -> Path:
    rows = [",".join(markers), *(",".join(f"{v:.17g}" for v in r) for r in points)]
    path.write_text("\n".join(rows) + "\n")
    return path


def dose_folder(folder: Path, n: int = 3, seed: int = 4, shift: float = 0.0) -> list[Path]:
    folder.mkdir(exist_ok=True)
    bags, _, markers = demo_samples("dose", n, seed)
    return [
        write_csv(folder / f"tube-{seed}-{i}.csv", np.asarray(b) + shift, markers)
        for i, b in enumerate(bags)
    ]


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def header(path: Path) -> list[str]:
    with path.open(newline="") as f:
        return next(csv.reader(f))


def local(model: Path, interval: float | None = 0.9, timeout: float = 60.0) -> LocalPredictor:
    limits = ReadLimits(max_decoded_bytes=2_000_000, max_cells=200_000, max_columns=64)
    return LocalPredictor(model, PredictOptions(coverage=interval, cells=False), limits, timeout)


def run(model: Path, folder: Path, out: Path, **kwargs) -> tuple[dict[str, int], list[str]]:
    lines: list[str] = []
    predictor = local(model)
    try:
        counts = batch(predictor, folder, out, settle=0.0, log=lines.append, **kwargs)
    finally:
        predictor.close()
    return counts.as_dict(), lines


def test_a_folder_becomes_one_row_per_file_and_reruns_redo_nothing(models, tmp_path, capsys):
    model = models / "demo-dose" / "1"
    folder = tmp_path / "drop"
    files = dose_folder(folder)
    (folder / "broken.csv").write_text("FSC-A,SSC-A\n")  # no cells, wrong markers
    (folder / ".hidden.csv").write_text("x\n")
    (folder / "copying.csv.part").write_text("x\n")
    (folder / "notes.pdf").write_text("not a sample\n")
    out = tmp_path / "results.csv"
    code = main(["batch", str(model), str(folder), str(out), "--settle", "0"])
    assert code == 1  # one file failed; the others were predicted
    err = capsys.readouterr().err
    assert "3 predicted, 1 failed, 0 already" in err
    # One line per file done, naming it, its status and value.
    assert sum(line.startswith("batch: tube-") for line in err.splitlines()) == 3
    assert header(out) == DOSE_COLUMNS
    rows = read_rows(out)
    by_name = {r["id"]: r for r in rows}
    assert set(by_name) == {"broken.csv", *(p.name for p in files)}
    broken = by_name["broken.csv"]
    assert broken["status"] == "failed" and broken["error"] and broken["prediction"] == ""
    assert str(folder) not in broken["error"]  # the file, not the path
    sha = read_manifest(model)["manifest_sha256"]
    for path in files:
        row = by_name[path.name]
        (alone,) = predict_files(model, [path])["results"]
        assert float(row["prediction"]) == alone["prediction"]
        assert [float(row["interval_lo"]), float(row["interval_hi"])] == alone["interval"]
        assert row["status"] == alone["status"] and row["error"] == ""
        assert float(row["domain_score"]) == alone["domain"]["score"]
        assert row["out_of_range"] == str(int(alone["domain"]["out_of_range"]))
        assert row["input_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert row["model_sha256"] == sha
    # A rerun does only what is new: the failed file is not tried again.
    new = dose_folder(folder, n=1, seed=5)
    code = main(["batch", str(model), str(folder), str(out), "--settle", "0", "--quiet"])
    assert code == 0 and "1 predicted, 0 failed, 4 already" in capsys.readouterr().err
    assert [r["id"] for r in read_rows(out)][-1] == new[0].name
    assert len(read_rows(out)) == 5
    # Parquet when the name says so: the same table.
    pout = tmp_path / "results.parquet"
    assert main(["batch", str(model), str(folder), str(pout), "--settle", "0", "--quiet"]) == 1
    table = pq.read_table(pout)
    assert table.column_names == DOSE_COLUMNS
    csv_rows = {r["id"]: r for r in read_rows(out)}
    for r in table.to_pylist():
        assert {k: v or "" for k, v in r.items()} == csv_rows[r["id"]]
    assert main(["batch", str(model), str(folder), str(pout), "--settle", "0", "--quiet"]) == 0
    assert len(pq.read_table(pout)) == 5  # nothing added the second time


def test_a_table_of_other_columns_is_refused_untouched(models, tmp_path, capsys):
    folder = tmp_path / "drop"
    dose_folder(folder, n=1)
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    code = main(
        ["batch", str(models / "demo-dose" / "1"), str(folder), str(other), "--settle", "0"]
    )
    assert code == 1
    assert "a table of other columns" in capsys.readouterr().err
    assert other.read_text() == "a,b\n1,2\n"
    # The table of the same model without an interval has other columns too.
    out = tmp_path / "plain.csv"
    model = str(models / "demo-dose" / "1")
    assert main(["batch", model, str(folder), str(out), "--settle", "0", "--quiet"]) == 0
    before = out.read_bytes()
    code = main(["batch", model, str(folder), str(out), "--settle", "0", "--interval", "0"])
    assert code == 1 and out.read_bytes() == before


@pytest.mark.parametrize("name", ["demo-dose-withheld", "demo-gating-withheld"])
def test_a_withheld_first_file_does_not_decide_the_columns(models, tmp_path, name):
    """The first file in the folder lies outside the domain, so its answer is withheld
    (no interval, no populations): the table's columns are the model's all the same,
    and every later file's values land in their own columns."""
    model = models / name / "1"
    folder = tmp_path / "drop"
    folder.mkdir()
    kind = "dose" if "dose" in name else "gating"
    bags, _, markers = demo_samples(kind, 3, 11)
    write_csv(folder / "a-beads.csv", np.asarray(bags[0]) + 50.0, markers)
    paths = [write_csv(folder / f"p{i}.csv", np.asarray(b), markers) for i, b in enumerate(bags)]
    out = tmp_path / "table.csv"
    counts, _ = run(model, folder, out)
    assert counts["predicted"] == 4 and counts["failed"] == 0
    rows = read_rows(out)
    first = rows[0]
    assert first["id"] == "a-beads.csv" and first["status"] == "withheld"
    assert first["withheld_reason"] and first["out_of_range"] == "1"
    columns = header(out)
    values = columns[1 : columns.index("status")]
    assert all(first[c] == "" for c in values)
    for path, row in zip(paths, rows[1:], strict=True):
        (alone,) = predict_files(model, [path])["results"]
        assert row["status"] == alone["status"] != "withheld"
        assert row["warnings"] == "" and row["withheld_reason"] == ""
        if kind == "dose":
            assert [float(row["interval_lo"]), float(row["interval_hi"])] == alone["interval"]
        else:
            for p in alone["population"]:
                assert int(row[f"count_{p['class']}"]) == p["count"]
                assert float(row[f"percent_{p['class']}"]) == p["percent"]
                assert float(row[f"mean_probability_{p['class']}"]) == p["mean_probability"]


def test_links_and_special_files_are_refused_unread(models, tmp_path):
    folder = tmp_path / "drop"
    folder.mkdir()
    secret = tmp_path / "secret.csv"
    secret.write_text("root:x:0:0:root,/bin/bash\nTOPSECRET-1,TOPSECRET-2\n")
    (folder / "passwd.csv").symlink_to(secret)
    (folder / "dangling.fcs").symlink_to(tmp_path / "nowhere.fcs")
    os.mkfifo(folder / "pipe.csv")  # opening it would block the run
    (folder / "dir.csv").mkdir()
    out = tmp_path / "table.csv"
    counts, lines = run(models / "demo-dose" / "1", folder, out)
    assert counts == {"predicted": 0, "failed": 4, "skipped": 0, "left": 0}
    rows = {r["id"]: r for r in read_rows(out)}
    assert rows["passwd.csv"]["error"] == rows["dangling.fcs"]["error"] == "refused: symlink"
    assert rows["pipe.csv"]["error"] == rows["dir.csv"]["error"] == "refused: not a regular file"
    assert all(r["input_sha256"] == "" and r["status"] == "failed" for r in rows.values())
    text = out.read_text() + "\n".join(lines)
    assert "root" not in text and "TOPSECRET" not in text
    # Not reported again while they stay as they are.
    counts, lines = run(models / "demo-dose" / "1", folder, out)
    assert counts["failed"] == 0 and counts["skipped"] == 4 and lines == []
    assert len(read_rows(out)) == 4


def test_no_error_quotes_the_files_content(models, tmp_path):
    folder = tmp_path / "drop"
    folder.mkdir()
    (folder / "log.csv").write_text("TOPSECRET-HEAD,SSC-A,GFP\n1,2,3\n")
    (folder / "lines.csv").write_text("FSC-A,SSC-A,GFP\nTOPSECRET-VALUE,1,2\n")
    (folder / "values.csv").write_text("FSC-A,SSC-A,GFP\n1,2,TOPSECRET-CELL\n")
    (folder / "junk.fcs").write_bytes(b"FCS3.1    TOPSECRET" + b"\0" * 60)
    out = tmp_path / "table.csv"
    counts, lines = run(models / "demo-dose" / "1", folder, out)
    assert counts["failed"] == 4
    rows = {r["id"]: r for r in read_rows(out)}
    assert all(r["error"] for r in rows.values())
    assert "TOPSECRET" not in out.read_text() + "\n".join(lines)
    # What the error may name: the model's markers and the file's own name.
    assert "'FSC-A'" in rows["log.csv"]["error"] and "log.csv" in rows["log.csv"]["error"]


def test_decoding_keeps_the_services_limits_and_a_bomb_is_not_redone(models, tmp_path):
    folder = tmp_path / "drop"
    (good,) = dose_folder(folder, n=1)
    head = good.read_text().splitlines()[0] + "\n"
    # 1 MB of gzip that inflates to 100 MB: past the 2 MB decoded-size limit.
    (folder / "bomb.csv.gz").write_bytes(
        gzip.compress(head.encode() + b"1," * 50_000_000, compresslevel=9, mtime=0)
    )
    # Empty gzip members: each costs an inflater; more than the limit are refused.
    (folder / "members.csv.gz").write_bytes(gzip.compress(b"", mtime=0) * 70_000)
    out = tmp_path / "table.csv"
    t0 = time.monotonic()
    counts, _ = run(models / "demo-dose" / "1", folder, out)
    assert time.monotonic() - t0 < 60  # seconds in fact; a bomb inflated whole takes minutes
    assert counts == {"predicted": 1, "failed": 2, "skipped": 0, "left": 0}
    rows = {r["id"]: r for r in read_rows(out)}
    assert "decoded-size limit" in rows["bomb.csv.gz"]["error"]
    assert "more than 65536 members" in rows["members.csv.gz"]["error"]
    assert rows["bomb.csv.gz"]["input_sha256"]  # it was read: known by its bytes
    counts, lines = run(models / "demo-dose" / "1", folder, out)
    assert counts == {"predicted": 0, "failed": 0, "skipped": 3, "left": 0} and lines == []


def test_a_file_past_the_time_limit_is_refused_and_the_next_one_answered(models, tmp_path):
    model = models / "demo-dose" / "1"
    folder = tmp_path / "drop"
    files = dose_folder(folder, n=2)
    slow, fast = local(model, timeout=1e-4), local(model)
    try:
        name, data = files[0].name, files[0].read_bytes()
        from bagserve.batch import predictors

        with pytest.raises(predictors.FileFailed, match=r"within 0\.0001 s"):
            slow.rows(name, data, "sha")
        assert slow._child is None  # ended, started again for the next file
        slow.timeout = 60.0
        again = slow.rows(name, data, "sha")
        assert again == fast.rows(name, data, "sha")
    finally:
        slow.close()
        fast.close()


def test_a_file_larger_than_the_body_limit_is_refused_unread(models, tmp_path):
    folder = tmp_path / "drop"
    (path,) = dose_folder(folder, n=1)
    out = tmp_path / "table.csv"
    predictor = local(models / "demo-dose" / "1")
    try:
        counts = batch(predictor, folder, out, settle=0.0, max_bytes=100)
    finally:
        predictor.close()
    (row,) = read_rows(out)
    size = path.stat().st_size
    assert row["error"] == f"refused: {size} bytes, more than the limit of 100 bytes"
    assert counts.failed == 1 and row["input_sha256"] == ""


def dose_fcs(path: Path, seed: int) -> bytes:
    bags, _, markers = demo_samples("dose", 1, seed)
    with open(path, "wb") as fh:
        flowio.create_fcs(fh, np.asarray(bags[0], dtype=np.float32).ravel(), markers)
    return path.read_bytes()


def test_watch_reads_a_file_only_once_complete_and_idle_polls_say_nothing(models, tmp_path):
    """An FCS export written in two halves with a pause longer than ``settle``: the
    first half is an incomplete FCS (its DATA segment is declared longer), so it gets
    no row; the whole file gets one. A CSV still being written waits ``settle``."""
    model = models / "demo-dose" / "1"
    folder = tmp_path / "watched"
    folder.mkdir()
    data = dose_fcs(tmp_path / "full.fcs", 8)
    bags, _, markers = demo_samples("dose", 1, 9)
    text = write_csv(tmp_path / "full.csv", np.asarray(bags[0]), markers).read_text()

    def export() -> None:  # the cytometer's export and a copy: written in pieces
        half = len(data) // 2
        with (folder / "late.fcs").open("wb") as f:
            f.write(data[:half])
            f.flush()
            time.sleep(2.0)  # four polls and more than `settle`
            f.write(data[half:])
        with (folder / "copy.csv").open("w") as f:
            f.write(text[: len(text) // 2])
            f.flush()
            time.sleep(0.4)  # less than `settle`
            f.write(text[len(text) // 2 :])

    writer = threading.Thread(target=export)
    writer.start()
    out = tmp_path / "watched.csv"
    lines: list[str] = []
    predictor = local(model)
    try:
        counts = batch(
            predictor, folder, out, watch=True, poll=0.2, settle=1.0, idle_exit=5.0,
            log=lines.append,
        )  # fmt: skip
    finally:
        predictor.close()
        writer.join()
    assert counts.as_dict() == {"predicted": 2, "failed": 0, "skipped": 0, "left": 0}
    rows = {r["id"]: r for r in read_rows(out)}
    assert rows["late.fcs"]["input_sha256"] == hashlib.sha256(data).hexdigest()
    assert rows["copy.csv"]["input_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert all(r["error"] == "" for r in rows.values())
    # One line per file; the idle polls (about 25) none.
    assert sorted(line.split(":")[0] for line in lines) == ["copy.csv", "late.fcs"]


def test_a_one_off_run_leaves_an_incomplete_file_for_later(models, tmp_path, capsys):
    folder = tmp_path / "drop"
    folder.mkdir()
    data = dose_fcs(tmp_path / "full.fcs", 3)
    (folder / "cut.fcs").write_bytes(data[: len(data) // 2])
    out = tmp_path / "table.csv"
    code = main(["batch", str(models / "demo-dose" / "1"), str(folder), str(out), "--settle", "0"])
    assert code == 1
    err = capsys.readouterr().err
    assert "cut.fcs left for a later run: incomplete: its DATA segment ends at byte" in err
    assert read_rows(out) == [] and header(out) == DOSE_COLUMNS
    (folder / "cut.fcs").write_bytes(data)
    code = main(["batch", str(models / "demo-dose" / "1"), str(folder), str(out), "--settle", "0"])
    assert code == 0
    (row,) = read_rows(out)
    assert row["input_sha256"] == hashlib.sha256(data).hexdigest() and row["error"] == ""


def test_a_row_cut_short_by_a_crash_is_dropped_and_done_again(models, tmp_path):
    folder = tmp_path / "drop"
    dose_folder(folder, n=2)
    out = tmp_path / "table.csv"
    run(models / "demo-dose" / "1", folder, out)
    whole = out.read_text()
    out.write_text(whole[: whole.rindex(",") - 3])  # the last row, cut inside a number
    counts, _ = run(models / "demo-dose" / "1", folder, out)
    assert counts == {"predicted": 1, "failed": 0, "skipped": 1, "left": 0}
    assert out.read_text() == whole


def test_gating_model_rows_have_a_column_per_population(models, tmp_path):
    folder = tmp_path / "cells"
    folder.mkdir()
    tasks, _, markers = demo_samples("gating", 2, 3)
    paths = [write_csv(folder / f"p{i}.csv", np.asarray(t), markers) for i, t in enumerate(tasks)]
    out = tmp_path / "populations.csv"
    model = models / "demo-gating" / "1"
    counts, _ = run(model, folder, out)
    assert counts == {"predicted": 2, "failed": 0, "skipped": 0, "left": 0}
    for path, row in zip(paths, read_rows(out), strict=True):
        (alone,) = predict_files(model, [path])["results"]
        assert int(row["n_cells"]) == alone["n_points"]
        for p in alone["population"]:
            assert int(row[f"count_{p['class']}"]) == p["count"]
            assert float(row[f"percent_{p['class']}"]) == p["percent"]
        total = sum(float(v) for k, v in row.items() if k.startswith("percent_"))
        assert total == pytest.approx(100)


def test_batch_through_a_running_service_matches_the_local_table(models, tmp_path):
    """To the last bit, whatever BLAS threads the local command may use (the service's
    workers use one); a file the service refuses gets the same kind of row, and a
    service that cannot answer leaves the file for later, without a row."""
    from threadpoolctl import threadpool_limits

    folder = tmp_path / "remote"
    dose_folder(folder, n=2, seed=6)
    (folder / "wrong.csv").write_text("A,B\n1,2\n")
    local_out, remote_out = tmp_path / "local.csv", tmp_path / "remote.csv"
    model = str(models / "demo-dose" / "1")
    with threadpool_limits(2):
        assert main(["batch", model, str(folder), str(local_out), "--settle", "0", "--quiet"]) == 1
    with running_service(models) as url:
        done = subprocess.run(
            [sys.executable, "-m", "bagserve", "batch", "demo-dose", str(folder),
             str(remote_out), "--url", url, "--settle", "0"],
            capture_output=True, text=True,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    local_rows, remote_rows = read_rows(local_out), read_rows(remote_out)
    assert header(remote_out) == header(local_out)
    assert [r for r in remote_rows if r["id"] != "wrong.csv"] == [
        r for r in local_rows if r["id"] != "wrong.csv"
    ]
    wrong = next(r for r in remote_rows if r["id"] == "wrong.csv")
    assert wrong["status"] == "failed" and "marker" in wrong["error"]
    # The service gone: the new file is left for later, no row.
    dose_folder(folder, n=1, seed=7)
    port = url.rsplit(":", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "bagserve", "batch", "demo-dose", str(folder), str(remote_out),
         "--url", f"http://127.0.0.1:{port}", "--settle", "0"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1
    assert "error:" in done.stderr or "left for a later run" in done.stderr
    assert len(read_rows(remote_out)) == len(remote_rows)
