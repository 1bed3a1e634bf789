"""What predicts one file's bytes for ``bagserve batch``: a saved model, or a service.

Both answer a file with its table rows (:class:`~bagserve.service.tables.TableLayout`,
the same columns on every door), built by the one table builder: the local model's in
a child process, the service's as its ``text/csv`` answer. A file is hostile input
here as on HTTP:

* :class:`LocalPredictor` decodes within the service's limits (``BAGSERVE_MAX_*``:
  cells, columns, decoded bytes, gzip members) and its time
  (``BAGSERVE_REQUEST_TIMEOUT``), in a child process that is ended past the time; a
  file that breaks a limit, crashes the decoder or takes too long gets an error row;
* :class:`RemotePredictor` sends the bytes that were read and hashed, and checks that
  the service predicted those bytes (``input_sha256``) with the table's columns.

:class:`FileFailed` is the file's own problem (a row says why, and a rerun does not
redo it); :class:`Unavailable` is the service's (no row: the file is tried again).
Error texts never quote the file's content (:func:`safe_error`).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..service.options import PredictOptions
from ..service.tables import TableLayout

if TYPE_CHECKING:
    from ..cli.remote import RemoteModel

__all__ = ["FileFailed", "LocalPredictor", "RemotePredictor", "Unavailable", "safe_error"]

#: Seconds a new child may take to start and open the model.
STARTUP = 120.0
_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


class FileFailed(Exception):
    """The file cannot be predicted: its row's ``error``."""


class Unavailable(Exception):
    """The service cannot answer now: the file is tried again later, without a row."""


def safe_error(text: str, keep: Sequence[str] = ()) -> str:
    """An error message fit for a table cell, quoting nothing of the file's content.

    Readers quote what they could not read (a header, a value, a line): for a file
    that is not what it claims (a link to ``/etc/passwd``, a log renamed ``.csv``) that
    is its content. Every quoted text is replaced by ``'…'`` unless it is one of
    ``keep`` (the model's markers, the file's name: not the file's content); control
    characters become spaces; at most 300 characters.
    """
    kept = set(keep)

    def elide(match: re.Match[str]) -> str:
        return match.group(0) if match.group(0)[1:-1] in kept else "'…'"

    text = _CONTROL.sub(" ", _QUOTED.sub(elide, text))
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:299] + "…"


def _one_line(exc: BaseException) -> str:
    from ..core.errors import DataError

    text = " ".join(str(exc).split()) or type(exc).__name__
    known = isinstance(exc, ValueError | OSError | DataError)
    return text if known else f"{type(exc).__name__}: {text}"


