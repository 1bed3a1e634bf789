"""The ``bagserve`` parser, put together from the command groups, and its entry point."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from . import audit, batch, models, predict, serve, signing, train, validate

__all__ = ["build_parser", "main"]

#: The command groups in the order ``bagserve --help`` lists them.
GROUPS = (train, validate, batch, predict, models, serve, audit, signing)


def build_parser() -> argparse.ArgumentParser:
    """The ``bagserve`` parser: every group adds its own commands and arguments."""
    p = argparse.ArgumentParser(prog="bagserve", description="Learning on bags of points.")
    p.add_argument("--version", action="version", version=f"bagserve {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bagserve`` command."""
    from ..core.errors import CoreError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        hint = (
            "; `bagserve train --streaming` reads a few bags at a time, "
            "`--scheduler ADDRESS` trains on a Dask cluster"
            if args.command == "train"
            else ""
        )
        print(f"error: out of memory{hint}", file=sys.stderr)
        return 1
    except (CoreError, OSError, ValueError, ImportError) as exc:
        message = " ".join(str(exc).split())
        print(f"error: {message}", file=sys.stderr)
        return 1
