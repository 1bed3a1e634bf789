"""``bagserve validate``: a saved model against a reference method (CLSI EP09/EP12)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["register"]


def _cmd_validate(args: argparse.Namespace) -> int:
    from ..core.validation import validate, write_study

    doc = validate(args.model, args.data)
    paths = write_study(doc, args.out)
    samples = doc["samples"]
    print(
        f"validate: {samples['n']} sample(s), {samples['n_declined']} declined by the model; "
        f"acceptance: {doc['verdict']}",
        file=sys.stderr,
    )
    print(json.dumps({"verdict": doc["verdict"], **{k: str(v) for k, v in paths.items()}}))
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``bagserve`` parser's subcommands."""
    v = sub.add_parser(
        "validate",
        help="compare a model with a reference method on new samples (CLSI EP09/EP12)",
        description="Runs a saved model exactly as served on samples with reference "
        "results (a validation TOML: [data] with files and references, [acceptance] "
        "limits, [statistics], [precision], [report]) and writes validation.html "
        "(printable, with a signature block), validation.json and per_sample.csv into "
        "--out. Samples the model was trained on are refused.",
    )
    v.add_argument("model", help="a saved model's directory")
    v.add_argument("data", help="the validation TOML file")
    v.add_argument("--out", required=True, help="directory for the three files")
    v.set_defaults(func=_cmd_validate)
