"""The results table of ``bagserve batch``: its header first, then one row per file.

The columns are the model's and the request's (:class:`~bagserve.service.tables.
TableLayout`), written when the table is created, before any row: an existing table is
extended only if its header is exactly that layout (a table of another model, request
or bagserve version is refused, never appended to in shifted columns). CSV tables are
appended to a whole row per write, flushed to disk (a crash keeps what was done; a row
cut short by one is dropped when the table is next opened, and its file is done
again). Parquet tables (``.parquet``, pyarrow) are rewritten atomically after every file.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.io.spreadsheet import SafeWriter, safe_cell
from ..service.tables import FAILED

__all__ = ["BatchTable"]


class BatchTable:
    """An open results table: its columns, the files it covers, how to add rows.

    Parameters
    ----------
    path : Path
        ``.csv``, or ``.parquet`` for Parquet.
    columns : list of str
        The layout's columns.
    """

    def __init__(self, path: Path, columns: Sequence[str]) -> None:
        self.path = path
        self.columns = list(columns)
        self.rows: list[list[Any]] = []
        self._id = self.columns.index("id")
        self._sha = self.columns.index("input_sha256")
        self._status = self.columns.index("status")
        self._error = self.columns.index("error")

    @property
    def parquet(self) -> bool:
        return self.path.suffix.lower() == ".parquet"

    @classmethod
    def open(cls, path: Path, columns: Sequence[str]) -> BatchTable:
        """The table at ``path``, created with its header if new or empty.

        Raises
        ------
        ValueError
            The table exists with other columns (naming the difference).
        """
        table = cls(path, columns)
        if not path.exists() or path.stat().st_size == 0:
            table._create()
            return table
        found, rows = table._read()
        if found != table.columns:
            missing = [c for c in table.columns if c not in found]
            extra = [c for c in found if c not in table.columns]
            diff = "; ".join(
                part
                for part in (
                    f"it lacks {missing}" if missing else "",
                    f"it has {extra} besides" if extra else "",
                    "its columns are in another order" if not (missing or extra) else "",
                )
                if part
            )
            raise ValueError(
                f"{path}: a table of other columns ({diff}): it was written for another "
                "model, request or bagserve version; give another output file"
            )
        table.rows = rows
        return table

    def done(self) -> set[str]:
        """sha256 of every file already in the table (predicted or failed)."""
        return {str(r[self._sha]) for r in self.rows if r[self._sha]}

    def refused(self) -> set[tuple[str, str]]:
        """(file, error) of the rows of files refused unread (no sha256)."""
        return {
            (str(r[self._id]), str(r[self._error]))
            for r in self.rows
            if not r[self._sha] and r[self._status] == FAILED
        }

    def add(self, rows: Sequence[Sequence[Any]]) -> None:
        """Append one file's rows (one write, flushed to disk)."""
        rows = [list(r) for r in rows]
        for r in rows:
            if len(r) != len(self.columns):
                raise ValueError(f"a row of {len(r)} cells for {len(self.columns)} columns")
        self.rows.extend(rows)
        if self.parquet:
            self._rewrite_parquet()
            return
        buf = io.StringIO()
        SafeWriter(buf, lineterminator="\n").writerows(rows)
        with self.path.open("a", newline="") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())

    # ---------------------------------------------------------------- storage
    def _create(self) -> None:
        if self.parquet:
            self._rewrite_parquet()
            return
        from ..core.atomic import atomic_write_bytes

        buf = io.StringIO()
        SafeWriter(buf, lineterminator="\n").writerow(self.columns)
        atomic_write_bytes(self.path, buf.getvalue().encode())

    def _read(self) -> tuple[list[str], list[list[Any]]]:
        if self.parquet:
            read = _pyarrow_parquet().read_table(self.path)
            data = read.to_pydict()
            found = list(read.column_names)
            rows = [[data[c][k] or "" for c in found] for k in range(read.num_rows)]
            return found, rows
        text = self.path.read_bytes().decode("utf-8")
        if not text.endswith("\n"):
            # A row cut short by a crash: a number cut short reads as another number.
            # It goes, and its file is done again.
            cut = text.rfind("\n") + 1
            with self.path.open("r+b") as f:
                f.truncate(len(text[:cut].encode("utf-8")))
                os.fsync(f.fileno())
            text = text[:cut]
        lines = list(csv.reader(io.StringIO(text, newline="")))
        found, rows = (lines[0] if lines else []), lines[1:]
        for n, row in enumerate(rows, start=2):
            if len(row) != len(found):
                raise ValueError(
                    f"{self.path}: line {n} has {len(row)} cells for {len(found)} columns "
                    "(a damaged table); give another output file"
                )
        return found, rows

    def _rewrite_parquet(self) -> None:
        import pyarrow as pa

        from ..core.atomic import atomic_write_bytes

        pq = _pyarrow_parquet()
        data = {
            c: pa.array([_cell(r[k]) for r in self.rows], type=pa.string())
            for k, c in enumerate(self.columns)
        }
        sink = io.BytesIO()
        pq.write_table(pa.table(data), sink)
        atomic_write_bytes(self.path, sink.getvalue())


def _cell(value: Any) -> str | None:
    # Parquet columns need one type: text, as the CSV's cells read back (the same
    # formula-safe text, whichever door the row came through).
    if value is None or value == "":
        return None
    return str(safe_cell(value if isinstance(value, str) else str(value)))


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - the parquet extra is missing
        raise ValueError(
            "Parquet tables need pyarrow: pip install 'bagserve[parquet]', or write a .csv"
        ) from exc
    return pq
