"""Reproduce paper 002 (conditional mean embeddings as regressors) and use it on bags.

(a) Sparse embeddings on the pendulum (paper 002 §5.1, Figure 1; digest §2.4-2.5, §5).
    200 training transitions of the under-actuated pendulum
    (:func:`core.datasets.make_pendulum_transitions`, seed ``seed``), 2,000 test
    transitions (seed ``seed + 1``); input ``(sin θ, cos θ, ω, u)``, output the next
    state ``(sin θ', cos θ', ω')``. A dense :class:`~core.ConditionalMeanEmbedding` with
    Gaussian input and output kernels is fitted; its input scale and ridge are chosen by
    the estimator's own cross-validation of the paper's loss (§3.2). Then

    * **sparse** (Algorithm 1): ``sparsify(γ, max_iter, tol=1e-5)`` over a log grid of
      ``γ`` relative to ``γ_max = max |K W L|``, the smallest ``γ`` whose solution is
      ``M = 0`` (12 values from ``1e-4 γ_max`` to ``0.9 γ_max``; 5 under ``--quick``);
    * **incomplete Cholesky** (the paper's baseline): pivots of
      ``incomplete_cholesky(K, 200)`` and, for every rank ``r`` from 1 to 200 (a
      coarser grid under ``--quick``), ``restrict(pivots[:r])``, the best embedding
      (closest in ``‖·‖_Γ``) that uses only those ``r`` training inputs.

    For each, the number of retained training inputs (``len(support_)``, the kernel
    evaluations a query costs), the non-zeros of ``M``, the squared distance to the
    dense solution (eq. 16, ``distance_to_dense()``), the test mean squared error of
    ``predict`` (the conditional mean) and the test surrogate loss ``-score`` (eq. 7).
    The column "sparse, refit" is a diagnostic that is not in the paper:
    ``restrict(support_)`` on the sparse method's own support, i.e. its choice of inputs
    without the ℓ1 shrinkage of the kept coefficients. The summary gives, for a test MSE
    (and, separately, a test surrogate loss) within 5, 10, 50 and 100 % of the dense
    model's, the fewest retained inputs and the fewest non-zeros each method needs
    among the evaluated points ("never": no evaluated point is that accurate).
    The paper reports no numbers, only that the sparse method is "significantly"
    sparser than incomplete Cholesky at comparable error.

(b) Distribution-regression intervals on bags. Bag ``t`` holds 300 points from
    ``N(m_t, 0.5² I)`` in 2-D with ``m_t ~ U([-2, 2]²)``; its label is
    ``y_t = sin(m_t0) + (0.1 + 0.3 |m_t0|) ε_t``, ``ε_t ~ N(0, 1)`` (heteroscedastic).
    400 training and 400 test bags per repeat (5 seeded repeats; 1 repeat of 200 + 200
    under ``--quick``). Nominal 80 % intervals from

    * **CME**: ``ConditionalMeanEmbedding(SlicedWasserstein(n_directions=20,
      n_levels=20, random_state=0), gamma=γ₀ · logspace(-1, 2, 7))`` with ``γ₀`` the
      median heuristic of the training bags' sliced-Wasserstein distances and the ridge
      by the estimator's cross-validation; interval = conditional 10 % and 90 %
      quantiles (``quantiles(test, [0.1, 0.9])``), fitted on all training bags;
    * **split conformal** around ``DistributionRidge(SlicedWasserstein(n_directions=20,
      n_levels=20, random_state=0), random_state=0)`` (its own LOO search of ``γ`` and
      ``λ``): fitted on a random half of the training bags; ``q`` = the
      ``⌈(n_cal + 1) 0.8⌉``-th smallest absolute residual on the other half; interval
      = prediction ± ``q``;
    * **oracle**: ``sin(m_0) ± z_0.9 (0.1 + 0.3 |m_0|)`` from the true means.

    Empirical coverage and mean width, overall and in the lower and upper halves of the
    test bags' ``|m_0|`` (split at its median): intervals that adapt to the noise are
    narrow in the lower half and wide in the upper half.

Choices the paper leaves open (digest 002 §5): the pendulum's inputs and outputs are
standardised with the training mean and standard deviation (so ``ω`` and ``u`` do not
dominate the Euclidean distances) and the test MSE is in these standardised units,
averaged over the three outputs; the input-kernel grid is the median heuristic
``γ₀ × logspace(-1, 1, 5)``, the output kernel's scale its median heuristic, the ridge
the estimator's default grid ``logspace(-7, 1, 17)`` in the ``(K + λ n I)`` scaling;
FISTA runs at most 3,000 iterations (1,000 under ``--quick``) with ``tol=1e-5``
(relative KKT residual); sparsity is reported both as retained inputs and as
non-zeros of ``M``; incomplete Cholesky pivots on the largest residual diagonal and
turns the pivots into an embedding by projection (``restrict``). ``--alpha`` fixes the
pendulum's ridge instead of cross-validating it (a sensitivity check, not the protocol;
nothing is written then).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python bench/reproduce_cme.py            # ~3 minutes
    OMP_NUM_THREADS=1 .venv/bin/python bench/reproduce_cme.py --quick    # ~30 seconds

The full run writes ``bench/results/reproduce_cme.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from bagserve.core import (
    Bags,
    ConditionalMeanEmbedding,
    DistributionRidge,
    SlicedWasserstein,
    get_kernel,
)
from bagserve.core.datasets import make_pendulum_transitions
from bagserve.core.estimators.cme import incomplete_cholesky
from bagserve.core.kernels import squared_euclidean_distances
from bagserve.core.selection import median_heuristic_gamma
from numpy.typing import NDArray
from scipy.stats import norm

RESULTS = Path(__file__).resolve().parent / "results"
#: Relative test-error levels of the summary: MSE ≤ (1 + level) × dense MSE.
ERROR_LEVELS = (0.05, 0.10, 0.50, 1.00)
FISTA_TOL = 1e-5
NOMINAL = 0.8

Array = NDArray[np.float64]


# --------------------------------------------------------------------------- (a)
def pendulum_data(n_train: int, n_test: int, seed: int) -> tuple[Array, Array, Array, Array]:
    """Training and test transitions, standardised with the training statistics."""
    X, Y = make_pendulum_transitions(n_train, random_state=seed)
    Xt, Yt = make_pendulum_transitions(n_test, random_state=seed + 1)
    mx, sx = X.mean(axis=0), X.std(axis=0)
    my, sy = Y.mean(axis=0), Y.std(axis=0)
    return (X - mx) / sx, (Y - my) / sy, (Xt - mx) / sx, (Yt - my) / sy


def evaluate(model: ConditionalMeanEmbedding, X_test: Array, Y_test: Array) -> dict[str, Any]:
    """Sparsity, distance to the dense solution and test errors of one embedding."""
    return {
        "retained": int(model.support_.size),
        "nnz": int(np.count_nonzero(model.dual_)),
        "distance": model.distance_to_dense(),
        "mse": float(np.mean((model.predict(X_test) - Y_test) ** 2)),
        "loss": -model.score(X_test, Y_test),
    }


def fewest(rows: list[dict[str, Any]], key: str, metric: str, bound: float) -> int | None:
    """Smallest ``key`` among the rows whose ``metric`` is within ``bound``."""
    ok = [r[key] for r in rows if r[metric] <= bound]
    return min(ok) if ok else None


def pendulum_experiment(
    seed: int, n_gammas: int, max_iter: int, rank_step: int, alpha: float | None
) -> dict[str, Any]:
    X, Y, X_test, Y_test = pendulum_data(200, 2000, seed)
    g0 = median_heuristic_gamma(squared_euclidean_distances(X), get_kernel("gaussian"))
    t0 = time.perf_counter()
    dense = ConditionalMeanEmbedding(
        gamma=g0 * np.logspace(-1, 1, 5), alpha=alpha, random_state=seed
    ).fit(X, Y)
    fit_seconds = time.perf_counter() - t0
    K = dense.kernel_matrix(X)
    L = dense.output_kernel_(squared_euclidean_distances(Y), dense.output_gamma_)
    W = dense.dual_
    gamma_max = float(np.abs(K @ W @ L).max())
    dense_row = evaluate(dense, X_test, Y_test)
    dense_row["norm2"] = float(np.sum((K @ W) * (W @ L)))  # ‖μ̂‖²_Γ, the distance's scale
    print(
        f"(a) pendulum, n = 200 train / 2000 test: input γ = {dense.gamma_:.4g} "
        f"(median heuristic × {dense.gamma_ / g0:.3g}), λ = {dense.alpha_:.3g}, "
        f"output γ = {dense.output_gamma_:.4g}, fit + CV {fit_seconds:.2f} s",
        flush=True,
    )
    print(
        f"    dense: test MSE {dense_row['mse']:.3e}, surrogate loss {dense_row['loss']:.3e}, "
        f"‖μ̂‖²_Γ = {dense_row['norm2']:.4g}, γ_max = {gamma_max:.4g}",
        flush=True,
    )

    sparse_rows = []
    for rel in np.logspace(-4, math.log10(0.9), n_gammas):
        t1 = time.perf_counter()
        model = dense.sparsify(rel * gamma_max, max_iter=max_iter, tol=FISTA_TOL)
        seconds = time.perf_counter() - t1
        row = {
            "gamma": float(rel * gamma_max),
            "gamma_rel": float(rel),
            **evaluate(model, X_test, Y_test),
        }
        row.update(
            iterations=int(model.sparse_info_["iterations"]),
            kkt=float(model.sparse_info_["kkt"]),
            seconds=seconds,
        )
        if model.support_.size:
            refit = evaluate(dense.restrict(model.support_), X_test, Y_test)
            row["refit"] = {k: refit[k] for k in ("distance", "mse", "loss")}
        sparse_rows.append(row)

    pivots = incomplete_cholesky(K, 200)
    # Every rank (every ``rank_step``-th under --quick), the grid printed below and the
    # sparse method's retained-input counts.
    ranks = sorted(
        set(range(1, pivots.size + 1, rank_step))
        | set(range(10, pivots.size + 1, 10))
        | {int(r["retained"]) for r in sparse_rows if 0 < r["retained"] <= pivots.size}
        | {int(pivots.size)}
    )
    chol_rows = [{"rank": r, **evaluate(dense.restrict(pivots[:r]), X_test, Y_test)} for r in ranks]
    by_rank = {r["rank"]: r for r in chol_rows}

    print("\n    sparse (Algorithm 1) against incomplete Cholesky at the same number of inputs")
    print(
        f"    {'γ/γ_max':>8} {'inputs':>6} {'nnz M':>6} {'iters':>5} {'KKT':>8} {'sec':>5} |"
        f" {'sparse dist':>11} {'MSE':>9} {'loss':>9} | {'refit MSE':>9} |"
        f" {'chol dist':>9} {'MSE':>9} {'loss':>9} {'nnz M':>6}"
    )
    for row in sparse_rows:
        chol = by_rank.get(row["retained"])
        refit = row.get("refit")
        chol_text = (
            f"{chol['distance']:9.4g} {chol['mse']:9.3e} {chol['loss']:9.3e} {chol['nnz']:6d}"
            if chol
            else f"{'-':>9} {'-':>9} {'-':>9} {'-':>6}"
        )
        print(
            f"    {row['gamma_rel']:8.2g} {row['retained']:6d} {row['nnz']:6d} "
            f"{row['iterations']:5d} {row['kkt']:8.1e} {row['seconds']:5.1f} |"
            f" {row['distance']:11.4g} {row['mse']:9.3e} {row['loss']:9.3e} |"
            f" {refit['mse'] if refit else float('nan'):9.3e} | {chol_text}"
        )
    print("\n    incomplete Cholesky on a regular grid of ranks")
    print(f"    {'inputs':>6} {'nnz M':>6} {'distance':>9} {'MSE':>9} {'loss':>9}")
    for r in [1, *range(10, pivots.size + 1, 10)]:
        c = by_rank[r]
        print(f"    {r:6d} {c['nnz']:6d} {c['distance']:9.4g} {c['mse']:9.3e} {c['loss']:9.3e}")

    summary = []
    print("\n    fewest retained inputs / non-zeros of M reaching a test error level")
    print(
        f"    {'metric':>7} {'level':>6} | {'sparse inputs':>13} {'nnz':>6} |"
        f" {'chol inputs':>11} {'nnz':>6}"
    )
    for metric in ("mse", "loss"):
        for level in ERROR_LEVELS:
            bound = (1.0 + level) * dense_row[metric]
            entry = {
                "metric": metric,
                "level": level,
                "bound": bound,
                "sparse_inputs": fewest(sparse_rows, "retained", metric, bound),
                "sparse_nnz": fewest(sparse_rows, "nnz", metric, bound),
                "chol_inputs": fewest(chol_rows, "retained", metric, bound),
                "chol_nnz": fewest(chol_rows, "nnz", metric, bound),
            }
            summary.append(entry)
            cells = [
                "never" if entry[k] is None else str(entry[k])
                for k in ("sparse_inputs", "sparse_nnz", "chol_inputs", "chol_nnz")
            ]
            print(
                f"    {metric:>7} {f'+{level:.0%}':>6} | {cells[0]:>13} {cells[1]:>6} |"
                f" {cells[2]:>11} {cells[3]:>6}"
            )
    return {
        "settings": {
            "n_train": 200,
            "n_test": 2000,
            "input_gamma": dense.gamma_,
            "input_gamma_over_median": dense.gamma_ / g0,
            "alpha": dense.alpha_,
            "alpha_given": alpha,
            "output_gamma": dense.output_gamma_,
            "gamma_max": gamma_max,
            "max_iter": max_iter,
            "tol": FISTA_TOL,
            "n_pivots": int(pivots.size),
            "rank_step": rank_step,
            "fit_seconds": fit_seconds,
        },
        "dense": dense_row,
        "sparse": sparse_rows,
        "incomplete_cholesky": chol_rows,
        "summary": summary,
    }


# --------------------------------------------------------------------------- (b)
def heteroscedastic_bags(
    n_bags: int, rng: np.random.Generator, n_points: int = 300
) -> tuple[Array, Array, Array]:
    """Points ``(n_bags, n_points, 2)``, labels and the bags' true means."""
    means = rng.uniform(-2.0, 2.0, size=(n_bags, 2))
    points = means[:, None, :] + 0.5 * rng.standard_normal((n_bags, n_points, 2))
    sd = 0.1 + 0.3 * np.abs(means[:, 0])
    y = np.sin(means[:, 0]) + sd * rng.standard_normal(n_bags)
    return points, y, means


