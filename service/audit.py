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
:meth:`AuditLog.verify` (``bagserve audit verify --database URL``). ``bagserve audit
export FILE`` writes the chain as JSON lines with a ``FILE.head`` sidecar (count, last
hash) that :func:`verify` checks the same way, away from the database.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bagserve.core.atomic import atomic_write_json
from bagserve.core.hashing import json_sha256

from .database import GENESIS, Database

__all__ = ["GENESIS", "AuditLog", "VerifyResult", "verify"]

#: Records read per query when walking the chain.
_PAGE = 5000


def _digest(record: dict[str, Any]) -> str:
    return json_sha256(record, exclude=("hash",))


def _canonical(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


@dataclass
class VerifyResult:
    """What a verification found: ``ok``, the records read, the last hash, the first problem."""

    ok: bool
    lines: int
    last_hash: str
    problem: str | None


class AuditLog:
    """The audit chain in the database; thread-safe (each call is one transaction).

    Parameters
    ----------
    db : Database
    """

    def __init__(self, db: Database) -> None:
        self.db = db

    def append(self, **fields: Any) -> dict[str, Any]:
        """Append one record (``time``, the fields, ``prev`` and its own ``hash``),
        committed (durably) before returning."""
        lock = " FOR UPDATE" if self.db.dialect == "postgresql" else ""
        with self.db.transaction() as cur:
            seq, last = cur.execute(
                "SELECT seq, last_hash FROM audit_head WHERE id = 1" + lock
            ).fetchone()  # type: ignore[misc]
            record = {
                "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
                **fields,
                "prev": last,
            }
            record["hash"] = _digest(record)
            cur.execute(
                "INSERT INTO audit (seq, api_key_id, record) VALUES (%s, %s, %s)",
                (int(seq) + 1, fields.get("api_key_id"), _canonical(record)),
            )
            cur.execute(
                "UPDATE audit_head SET seq = %s, last_hash = %s WHERE id = 1",
                (int(seq) + 1, record["hash"]),
            )
        return record

    def recent(self, limit: int, key_id: str | None = None) -> list[dict[str, Any]]:
        """The last ``limit`` records, newest first (of API key ``key_id`` only, if given)."""
        with self.db.transaction(write=False) as cur:
            if key_id is None:
                rows = cur.execute(
                    "SELECT record FROM audit ORDER BY seq DESC LIMIT %s", (limit,)
                ).fetchall()
            else:
                rows = cur.execute(
                    "SELECT record FROM audit WHERE api_key_id = %s ORDER BY seq DESC LIMIT %s",
                    (key_id, limit),
                ).fetchall()
        return [json.loads(r[0]) for r in rows]

    def count(self) -> int:
        """Records in the chain (the head's count)."""
        with self.db.transaction(write=False) as cur:
            row = cur.execute("SELECT seq FROM audit_head WHERE id = 1").fetchone()
        return int(row[0]) if row else 0

    def _pages(self) -> Iterator[tuple[int, str]]:
        after = 0
        while True:
            with self.db.transaction(write=False) as cur:
                rows = cur.execute(
                    "SELECT seq, record FROM audit WHERE seq > %s ORDER BY seq LIMIT %s",
                    (after, _PAGE),
                ).fetchall()
            if not rows:
                return
            for seq, text in rows:
                yield int(seq), str(text)
            after = int(rows[-1][0])

    def _head(self) -> tuple[int, str]:
        with self.db.transaction(write=False) as cur:
            seq, last = cur.execute("SELECT seq, last_hash FROM audit_head WHERE id = 1").fetchone()  # type: ignore[misc]
        return int(seq), str(last)

    def verify(self) -> VerifyResult:
        """Walk the chain in the database, then check it against the head."""
        # The head first: records appended while walking lie beyond it and are not read.
        head = self._head()
        records = ((seq, text) for seq, text in self._pages() if seq <= head[0])
        return _walk(records, head, "record")

    def export(self, path: str | Path) -> VerifyResult:
        """Write the chain, as far as its head when the export starts, to ``path`` as
        JSON lines and the head to ``path.head``. The lines are streamed to a temporary
        file that replaces ``path`` only once the chain verified."""
        path = Path(path)
        head = self._head()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:

                def written() -> Iterator[tuple[int, str]]:
                    for seq, text in self._pages():
                        if seq > head[0]:
                            return
                        fh.write(text + "\n")
                        yield seq, text

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
    records: Iterable[tuple[int, str]], head: tuple[int, str] | None, unit: str
) -> VerifyResult:
    """Check a chain: numbering, links and hashes, then the head (count, last hash)."""
    prev = GENESIS
    n = 0
    for seq, text in records:
        n += 1
        if seq != n:
            return VerifyResult(
                False, n - 1, prev, f"{unit} {n} is missing (the next is {seq}): deleted"
            )
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            return VerifyResult(False, n - 1, prev, f"{unit} {n} is not JSON")
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
        prev = record["hash"]
    if head is not None and (head[0] != n or head[1] != prev):
        problem = f"the chain ends at {unit} {n} but {head[0]} {unit}(s) were written"
        return VerifyResult(False, n, prev, problem + f" ({unit}s removed from the end)")
    return VerifyResult(True, n, prev, None)


def verify(path: str | Path) -> VerifyResult:
    """Check an exported (or pre-database) trail file: the first edited, inserted or
    deleted line is named; ``FILE.head``, when present, catches lines cut from the end."""
    path = Path(path)
    head_path = path.with_name(path.name + ".head")
    head = None
    if head_path.exists():
        expected = json.loads(head_path.read_text())
        head = (int(expected.get("lines", -1)), str(expected.get("last_hash")))
    with open(path, encoding="utf-8") as fh:
        lines = ((n, line) for n, line in enumerate(fh, start=1))
        return _walk(lines, head, "line")
