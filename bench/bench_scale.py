"""Scaling training out: featurisation on 1, 2 and 4 Dask workers, and what 10^4 bags cost.

* **Throughput.** The features pass of :mod:`core.streaming` (read an FCS file,
  arcsinh + standard scaling, sliced-Wasserstein quantile features, 50 directions × 50
  levels) over ``--bags`` files of 10^5 cells × 10 markers, on a ``LocalCluster`` of 1,
  2 and 4 single-threaded worker processes on 127.0.0.1, and on one local thread (the
  baseline, same run). Bags per second and the ratio to one worker.
* **Per-bag figures** on one bag in this process: reading, the first pass (moments)
  and the features of one scaling, each the median of 5 runs.
* **Solve.** The ridge search on the ``(bags × features)`` matrix: exact (Gram, one
  eigendecomposition per bandwidth, cubic in the bags) and with 2000 random features
  of the embeddings (``n_components``, linear in the bags), for the extrapolation.
* **Memory.** Peak RSS of ``bagserve train`` on the same files in memory and streamed.
* **Projection** for 10^4 bags × 10^5 cells from the measured figures (written out in
  ``bench/README.md``).

Run with ``make bench`` or ``OMP_NUM_THREADS=1 .venv/bin/python bench/bench_scale.py``.
Loopback only; about 4 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
from bagserve.core import DistributionRidge, SlicedWasserstein
from bagserve.core.bags import Bags
from bagserve.core.io import Panel, Preprocessing, read_file
from bagserve.core.representations.base import FeatureEmbedding
from bagserve.core.streaming import (
    BagSummary,
    DaskExecutor,
    LocalExecutor,
    bag_features,
    bag_summary,
    scalings,
    stream_features,
    stream_summaries,
)

RESULTS = Path(__file__).resolve().parent / "results"
MARKERS = [f"CD{j}" for j in range(10)]


def write_files(root: Path, n_bags: int, n_cells: int) -> None:
    """FCS files of float32 cells: a shifted population whose share is the label."""
    import flowio

    rng = np.random.default_rng(0)
    rows = ["file,label"]
    for t in range(n_bags):
        share = rng.uniform(0.1, 0.9)
        x = rng.gamma(2.0, 300.0, size=(n_cells, len(MARKERS))).astype(np.float32)
        x[: int(share * n_cells), :3] += 2000.0
        with open(root / f"s{t:03d}.fcs", "wb") as fh:
            flowio.create_fcs(fh, x.ravel(), MARKERS)
        rows.append(f"s{t:03d}.fcs,{share:.6f}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")


def median_seconds(fn: Any, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def featurise(executor: Any, paths: list[str], panel: Panel, pre: Preprocessing, rep: Any) -> float:
    t0 = time.perf_counter()
    stream_features(executor, paths, panel, [pre], [rep])
    return time.perf_counter() - t0


def dask_featurise(
    workers: int, paths: list[str], panel: Panel, pre: Preprocessing, rep: Any
) -> float:
    """Seconds of the features pass on a fresh LocalCluster of single-threaded worker
    processes on 127.0.0.1 (Dask's defaults otherwise), the workers warmed first."""
    from dask.distributed import LocalCluster

    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            worker_dashboard_address=None,
        ) as cluster,
        DaskExecutor(cluster.scheduler_address) as executor,
    ):
        featurise(executor, paths[:workers], panel, pre, rep)
        return featurise(executor, paths, panel, pre, rep)


