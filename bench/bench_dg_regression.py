"""Marginal transfer regression on real per-site data, against pooled ridge and HGB.

Data: Munnell (1990), state productivity and public capital, as ``linearmodels`` ships
it (``core.datasets.load_state_productivity``): 48 contiguous US states x 17 years.
Each state is a task; each state-year a point with 4 inputs, log public capital, log
private capital, log employment and the unemployment rate; the target is log gross
state product. The states' census divisions (9) are the batches.

Protocols, as for the per-cell classifiers (``bench_dg_baselines.py``):

* leave one state out (48 splits): train on the other 47 states (the model is given
  their divisions, so its own selection is leave-one-division-out), predict every year
  of the state left out;
* leave one division out (9 splits): train on the other divisions, predict every state
  of the division left out.

Methods: ``MTL`` (``MarginalTransferRegressor()`` defaults), ``pooling`` (the same with
``pooling=True``), ``MTL paper kernel`` (Gaussian ``k_X``, no normalisation), and pooled
baselines: ridge (``RidgeCV`` on standardised inputs, 13 ``λ`` from 1e-4 to 1e2) and
histogram gradient boosting (200 iterations), each with and without per-state
standardisation of the inputs. Reported: RMSE of log GSP over all held-out state-years
and R² against their variance, and the mean fit seconds per split, each fit timed in the
same run.

Run with ``.venv/bin/python bench/bench_dg_regression.py [--quick]`` (``--quick``: 8
states left out, 3 divisions). Writes bench/results/bench_dg_regression.json.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _report import report
from bagserve.core import Bags, MarginalTransferRegressor
from bagserve.core.datasets import CENSUS_DIVISIONS, load_state_productivity
from dg_baselines import per_sample_standardised
from numpy.typing import NDArray
from sklearn.ensemble import HistGradientBoostingRegressor
from sklearn.linear_model import RidgeCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

METHODS: dict[str, dict[str, Any]] = {
    "MTL": {},
    "pooling": {"pooling": True},
    "MTL paper kernel": {"point_kernel": "gaussian", "normalise": "none"},
}


def load_munnell() -> tuple[list[NDArray[np.float64]], list[NDArray[np.float64]], NDArray[Any]]:
    """Per state: its inputs (years x 4), its log GSP, and its census division."""
    tasks, y, divisions, _ = load_state_productivity()
    return (
        [np.asarray(tasks[t]) for t in range(len(tasks))],
        [y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in range(len(tasks))],
        divisions,
    )


def _ridge() -> Any:
    return make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-4, 2, 13)))


def _hgb(seed: int) -> Any:
    return HistGradientBoostingRegressor(max_iter=200, early_stopping=False, random_state=seed)


BASELINES: dict[str, tuple[Callable[[int], Any], bool]] = {
    "ridge": (lambda s: _ridge(), False),
    "ridge + std": (lambda s: _ridge(), True),
    "HGB": (_hgb, False),
    "HGB + std": (_hgb, True),
}


def split(xs, ys, groups, train, test, seed: int) -> dict[str, dict[str, float]]:
    y_test = np.concatenate([ys[i] for i in test])
    out: dict[str, dict[str, float]] = {}

    def record(name: str, pred: NDArray[np.float64], fit: float) -> None:
        out[name] = {"sse": float(np.sum((pred - y_test) ** 2)), "fit_seconds": fit}

    for name, (factory, standardise) in BASELINES.items():
        tr = [xs[i] for i in train]
        te = [xs[i] for i in test]
        if standardise:
            tr, te = per_sample_standardised(tr), per_sample_standardised(te)
        model = factory(seed)
        t0 = time.perf_counter()
        model.fit(np.vstack(tr), np.concatenate([ys[i] for i in train]))
        fit = time.perf_counter() - t0
        record(name, model.predict(np.vstack(te)), fit)
    for name, params in METHODS.items():
        model = MarginalTransferRegressor(random_state=seed, **params)
        t0 = time.perf_counter()
        model.fit(
            Bags.from_arrays([xs[i] for i in train]),
            [ys[i] for i in train],
            groups=groups[train],
        )
        fit = time.perf_counter() - t0
        record(name, model.predict(Bags.from_arrays([xs[i] for i in test])), fit)
        if name == "MTL":
            fallback = "fallback" if model.fallback_ is not None else "no fallback"
            out[name]["chosen"] = f"{model.normalise_}, tau {model.tau_}, {fallback}"
    return out


def summarise(case: str, results: list[dict[str, dict[str, float]]], y_all, n_points):
    rows = []
    for name in results[0]:
        sse = sum(r[name]["sse"] for r in results)
        mse = sse / n_points
        row = {
            "case": f"{case}: {name}",
            "rmse": float(np.sqrt(mse)),
            "r2": float(1.0 - mse / np.var(y_all)),
            "fit_seconds": float(np.mean([r[name]["fit_seconds"] for r in results])),
        }
        if "chosen" in results[0][name]:
            row["chosen"] = "; ".join(sorted({r[name]["chosen"] for r in results}))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer splits")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    xs, ys, groups = load_munnell()
    n = len(xs)
    states = range(n) if not args.quick else range(0, n, 6)
    divisions = list(CENSUS_DIVISIONS) if not args.quick else list(CENSUS_DIVISIONS)[:3]
    out = []
    loso, held = [], []
    for i in states:
        train = np.setdiff1d(np.arange(n), [i])
        loso.append(split(xs, ys, groups, train, np.array([i]), args.seed))
        held.append(ys[i])
    y_held = np.concatenate(held)
    out += summarise(f"leave one state out ({len(loso)})", loso, y_held, y_held.size)
    lodo, held = [], []
    for d in divisions:
        test = np.flatnonzero(groups == d)
        train = np.flatnonzero(groups != d)
        lodo.append(split(xs, ys, groups, train, test, args.seed))
        held += [ys[i] for i in test]
    y_held = np.concatenate(held)
    out += summarise(f"leave one division out ({len(lodo)})", lodo, y_held, y_held.size)
    report(out, "bench_dg_regression", save=not args.quick, width=12)


if __name__ == "__main__":
    main()
