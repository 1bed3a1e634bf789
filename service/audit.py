"""Append-only audit trail: one record per prediction, each chained to the previous.

A record holds the UTC time, request id, API key *id* (never the key), model name,
version and sha256, the input's sha256, the bag sizes, a summary of the output, and the
status: no point values, and file names only when configured. Each record carries
``prev`` (the previous record's hash) and ``hash`` = sha256 of its canonical JSON
without ``hash``.

The trail lives in the service's database (:mod:`.database`), one chain for every
replica: appending reads and moves the chain's head (record count and last hash) in
the same transaction, under the head row's lock, so replicas never fork it. Editing,
reordering or deleting any record, the last one included, is found by
:meth:`AuditLog.verify` (``bagserve audit verify --database URL``). The key id column
that each API key's listing selects on is checked against the key id inside the hashed
record, so moving a record to another key is an edit like any other. ``bagserve audit
export FILE`` writes the chain as JSON lines with a ``FILE.head`` sidecar (count, last
hash) that :func:`verify` checks the same way, away from the database.

Records are written by group commit (:mod:`.group_commit`): the service has one writer
thread, which takes every record waiting when it becomes free (audit records and the
idempotency records of the same requests), writes them in one transaction (one fsync),
and only then releases each caller. A request is still answered only once its record is
durable, but concurrent requests share the commit's cost instead of queueing behind one
fsync each.

Someone who can write the database can also cut records off its end and move the head
row back to match. A head taken earlier and kept elsewhere (``bagserve audit head``,
copied to another system) catches that: ``bagserve audit verify --head FILE`` requires
the chain to still hold that record with that hash.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from bagserve.core.atomic import atomic_write_json
from bagserve.core.hashing import json_sha256

from .database import GENESIS, Cursor, Database
from .group_commit import GroupCommit, Transaction

log = logging.getLogger("bagserve.audit")

__all__ = ["GENESIS", "AuditLog", "Head", "HeadMissing", "VerifyResult", "read_head", "verify"]

#: Records read per query when walking the chain.
_PAGE = 5000
#: The key id of a record read from a file, which has no column to compare with.
_NO_COLUMN = object()
#: A chain's head: the number of records and the hash of the last.
Head = tuple[int, str]


def _digest(record: dict[str, Any]) -> str:
    return json_sha256(record, exclude=("hash",))


def _canonical(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def _insert(cur: Cursor, rows: list[tuple[int, str | None, str]]) -> None:
    """Insert audit rows (seq, key id, record) in one statement per engine call."""
    cur.executemany("INSERT INTO audit (seq, api_key_id, record) VALUES (%s, %s, %s)", rows)


class HeadMissing(ValueError):
    """The database holds no valid chain head (the ``audit_head`` row): a sign of
    tampering, since bagserve writes it with the schema and only ever updates it."""

    def __init__(self, found: str) -> None:
        super().__init__(
            f"the audit chain's head (the audit_head row: how many records were written and "
            f"the last one's hash) is {found}. bagserve creates it with the database and "
            "only ever moves it forward: someone with write access to the database removed "
            "or changed it, a sign of tampering. Without it, records deleted from the end of "
            "the chain cannot be found from the database alone; check the chain against a "
            "head kept elsewhere (bagserve audit verify --head FILE), and restore the "
            "database from a backup before serving again"
        )


def _head_of(row: tuple[Any, ...] | None) -> Head:
    """The head a row of ``audit_head`` holds (:class:`HeadMissing` if none, or not one)."""
    if row is None:
        raise HeadMissing("missing")
    seq, last = row
    try:
        count = int(seq)
    except (TypeError, ValueError):
        raise HeadMissing(f"not valid (record count {seq!r})") from None
    if count < 0 or not isinstance(last, str) or len(last) != len(GENESIS):
        raise HeadMissing(f"not valid (record count {seq!r}, last hash {last!r})")
    return count, last


@dataclass
class VerifyResult:
    """What a verification found: ``ok``, the records read, the last hash, the first problem."""

    ok: bool
    lines: int
    last_hash: str
    problem: str | None


@dataclass
class _Chain:
    """The chain's end as one transaction extends it: rows to insert at its end."""

    seq: int
    last: str
    now: str
    rows: list[tuple[int, str | None, str]] = field(default_factory=list)