def peak_rss_of_training(config: Path, output: Path, streaming: bool) -> float:
    """Peak resident MiB of ``bagserve train`` in a fresh process."""
    code = textwrap.dedent(
        """
        import json, sys
        from bagserve.cli import main
        code = main(sys.argv[1:])
        # VmHWM: ru_maxrss would carry the parent's peak over a vfork + exec.
        with open("/proc/self/status") as fh:
            peak = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
        print(json.dumps({"code": code, "peak": peak}))
        """
    )
    args = ["train", str(config), "--quiet", "--output", str(output)]
    if streaming:
        args.append("--streaming")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=True
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["code"] == 0, out.stderr
    return report["peak"] / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bags", type=int, default=48)
    parser.add_argument("--cells", type=int, default=100_000)
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_scale.json")
    args = parser.parse_args()
    result: dict[str, Any] = {"bags": args.bags, "cells": args.cells, "markers": len(MARKERS)}
    panel = Panel(tuple(MARKERS))
    base = {"transform": "arcsinh", "cofactor": 150.0, "scale": "standard"}
    rep = SlicedWasserstein(n_directions=50, n_levels=50, random_state=0).fit_to_dimension(
        len(MARKERS)
    )
    with tempfile.TemporaryDirectory(prefix="bagserve-scale-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        write_files(root, args.bags, args.cells)
        print(f"wrote {args.bags} FCS files in {time.perf_counter() - t0:.1f} s", flush=True)
        paths = sorted(str(p) for p in root.glob("*.fcs"))
        summaries: list[BagSummary] = stream_summaries(
            LocalExecutor(1), paths, panel, Preprocessing(**base)
        )
        (pre,) = scalings(base, summaries, [np.arange(len(paths))])

        # Per-bag figures, in this process.
        one = paths[0]
        per_bag = {
            "read_s": median_seconds(lambda: read_file(one)),
            "moments_pass_s": median_seconds(lambda: bag_summary(one, panel, pre)),
            "features_pass_s": median_seconds(lambda: bag_features(one, panel, [pre], [rep])),
        }
        sample = panel.select(read_file(one)[0])
        scaled = pre.apply(Bags(sample, np.array([0, len(sample)])), MARKERS)
        per_bag["features_only_s"] = median_seconds(lambda: rep.transform(scaled))
        per_bag["features_bytes"] = rep.n_output_features_ * 8
        per_bag["file_bytes"] = os.path.getsize(one)
        result["per_bag"] = per_bag
        print("per bag:", json.dumps(per_bag), flush=True)

        # Throughput: one local thread (baseline), then 1, 2, 4 Dask workers.
        rows = [{"executor": "local, 1 thread", "workers": 1}]
        rows[0]["seconds"] = featurise(LocalExecutor(1), paths, panel, pre, rep)
        for workers in (1, 2, 4):
            rows.append(
                {
                    "executor": f"dask, {workers} worker(s)",
                    "workers": workers,
                    "seconds": dask_featurise(workers, paths, panel, pre, rep),
                }
            )
        one_worker = rows[1]["seconds"]
        for row in rows:
            row["bags_per_s"] = args.bags / row["seconds"]
            row["speedup_vs_1_worker"] = one_worker / row["seconds"]
            row["speedup_vs_local_thread"] = rows[0]["seconds"] / row["seconds"]
            print(
                f"{row['executor']:>30}: {row['seconds']:6.1f} s, {row['bags_per_s']:5.2f} "
                f"bags/s, {row['speedup_vs_1_worker']:.2f}x one worker, "
                f"{row['speedup_vs_local_thread']:.2f}x local thread",
                flush=True,
            )
        result["throughput"] = rows

        # Peak memory of the whole training, in memory and streamed.
        config = root / "train.toml"
        config.write_text(
            textwrap.dedent(
                f"""
                [model]
                name = "scale"
                [data]
                files = "*.fcs"
                labels = "labels.csv"
                n_jobs = 2
                [panel]
                markers = {json.dumps(MARKERS)}
                [preprocessing]
                transform = "arcsinh"
                cofactor = 150.0
                scale = "standard"
                [estimator]
                class = "DistributionRidge"
                random_state = 0
                [estimator.representation]
                class = "SlicedWasserstein"
                n_directions = 50
                n_levels = 50
                [cv]
                n_splits = 5
                """
            )
        )
        result["memory"] = {
            "cells_as_float64_mib": args.bags * args.cells * len(MARKERS) * 8 / 2**20,
            "in_memory_peak_mib": peak_rss_of_training(config, root / "m1", streaming=False),
            "streaming_peak_mib": peak_rss_of_training(config, root / "m2", streaming=True),
        }
        print("memory:", json.dumps(result["memory"]), flush=True)

    # The solve on (bags x features): Gram, eigendecompositions of the search, final solve.
    rng = np.random.default_rng(0)
    solve = []
    for T in (500, 1000, 2000):
        F = rng.standard_normal((T, rep.n_output_features_)) / 50.0
        y = rng.standard_normal(T)
        t0 = time.perf_counter()
        DistributionRidge(random_state=0).fit_embedded(rep, FeatureEmbedding(F, "euclidean"), y)
        solve.append({"bags": T, "seconds": time.perf_counter() - t0})
        print(f"solve, {T} bags: {solve[-1]['seconds']:.2f} s", flush=True)
    result["solve"] = solve
    # Random features of the embeddings (n_components): a primal solve linear in the bags.
    primal = []
    for T in (1000, 4000):
        F = rng.standard_normal((T, rep.n_output_features_)) / 50.0
        y = rng.standard_normal(T)
        t0 = time.perf_counter()
        DistributionRidge(n_components=2000, random_state=0).fit_embedded(
            rep, FeatureEmbedding(F, "euclidean"), y
        )
        primal.append({"bags": T, "seconds": time.perf_counter() - t0})
        print(f"primal solve (2000 random features), {T} bags: {primal[-1]['seconds']:.2f} s")
    result["primal_solve"] = primal

    # Projection to 10^4 bags x 10^5 cells (the per-bag figures are for 10^5 cells).
    T, folds = 10_000, 5
    fits = folds + 1
    # Two passes over every file; the features pass does every fold's scaling at once.
    core_seconds = T * (
        per_bag["moments_pass_s"]
        + per_bag["features_pass_s"]
        + (fits - 1) * per_bag["features_only_s"]
    )
    cubic = solve[-1]["seconds"] * (T / solve[-1]["bags"]) ** 3
    efficiency_2 = rows[2]["speedup_vs_1_worker"] / 2
    result["projection"] = {
        "bags": T,
        "cells_per_bag": args.cells,
        "folds": folds,
        "disk_gb_float32": T * args.cells * len(MARKERS) * 4 / 1e9,
        "featurise_core_hours": core_seconds / 3600,
        "parallel_efficiency_2_workers": efficiency_2,
        "featurise_hours_on_64_cores": core_seconds / 3600 / (64 * min(1.0, efficiency_2)),
        "client_feature_matrix_gib": fits * T * per_bag["features_bytes"] / 2**30,
        "gram_gib": T * T * 8 / 2**30,
        "solve_seconds_per_fit_cubic": cubic,
        "solve_hours_all_fits": cubic * fits / 3600,
        "primal_solve_seconds_per_fit_linear": primal[-1]["seconds"] * T / primal[-1]["bags"],
    }
    print("projection:", json.dumps(result["projection"]), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
