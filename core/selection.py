"""Model selection without refitting: median heuristic and closed-form ridge LOO/GCV.

One eigendecomposition ``K = U diag(s) Uᵀ`` serves every ridge parameter: the hat
matrix of kernel ridge with the papers' scaling ``(K + λ T I)⁻¹`` is
``H_λ = U diag(s / (s + λT)) Uᵀ``, so fitted values, leverages ``h_i = H_ii``,
leave-one-out residuals ``(y_i - ŷ_i) / (1 - h_i)`` and the GCV score cost ``O(T²)``
per ``λ`` after the ``O(T³)`` decomposition. One distance matrix serves every
``γ`` (the kernel is an elementwise map of it).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._random import check_generator
from .kernels import DistanceKernel

__all__ = [
    "DEFAULT_ALPHA_GRID",
    "gamma_grid",
    "leave_tasks_out_folds",
    "median_heuristic_gamma",
    "ridge_selection_scores",
]

#: ``λ`` grid of paper 000 Appendix F: 25 log-spaced values from 1e-8 to 1e2.
DEFAULT_ALPHA_GRID = np.logspace(-8, 2, 25)

#: The ``γ`` grid spans this many decades on each side of the median heuristic.
GAMMA_GRID_DECADES = 3.0
#: Number of ``γ`` values in the automatic grid (half-decade steps).
GAMMA_GRID_SIZE = 13


def median_heuristic_gamma(base: NDArray[np.float64], kernel: DistanceKernel) -> float:
    """``γ₀`` that puts the median pair of training bags at unit scaled distance.

    For radial kernels ``γ₀ = 1 / median(D)^q`` with ``q`` the kernel's power
    (``D`` the off-diagonal distances, from the squared distances ``base``); for the
    polynomial kernel ``γ₀ = 1 / median(⟨φ_t, φ_t⟩)`` from the inner products ``base``.
    Zero distances (duplicate bags) are ignored.
    """
    if kernel.uses_inner_product:
        diag = np.abs(np.diag(base))
        diag = diag[diag > 0]
        return 1.0 / float(np.median(diag)) if diag.size else 1.0
    T = base.shape[0]
    off = base[~np.eye(T, dtype=bool)]
    off = off[off > 0]
    if off.size == 0:
        return 1.0
    q = kernel.power
    return float(1.0 / np.median(np.sqrt(off)) ** q)


def gamma_grid(base: NDArray[np.float64], kernel: DistanceKernel) -> NDArray[np.float64]:
    """The automatic ``γ`` grid: 13 values, ±3 decades around the median heuristic."""
    g0 = median_heuristic_gamma(base, kernel)
    return g0 * np.logspace(-GAMMA_GRID_DECADES, GAMMA_GRID_DECADES, GAMMA_GRID_SIZE)


def as_grid(
    value: float | ArrayLike | None, default: NDArray[np.float64], name: str
) -> NDArray[np.float64]:
    """``None`` → ``default``; a scalar → a one-point grid; validates positivity."""
    grid = default if value is None else np.atleast_1d(np.asarray(value, dtype=np.float64))
    if grid.ndim != 1 or grid.size == 0:
        raise ValueError(f"{name} must be a positive number, a 1-D grid, or None; got {value!r}")
    if not np.all(np.isfinite(grid)) or np.any(grid <= 0):
        raise ValueError(f"{name} values must be finite and > 0, got {value!r}")
    return grid


def ridge_selection_scores(
    eigvals: NDArray[np.float64],
    eigvecs: NDArray[np.float64],
    Y: NDArray[np.float64],
    alphas: NDArray[np.float64],
    *,
    fit_intercept: bool,
    criterion: Literal["loo", "gcv"] = "loo",
) -> NDArray[np.float64]:
    """Mean squared leave-one-out (or GCV) error of kernel ridge for each ``λ``.

    Parameters
    ----------
    eigvals : ndarray of shape (r,)
        Eigenvalues of ``K`` (negative round-off is clipped to 0).
    eigvecs : ndarray of shape (T, r)
        The matching orthonormal eigenvectors; ``r < T`` is allowed (a thin
        decomposition, e.g. the SVD of an explicit feature matrix).
    Y : ndarray of shape (T, k)
        Raw targets (centring is handled here when ``fit_intercept``).
    alphas : ndarray of shape (n_alpha,)
        Ridge parameters ``λ`` in the papers' scaling ``K + λ T I``.
    fit_intercept : bool
        Whether the model subtracts the training mean of ``Y``. The LOO error then
        re-centres on the mean of the ``T - 1`` remaining targets, exactly as a refit
        would.
    criterion : {"loo", "gcv"}
        ``"loo"``: exact leave-one-out with the effective ridge ``λT`` held fixed.
        ``"gcv"``: generalised cross-validation,
        ``mean(r²) / (1 - df/T)²`` with ``df = tr(H) (+1 for the intercept)``.

    Returns
    -------
    ndarray of shape (n_alpha,)
        Mean over bags and outputs of the squared error; ``inf`` where a leverage
        reaches 1 (interpolation makes LOO undefined).
    """
    T = Y.shape[0]
    s = np.maximum(eigvals, 0.0)
    U = eigvecs
    U2 = U * U
    mean = Y.mean(axis=0)
    Yc = Y - mean if fit_intercept else Y
    UtY = U.T @ Yc
    Ut1 = U.T @ np.ones(T)
    scores = np.empty(alphas.shape[0])
    for a, lam in enumerate(alphas):
        f = s / (s + lam * T)
        h = U2 @ f
        fitted = U @ (f[:, None] * UtY)
        if criterion == "gcv":
            df = h.sum() + (1.0 if fit_intercept else 0.0)
            denom = (1.0 - df / T) ** 2
            resid = Yc - fitted
            scores[a] = np.mean(resid**2) / denom if denom > 1e-12 else np.inf
            continue
        one_minus_h = 1.0 - h
        if np.any(one_minus_h < 1e-10):
            scores[a] = np.inf
            continue
        if fit_intercept:
            # The ridge is linear in its targets, so the LOO prediction of a fit to
            # (y - c·1) is loo(y) - c·loo(1) + c, with loo(v)_i = ((Hv)_i - h_i v_i)/(1 - h_i)
            # and c the mean of the other T-1 targets.
            H1 = U @ (f * Ut1)
            HY = fitted + H1[:, None] * mean[None, :]
            c = (Y.sum(axis=0)[None, :] - Y) / (T - 1)
            loo_y = (HY - h[:, None] * Y) / one_minus_h[:, None]
            loo_1 = ((H1 - h) / one_minus_h)[:, None]
            resid = Y - (loo_y + c * (1.0 - loo_1))
        else:
            resid = (Yc - fitted) / one_minus_h[:, None]
        scores[a] = np.mean(resid**2)
    return scores


def leave_tasks_out_folds(
    n_tasks: int, n_splits: int = 5, n_repeats: int = 1, random_state: Any = None
) -> list[tuple[NDArray[np.int64], NDArray[np.int64]]]:
    """Leave-tasks-out cross-validation: whole tasks (bags) go to validation.

    Each repeat shuffles the tasks and cuts them into ``min(n_splits, n_tasks)`` groups
    of near-equal size; every group is the validation set of one fold, so within a
    repeat the validation sets partition the tasks. A validation task never
    contributes a point, a label or an embedding to its fold's training side.

    Returns
    -------
    list of (train_tasks, validation_tasks)
        ``n_repeats * min(n_splits, n_tasks)`` pairs of sorted task indices.
    """
    if n_tasks < 2:
        raise ValueError(f"cross-validation over tasks needs at least 2 tasks, got {n_tasks}")
    if n_splits < 2 or n_repeats < 1:
        raise ValueError(f"need n_splits >= 2 and n_repeats >= 1, got {n_splits}, {n_repeats}")
    rng = check_generator(random_state)
    k = min(n_splits, n_tasks)
    folds = []
    for _ in range(n_repeats):
        perm = rng.permutation(n_tasks)
        for part in np.array_split(perm, k):
            val = np.sort(part)
            folds.append((np.setdiff1d(np.arange(n_tasks), val), val))
    return folds
