"""A new task's labels refined by a mixture fitted to the task's own points.

A new patient's cells form populations of their own. Where a batch effect has moved
or reshaped them, a classifier trained on other batches cuts through the populations'
edges; the task's own distribution, observed at prediction time (the premise of
marginal transfer, paper 004 §3), shows where they really lie. The refinement fits
one Gaussian per class to the task's points, started at the points the classifier
gives that class, by expectation-maximisation (Dempster, Laird and Rubin, *JRSS B*
39, 1977), and labels every point by the mixture's posterior.

Scores come back on the classifier's own scale: its targets are ``±1`` per class, and
the least-squares target of a ``±1`` code is ``E[Y_k | x] = 2 P(k | x) - 1``, so the
posterior ``p`` becomes ``2 p - 1`` (for two classes, ``p_1 - p_0``). Whether the
refinement helps is a property of the data (populations that a Gaussian describes,
or not), so the estimator applies it only where its folds show it helps
(``refine="auto"``).
"""

from __future__ import annotations

import warnings

import numpy as np
from numpy.typing import NDArray
from sklearn.exceptions import ConvergenceWarning
from sklearn.mixture import GaussianMixture

from ....bags import lexicographic_order

__all__ = ["REFINE_FIT_POINTS", "refine_scores"]

#: Points of a task the mixture is fitted on (a seeded subsample of larger tasks);
#: every point is then labelled by it.
REFINE_FIT_POINTS = 20_000
#: Expectation-maximisation steps at most: the classifier's labels start it close.
REFINE_MAX_ITER = 50
#: Rows labelled at a time.
REFINE_BLOCK = 65_536
#: Stop when the mean log-likelihood per point changes by less than this.
REFINE_TOL = 1e-3
#: Ridge added to every covariance, relative to the task's mean marker variance.
REFINE_REG = 1e-4


def _codes(scores: NDArray[np.float64]) -> NDArray[np.int64]:
    """Class index of every point under the ``±1`` coding (sign, or argmax)."""
    if scores.shape[1] == 1:
        return (scores[:, 0] > 0).astype(np.int64)
    return np.argmax(scores, axis=1)


def refine_scores(
    points: NDArray[np.float64], scores: NDArray[np.float64], seed: int
) -> tuple[NDArray[np.float64], float]:
    """The scores of one task after a Gaussian mixture fitted to its points.

    Parameters
    ----------
    points : ndarray of shape (n, d)
        The task's points, as the classifier saw them.
    scores : ndarray of shape (n, 1) or (n, K)
        The classifier's scores (``±1`` coding: sign for two classes, one-vs-rest).
    seed : int
        Seed of the subsample the mixture is fitted on (tasks above
        :data:`REFINE_FIT_POINTS` points; drawn as :func:`~core.bags.subsample_bags`
        draws, so the same cells give the same answer in any order).

    Returns
    -------
    scores : ndarray like ``scores``
        ``2 p - 1`` of the mixture's posterior ``p`` for the points of the classes it
        models; the classifier's own scores for points of a class too rare in the task
        to fit a Gaussian to (fewer than ``d + 1`` points in the fitted sample): a rare
        population is never absorbed into a common one.
    relabelled : float
        Share of the task's points whose label changed.
    """
    n, d = points.shape
    n_classes = max(2, scores.shape[1])
    codes = _codes(scores)
    # Everything in lexicographic row order, and back: the same cells give the same
    # answer bit for bit, however they are ordered.
    order = lexicographic_order(points)
    fit = order
    if n > REFINE_FIT_POINTS:
        rng = np.random.default_rng([seed, n])
        fit = order[np.sort(rng.choice(n, REFINE_FIT_POINTS, replace=False))]
    counts = np.bincount(codes[fit], minlength=n_classes)
    modelled = np.flatnonzero(counts >= d + 1)
    if modelled.size < 2:
        return scores, 0.0
    x = points[fit]
    reg = REFINE_REG * float(np.mean(np.var(x, axis=0))) or REFINE_REG
    # Component j starts as class modelled[j]: its points' weight, mean and covariance.
    member = codes[fit][:, None] == modelled[None, :]
    weights = member.sum(axis=0).astype(np.float64)
    means = (member.T @ x) / weights[:, None]
    precisions = np.empty((modelled.size, d, d))
    for j in range(modelled.size):  # one d × d matrix per class, not per point
        centred = x[member[:, j]] - means[j]
        cov = centred.T @ centred / weights[j] + reg * np.eye(d)
        precisions[j] = np.linalg.inv(cov)
    mixture = GaussianMixture(
        modelled.size,
        covariance_type="full",
        reg_covar=reg,
        max_iter=REFINE_MAX_ITER,
        tol=REFINE_TOL,
        weights_init=weights / weights.sum(),
        means_init=means,
        precisions_init=precisions,
    )
    with warnings.catch_warnings():
        # Stopping at the step limit is a choice here, not a failure.
        warnings.simplefilter("ignore", ConvergenceWarning)
        mixture.fit(x)
    posterior = np.zeros((n, n_classes))
    # In blocks of rows (canonical order), so memory stays bounded on large tasks.
    for lo in range(0, n, REFINE_BLOCK):
        rows = order[lo : lo + REFINE_BLOCK]
        posterior[rows[:, None], modelled[None, :]] = mixture.predict_proba(points[rows])
    if scores.shape[1] == 1:
        refined = posterior[:, [1]] - posterior[:, [0]]
    else:
        refined = 2.0 * posterior - 1.0
    keep = ~np.isin(codes, modelled)
    refined[keep] = scores[keep]
    return refined, float(np.mean(_codes(refined) != codes))
