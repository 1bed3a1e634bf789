"""Printing a benchmark's cases and writing them to ``bench/results/<name>.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def report(results: list[dict[str, Any]], name: str, *, save: bool = True, width: int = 28) -> None:
    """Print each case's figures; unless ``save`` is false (smoke runs), write the JSON."""
    for r in results:
        print(f"\n{r['case']}")
        for k, v in r.items():
            if k != "case":
                print(f"  {k:{width}s} {v:.4g}" if isinstance(v, float) else f"  {k:{width}s} {v}")
    if save:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"{name}.json"
        path.write_text(json.dumps(results, indent=2, default=float) + "\n")
        print(f"\nwrote {path}")
