"""``bagserve models list``: the model artifacts of a directory, verified."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["list_models", "register"]


def list_models(directory: str | Path) -> list[dict[str, Any]]:
    """Every artifact under ``directory`` (``<name>/<version>/manifest.json``), verified."""
    from ..core.artifact_info import ArtifactInfo
    from ..core.artifacts import ArtifactError

    rows = []
    for mpath in sorted(Path(directory).glob("*/*/manifest.json")):
        path = mpath.parent
        row: dict[str, Any] = {"name": path.parent.name, "version": path.name, "path": str(path)}
        try:
            info = ArtifactInfo.read(path)
            kind = str(info.kind)
        except ArtifactError as exc:
            row.update(status=f"FAILED: {exc}")
        else:
            row.update(
                status="ok",
                estimator=info.estimator,
                kind=kind,
                panel=info.markers or None,
                metrics=info.metadata.get("metrics"),
                created=info.manifest.get("created"),
                manifest_sha256=info.sha256,
            )
        rows.append(row)
    return rows


def _cmd_models(args: argparse.Namespace) -> int:
    rows = list_models(args.directory)
    if args.format == "json":
        print(json.dumps(rows, default=str))
        return 0
    if not rows:
        print(f"no models under {args.directory}")
        return 0
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['name']}/{r['version']}  {r['status']}")
            continue
        metrics = ", ".join(
            f"{k}={v:.4g}" for k, v in (r["metrics"] or {}).items() if isinstance(v, int | float)
        )
        head = f"{r['name']}/{r['version']}  {r['estimator']}  panel={r['panel']}"
        print(f"{head}  {metrics}  hashes ok")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def register(sub: Any) -> None:
    """Add this group's commands to the ``bagserve`` parser's subcommands."""
    m = sub.add_parser("models", help="model artifacts")
    msub = m.add_subparsers(dest="models_command", required=True)
    ml = msub.add_parser("list", help="name, version, estimator, panel, metrics, hash status")
    ml.add_argument("directory")
    ml.add_argument("--format", choices=("text", "json"), default="text")
    ml.set_defaults(func=_cmd_models)
