"""Scaling of the density random features (paper 001) against a pairwise estimator.

Run with ``make bench`` (or ``.venv/bin/python bench/bench_density.py [--quick]``).
Prints a table and writes ``bench/results/bench_density.json``. Every speed figure is a
ratio between two timings of the same run (the machine is shared and noisy):

1. Featurisation time of ``DensityFeatures(divergence="js")`` as the number of bags
   grows 1x, 4x, 16x (bags of 500 points in 2-D). Linear time means ratios near 4 and 16.
2. The exact pairwise alternative: the plug-in Jensen-Shannon estimate of every pair of
   bags from kernel density estimates (paper 001 App., the "entropies" estimator of
   Table 2), whose cost grows as ``N² n²``; timed at 1x and 2x bags and against the
   features plus their full Gram at the same size.
3. A 10-marker panel (marker pairs, 45 groups): seconds per bag of 2,000 cells.
4. Training ``DistributionRidge`` on the features: the primal random-feature path
   (``n_components=2000``) against the exact T x T Gram path, at 4x, 16x and 64x bags.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np
from _report import report
from bagserve.core import Bags, DensityFeatures, DistributionRidge
from bagserve.core.kernels import squared_euclidean_distances


def plugin_js_matrix(bags: Bags, bandwidth: float) -> np.ndarray:
    """Pairwise plug-in Jensen-Shannon divergences (nats) between the bags' KDEs.

    Each bag's Gaussian KDE is fitted on the second half of its points and the log
    ratios are averaged over the first half (paper 001 appendix, "entropies"):
    ``JS(p, q) = ½ E_p log(2p / (p + q)) + ½ E_q log(2q / (p + q))``. Cost ``O(N² n²)``.
    """
    halves = [
        (bags[i][: bags.sizes[i] // 2], bags[i][bags.sizes[i] // 2 :]) for i in range(len(bags))
    ]
    evals = np.concatenate([a for a, _ in halves])
    starts = np.concatenate([[0], np.cumsum([a.shape[0] for a, _ in halves])])
    d = bags.dim
    norm = (2.0 * math.pi * bandwidth**2) ** (-d / 2.0)
    # dens[i, x]: bag i's KDE at every evaluation point of every bag.
    dens = np.empty((len(bags), evals.shape[0]))
    for i, (_, fit_half) in enumerate(halves):
        sq = squared_euclidean_distances(evals, fit_half)
        dens[i] = norm * np.exp(-sq / (2.0 * bandwidth**2)).mean(axis=1)
    dens = np.maximum(dens, 1e-300)
    R = np.empty((len(bags), len(bags)))
    for i in range(len(bags)):
        block = dens[:, starts[i] : starts[i + 1]]  # every KDE at bag i's points
        own = block[i]
        R[i] = np.mean(np.log(2.0 * own / (own + block)), axis=1)
    return 0.5 * (R + R.T)


def make_bags(rng: np.random.Generator, n_bags: int, n_points: int, dim: int = 2) -> Bags:
    centres = rng.uniform(-2, 2, size=(n_bags, 1, dim))
    scales = rng.uniform(0.3, 1.5, size=(n_bags, 1, dim))
    return Bags.from_arrays(list(centres + scales * rng.standard_normal((n_bags, n_points, dim))))


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def featurisation_scaling(rng: np.random.Generator, base: int) -> dict[str, Any]:
    sizes = [base, 4 * base, 16 * base]
    all_bags = make_bags(rng, sizes[-1], 500)
    feats = DensityFeatures(divergence="js", random_state=0).fit(all_bags[: sizes[0]])
    feats.transform(all_bags[:2])  # warm-up
    times = [timed(lambda n=n: feats.transform(all_bags[:n]))[0] for n in sizes]
    return {
        "case": f"JS features, bags of 500 points in 2-D, {feats.n_output_features_} features",
        **{f"seconds_{n}_bags": t for n, t in zip(sizes, times, strict=True)},
        "ratio_4x": times[1] / times[0],
        "ratio_16x": times[2] / times[0],
        "ms_per_bag_at_16x": 1e3 * times[2] / sizes[2],
    }


def pairwise_vs_features(rng: np.random.Generator, base: int) -> dict[str, Any]:
    bags = make_bags(rng, 2 * base, 500)
    feats = DensityFeatures(divergence="js", random_state=0).fit(bags)
    h = feats.bandwidth_ * float(np.mean(feats.span_))
    small = bags[:base]

    def features_gram(b: Bags) -> np.ndarray:
        A = feats.transform(b)
        return squared_euclidean_distances(A, A)

    t_pair_1, js_1 = timed(lambda: plugin_js_matrix(small, h))
    t_pair_2, _ = timed(lambda: plugin_js_matrix(bags, h))
    t_feat_1, est = timed(lambda: features_gram(small))
    t_feat_2, _ = timed(lambda: features_gram(bags))
    off = ~np.eye(base, dtype=bool)
    return {
        "case": f"JS Gram of {base} and {2 * base} bags x 500 points: pairwise plug-in vs features",
        f"pairwise_seconds_{base}": t_pair_1,
        f"pairwise_seconds_{2 * base}": t_pair_2,
        "pairwise_ratio_2x": t_pair_2 / t_pair_1,
        f"features_seconds_{base}": t_feat_1,
        f"features_seconds_{2 * base}": t_feat_2,
        "features_ratio_2x": t_feat_2 / t_feat_1,
        f"speedup_at_{2 * base}": t_pair_2 / t_feat_2,
        "corr_features_vs_pairwise": float(np.corrcoef(est[off], js_1[off])[0, 1]),
    }


def ten_marker_panel(rng: np.random.Generator, n_bags: int) -> dict[str, Any]:
    bags = make_bags(rng, n_bags, 2000, dim=10)
    feats = DensityFeatures(divergence="hellinger", random_state=0).fit(bags)
    t, A = timed(lambda: feats.transform(bags))
    return {
        "case": f"10-marker panel, Hellinger on marker pairs, {n_bags} bags x 2000 cells",
        "groups": len(feats.groups_),
        "features": int(A.shape[1]),
        "ms_per_bag": 1e3 * t / n_bags,
    }


def primal_vs_gram_training(rng: np.random.Generator, base: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "case": "DistributionRidge fit on JS features, bags of 200 points: RFF primal "
        "(D = 2000) vs exact T x T Gram"
    }
    for n in (4 * base, 16 * base, 64 * base):
        bags = make_bags(rng, n, 200)
        y = np.array([b.std() for b in bags])
        rep = DensityFeatures(divergence="js", random_state=0)
        t_primal, _ = timed(
            lambda b=bags, y=y, r=rep: DistributionRidge(
                r, gamma=1.0, alpha=1e-3, n_components=2000, random_state=0
            ).fit(b, y)
        )
        t_gram, _ = timed(
            lambda b=bags, y=y, r=rep: DistributionRidge(r, gamma=1.0, alpha=1e-3).fit(b, y)
        )
        out[f"primal_seconds_{n}"] = t_primal
        out[f"gram_seconds_{n}"] = t_gram
        out[f"gram_over_primal_{n}"] = t_gram / t_primal
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    base = 25 if args.quick else 100
    results = [
        featurisation_scaling(rng, base),
        pairwise_vs_features(rng, base // 2 if args.quick else base),
        ten_marker_panel(rng, 10 if args.quick else 50),
        primal_vs_gram_training(rng, base),
    ]
    report(results, "bench_density", save=not args.quick)


if __name__ == "__main__":
    main()
