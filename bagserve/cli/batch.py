"""``bagserve batch``: every sample file of a folder into one table."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from .remote import remote_model

__all__ = ["register"]


def _cmd_batch(args: argparse.Namespace) -> int:
    from ..batch import LocalPredictor, RemotePredictor, batch, report_counts
    from ..service.options import PredictOptions
    from ..service.settings import Settings

    # The service's limits, from the same BAGSERVE_* settings: a drop folder is as
    # hostile as an HTTP body.
    settings = Settings()
    with contextlib.ExitStack() as stack:
        if args.url:
            predictor: Any = RemotePredictor(stack.enter_context(remote_model(args)))
        else:
            predictor = LocalPredictor(
                args.model,
                PredictOptions(coverage=args.interval, cells=False, compensated=args.compensated),
                settings.request_limits().reading(),
                settings.request_timeout,
            )
            stack.callback(predictor.close)

        def log(line: str) -> None:
            if not args.quiet:
                print(f"batch: {line}", file=sys.stderr, flush=True)

        counts = batch(
            predictor,
            args.folder,
            args.output,
            watch=args.watch,
            poll=args.poll,
            settle=args.settle,
            idle_exit=args.idle_exit,
            max_bytes=settings.max_body_bytes,
            log=log,
        )
    report_counts(counts, Path(args.output))
    return 1 if counts.failed or counts.left else 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``bagserve`` parser's subcommands."""
    ba = sub.add_parser(
        "batch",
        help="predict every sample file of a folder into one table (CSV or Parquet)",
        description="One row per file with the trust fields, in the columns every CSV "
        "door writes; files already in the table (by sha256) are skipped; a failing file "
        "becomes a row with its error and the run goes on; symlinks and files still being "
        "written are not read (exit 1 when any failed or was left for a later run).",
    )
    ba.add_argument("model", help="a saved model's directory, or name[/version] with --url")
    ba.add_argument("folder", help="the folder of sample files (not read recursively)")
    ba.add_argument("output", help="the table: OUT.csv, or OUT.parquet (pyarrow)")
    ba.add_argument("--url", help="use a running service")
    ba.add_argument("--api-key", help="service API key (default: BAGSERVE_API_KEY)")
    ba.add_argument("--interval", type=float, default=0.9, help="interval coverage (0.9)")
    ba.add_argument("--compensated", action="store_true", help="as for predict")
    ba.add_argument(
        "--watch", action="store_true", help="keep taking new files as they arrive (Ctrl-C)"
    )
    ba.add_argument("--poll", type=float, default=2.0, help="seconds between looks (2)")
    ba.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="a file is read once unchanged for this many seconds (5): a copy in progress "
        "is left for later",
    )
    ba.add_argument(
        "--idle-exit",
        type=float,
        default=None,
        help="with --watch: stop after this many seconds without a new file",
    )
    ba.add_argument("--quiet", action="store_true", help="no line per file on stderr")
    ba.set_defaults(func=_cmd_batch)
