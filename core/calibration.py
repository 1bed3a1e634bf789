"""Class probabilities from one-vs-rest scores, calibrated on out-of-fold cells.

A per-cell classifier (marginal transfer) scores every class with a ridge fit to ±1
targets; its scores are not probabilities. Temperature scaling (Guo, Pleiss, Sun &
Weinberger 2017, "On calibration of modern neural networks", ICML, §4.2) maps them to
``softmax(s / T)`` with one temperature ``T`` chosen to minimise the negative
log-likelihood of the true classes. ``T`` is fitted by training on the out-of-fold
scores of its cross-validation (cells of tasks the scoring model never saw), never on
the cells a model was fitted to, whose scores are over-confident. One parameter keeps
the argmax, so the labels do not change; only how sure the answer says it is.

Two classes: the classifier gives one margin ``s`` for ``classes[1]``; the logits are
``(-s, s)``, so ``P(classes[1]) = sigmoid(2 s / T)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax, softmax

__all__ = ["fit_temperature", "probabilities"]

#: At most this many cells are used to fit the temperature (a seeded draw): one
#: parameter is pinned down long before, and the fit stays well under a second.
MAX_CALIBRATION_CELLS = 200_000


def _logits(scores: NDArray[np.float64]) -> NDArray[np.float64]:
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim == 1:
        return np.stack([-s, s], axis=1)
    return s


def probabilities(scores: NDArray[np.float64], temperature: float) -> NDArray[np.float64]:
    """``softmax(s / T)`` per cell: shape ``(n_cells, n_classes)``, rows sum to 1.

    Parameters
    ----------
    scores : ndarray of shape (n_cells,) or (n_cells, n_classes)
        As the classifier's ``decision_function`` gives them.
    temperature : float
    """
    return softmax(_logits(scores) / temperature, axis=1)


def fit_temperature(
    scores: NDArray[np.float64],
    y: NDArray[Any],
    classes: Sequence[Any],
    *,
    seed: int = 0,
) -> dict[str, Any]:
    """The temperature minimising the out-of-fold negative log-likelihood.

    Parameters
    ----------
    scores : ndarray of shape (n_cells,) or (n_cells, n_classes)
        Out-of-fold scores.
    y : ndarray of shape (n_cells,)
        True labels (values of ``classes``).
    classes : sequence
        The classifier's ``classes_`` (sorted, as scikit-learn keeps them).

    Returns
    -------
    dict
        ``temperature``, ``cells`` used, ``nll`` at that temperature and ``nll_at_1``
        (per cell, natural log), and ``method``.
    """
    logits = _logits(scores)
    codes = np.searchsorted(np.asarray(classes), y)
    n = logits.shape[0]
    if n > MAX_CALIBRATION_CELLS:
        pick = np.random.default_rng(seed).choice(n, MAX_CALIBRATION_CELLS, replace=False)
        logits, codes = logits[pick], codes[pick]
    rows = np.arange(logits.shape[0])

    def nll(log_t: float) -> float:
        return float(-log_softmax(logits / np.exp(log_t), axis=1)[rows, codes].mean())

    # Ridge scores of ±1 targets live on a scale of about 1: temperatures from 1e-3
    # to 1e2 cover probabilities from near-hard to near-uniform.
    fit = minimize_scalar(nll, bounds=(np.log(1e-3), np.log(1e2)), method="bounded")
    return {
        "method": "temperature scaling of out-of-fold scores (Guo et al. 2017)",
        "temperature": float(np.exp(fit.x)),
        "cells": int(logits.shape[0]),
        "nll": float(fit.fun),
        "nll_at_1": nll(0.0),
    }
