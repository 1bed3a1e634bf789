"""``bagserve train``, ``bagserve evaluate`` and ``bagserve demo``: models made and measured."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["register"]


def _cmd_train(args: argparse.Namespace) -> int:
    from ..core.training import train

    result = train(
        args.config,
        output=args.output,
        progress=not args.quiet,
        overwrite=args.overwrite,
        scheduler=args.scheduler,
        streaming=True if args.streaming else None,
    )
    cv = result.metrics["cv"]
    shown = {k: v for k, v in cv.items() if not isinstance(v, list | dict)}
    print(
        json.dumps(
            {
                "model": str(result.path),
                "cv": shown,
                "best_params": result.metrics["chosen_params"],
            },
            default=str,
        )
    )
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from ..core.training import evaluate

    result = evaluate(
        args.model, args.data, include_training=args.include_training, progress=not args.quiet
    )
    # Which bags the metrics cover goes to stderr too, so that a reader of the numbers
    # alone (a script keeping stdout) is not the only one told.
    print(f"evaluate: {result['note']}", file=sys.stderr)
    print(json.dumps(result, default=str))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..core.demo import build_demo_models

    for path in build_demo_models(args.models, overwrite=args.force):
        print(path)
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``bagserve`` parser's subcommands."""
    t = sub.add_parser("train", help="train a model from a TOML configuration")
    t.add_argument("config")
    t.add_argument("--output", help="models directory (default: [model] output)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing version")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="train on a Dask cluster (e.g. tcp://host:8786): its workers read and "
        "featurise the bags; default: [compute] scheduler",
    )
    t.add_argument(
        "--streaming",
        action="store_true",
        help="read bags from their files a few at a time (memory-bounded); "
        "default: [compute] streaming",
    )
    t.set_defaults(func=_cmd_train)

    e = sub.add_parser(
        "evaluate",
        help="metrics of a model on the data of a configuration (its unseen bags only)",
    )
    e.add_argument("model")
    e.add_argument(
        "data",
        help="a TOML file with a [data] table (files and their labels); a training "
        "configuration will do, its other tables are not read",
    )
    e.add_argument(
        "--include-training",
        action="store_true",
        help="also count the bags the model was trained on (optimistic); the unseen bags' "
        "metrics are then under unseen_only",
    )
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=_cmd_evaluate)

    d = sub.add_parser("demo", help="train the bundled demo models (generated data)")
    d.add_argument("--models", default="models", help="models directory (default: ./models)")
    d.add_argument("--force", action="store_true", help="rebuild existing demo models")
    d.set_defaults(func=_cmd_demo)
