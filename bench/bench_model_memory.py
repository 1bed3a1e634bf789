"""Memory of a served model: one copy for the service, whatever the number of workers.

Run with ``.venv/bin/python bench/bench_model_memory.py [--workers 2 4] [--against
COMMIT]`` (about a minute per variant; Linux: it reads ``/proc``). It saves a larger
model (sliced-Wasserstein ridge, 400 training bags embedded in 50,000 dimensions:
about 160 MB of arrays) beside the two demo models, starts ``bagserve serve``
(:class:`bench_start.Server`) with N workers, asks each model for one prediction per
worker (every page a prediction touches is then in memory), and sums
``/proc/<pid>/smaps_rollup`` over the server, the process the workers are forked from
and the workers: the proportional set size (PSS: a page shared by k processes counts
1/k in each), the unique set size (USS: private pages) and the resident set size (RSS).
The same without the larger model gives what it costs: about its size once, not N
times. With ``--against COMMIT`` that commit's code is measured the same way (before
this design its workers memory-mapped the files, shared through the page cache).
Writes ``bench/results/bench_model_memory.json``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _report import report
from bench_start import Server, extract

MIB = 1 << 20


def big_model(directory: Path) -> int:
    """Save ``big/1``; returns the bytes of its array files."""
    from bagserve.core import DistributionRidge, SlicedWasserstein, save
    from bagserve.core.io import Panel, Preprocessing

    rng = np.random.default_rng(0)
    bags = [rng.normal(loc=i / 100, size=(100, 3)) for i in range(400)]
    model = DistributionRidge(SlicedWasserstein(n_directions=200, n_levels=250, random_state=0))
    model.fit(bags, np.arange(400.0))
    path = save(
        model,
        directory / "big" / "1",
        name="big",
        version="1",
        panel=Panel(("a", "b", "c")).to_json(),
        preprocessing=Preprocessing().to_json(),
    )
    return sum(f.stat().st_size for f in (path / "arrays").iterdir())


def rollup(pid: int) -> dict[str, int]:
    """A process's ``smaps_rollup`` in bytes (RSS, PSS, USS)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value) * 1024
    uss = fields["Private_Clean"] + fields["Private_Dirty"]
    return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": uss}


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def measure(models: Path, root: Path, pythonpath: Path | None, workers: int) -> dict[str, Any]:
    from bagserve.core.demo import demo_samples

    server = Server(models, root, pythonpath, workers=workers)
    try:
        server.wait_ready()
        bags, _, markers = demo_samples("dose", 1, 3)
        bodies = {
            "demo-dose": {"bags": [{"id": "b", "markers": markers, "points": bags[0].tolist()}]}
        }
        if (models / "big").exists():
            points = np.random.default_rng(1).normal(size=(100, 3)).tolist()
            bodies["big"] = {"bags": [{"id": "b", "markers": ["a", "b", "c"], "points": points}]}
        with httpx.Client(timeout=300.0) as client:
            for name, body in bodies.items():
                for _ in range(2 * workers):  # every worker, most likely
                    r = client.post(f"{server.url}/v1/models/{name}/predict", json=body)
                    r.raise_for_status()
            pids = client.get(f"{server.url}/readyz").json()["workers"]["pids"]
        time.sleep(0.5)
        helpers = [c for c in children(server.proc.pid) if c not in pids]
        parts = {
            "server": rollup(server.proc.pid),
            "fork server": {k: sum(rollup(p)[k] for p in helpers) for k in ("rss", "pss", "uss")},
            "workers": {k: sum(rollup(p)[k] for p in pids) for k in ("rss", "pss", "uss")},
        }
    finally:
        server.stop()
    total = {k: sum(part[k] for part in parts.values()) for k in ("rss", "pss", "uss")}
    return {**parts, "total": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--against", metavar="COMMIT", help="also measure this commit's code")
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        from bagserve.core.demo import build_demo_models

        small = root / "models-small"
        build_demo_models(small)
        large = root / "models-large"
        shutil.copytree(small, large)
        size = big_model(large)
        variants: dict[str, Path | None] = {"now": None}
        if args.against:
            variants[f"before ({args.against})"] = extract(args.against, root)
        for variant, path in variants.items():
            for n in args.workers:
                with_big = measure(large, root, path, n)
                without = measure(small, root, path, n)
                row: dict[str, Any] = {"case": f"{variant}, {n} workers", "model_MiB": size / MIB}
                for part in ("server", "fork server", "workers", "total"):
                    for k in ("pss", "uss", "rss"):
                        row[f"{part} {k} MiB"] = with_big[part][k] / MIB
                for k in ("pss", "uss", "rss"):
                    cost = with_big["total"][k] - without["total"][k]
                    row[f"model's cost in {k}, copies"] = cost / size
                results.append(row)
    report(results, "bench_model_memory", width=34)


if __name__ == "__main__":
    main()