class AuditLog:
    """The audit chain in the database; thread-safe.

    Appends go through a :class:`~.group_commit.GroupCommit` writer, which commits
    every write waiting when it becomes free in one transaction (group commit), the
    idempotency records of the same requests included when the service shares it; each
    caller is released once the transaction holding its record committed. Within a
    transaction the chain's head is read once, under its lock, and moved once.

    Parameters
    ----------
    db : Database
    writer : GroupCommit, optional
        The writer to share (the service's, shared with its idempotency records); by
        default one of the log's own, made with ``max_batch``, ``on_commit`` and
        ``idle`` (see :class:`~.group_commit.GroupCommit`).
    """

    def __init__(
        self,
        db: Database,
        *,
        writer: GroupCommit | None = None,
        max_batch: int = 512,
        on_commit: Callable[[int, float], None] | None = None,
        idle: float = 30.0,
    ) -> None:
        self.db = db
        self.writer = writer or GroupCommit(db, max_batch=max_batch, on_commit=on_commit, idle=idle)

    def append(self, **fields: Any) -> dict[str, Any]:
        """Append one record (``time``, the fields, ``prev`` and its own ``hash``),
        committed (durably) before returning.

        Raises
        ------
        Exception
            What the database raised for the transaction that held the record.
        """
        return self.submit(fields).result()

    async def append_async(self, **fields: Any) -> dict[str, Any]:
        """:meth:`append` for the event loop: waits for the commit without a thread.

        The record is written even if the awaiting task is cancelled.
        """
        return await self.writer.run(partial(self._append, fields))

    def submit(self, fields: dict[str, Any]) -> Future[dict[str, Any]]:
        """Queue one record for the writer; the future holds the record once committed.

        Cancelling the future does not withdraw the record: what was submitted is
        written.

        Raises
        ------
        RuntimeError
            The writer was closed.
        """
        return self.writer.submit(partial(self._append, fields))

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then stop the writer (later appends raise; a shared
        writer stops for every user)."""
        self.writer.close(timeout)

    def _append(self, fields: dict[str, Any], tx: Transaction) -> dict[str, Any]:
        """One record after the transaction's last: chained, its row queued for the
        transaction's end."""
        chain = tx.shared("audit", self._open_chain, self._close_chain)
        record = {"time": chain.now, **fields, "prev": chain.last}
        record["hash"] = chain.last = _digest(record)
        chain.seq += 1
        chain.rows.append((chain.seq, fields.get("api_key_id"), _canonical(record)))
        return record

    def _open_chain(self, cur: Cursor) -> _Chain:
        """The head, locked until the commit (PostgreSQL: replicas never fork it)."""
        lock = " FOR UPDATE" if self.db.dialect == "postgresql" else ""
        seq, last = _head_of(
            cur.execute("SELECT seq, last_hash FROM audit_head WHERE id = 1" + lock).fetchone()
        )
        return _Chain(seq, last, datetime.now(UTC).isoformat(timespec="milliseconds"))

    @staticmethod
    def _close_chain(cur: Cursor, chain: _Chain) -> None:
        """The transaction's records in one statement, and the head moved once."""
        _insert(cur, chain.rows)
        cur.execute(
            "UPDATE audit_head SET seq = %s, last_hash = %s WHERE id = 1", (chain.seq, chain.last)
        )

    def recent(self, limit: int, key_id: str | None = None) -> list[dict[str, Any]]:
        """The last ``limit`` records, newest first (of API key ``key_id`` only, if given).

        The key id column selects; the key id inside the hashed record decides: a record
        whose column was edited to another key is left out (and logged), never shown to
        that key.
        """
        with self.db.transaction(write=False) as cur:
            if key_id is None:
                rows = cur.execute(
                    "SELECT seq, record FROM audit ORDER BY seq DESC LIMIT %s", (limit,)
                ).fetchall()
            else:
                rows = cur.execute(
                    "SELECT seq, record FROM audit WHERE api_key_id = %s "
                    "ORDER BY seq DESC LIMIT %s",
                    (key_id, limit),
                ).fetchall()
        records = []
        for seq, text in rows:
            record = json.loads(text)
            if key_id is not None and record.get("api_key_id") != key_id:
                log.error("audit record's key id column was edited", extra={"record": int(seq)})
                continue
            records.append(record)
        return records

    def count(self) -> int:
        """Records in the chain (the head's count)."""
        with self.db.transaction(write=False) as cur:
            row = cur.execute("SELECT seq FROM audit_head WHERE id = 1").fetchone()
        return int(row[0]) if row else 0

    def _pages(self) -> Iterator[tuple[int, str, Any]]:
        after = 0
        while True:
            with self.db.transaction(write=False) as cur:
                rows = cur.execute(
                    "SELECT seq, record, api_key_id FROM audit WHERE seq > %s "
                    "ORDER BY seq LIMIT %s",
                    (after, _PAGE),
                ).fetchall()
            if not rows:
                return
            for seq, text, key in rows:
                yield int(seq), str(text), key
            after = int(rows[-1][0])

    def head(self) -> Head:
        """The chain's head as the database holds it: record count and last hash.

        Raises
        ------
        HeadMissing
            The database has no valid head.
        """
        with self.db.transaction(write=False) as cur:
            row = cur.execute("SELECT seq, last_hash FROM audit_head WHERE id = 1").fetchone()
        return _head_of(row)

    def verify(self, earlier: Head | None = None) -> VerifyResult:
        """Walk the chain in the database, then check it against the head (and against
        a head taken ``earlier``, which the chain must still hold). Without a valid head
        the chain fails, and the records are still walked to say how far they hold."""
        # The head first: records appended while walking lie beyond it and are not read.
        try:
            head = self.head()
        except HeadMissing as missing:
            walked = _walk(self._pages(), None, "record", earlier)
            found = (
                f"The {walked.lines} record(s) in the table are chained correctly."
                if walked.ok
                else f"And {walked.problem}."
            )
            return VerifyResult(False, walked.lines, walked.last_hash, f"{missing}. {found}")
        records = (r for r in self._pages() if r[0] <= head[0])
        return _walk(records, head, "record", earlier)

    def export(self, path: str | Path) -> VerifyResult:
        """Write the chain, as far as its head when the export starts, to ``path`` as
        JSON lines and the head to ``path.head``. The lines are streamed to a temporary
        file that replaces ``path`` only once the chain verified."""
        path = Path(path)
        try:
            head = self.head()
        except HeadMissing:
            return self.verify()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:

                def written() -> Iterator[tuple[int, str, Any]]:
                    for seq, text, key in self._pages():
                        if seq > head[0]:
                            return
                        fh.write(text + "\n")
                        yield seq, text, key

                checked = _walk(written(), head, "record")
                fh.flush()
                os.fsync(fh.fileno())
            if not checked.ok:
                return checked
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        atomic_write_json(
            path.with_name(path.name + ".head"), {"lines": head[0], "last_hash": head[1]}
        )
        return checked


