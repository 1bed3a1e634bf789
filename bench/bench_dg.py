"""Cost of marginal transfer: random-feature fit and prediction, against the exact solver.

* random-feature fit on 16 tasks x 20,000 cells x 8 markers (fixed hyperparameters, and
  with the default leave-tasks-out search), seconds and peak memory;
* prediction for a new task of 10^5 cells, seconds and peak memory;
* the exact solver against the random-feature solver on a size the exact one can do
  (8 tasks x 250 cells), timed in the same run.

Peak memory is numpy's traced allocation peak (tracemalloc) above what was allocated
before the call. Run with ``make bench`` or ``.venv/bin/python bench/bench_dg.py``.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
from _report import report
from bagserve.core import MarginalTransferClassifier, MeanEmbedding
from bagserve.core.datasets import make_cytometry_tasks


def measure(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Wall seconds and peak traced MiB of one call."""
    tracemalloc.start()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return seconds, peak / 2**20, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n_cells = 2_000 if args.quick else 20_000
    n_new = 10_000 if args.quick else 100_000
    train, y_train = make_cytometry_tasks(16, n_cells, n_markers=8, random_state=0)
    new, y_new = make_cytometry_tasks(1, n_new, n_markers=8, random_state=1)
    # Every hyperparameter fixed (the normalisation, the refinement and the embedding
    # bandwidth too): no search.
    fixed = {
        "normalise": "none",
        "refine": "none",
        "point_bandwidth": 2.0,
        "task_gamma": 1.0,
        "tau": 0.2,
        "alpha": 1e-5,
        "embedding": MeanEmbedding(bandwidth=2.0),
    }
    results: list[dict[str, Any]] = []

    def fixed_model() -> MarginalTransferClassifier:
        return MarginalTransferClassifier(random_state=0, **fixed)

    s, mem, model = measure(lambda: fixed_model().fit(train, y_train))
    results.append(
        {
            "case": f"RF fit, 16 tasks x {n_cells} cells x 8 markers, fixed params",
            "seconds": s,
            "peak_mib": mem,
            "data_mib": train.points.nbytes / 2**20,
        }
    )
    s, mem, pred = measure(lambda: model.predict(new))
    results.append(
        {
            "case": f"RF predict, one new task of {n_new} cells",
            "seconds": s,
            "peak_mib": mem,
            "data_mib": new.points.nbytes / 2**20,
            "accuracy": float(np.mean(pred == y_new)),
        }
    )
    s, mem, searched = measure(
        lambda: MarginalTransferClassifier(random_state=0).fit(train, y_train)
    )
    results.append(
        {
            "case": "RF fit with the default leave-tasks-out search (5 folds)",
            "seconds": s,
            "peak_mib": mem,
            "chosen": {
                "tau": searched.tau_,
                "alpha": searched.alpha_,
                "point_bandwidth": searched.point_bandwidth_,
                "task_gamma": searched.task_gamma_,
            },
            "accuracy": float(np.mean(searched.predict(new) == y_new)),
        }
    )

    small, y_small = make_cytometry_tasks(8, 250, n_markers=8, random_state=2)
    test_small, y_test_small = make_cytometry_tasks(2, 2000, n_markers=8, random_state=3)
    timings = {}
    for name, params in {
        "exact ridge": {"solver": "exact", "loss": "squared"},
        "exact SVM (hinge)": {"solver": "exact", "loss": "hinge"},
        "random features": {},
    }.items():
        s_fit, mem, m = measure(
            lambda params=params: MarginalTransferClassifier(random_state=0, **fixed, **params).fit(
                small, y_small
            )
        )
        s_pred, _, pred = measure(lambda m=m: m.predict(test_small))
        timings[name] = s_fit
        results.append(
            {
                "case": f"{name}: fit 8 tasks x 250 cells, predict 2 x 2000",
                "fit_seconds": s_fit,
                "predict_seconds": s_pred,
                "peak_mib": mem,
                "accuracy": float(np.mean(pred == y_test_small)),
            }
        )
    for name in ("exact ridge", "exact SVM (hinge)"):
        results.append(
            {
                "case": f"fit time ratio {name} / random features (same run)",
                "ratio": timings[name] / timings["random features"],
            }
        )

    report(results, "bench_dg", save=not args.quick, width=18)


if __name__ == "__main__":
    main()