# ------------------------------------------------------------------------ local
def _serve(conn: Any, model: str, options: dict[str, Any], limits: dict[str, Any]) -> None:
    """The child process: open the model once, then answer ``(name, data, sha)`` with
    ``("rows", rows)`` or ``("error", text)`` until the pipe closes."""
    from ..core.blas import one_thread
    from ..core.io import read_sample
    from ..core.io.readers import format_of
    from ..core.io.sample import ReadLimits
    from ..core.runtime import ModelRuntime

    try:
        runtime = ModelRuntime.open(model)
        opts = PredictOptions.from_json(options)
        layout = TableLayout.of(runtime.info.answer_shape(), opts)
        reading = ReadLimits(**limits)
    except Exception as exc:  # the model's problem, not a file's: the run stops
        conn.send(("fatal", _one_line(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            name, data, sha = conn.recv()
        except (EOFError, OSError):
            return
        try:
            sample = read_sample(data, format=format_of(name), name=name, limits=reading)
            # The service's workers compute with one BLAS thread; so does this, so that
            # the table's values are the service's to the last bit.
            with one_thread():
                bags = runtime.align([sample], compensated=opts.compensated)
                result = runtime.predict(bags, coverage=opts.coverage)
            rows = list(layout.rows(result, [name], runtime.info, inputs=[sha]))
        except Exception as exc:  # the file's problem: its row says it
            conn.send(("error", _one_line(exc)))
        else:
            conn.send(("rows", rows))


class LocalPredictor:
    """A saved model predicting one file at a time in a child process.

    Parameters
    ----------
    model : path
        The saved model's directory (verified here, and again by the child).
    options : PredictOptions
        What each prediction asks (an interval, compensated cells).
    limits : ReadLimits
        The service's decoding limits.
    timeout : float
        Seconds one file may take (decoding and prediction); past it the child is
        ended and the file gets an error row.
    """

    def __init__(self, model: str | Path, options: PredictOptions, limits: Any, timeout: float):
        from ..core.artifact_info import ArtifactInfo

        self.model = str(model)
        self.info = ArtifactInfo.read(model)
        shape = self.info.answer_shape()
        # As `predict` asks: an interval only where the model gives one.
        self.options = PredictOptions.asked_of(
            shape, coverage=options.coverage, cells=options.cells, compensated=options.compensated
        )
        self.layout = TableLayout.of(shape, self.options)
        self.model_sha256 = self.info.sha256
        self.limits = limits
        self.timeout = timeout
        self.keep = [*self.info.markers]
        self._child: Any = None
        self._conn: Any = None

    def _start(self) -> None:
        import multiprocessing
        from dataclasses import asdict

        ctx = multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        self._child = ctx.Process(
            target=_serve,
            args=(child_end, self.model, self.options.to_json(), asdict(self.limits)),
            daemon=True,
            name="bagserve-batch",
        )
        self._child.start()
        child_end.close()
        ready = self._conn.poll(STARTUP)
        try:
            kind, payload = self._conn.recv() if ready else ("fatal", "no answer")
        except (EOFError, OSError):
            kind, payload = "fatal", f"it ended (exit code {self._child.exitcode})"
        if kind != "ready":
            self._stop()
            raise ValueError(f"{self.model}: the model could not be opened to predict ({payload})")

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join()
            self._conn.close()
        self._child = self._conn = None

    def close(self) -> None:
        self._stop()

    def rows(self, name: str, data: bytes, sha256: str) -> list[list[Any]]:
        """The file's rows.

        Raises
        ------
        FileFailed
            The file could not be predicted: unreadable, beyond a limit, past the time,
            or it ended the child.
        """
        if self._child is None:
            self._start()
        self._conn.send((name, data, sha256))
        if not self._conn.poll(self.timeout):
            self._stop()
            raise FileFailed(
                f"refused: not decoded and predicted within {self.timeout:g} s (the time "
                "limit, BAGSERVE_REQUEST_TIMEOUT)"
            )
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            code = self._child.exitcode
            self._stop()
            raise FileFailed(
                f"refused: the file ended the decoder's process (exit code {code})"
            ) from None
        if kind == "error":
            raise FileFailed(safe_error(payload, [name, *self.keep]))
        return payload


# ----------------------------------------------------------------------- remote
class RemotePredictor:
    """A served model (:class:`~bagserve.cli.remote.RemoteModel`, its version pinned) that
    answers each file with the rows of its ``text/csv`` answer."""

    def __init__(self, remote: RemoteModel) -> None:
        self.remote = remote
        self.layout = remote.layout
        self.model_sha256 = remote.sha256
        self.keep = list(remote.markers)

    def close(self) -> None:
        self.remote.client.close()

    def rows(self, name: str, data: bytes, sha256: str) -> list[list[Any]]:
        """The file's rows, as the service answered them.

        Raises
        ------
        FileFailed
            The service refused the file (4xx: its problem names why).
        Unavailable
            No answer, or the service is busy or failing (429, 5xx).
        ValueError
            The service answers with other columns, another file's hash, or refuses
            the caller (401, 403, 404): nothing more can be done in this run.
        """
        from ..service.client import BagserveError

        try:
            text = self.remote.table_csv([(name, data)])
        except BagserveError as exc:
            if exc.status is None or exc.status >= 500 or exc.status == 429:
                raise Unavailable(str(exc)) from None
            if exc.status in (401, 403, 404):
                raise ValueError(f"{self.remote.url}: {exc}") from None
            raise FileFailed(safe_error(str(exc), [name, *self.keep])) from None
        lines = list(csv.reader(io.StringIO(text, newline="")))
        columns = self.layout.columns
        if not lines or lines[0] != columns:
            raise ValueError(
                f"{self.remote.url} answers the columns {lines[0] if lines else []}, not "
                f"{columns}: another bagserve version or model; give another output file"
            )
        rows = lines[1:]
        sha = columns.index("input_sha256")
        if not rows or any(r[sha] != sha256 for r in rows):
            raise ValueError(
                f"{self.remote.url} answered for other bytes than {name}'s (input_sha256)"
            )
        return rows
