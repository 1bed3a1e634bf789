"""The open set: cells no population claims, decided on the calibrated sample
(issue 44, point 5).

A gated sample holds cells no gate claims (debris, doublets, populations the panel
does not resolve: 17-29 % of the FlowCAP-I samples). With a *rest label* named
(``unassigned=``), those cells are a class of their own while fitting, and at
prediction a cell also joins them when no population claims it with enough
confidence: its best population score (the rest class excluded) below ``θ``. The
scores are in the ±1 coding, so ``θ`` reads as a posterior ``(1 + θ) / 2``. Whether a
threshold is used, and which, is chosen on the same instrument-perturbed folds as the
rest of the model, after calibration (:func:`choose_reject`): the issue-44 cohort
showed a rule measured before calibration flagging a third of a new batch's cells at
precision 0.5.

Without a rest label, a cell far from every population can still be reported
unassigned on request (:func:`far_from_populations`): its squared Mahalanobis
distance to the population it was given, under that population's training
covariance, beyond the χ² quantile of the requested level — measured, like the
labels, on the calibrated cells.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray
from scipy.stats import chi2

__all__ = [
    "REJECT_THRESHOLDS",
    "UNASSIGNED",
    "apply_reject",
    "choose_reject",
    "far_from_populations",
    "population_statistics",
]

#: The label of a cell no population claims, where no rest label names it.
UNASSIGNED = "unassigned"
#: Thresholds on the best population score the folds choose among (posteriors
#: 0.5, 0.625 and 0.75 under the ±1 coding); "off" is tried first.
REJECT_THRESHOLDS = (0.0, 0.25, 0.5)


def apply_reject(
    scores: NDArray[np.float64], rest: int, threshold: float | None
) -> NDArray[np.int64]:
    """Class codes of cells with ``scores`` (n, classes): the best class, or ``rest``
    where the best population's score is below ``threshold`` (None: no rule)."""
    codes = np.argmax(scores, axis=1)
    if threshold is None:
        return codes
    populations = np.delete(scores, rest, axis=1)
    return np.where(populations.max(axis=1) < threshold, rest, codes)


def choose_reject(
    held_out: list[tuple[NDArray[np.float64], NDArray[np.int64]]], rest: int
) -> tuple[float | None, dict[str, float]]:
    """The threshold (or None) with the best mean accuracy over the held-out
    ``(scores, true codes)`` pairs of the perturbed folds; "off" unless a threshold
    beats it by more than the standard error of the difference."""
    options: list[float | None] = [None, *REJECT_THRESHOLDS]
    acc = np.array([[np.mean(apply_reject(s, rest, t) == y) for s, y in held_out] for t in options])
    gain = acc[1:] - acc[0]
    se = gain.std(axis=1, ddof=1) / np.sqrt(max(gain.shape[1], 1)) if gain.shape[1] > 1 else 0
    best = int(np.argmax(gain.mean(axis=1)))
    chosen = options[best + 1] if gain[best].mean() > np.atleast_1d(se)[best] else None
    return chosen, {str(t): float(a) for t, a in zip(options, acc.mean(axis=1), strict=True)}


def population_statistics(
    points: NDArray[np.float64], codes: NDArray[np.int64], n_classes: int, rest: int | None
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Every population's mean and inverse covariance on the model's (normalised)
    training cells, for :func:`far_from_populations`.

    The rest class and populations with fewer cells than markers get no statistics
    (their rows are NaN): a cell given to them is never called far. A ridge of
    ``1e-6`` times the mean marker variance keeps each covariance invertible.
    """
    d = points.shape[1]
    means = np.full((n_classes, d), np.nan)
    precisions = np.full((n_classes, d, d), np.nan)
    ridge = 1e-6 * float(np.mean(points.var(axis=0))) or 1e-12
    for k in range(n_classes):
        if k == rest:
            continue
        cells = points[codes == k]
        if cells.shape[0] <= d:
            continue
        means[k] = cells.mean(axis=0)
        cov = np.cov(cells, rowvar=False).reshape(d, d) + ridge * np.eye(d)
        precisions[k] = np.linalg.inv(cov)
    return means, precisions


def far_from_populations(
    points: NDArray[np.float64],
    codes: NDArray[np.int64],
    means: NDArray[np.float64],
    precisions: NDArray[np.float64],
    level: float,
) -> NDArray[np.bool_]:
    """Whether each point lies beyond the ``level`` χ² quantile (``d`` degrees of
    freedom) of squared Mahalanobis distance from the population it was given."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    d = points.shape[1]
    cut = float(chi2.ppf(level, d))
    far = np.zeros(points.shape[0], dtype=bool)
    for k in np.unique(codes):
        if np.isnan(means[k]).any():
            continue
        rows = np.flatnonzero(codes == k)
        diff = points[rows] - means[k]
        d2 = np.einsum("ij,jk,ik->i", diff, precisions[k], diff)
        far[rows] = d2 > cut
    return far