def _walk(
    records: Iterable[tuple[int, str, Any]],
    head: Head | None,
    unit: str,
    earlier: Head | None = None,
) -> VerifyResult:
    """Check a chain: numbering, links, hashes and key id columns, then the head
    (count, last hash), then that the chain still holds a head taken ``earlier``."""
    prev = GENESIS
    n = 0
    for seq, text, column in records:
        n += 1
        if seq != n:
            return VerifyResult(
                False, n - 1, prev, f"{unit} {n} is missing (the next is {seq}): deleted"
            )
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            return VerifyResult(False, n - 1, prev, f"{unit} {n} is not JSON")
        if not isinstance(record, dict):
            return VerifyResult(False, n - 1, prev, f"{unit} {n} is not a JSON object")
        if record.get("prev") != prev:
            return VerifyResult(
                False,
                n - 1,
                prev,
                f"{unit} {n} does not follow {unit} {n - 1} (a {unit} was deleted or reordered)",
            )
        if record.get("hash") != _digest(record):
            return VerifyResult(
                False, n - 1, prev, f"{unit} {n} was edited (its hash does not match)"
            )
        if column is not _NO_COLUMN and column != record.get("api_key_id"):
            return VerifyResult(
                False,
                n - 1,
                prev,
                f"{unit} {n} was moved to another API key (its key id column says "
                f"{column!r}, the hashed record {record.get('api_key_id')!r})",
            )
        if earlier is not None and n == earlier[0] and record["hash"] != earlier[1]:
            return VerifyResult(
                False,
                n,
                record["hash"],
                f"{unit} {n} is not the one the head taken earlier names: the history "
                "up to it was rewritten",
            )
        prev = record["hash"]
    if head is not None and head[0] > n:
        problem = f"the chain ends at {unit} {n} but {head[0]} {unit}(s) were written"
        return VerifyResult(False, n, prev, problem + f" ({unit}s removed from the end)")
    if head is not None and head[0] < n:
        return VerifyResult(
            False,
            n,
            prev,
            f"the chain has {n} {unit}(s) but its head counts {head[0]} ({unit}s added "
            "after the end, or the head moved back)",
        )
    if head is not None and head[1] != prev:
        return VerifyResult(
            False,
            n,
            prev,
            f"the head names {head[1][:16]}... as the hash of {unit} {n}, which is "
            f"{prev[:16]}...: the head or the last {unit} was replaced",
        )
    if earlier is not None and n < earlier[0]:
        return VerifyResult(
            False,
            n,
            prev,
            f"the chain has {n} {unit}(s) but a head taken earlier counted {earlier[0]}: "
            f"{unit}s were removed from the end",
        )
    return VerifyResult(True, n, prev, None)


def read_head(path: str | Path) -> Head:
    """A head written by ``bagserve audit head`` or ``audit export`` (``FILE.head``).

    Raises
    ------
    ValueError
        The file is not such a head.
    """
    try:
        spec = json.loads(Path(path).read_text())
        return int(spec["lines"]), str(spec["last_hash"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not an audit head ({exc})") from None


def verify(path: str | Path, earlier: Head | None = None) -> VerifyResult:
    """Check an exported (or pre-database) trail file: the first edited, inserted or
    deleted line is named; ``FILE.head``, when present, catches lines cut from the end,
    and so does a head taken ``earlier`` and kept elsewhere."""
    path = Path(path)
    head_path = path.with_name(path.name + ".head")
    head = read_head(head_path) if head_path.exists() else None
    with open(path, encoding="utf-8") as fh:
        lines = ((n, line, _NO_COLUMN) for n, line in enumerate(fh, start=1))
        return _walk(lines, head, "line", earlier)
