"""One-time import of the state earlier versions kept in files under ``DATA_DIR``.

Before the database (:mod:`.database`), each replica kept ``jobs/<id>/`` (request,
``meta.json``, ``result.json``), ``idempotency/<sha256 of key>.json`` and the audit
trail ``audit.jsonl`` (+ ``.head``). At start-up whatever of these is found is imported,
in one transaction per kind, and the source is then renamed ``*.imported`` (kept, never
deleted: nothing stored is lost, and a crash before the rename imports again without
duplicates).

* Jobs keep their ids, status, times and results; jobs that were running are queued.
* Idempotency records keep their key (by its sha256) and answer; a key already in the
  database (another replica's) is left alone.
* An audit file is verified first (a file that does not verify stops the start-up, as
  before). Its records cannot join the database's chain as they are (their ``prev``
  links belong to their own chain, and several replicas may bring one each), so the
  chain gets one *import record* that names the file and seals it: its sha256, line
  count and last hash. The renamed file keeps verifying with ``bagserve audit verify``,
  and the seal in the chain shows it was not changed since.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from bagserve.core.hashing import file_sha256

from .audit import AuditLog, verify
from .database import Database

__all__ = ["import_files"]

log = logging.getLogger("bagserve.import")


def import_files(db: Database, data_dir: Path, audit_file: Path | None = None) -> dict[str, int]:
    """Import what pre-database versions stored under ``data_dir``; counts by kind.

    Raises
    ------
    RuntimeError
        The audit file does not verify (the message says where it breaks).
    """
    data_dir = Path(data_dir)
    done: dict[str, int] = {}
    jobs = data_dir / "jobs"
    if jobs.is_dir():
        done["jobs"] = _import_jobs(db, jobs)
        _retire(jobs)
    keys = data_dir / "idempotency"
    if keys.is_dir():
        done["idempotency"] = _import_keys(db, keys)
        _retire(keys)
    audit = Path(audit_file) if audit_file is not None else data_dir / "audit.jsonl"
    if audit.is_file():
        done["audit_lines"] = _import_audit(db, audit)
        head = audit.with_name(audit.name + ".head")
        _retire(audit)
        if head.exists():
            _retire(head)
    if done:
        log.info("imported pre-database state", extra={"imported": done, "from": str(data_dir)})
    return done


def _retire(path: Path) -> None:
    target = path.with_name(path.name + ".imported")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.imported.{n}")
    os.replace(path, target)


def _import_jobs(db: Database, directory: Path) -> int:
    n = 0
    with db.transaction() as cur:
        for path in sorted(directory.iterdir()):
            if path.name.startswith("."):
                continue  # never fully created
            try:
                meta = json.loads((path / "meta.json").read_text())
                body = (path / "request.bin").read_bytes()
            except (OSError, ValueError):
                log.warning("unreadable job left out of the import", extra={"path": str(path)})
                continue
            result_path = path / "result.json"
            result = result_path.read_text() if result_path.exists() else None
            status = meta.get("status", "queued")
            if status == "running" or (status in ("succeeded", "failed") and result is None):
                status = "queued"
            fields = {
                k: v
                for k, v in meta.items()
                if k not in ("id", "status", "created", "updated", "attempts")
            }
            n += cur.execute(
                "INSERT INTO jobs (id, status, created, updated, meta, body, result) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
                (
                    meta["id"],
                    status,
                    float(meta.get("created", time.time())),
                    float(meta.get("updated", time.time())),
                    json.dumps(fields),
                    body,
                    result,
                ),
            ).rowcount
    return n


def _import_keys(db: Database, directory: Path) -> int:
    n = 0
    with db.transaction() as cur:
        for path in sorted(directory.glob("*.json")):
            try:
                record: dict[str, Any] = json.loads(path.read_text())
                body = base64.b64decode(record["body"])
                stored = float(record["stored"])
            except (OSError, ValueError, KeyError):
                continue
            n += cur.execute(
                "INSERT INTO idempotency (key_hash, fingerprint, created, stored, status, "
                "headers, body) VALUES (%s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (key_hash) DO NOTHING",
                (
                    path.stem,
                    record["fingerprint"],
                    stored,
                    stored,
                    int(record["status"]),
                    json.dumps(record.get("headers", {})),
                    body,
                ),
            ).rowcount
    return n


def _import_audit(db: Database, path: Path) -> int:
    checked = verify(path)
    if not checked.ok:
        raise RuntimeError(f"audit log {path} does not verify: {checked.problem}")
    digest = file_sha256(path)
    with db.transaction(write=False) as cur:
        seen = cur.execute(
            "SELECT 1 FROM imports WHERE source = %s", (f"audit:{digest}",)
        ).fetchone()
    if seen is None:
        AuditLog(db).append(
            event="import",
            source=str(path),
            file_sha256=digest,
            lines=checked.lines,
            last_hash=checked.last_hash,
        )
        with db.transaction() as cur:
            cur.execute(
                "INSERT INTO imports (source, done, summary) VALUES (%s, %s, %s) "
                "ON CONFLICT (source) DO NOTHING",
                (f"audit:{digest}", time.time(), json.dumps({"lines": checked.lines})),
            )
    return checked.lines
