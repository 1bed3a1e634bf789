"""``bagserve predict``: sample files through a saved model or a running service."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

from .local import oru_for_files, predict_files, table_for_files
from .remote import remote_model

__all__ = ["register"]


def _remote_predict(args: argparse.Namespace) -> dict[str, Any]:
    """Predict through a running service (MODEL is ``name`` or ``name/version``)."""
    with remote_model(args) as remote:
        return remote.predict(args.files)


def _cmd_predict(args: argparse.Namespace) -> int:
    if args.control and args.url:
        raise ValueError(
            "--control maps samples with a model on this machine; through a service, send "
            "the control as one of the request's bags and name it with ?control=ID"
        )
    if (args.explain or args.fcs_dir) and (args.format != "json" or args.url):
        raise SystemExit("--explain and --fcs-dir need --format json and a saved model")
    if args.fcs_dir and not args.explain:
        raise SystemExit("--fcs-dir needs --explain")
    plan = _hl7_plan(args) if args.hl7 else None
    if args.format == "json":
        result = (
            _remote_predict(args)
            if args.url
            else predict_files(
                args.model,
                args.files,
                compensated=args.compensated,
                coverage=args.interval,
                cells=args.cells,
                control=args.control,
                explain=args.explain,
                fcs_dir=args.fcs_dir,
            )
        )
        text = json.dumps(result, default=str)
        warnings = result.get("warnings") or []
    elif args.url:
        with remote_model(args) as remote:
            text = remote._call(remote.table_csv, args.files).rstrip("\n")
        warnings = _table_warnings(text)
    else:
        from ..service.tables import csv_bytes

        columns, rows, warnings = table_for_files(
            args.model,
            args.files,
            compensated=args.compensated,
            coverage=args.interval,
            cells=args.cells,
            control=args.control,
        )
        text = csv_bytes(columns, rows).decode().rstrip("\n")
    # Flags reach whoever runs the command, not only the file it writes.
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if plan is not None:
        _send_hl7(args, plan)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


def _table_warnings(text: str) -> list[str]:
    """The distinct warnings of a results table's rows, in order."""
    import csv

    out: dict[str, None] = {}
    for row in csv.DictReader(io.StringIO(text, newline="")):
        for warning in (row.get("warnings") or "").split(" | "):
            if warning:
                out[warning] = None
    return list(out)


def _hl7_plan(args: argparse.Namespace) -> tuple[dict[str, Any], Any, float]:
    """What ``--hl7`` needs, checked before any work: the patient and placer order
    numbers (one per file), MSH-3..6 and the try timeout from the ``BAGSERVE_HL7_*``
    settings."""
    from ..service.errors import Problem
    from ..service.hl7 import Parties, check_orders, hl7_references
    from ..service.mllp import parse_mllp_url
    from ..service.settings import Settings

    parse_mllp_url(args.hl7)  # a wrong address fails before any work
    try:
        refs = hl7_references({"patient": args.patient, "order": args.order or []})
        check_orders(refs.get("orders") or [], len(args.files))
    except Problem as exc:
        raise ValueError(f"HL7: {exc.detail}") from exc
    settings = Settings()
    return refs, Parties.from_settings(settings), settings.hl7_timeout


def _send_hl7(args: argparse.Namespace, plan: tuple[dict[str, Any], Any, float]) -> None:
    """The answer as an HL7 v2 ORU^R01 message to the MLLP peer of ``--hl7``."""
    from ..service.mllp import MllpError, send

    refs, parties, timeout = plan
    if args.url:
        # The service builds the message, with its own MSH settings.
        with remote_model(args) as remote:
            message = remote.oru(args.files, refs)
    else:
        message = oru_for_files(
            args.model,
            args.files,
            compensated=args.compensated,
            coverage=args.interval,
            refs=refs,
            parties=parties,
            control=args.control,
            explain=args.explain,
        )
    try:
        ack = send(message, args.hl7, timeout=timeout)
    except MllpError as exc:
        raise ValueError(f"HL7: {exc}") from exc
    print(f"hl7: {args.hl7} accepted the ORU^R01 message ({ack.code})", file=sys.stderr)


def register(sub: Any) -> None:
    """Add this group's commands to the ``bagserve`` parser's subcommands."""
    pr = sub.add_parser("predict", help="predict sample files (FCS, CSV, TSV, NPY)")
    pr.add_argument("model")
    pr.add_argument("files", nargs="+")
    pr.add_argument("--format", choices=("json", "csv"), default="json")
    pr.add_argument(
        "--interval",
        type=float,
        default=0.9,
        help="coverage of the prediction interval or set, where the model has one (default 0.9)",
    )
    pr.add_argument(
        "--cells",
        action="store_true",
        help="per-cell models: every cell's label (default: the population summary)",
    )
    pr.add_argument(
        "--explain",
        action="store_true",
        help="which cells moved each prediction (an explanation per result: baseline, "
        "total, by marker, top cells; per-cell models: the share of cells per class)",
    )
    pr.add_argument(
        "--fcs-dir",
        metavar="DIR",
        help="with --explain: write each sample to DIR as NAME.explained.fcs, its channels "
        "plus 'contribution', for gating on the cells that moved the prediction",
    )
    pr.add_argument("--output", help="write here instead of stdout")
    pr.add_argument(
        "--control",
        metavar="FILE",
        help="per-cell models trained with a reference control: the control measured in "
        "the files' batch; every file is mapped by it onto the training batch first",
    )
    pr.add_argument(
        "--hl7",
        metavar="mllp://HOST:PORT",
        help="also send the answer as an HL7 v2.5.1 ORU^R01 message to this MLLP peer "
        "(exit 1 unless it is accepted; MSH-3..6 and the try timeout from the "
        "BAGSERVE_HL7_* variables, with --url the service's)",
    )
    pr.add_argument("--patient", help="with --hl7: the patient identifier (PID-3)")
    pr.add_argument(
        "--order",
        action="append",
        help="with --hl7: the placer order number (ORC-2, OBR-2) of each file, repeated "
        "in the files' order (one order per file, or none)",
    )
    pr.add_argument("--url", help="use a running service (MODEL is then name or name/version)")
    pr.add_argument("--api-key", help="service API key (default: BAGSERVE_API_KEY)")
    pr.add_argument(
        "--compensated",
        action="store_true",
        help="the files hold compensated cells: skip the model's own compensation",
    )
    pr.set_defaults(func=_cmd_predict)
