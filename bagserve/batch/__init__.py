"""``bagserve batch``: every sample file of a folder into one table, one row per file.

Labs export from the cytometer into a drop folder; this turns the folder into a results
table a LIS or a spreadsheet reads. The table is the one every CSV door writes
(:mod:`bagserve.service.tables`): its columns follow from the model and the request,
written before any row, the same whichever file comes first.

The folder is hostile input, as an HTTP body is (:mod:`.folder`, :mod:`.predictors`):

* symlinks and non-regular files are never followed or opened: a row says
  ``refused: symlink`` (or ``refused: not a regular file``);
* a file is read only once complete: unchanged for ``settle`` seconds and, for FCS,
  holding every segment its header declares; otherwise it is tried again later and
  gets no row;
* decoding keeps the service's limits (cells, columns, decoded bytes, gzip members,
  body size, time); a file that breaks one gets an error row, and no error quotes the
  file's content;
* a file already in the table (by the sha256 of its bytes, predicted or failed) is never
  done again; a refused file is not reported again while it stays as it was.

Each file done gets one line on stderr (file, status, value, seconds); polls that find
nothing new print nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..core.hashing import bytes_sha256
from ..service.tables import FAILED
from .folder import Entry, Incomplete, NotReady, Refused, list_folder, read_settled
from .predictors import FileFailed, LocalPredictor, RemotePredictor, Unavailable
from .table import BatchTable

__all__ = [
    "BatchTable",
    "Counts",
    "LocalPredictor",
    "RemotePredictor",
    "batch",
    "list_folder",
    "report_counts",
]

#: A one-off run waits this many times ``settle`` for files still being written.
PATIENCE = 10.0


class Predictor(Protocol):
    """What :func:`batch` predicts with (:mod:`.predictors`)."""

    layout: Any
    model_sha256: str

    def rows(self, name: str, data: bytes, sha256: str) -> list[list[Any]]: ...


@dataclass
class Counts:
    """What a run did: files ``predicted``, ``failed`` (error rows, refusals
    included), ``skipped`` (already in the table) and ``left`` (not ready, or the
    service unavailable: no row, tried by a later run), with the reasons."""

    predicted: int = 0
    failed: int = 0
    skipped: int = 0
    left: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        return {
            "predicted": self.predicted,
            "failed": self.failed,
            "skipped": self.skipped,
            "left": len(self.left),
        }


def batch(
    predictor: Predictor,
    folder: str | Path,
    output: str | Path,
    *,
    watch: bool = False,
    poll: float = 2.0,
    settle: float = 5.0,
    idle_exit: float | None = None,
    max_bytes: int = 256 * 2**20,
    log: Callable[[str], None] | None = None,
) -> Counts:
    """Predict every sample file of ``folder`` into the table ``output``.

    Parameters
    ----------
    predictor : LocalPredictor or RemotePredictor
        Answers one file's bytes with its table rows.
    folder, output : path
        The folder read (not recursively) and the table written (CSV, or Parquet for
        a ``.parquet`` name); an existing table is extended if it has the layout's
        columns.
    watch : bool
        Keep polling ``folder`` every ``poll`` seconds; stop after ``idle_exit``
        seconds without a new file (never without it). Without it the run ends once
        every file is done, waiting for files still being written (up to
        ``PATIENCE`` times ``settle``).
    settle : float
        Seconds a file must be unchanged before it is read.
    max_bytes : int
        The largest file read (the service's ``BAGSERVE_MAX_BODY_BYTES``).
    log : callable, optional
        Receives one line per file done (default: none).

    Returns
    -------
    Counts
    """
    folder, output = Path(folder), Path(output)
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    run = _Run(predictor, BatchTable.open(output, predictor.layout.columns), settle, max_bytes, log)
    counts = run.counts
    # What was decided of each entry as it was (its mark): not looked at again until
    # it changes. Files left for later are not in it.
    settled: dict[str, tuple[int, int, int, int]] = {}
    waiting_since: dict[str, float] = {}
    idle_since = time.monotonic()

    while True:
        found_new = waiting = False
        now = time.monotonic()
        listed = list_folder(folder, output)
        names = {e.name for e in listed}
        for name in [n for n in counts.left if n not in names]:
            del counts.left[name]  # gone from the folder
        for entry in listed:
            if settled.get(entry.name) == entry.mark:
                continue
            outcome = run.take(entry)
            if outcome == "done":
                settled[entry.name] = entry.mark
                waiting_since.pop(entry.name, None)
                found_new = True
            elif outcome == "incomplete":
                # Unchanged for `settle` and still short: looked at again when it
                # changes (watch) or by a later run.
                settled[entry.name] = entry.mark
            elif outcome == "writing":
                first = waiting_since.setdefault(entry.name, now)
                waiting = waiting or now - first < PATIENCE * max(settle, poll)
            # "unavailable": tried again at the next poll (watch) or by a later run.
        if found_new:
            idle_since = time.monotonic()
        if not watch and not waiting:
            return counts
        if watch and idle_exit is not None and time.monotonic() - idle_since >= idle_exit:
            return counts
        time.sleep(poll)


class _Run:
    """One run's table, what it holds already, its counts, and how it takes a file."""

    def __init__(
        self,
        predictor: Predictor,
        table: BatchTable,
        settle: float,
        max_bytes: int,
        log: Callable[[str], None] | None,
    ) -> None:
        self.predictor, self.table, self.layout = predictor, table, predictor.layout
        self.settle, self.max_bytes = settle, max_bytes
        self.done, self.refused = table.done(), table.refused()
        self.counts = Counts()
        self.say = log or (lambda line: None)

    def refuse(self, name: str, error: str) -> None:
        if (name, error) in self.refused:
            self.counts.skipped += 1
            return
        self.refused.add((name, error))
        self.table.add([self.layout.failed(name, error, model_sha256=self.predictor.model_sha256)])
        self.counts.failed += 1
        self.say(f"{name}: {error}")

    def take(self, entry: Entry) -> str:
        """Handle one listed entry: ``done``, or why it is left (``writing``,
        ``incomplete``, ``unavailable``), its reason in ``counts.left``."""
        counts, layout, predictor = self.counts, self.layout, self.predictor
        if entry.refusal is not None:
            self.refuse(entry.name, entry.refusal)
            return "done"
        try:
            data = read_settled(
                entry, settle=self.settle, max_bytes=self.max_bytes, now=time.time()
            )
        except Refused as exc:
            self.refuse(entry.name, str(exc))
            return "done"
        except NotReady as exc:
            counts.left[entry.name] = str(exc)
            return "incomplete" if isinstance(exc, Incomplete) else "writing"
        sha = bytes_sha256(data)
        if sha in self.done:
            counts.skipped += 1
            return "done"
        t0 = time.perf_counter()
        try:
            rows = predictor.rows(entry.name, data, sha)
        except Unavailable as exc:
            reason = f"the service is unavailable ({exc})"
            if counts.left.get(entry.name) != reason:
                self.say(f"{entry.name}: waiting: {reason}")
            counts.left[entry.name] = reason
            return "unavailable"
        except FileFailed as exc:
            rows = [
                layout.failed(
                    entry.name, str(exc), input_sha256=sha, model_sha256=predictor.model_sha256
                )
            ]
        self.table.add(rows)
        self.done.add(sha)
        counts.left.pop(entry.name, None)
        if rows[0][layout.columns.index("status")] == FAILED:
            counts.failed += 1
        else:
            counts.predicted += 1
        elapsed = time.perf_counter() - t0
        self.say(f"{entry.name}: {_summary(layout.columns, rows)} ({elapsed:.3f} s)")
        return "done"


def _summary(columns: list[str], rows: list[list[Any]]) -> str:
    """A file's status and first value, or its error, for its log line."""
    row = dict(zip(columns, rows[0], strict=True))
    if row["status"] == FAILED:
        return f"failed: {row['error']}"
    first = columns[1]
    return f"{row['status']}, {first} {row[first]}" if row[first] != "" else row["status"]


def report_counts(counts: Counts, output: Path) -> None:
    """The run's summary on stderr (the table is the output), and the files left."""
    for name, reason in counts.left.items():
        print(f"batch: {name} left for a later run: {reason}", file=sys.stderr)
    print(
        f"batch: {counts.predicted} predicted, {counts.failed} failed, "
        f"{counts.skipped} already in {output}, {len(counts.left)} left",
        file=sys.stderr,
    )
