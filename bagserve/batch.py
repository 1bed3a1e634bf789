"""``bagserve batch``: every sample file of a folder into one table, one row per file.

Labs export from the cytometer into a drop folder; this turns the folder into a results
table a LIS or a spreadsheet reads, with the same trust fields as every other door
(status under the model's out-of-domain policy, domain flag and score, interval or set,
the file's and the model's sha256, warnings). A file that fails becomes a row with its
error and the run goes on. Files already in the table (by their sha256, without an
error) are skipped, so a rerun or ``--watch`` adds only what is new; a file that
failed is tried again. With ``--watch`` the folder is polled and a file is taken once
it has stopped growing.

CSV tables are appended to row by row (a crash keeps what was done); Parquet tables
(``OUT`` ending in ``.parquet``, pyarrow) are rewritten atomically after every file.
"""

from __future__ import annotations

import csv
import io
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BatchTable", "answer_fields", "batch", "sample_files"]

#: Columns every table starts and ends with; the prediction's own columns go between.
HEAD = ["file", "file_sha256", "status"]
TAIL = ["out_of_range", "domain_score", "model_sha256", "warnings", "error"]


def sample_files(folder: Path, exclude: Path | None = None) -> list[Path]:
    """The sample files directly in ``folder`` (by suffix, as :func:`read_sample`
    reads them), sorted by name; hidden and partial files (``.name``, ``*.part``,
    ``*.tmp``) and ``exclude`` (the output table) are left out."""
    from .core.io.readers import SUPPORTED_SUFFIXES

    out = []
    for path in sorted(folder.iterdir()):
        name = path.name.lower()
        if name.startswith(".") or name.endswith((".part", ".tmp")) or not path.is_file():
            continue
        if exclude is not None and path.resolve() == exclude.resolve():
            continue
        if any(name.endswith(s) for s in SUPPORTED_SUFFIXES):
            out.append(path)
    return out


def answer_fields(r: dict[str, Any]) -> dict[str, Any]:
    """One bag's trust fields from its JSON answer, as table cells: interval (or set)
    where it has one, ``out_of_range``, ``domain_score``, ``status``, ``file_sha256``
    and why a withheld value is absent (also the command line's ``--format csv``)."""
    domain = r.get("domain") or {}
    flag = domain.get("out_of_range", (r.get("report") or {}).get("out_of_range"))
    out: dict[str, Any] = {}
    if "interval" in r:
        out["interval_lo"], out["interval_hi"] = r["interval"]
    if "set" in r:
        out["set"] = "|".join(str(c) for c in r["set"])
    out.update(
        out_of_range="" if flag is None else int(bool(flag)),
        domain_score=domain.get("score", ""),
        status=r.get("status", ""),
        file_sha256=r.get("input_sha256", ""),
        withheld=r.get("withheld", ""),
    )
    return out


def row_of(result: dict[str, Any], name: str) -> dict[str, Any]:
    """One file's row from its answer (:func:`~bagserve.cli.predict_files` or a
    service's, as :class:`~bagserve.cli.RemoteModel` gives it)."""
    (r,) = result["results"]
    fields = answer_fields(r)
    row: dict[str, Any] = {
        "file": name,
        "file_sha256": fields["file_sha256"],
        "status": fields["status"],
    }
    if "report" in r:  # a per-cell model: the population summary, one column per class
        row["n_cells"] = r.get("n_points", "")
        for p in r.get("population") or []:
            row[f"count_{p['class']}"] = p["count"]
        for p in r.get("population") or []:
            row[f"percent_{p['class']}"] = p["percent"]
    else:
        value = r.get("prediction")
        if isinstance(value, list):
            row.update({f"prediction_{j}": v for j, v in enumerate(value)})
        else:
            row["prediction"] = "" if value is None else value
        row.update({k: fields[k] for k in ("interval_lo", "interval_hi", "set") if k in fields})
    warnings = [*result.get("warnings", []), fields["withheld"]]
    row.update(
        out_of_range=fields["out_of_range"],
        domain_score=fields["domain_score"],
        model_sha256=result["model"].get("sha256", ""),
        warnings=" | ".join(w for w in warnings if w),
        error="",
    )
    return row


@dataclass
class BatchTable:
    """The results table: rows already there, the files they cover, and how to add one.

    The columns are fixed by the first row that carries a prediction (or by the table
    already on disk); rows of failed files that come before it wait in memory.
    """

    path: Path
    columns: list[str] | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)

    @property
    def parquet(self) -> bool:
        return self.path.suffix.lower() == ".parquet"

    @classmethod
    def open(cls, path: Path) -> BatchTable:
        table = cls(path)
        if not path.exists() or path.stat().st_size == 0:
            return table
        if table.parquet:
            pq = _pyarrow_parquet()
            read = pq.read_table(path)
            table.columns = list(read.column_names)
            table.rows = read.to_pylist()
        else:
            with path.open(newline="") as f:
                reader = csv.DictReader(f)
                table.columns = list(reader.fieldnames or [])
                table.rows = list(reader)
        missing = set(HEAD + TAIL) - set(table.columns or [])
        if missing:
            raise ValueError(
                f"{path}: not a bagserve batch table (no column(s) {sorted(missing)}); "
                "give another output file"
            )
        return table

    def done(self) -> set[str]:
        """sha256 of the files predicted without an error."""
        return {
            str(r["file_sha256"]) for r in self.rows if r.get("file_sha256") and not r.get("error")
        }

    def add(self, row: dict[str, Any]) -> None:
        if self.columns is None:
            if row["error"]:
                self.pending.append(row)
                return
            self.columns = [*HEAD, *(k for k in row if k not in HEAD + TAIL), *TAIL]
        extra = set(row) - set(self.columns)
        if extra:  # a column the table does not have: kept in words, not lost
            note = ", ".join(f"{k}={row.pop(k)}" for k in sorted(extra))
            row["warnings"] = " | ".join(filter(None, [row.get("warnings", ""), note]))
        for r in [*self.pending, row]:
            self._write(r)
        self.pending.clear()

    def close(self) -> None:
        """Write the rows still waiting for columns (every file failed)."""
        if self.pending:
            if self.columns is None:
                self.columns = [*HEAD, *TAIL]
            for r in self.pending:
                self._write(r)
            self.pending.clear()

    def _write(self, row: dict[str, Any]) -> None:
        assert self.columns is not None
        self.rows.append(row)
        if self.parquet:
            self._rewrite_parquet()
            return
        from .core.io.spreadsheet import SafeWriter

        new = not self.path.exists() or self.path.stat().st_size == 0
        with self.path.open("a", newline="") as f:
            buf = io.StringIO()
            writer = SafeWriter(buf, lineterminator="\n")
            if new:
                writer.writerow(self.columns)
            writer.writerow([row.get(c, "") for c in self.columns])
            f.write(buf.getvalue())
            f.flush()

    def _rewrite_parquet(self) -> None:
        import pyarrow as pa

        from .core.atomic import atomic_write_bytes

        pq = _pyarrow_parquet()
        assert self.columns is not None
        data = {c: [_cell(r.get(c)) for r in self.rows] for c in self.columns}
        sink = io.BytesIO()
        pq.write_table(pa.table(data), sink)
        atomic_write_bytes(self.path, sink.getvalue())