def interval_stats(lo: Array, hi: Array, y: Array, upper: NDArray[np.bool_]) -> dict[str, float]:
    covered = (y >= lo) & (y <= hi)
    width = hi - lo
    return {
        "coverage": float(covered.mean()),
        "width": float(width.mean()),
        "coverage_low": float(covered[~upper].mean()),
        "width_low": float(width[~upper].mean()),
        "coverage_high": float(covered[upper].mean()),
        "width_high": float(width[upper].mean()),
    }


def sw() -> SlicedWasserstein:
    return SlicedWasserstein(n_directions=20, n_levels=20, random_state=0)


def interval_experiment(seed: int, n_train: int, n_test: int, n_repeats: int) -> dict[str, Any]:
    z = float(norm.ppf(0.5 + NOMINAL / 2))
    runs = []
    for rep in range(n_repeats):
        rng = np.random.default_rng([seed, rep])
        P, y, _ = heteroscedastic_bags(n_train, rng)
        P_test, y_test, m_test = heteroscedastic_bags(n_test, rng)
        train, test = Bags.from_arrays(P), Bags.from_arrays(P_test)
        upper = np.abs(m_test[:, 0]) > np.median(np.abs(m_test[:, 0]))

        t0 = time.perf_counter()
        base = sw().fit(train).embed(train).sq_distances()
        g0 = median_heuristic_gamma(base, get_kernel("gaussian"))
        cme = ConditionalMeanEmbedding(sw(), gamma=g0 * np.logspace(-1, 2, 7), random_state=0).fit(
            train, y
        )
        q = cme.quantiles(test, [0.5 - NOMINAL / 2, 0.5 + NOMINAL / 2])
        cme_stats = interval_stats(q[:, 0], q[:, 1], y_test, upper)
        cme_stats.update(
            mse=float(np.mean((cme.predict(test) - y_test) ** 2)),
            gamma_over_median=cme.gamma_ / g0,
            alpha=cme.alpha_,
            seconds=time.perf_counter() - t0,
        )

        t0 = time.perf_counter()
        order = rng.permutation(n_train)
        fit_idx, cal_idx = order[: n_train // 2], order[n_train // 2 :]
        ridge = DistributionRidge(sw(), random_state=0).fit(
            Bags.from_arrays(P[fit_idx]), y[fit_idx]
        )
        residuals = np.sort(np.abs(ridge.predict(Bags.from_arrays(P[cal_idx])) - y[cal_idx]))
        k = math.ceil((cal_idx.size + 1) * NOMINAL)
        half = float(residuals[min(k, cal_idx.size) - 1])
        pred = ridge.predict(test)
        conf_stats = interval_stats(pred - half, pred + half, y_test, upper)
        conf_stats.update(
            mse=float(np.mean((pred - y_test) ** 2)),
            half_width=half,
            gamma=ridge.gamma_,
            alpha=ridge.alpha_,
            seconds=time.perf_counter() - t0,
        )

        centre = np.sin(m_test[:, 0])
        sd = 0.1 + 0.3 * np.abs(m_test[:, 0])
        oracle_stats = interval_stats(centre - z * sd, centre + z * sd, y_test, upper)
        oracle_stats["mse"] = float(np.mean((centre - y_test) ** 2))
        runs.append(
            {"repeat": rep, "cme": cme_stats, "conformal": conf_stats, "oracle": oracle_stats}
        )

    keys = ("coverage", "coverage_low", "coverage_high", "width", "width_low", "width_high", "mse")
    summary = {
        method: {
            key: [
                float(np.mean([r[method][key] for r in runs])),
                float(np.std([r[method][key] for r in runs])),
            ]
            for key in keys
        }
        for method in ("cme", "conformal", "oracle")
    }
    print(
        f"\n(b) nominal {NOMINAL:.0%} intervals on bags: {n_train} train / {n_test} test bags of "
        f"300 points, {n_repeats} repeat(s), mean ± sd over repeats; low/high = lower/upper "
        f"half of |m_0|"
    )
    print(
        f"    {'method':<16} {'coverage':>13} {'cov low':>13} {'cov high':>13} |"
        f" {'width':>13} {'width low':>13} {'width high':>13} | {'point MSE':>13}"
    )
    names = {"cme": "CME quantiles", "conformal": "split conformal", "oracle": "oracle"}
    for method, name in names.items():
        cells = [f"{summary[method][k][0]:.3f} ± {summary[method][k][1]:.3f}" for k in keys]
        print(
            f"    {name:<16} {cells[0]:>13} {cells[1]:>13} {cells[2]:>13} |"
            f" {cells[3]:>13} {cells[4]:>13} {cells[5]:>13} | {cells[6]:>13}"
        )
    chosen = ", ".join(
        f"γ/γ₀ = {r['cme']['gamma_over_median']:.3g}, λ = {r['cme']['alpha']:.2g}" for r in runs
    )
    print(f"    CME selections per repeat: {chosen}")
    return {
        "settings": {
            "n_train": n_train,
            "n_test": n_test,
            "n_points": 300,
            "n_repeats": n_repeats,
            "nominal": NOMINAL,
        },
        "summary": summary,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--alpha", type=float, default=None, help="fix the pendulum's ridge (default: CV)"
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    pendulum = pendulum_experiment(
        args.seed,
        n_gammas=5 if args.quick else 12,
        max_iter=1000 if args.quick else 3000,
        rank_step=10 if args.quick else 1,
        alpha=args.alpha,
    )
    t_a = time.perf_counter() - t0
    print(f"    [(a) {t_a:.0f} s]", flush=True)
    intervals = interval_experiment(
        args.seed,
        n_train=200 if args.quick else 400,
        n_test=200 if args.quick else 400,
        n_repeats=1 if args.quick else 5,
    )
    total = time.perf_counter() - t0
    print(f"    [(b) {total - t_a:.0f} s; total {total:.0f} s]")
    if not args.quick and args.alpha is None:
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / "reproduce_cme.json"
        out.write_text(
            json.dumps({"pendulum": pendulum, "intervals": intervals, "seconds": total}, indent=2)
            + "\n"
        )
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
