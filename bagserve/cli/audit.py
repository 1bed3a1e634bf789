"""``bagserve audit verify|head|export``: the service's hash-chained audit trail."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["register"]


def _audit_source(args: argparse.Namespace):
    """The audit chain a command reads: ``--database``, else the service's settings
    (BAGSERVE_DATABASE_URL, or the SQLite file in BAGSERVE_DATA_DIR)."""
    from ..service.audit import AuditLog
    from ..service.database import Database
    from ..service.settings import Settings

    settings = Settings()
    data_dir = Path(args.data_dir) if args.data_dir else settings.data_dir
    url = args.database or settings.database_url
    if url is None and not (data_dir / "bagserve.sqlite3").exists():
        raise SystemExit(
            f"error: no audit database: {data_dir / 'bagserve.sqlite3'} does not exist"
        )
    return AuditLog(Database(url, data_dir, pool_size=1, timeout=settings.database_timeout))


@contextlib.contextmanager
def _audit_chain(args: argparse.Namespace) -> Iterator[Any]:
    """The audit chain a command reads (:func:`_audit_source`), closed afterwards; a
    database that cannot be opened or read ends the command with the reason."""
    from ..service.database import from_database

    log = None
    try:
        log = _audit_source(args)
        yield log
    except Exception as exc:
        if not from_database(exc):
            raise
        # Opening errors name the database themselves (without its password).
        where = "" if log is None else f"{log.db.where}: cannot read the audit chain: "
        raise SystemExit(f"error: {where}{' '.join(str(exc).split())}") from exc
    finally:
        if log is not None:
            log.db.close()


def _cmd_audit_verify(args: argparse.Namespace) -> int:
    from ..service.audit import read_head, verify

    earlier = read_head(args.head) if args.head else None
    if args.file is not None:
        where, result = args.file, verify(args.file, earlier)
    else:
        with _audit_chain(args) as log:
            where, result = log.db.where, log.verify(earlier)
    if not result.ok:
        print(f"error: {where}: {result.problem}", file=sys.stderr)
        return 1
    matched = f"; holds the head of {args.head} (record {earlier[0]})" if earlier else ""
    print(f"ok: {result.lines} record(s), chain intact, last hash {result.last_hash}{matched}")
    return 0


def _cmd_audit_head(args: argparse.Namespace) -> int:
    """The chain's head, after verifying the chain: to be kept away from the database."""
    from datetime import UTC, datetime

    from ..core.atomic import atomic_write_json

    with _audit_chain(args) as log:
        where, result = log.db.where, log.verify()
    if not result.ok:
        print(f"error: {where}: {result.problem}; no head written", file=sys.stderr)
        return 1
    head = {
        "lines": result.lines,
        "last_hash": result.last_hash,
        "taken": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if args.output:
        atomic_write_json(args.output, head)
        print(f"{args.output}: {result.lines} record(s), last hash {result.last_hash}")
    else:
        print(json.dumps(head))
    return 0


def _cmd_audit_export(args: argparse.Namespace) -> int:
    with _audit_chain(args) as log:
        where, result = log.db.where, log.export(args.output)
    if not result.ok:
        print(f"error: {where}: {result.problem}; nothing written", file=sys.stderr)
        return 1
    print(f"{args.output}: {result.lines} record(s), last hash {result.last_hash}")
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``bagserve`` parser's subcommands."""
    a = sub.add_parser("audit", help="the service's audit trail")
    asub = a.add_subparsers(dest="audit_command", required=True)
    av = asub.add_parser(
        "verify", help="check the hash chain: exit 1 on an edited, reordered or deleted record"
    )
    av.add_argument("file", nargs="?", help="an exported trail; default: the service's database")
    av.add_argument(
        "--head",
        metavar="HEAD_FILE",
        help="a head taken earlier (`bagserve audit head`) and kept elsewhere: the chain must "
        "still hold it (catches records cut from the end with the head row edited to match)",
    )
    av.set_defaults(func=_cmd_audit_verify)
    ah = asub.add_parser(
        "head", help="the chain's head (count, last hash) after verifying it, to keep elsewhere"
    )
    ah.add_argument("--output", help="write it here (JSON) instead of printing it")
    ah.set_defaults(func=_cmd_audit_head)
    ae = asub.add_parser(
        "export", help="write the chain as JSON lines (+ FILE.head) after verifying it"
    )
    ae.add_argument("output")
    ae.set_defaults(func=_cmd_audit_export)
    for audit_parser in (av, ae, ah):
        audit_parser.add_argument(
            "--database", help="postgresql://... ; default: BAGSERVE_DATABASE_URL, else SQLite"
        )
        audit_parser.add_argument(
            "--data-dir", help="where the SQLite database is; default: BAGSERVE_DATA_DIR"
        )