def _cell(value: Any) -> str | None:
    # Parquet columns need one type; as text they read back like the CSV's.
    return None if value is None or value == "" else str(value)


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - the parquet extra is missing
        raise ValueError(
            "Parquet tables need pyarrow: pip install 'bagserve[parquet]', or write a .csv"
        ) from exc
    return pq


def _stable_files(folder: Path, exclude: Path, settle: float, poll: float) -> Iterator[list[Path]]:
    """Each poll, the files whose size and modification time have not changed since
    the previous poll and are at least ``settle`` seconds old (a copy in progress
    keeps growing)."""
    seen: dict[Path, tuple[int, int]] = {}
    while True:
        ready = []
        now = time.time()
        for path in sample_files(folder, exclude):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            mark = (st.st_size, st.st_mtime_ns)
            if seen.get(path) == mark and now - st.st_mtime >= settle:
                ready.append(path)
            seen[path] = mark
        yield ready
        time.sleep(poll)


def batch(
    predict: Callable[[Path], dict[str, Any]],
    folder: str | Path,
    output: str | Path,
    *,
    watch: bool = False,
    poll: float = 2.0,
    settle: float = 1.0,
    idle_exit: float | None = None,
    progress: bool = True,
) -> dict[str, int]:
    """Predict every sample file of ``folder`` into the table ``output``.

    Parameters
    ----------
    predict : callable
        One file's answer, as :func:`~bagserve.cli.predict_files` gives it.
    folder, output : path
        The folder read (not recursively) and the table written (CSV, or Parquet
        for a ``.parquet`` name); an existing table is extended.
    watch : bool
        Keep polling ``folder`` every ``poll`` seconds for new files, taking each once
        it has not changed for a poll and is ``settle`` seconds old; stop after
        ``idle_exit`` seconds without a new file (never without it).

    Returns
    -------
    dict
        Counts of files ``predicted``, ``failed`` and ``skipped`` (already in the
        table).
    """
    from tqdm.auto import tqdm

    from .core.hashing import file_sha256

    folder, output = Path(folder), Path(output)
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    table = BatchTable.open(output)
    done = table.done()
    counts = {"predicted": 0, "failed": 0, "skipped": 0}
    hashed: dict[Path, tuple[tuple[int, int], str]] = {}

    def digest(path: Path) -> str:
        st = path.stat()
        mark = (st.st_size, st.st_mtime_ns)
        if path not in hashed or hashed[path][0] != mark:
            hashed[path] = (mark, file_sha256(path))
        return hashed[path][1]

    # Each content once per run: a file that failed is tried again by the next run (or
    # when it changes), not at every poll.
    tried: set[str] = set()

    def run(files: list[Path]) -> int:
        todo = []
        for path in files:
            try:
                sha = digest(path)
            except OSError:
                continue  # gone since it was listed
            if sha in tried:
                continue
            tried.add(sha)
            if sha in done:
                counts["skipped"] += 1
            else:
                todo.append((path, sha))
        for path, sha in tqdm(todo, desc="files", unit="file", disable=not progress):
            name = path.name
            try:
                row = row_of(predict(path), name)
            except Exception as exc:  # a failing file is a row, not the end of the run
                # The folder is the caller's: the row names the file alone.
                error = _one_line(exc).replace(str(path), name)
                row = {"file": name, "file_sha256": sha, "error": error}
                counts["failed"] += 1
            else:
                counts["predicted"] += 1
                done.add(sha)
            table.add(row)
        return len(todo)

    try:
        if not watch:
            run(sample_files(folder, output))
            return counts
        idle_since = time.monotonic()
        for ready in _stable_files(folder, output, settle, poll):
            if run(ready):
                idle_since = time.monotonic()
            elif idle_exit is not None and time.monotonic() - idle_since >= idle_exit:
                return counts
    finally:
        table.close()
    return counts  # pragma: no cover - the watch loop only returns


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, ValueError | OSError) else f"{type(exc).__name__}: {text}"


def report_counts(counts: dict[str, int], output: Path) -> None:
    """The run's summary on stderr (the table is the output)."""
    print(
        f"batch: {counts['predicted']} predicted, {counts['failed']} failed, "
        f"{counts['skipped']} already in {output}",
        file=sys.stderr,
    )
