"""Held-out coverage of ``DistributionRidge``'s 90 % intervals: repeated subjects,
the hyperparameter search, and bags outside the training domain.

Run with ``make bench`` (or ``.venv/bin/python bench/bench_intervals.py [--quick]``).
Prints three tables and writes ``bench/results/bench_intervals.json``.

Three ways of fitting the same estimator (SW2 features, 50 directions x 50 levels, the
default grids of γ and λ) are compared:

* ``before``: what ``main`` did before groups existed: the closed-form leave-one-bag-out
  search, and jackknife+ on the residuals of that same search
  (``calibration="jackknife+"``, ``interval_scaling="none"``, no groups);
* ``bags``: today's default without groups: CV+ with the search repeated inside every
  calibration fold, residuals scaled by the domain score;
* ``groups``: the same with ``fit(..., groups=subjects)``: selection, calibration and
  domain check leave whole subjects out.

(a) Repeated subjects, generated here for this benchmark (not for the method): each
    subject has a two-population cell mix in 3-D (a Gaussian and a log-normal
    population) whose abundance ``p`` the bags show, and a clinical effect ``u`` they do
    not show; each of its 4 bags (visits, tubes) redraws 300 cells with a small
    instrument shift. The target is ``2p + u + ε`` (sd of ``u`` 0.5, of ``ε`` 0.1).
    60 training subjects (240 bags); the test bags are 60 *new* subjects' (240 bags).
(b) One bag per subject (i.i.d.): paper 003's entropy task and paper 000's mode
    count as regression (the generators of ``bench_conformal.py``), 200 training bags,
    400 test bags, every repeat an independent draw.
(c) Outside the domain: the (b) entropy model asked about bags whose cells are scaled
    by 3 (wider than any training bag): coverage and width where the domain check
    flags the bag.

Coverage is averaged over all test bags of all repeats; ± is the standard error of the
per-repeat coverage.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from _report import report
from bagserve.core import Bags, DistributionRidge, SlicedWasserstein
from bagserve.core.datasets import make_entropy_bags, make_gmm_modes

COVERAGE = 0.9
ARMS = ("before", "bags", "groups")


def sw(seed: int) -> SlicedWasserstein:
    return SlicedWasserstein(n_directions=50, n_levels=50, random_state=seed)


def model(arm: str, seed: int) -> DistributionRidge:
    if arm == "before":
        return DistributionRidge(
            sw(seed), calibration="jackknife+", interval_scaling="none", random_state=seed
        )
    return DistributionRidge(sw(seed), random_state=seed)


def subjects(
    n_subjects: int, visits: int, rng: np.random.Generator
) -> tuple[Bags, np.ndarray, np.ndarray]:
    """Bags of repeated subjects (see the module docstring, (a))."""
    p = rng.uniform(0.1, 0.9, n_subjects)
    u = rng.normal(scale=0.5, size=n_subjects)
    centre = rng.normal(scale=0.3, size=(n_subjects, 3))
    groups = np.repeat(np.arange(n_subjects), visits)
    arrays, y = [], []
    for s in groups:
        n = 300
        k = rng.binomial(n, p[s])
        shift = centre[s] + rng.normal(scale=0.05, size=3)  # instrument, per tube
        first = rng.normal(size=(n - k, 3)) * 0.6 + shift
        second = np.exp(rng.normal(scale=0.4, size=(k, 3))) + 1.5 + shift
        arrays.append(np.vstack([first, second]))
        y.append(2 * p[s] + u[s] + rng.normal(scale=0.1))
    return Bags.from_arrays(arrays), np.asarray(y), groups


def score(fitted: DistributionRidge, test: Bags, y: np.ndarray) -> dict[str, np.ndarray | float]:
    pred = fitted.predict(test)
    lo, hi = fitted.predict_interval(test, coverage=COVERAGE).T
    emb = fitted.representation_.embed(test)
    flagged = fitted.domain_check(emb).out_of_range
    return {
        "covered": (lo <= y) & (y <= hi),
        "width": hi - lo,
        "flagged": flagged,
        "r2": 1 - np.mean((y - pred) ** 2) / np.var(y),
    }


def summarise(case: str, arm: str, runs: list[dict[str, Any]], seconds: float, **extra) -> dict:
    cov = np.array([np.mean(r["covered"]) for r in runs])
    out = {
        "case": f"{case}: {arm}",
        "coverage": float(np.mean(np.concatenate([r["covered"] for r in runs]))),
        "coverage_se": float(cov.std(ddof=1) / np.sqrt(len(cov))) if len(cov) > 1 else 0.0,
        "coverage_worst_repeat": float(cov.min()),
        "coverage_in_domain": float(
            np.mean(np.concatenate([r["covered"][~r["flagged"]] for r in runs]))
        )
        if not all(r["flagged"].all() for r in runs)
        else float("nan"),
        "mean_width": float(np.mean(np.concatenate([r["width"] for r in runs]))),
        "r2": float(np.mean([r["r2"] for r in runs])),
        "flagged_share": float(np.mean(np.concatenate([r["flagged"] for r in runs]))),
        "fit_seconds": seconds / len(runs),
    }
    out.update(extra)
    return out


def repeated_subjects_case(repeats: int) -> list[dict]:
    results = []
    per_arm: dict[str, list] = {a: [] for a in ARMS}
    alphas: dict[str, list] = {a: [] for a in ARMS}
    seconds = dict.fromkeys(ARMS, 0.0)
    for r in range(repeats):
        rng = np.random.default_rng(r)
        train, y, groups = subjects(60, 4, rng)
        test, y_test, _ = subjects(60, 4, rng)
        for arm in ARMS:
            t0 = time.perf_counter()
            fitted = model(arm, r).fit(train, y, groups if arm == "groups" else None)
            seconds[arm] += time.perf_counter() - t0
            per_arm[arm].append(score(fitted, test, y_test))
            alphas[arm].append(fitted.alpha_)
    for arm in ARMS:
        results.append(
            summarise(
                "repeated subjects (60 x 4 bags, new subjects)",
                arm,
                per_arm[arm],
                seconds[arm],
                median_alpha=float(np.median(alphas[arm])),
            )
        )
    return results


def iid_case(task: str, repeats: int) -> list[dict]:
    per_arm: dict[str, list] = {a: [] for a in ARMS[:2]}
    shifted: dict[str, list] = {a: [] for a in ARMS[:2]}
    seconds = dict.fromkeys(ARMS[:2], 0.0)
    for r in range(repeats):
        n = 600
        if task == "entropy":
            bags, y = make_entropy_bags(n, 100, random_state=100 + r)
        else:
            bags, labels = make_gmm_modes(n, 100, max_components=4, dim=2, random_state=100 + r)
            y = labels.astype(np.float64)
        train, test = bags.take(np.arange(200)), bags.take(np.arange(200, n))
        for arm in ARMS[:2]:
            t0 = time.perf_counter()
            fitted = model(arm, r).fit(train, y[:200])
            seconds[arm] += time.perf_counter() - t0
            per_arm[arm].append(score(fitted, test, y[200:]))
            if task == "entropy":
                # Cells scaled by 3: the entropy of the first marginal grows by ln 3.
                wide = Bags.from_arrays([3.0 * b for b in test])
                shifted[arm].append(score(fitted, wide, y[200:] + np.log(3.0)))
    out = [
        summarise(f"{task} (200 train, 400 test bags)", arm, per_arm[arm], seconds[arm])
        for arm in ARMS[:2]
    ]
    if task == "entropy":
        out += [
            summarise("entropy, test cells scaled by 3 (outside the domain)", arm, shifted[arm],
                      seconds[arm])
            for arm in ARMS[:2]
        ]  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats, no JSON written")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    results = repeated_subjects_case(repeats)
    for task in ("entropy", "gmm-count"):
        results += iid_case(task, repeats)
    report(results, "bench_intervals", save=not args.quick)


if __name__ == "__main__":
    main()
