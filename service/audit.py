"""Append-only audit trail: one JSON line per prediction, each chained to the previous.

A line holds the UTC time, request id, API key *id* (never the key), model name,
version and sha256, the input's sha256, the bag sizes, a summary of the output, and the
status — no point values, and file names only when configured. Each line carries
``prev`` (the previous line's hash) and ``hash`` = sha256 of its canonical JSON
without ``hash``; a sidecar ``<file>.head`` holds the number of lines and the last
hash, so editing, reordering or deleting any line (the last one included) is detected
by :func:`verify` (``bagserve audit verify FILE``).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bagserve.core.atomic import atomic_write_json
from bagserve.core.hashing import json_sha256

__all__ = ["GENESIS", "AuditLog", "VerifyResult", "verify"]

GENESIS = "0" * 64


def _digest(record: dict[str, Any]) -> str:
    return json_sha256(record, exclude=("hash",))


class AuditLog:
    """Thread-safe appender; continues the chain of an existing file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        result = verify(self.path) if self.path.exists() else VerifyResult(True, 0, GENESIS, None)
        if not result.ok:
            raise RuntimeError(f"audit log {self.path} does not verify: {result.problem}")
        self._count = result.lines
        self._last = result.last_hash

    def append(self, **fields: Any) -> dict[str, Any]:
        """Append one record (``time``, the fields, ``prev`` and its own ``hash``), fsynced."""
        with self._lock:
            record = {
                "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
                **fields,
                "prev": self._last,
            }
            record["hash"] = _digest(record)
            line = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
            self._count += 1
            self._last = record["hash"]
            head = self.path.with_name(self.path.name + ".head")
            atomic_write_json(head, {"lines": self._count, "last_hash": self._last})
            return record

    def recent(self, limit: int, key_id: str | None = None) -> list[dict[str, Any]]:
        """The last ``limit`` records, newest first (of API key ``key_id`` only, if
        given), read from the end of the file without reading all of it."""
        wanted: list[dict[str, Any]] = []
        if not self.path.exists():
            return wanted
        with open(self.path, "rb") as fh:
            pos = fh.seek(0, os.SEEK_END)
            carry = b""
            while pos > 0 and len(wanted) < limit:
                start = max(0, pos - (1 << 16))
                fh.seek(start)
                lines = (fh.read(pos - start) + carry).split(b"\n")
                pos = start
                # The first piece is a line's end unless the file's start was reached.
                carry = lines.pop(0) if pos > 0 else b""
                for raw in reversed(lines):
                    if not raw.strip():
                        continue
                    record = json.loads(raw)
                    if key_id is None or record.get("api_key_id") == key_id:
                        wanted.append(record)
                        if len(wanted) == limit:
                            break
        return wanted


@dataclass
class VerifyResult:
    """What :func:`verify` found: ``ok``, the lines read, the last hash, the first problem."""

    ok: bool
    lines: int
    last_hash: str
    problem: str | None


def verify(path: str | Path) -> VerifyResult:
    """Walk the chain; the first edited, inserted or deleted line is named."""
    path = Path(path)
    prev = GENESIS
    n = 0
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                return VerifyResult(False, n - 1, prev, f"line {n} is not JSON")
            if record.get("prev") != prev:
                return VerifyResult(
                    False,
                    n - 1,
                    prev,
                    f"line {n} does not follow line {n - 1} (a line was deleted or reordered)",
                )
            if record.get("hash") != _digest(record):
                return VerifyResult(
                    False, n - 1, prev, f"line {n} was edited (its hash does not match)"
                )
            prev = record["hash"]
    head = path.with_name(path.name + ".head")
    if head.exists():
        expected = json.loads(head.read_text())
        if expected.get("lines") != n or expected.get("last_hash") != prev:
            written = expected.get("lines")
            problem = f"the file ends at line {n} but {written} line(s) were written"
            return VerifyResult(False, n, prev, problem + " (lines removed from the end)")
    return VerifyResult(True, n, prev, None)
