"""Conformal calibration of kernel ridge on bags: the held-out models and their residuals.

Every interval (:meth:`DistributionRidge.predict_interval`) and prediction set
(:meth:`DistributionRidgeClassifier.predict_set`) compares a new bag's predictions
under ``T`` *calibration models*, one per training bag ``i`` (the model that did not
see bag ``i``), with the residual ``R_i`` of bag ``i`` under that model. Two ways of
getting them, chosen by ``calibration``:

* **jackknife+** (Barber, Candès, Ramdas, Tibshirani, "Predictive inference with the
  jackknife+", Ann. Statist. 49(1), 2021, eq. 6): the leave-one-bag-out models, or the
  leave-one-group-out models when groups are given, in closed form with ``γ`` and the
  effective ridge ``λT`` held fixed (:func:`closed_form_state`). Exact and free, and
  valid when ``γ`` and ``λ`` were fixed beforehand. When they were chosen by the same
  leave-one-out errors, the residuals are optimistic exactly when the choice was lucky.
* **CV+** (ibid., §3, eq. 9): ``K`` folds, whole groups together, each fold's model
  fitted with the whole search repeated on the other folds (:func:`cv_plus_state`).
  The calibration then accounts for the search: its coverage guarantee holds for the
  procedure, choice included. Costs ``K`` more searches at fit time and ``K`` design
  rows per new bag at prediction time.

``calibration="auto"`` takes jackknife+ when nothing was searched and CV+ otherwise.

The residuals can be normalised by a difficulty that grows with the distance to the
training bags (``interval_scaling="domain"``): ``σ = max(1, domain score)``, the
calibrated distance of :mod:`core.domain` (about 1 for a typical training bag; each
training bag's own score leaves it and its group out). The interval is then
``[q⁻{μ̂_{m(i)}(P) - σ(P)·R_i/σ_i}, q⁺{μ̂_{m(i)}(P) + σ(P)·R_i/σ_i}]``, the locally
weighted conformal score (Lei, G'Sell, Rinaldo, Tibshirani, Wasserman, "Distribution-free
predictive inference for regression", JASA 2018, §5.2; Papadopoulos et al. 2008): in
the domain the intervals keep their coverage, and a bag far outside it gets an
interval as much wider as it is farther, instead of a narrow interval beside an
out-of-domain flag.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..kernels import batch_invariant_matmul
from ..selection import GroupBlocks, group_folds, group_out_residuals
from ._ridge_fit import RidgeDesign, RidgeFit, spd_solve

__all__ = [
    "CALIBRATIONS",
    "calibration_predictions",
    "closed_form_state",
    "cv_plus_state",
    "for_point_predictions",
    "interval_scales",
]

CALIBRATIONS = ("auto", "jackknife+", "cv+")


def for_point_predictions(estimator: Any) -> Any:
    """A clone of ``estimator`` for out-of-fold point predictions (cross-validated
    metrics): its conformal calibration, which only intervals and sets use, in closed
    form (jackknife+) rather than CV+'s refits of the whole search."""
    from sklearn.base import clone

    model = clone(estimator)
    if "calibration" in model.get_params(deep=False):
        model.set_params(calibration="jackknife+")
    return model


def closed_form_state(
    design: RidgeDesign,
    fit: RidgeFit,
    Y: NDArray[np.float64],
    fit_intercept: bool,
    groups: GroupBlocks | None,
) -> dict[str, Any]:
    """The leave-one-bag-out (or leave-one-group-out) models in closed form.

    Kernel ridge with the effective ridge ``ρ = λT`` held fixed is a linear smoother:
    ``μ̂(x) = c + w(x)ᵀ(y - c·1)`` with weights ``w(x) = (K + ρI)⁻¹ k_x`` (dual) or
    ``w(x) = Φ(ΦᵀΦ + ρI)⁻¹ φ(x)`` (primal) and ``c`` the intercept. Leaving out the
    group ``G`` (a single bag without groups) gives, with ``e`` the leave-group-out
    residuals of :func:`core.selection.group_out_residuals`, ``s(x) = w(x)ᵀ1`` and
    ``d_G = c_{-G} - c`` the move of the intercept,

        μ̂_{-G}(x) = μ̂(x) - Σ_{j∈G} w_j(x)·e_j + (1 - s(x))·d_G,

    and at ``x = x_i`` (``i ∈ G``) this is ``y_i - e_i``.

    Returns
    -------
    dict
        ``loo_smoother_`` ``S`` with ``w(x)ᵀ = z(x)ᵀS`` for the design row ``z(x)`` the
        prediction computes (dual ``S = (K + ρI)⁻¹``, ``z = k_x``; primal
        ``S = (ΦᵀΦ + ρI)⁻¹Φᵀ``, ``z = φ(x)``), ``loo_residuals_`` ``e`` and
        ``loo_intercept_shift_`` ``d``, both ``(T, k)``.
    """
    T = Y.shape[0]
    idx = np.arange(T)
    ridge = fit.alpha * T
    rows = design.train_rows(idx, fit.gamma)
    if not design.primal:
        K = rows.copy()
        K[np.diag_indices_from(K)] += ridge
        A = spd_solve(K, np.eye(T))
        A = 0.5 * (A + A.T)  # exactly symmetric, as the true inverse is
        smoother = A
        # I - H = ρA: the common factor ρ cancels in the residuals, so (A·)_G stands
        # for ((I - H)·)_G without the cancellation of forming I - H.
        resid_y, resid_1 = A @ Y, A.sum(axis=1)

        def block(g: NDArray[np.int64]) -> NDArray[np.float64]:
            return A[g[:, :, None], g[:, None, :]]

    else:
        Z = rows
        G = Z.T @ Z
        G[np.diag_indices_from(G)] += ridge
        smoother = spd_solve(G, np.ascontiguousarray(Z.T))
        resid_y = Y - Z @ (smoother @ Y)
        resid_1 = 1.0 - Z @ smoother.sum(axis=1)

        def block(g: NDArray[np.int64]) -> NDArray[np.float64]:
            # (I - Z S)_GG = I - Z_G S[:, G]
            eye = np.eye(g.shape[1])[None, :, :]
            return eye - np.einsum("gap,gpb->gab", Z[g], np.moveaxis(smoother[:, g], 0, 1))

    blocks = groups if groups is not None else GroupBlocks(idx)
    with np.errstate(divide="ignore", invalid="ignore"):
        e, shift = group_out_residuals(
            blocks, block, resid_y, resid_1 if fit_intercept else None, Y
        )
    # A block that is singular (the model interpolates a bag or group) leaves the
    # residual undefined: inf/NaN, which the conformal methods refuse.
    return {
        "loo_smoother_": np.ascontiguousarray(smoother),
        "loo_residuals_": e,
        "loo_intercept_shift_": shift,
    }


def cv_plus_state(
    design: RidgeDesign,
    Y: NDArray[np.float64],
    groups: NDArray[np.int64] | None,
    *,
    n_folds: int,
    random_state: Any,
    fit_params: dict[str, Any],
) -> dict[str, Any]:
    """Fold models with the search repeated inside each fold (CV+).

    The folds hold whole groups (every bag its own group without groups); each fold's
    model searches ``γ`` and ``λ`` on the other folds exactly as the model searched them
    on every bag (leave-one-group-out within the fold's training side when groups are
    given), and predicts the fold's bags: their residuals are out of sample for the
    whole procedure.

    Returns
    -------
    dict
        ``cv_fold_`` (T,) each bag's fold; ``cv_gamma_``, ``cv_alpha_`` (K,);
        ``cv_coef_`` (K, T, k) dual coefficients over all training bags (zero on the
        fold's own bags) or (K, n_features, k) primal weights; ``cv_intercept_`` (K, k);
        ``cv_residuals_`` (T, k) signed out-of-fold residuals ``y_i - μ̂_{-k(i)}(x_i)``.
    """
    T, k = Y.shape
    folds = group_folds(groups, T, n_folds, random_state)
    K = int(folds.max()) + 1
    width = T if not design.primal else design.train_rows(np.arange(1), 1.0).shape[1]
    coef = np.zeros((K, width, k))
    gammas = np.full(K, np.nan)
    alphas = np.empty(K)
    intercepts = np.empty((K, k))
    residuals = np.empty((T, k))
    for f in range(K):
        held = np.flatnonzero(folds == f)
        train = np.flatnonzero(folds != f)
        sub_groups = None if groups is None else GroupBlocks(groups[train])
        if sub_groups is not None and sub_groups.n_groups < 2:
            sub_groups = None
        fit = design.fit(train, Y[train], groups=sub_groups, **fit_params)
        gammas[f] = np.nan if fit.gamma is None else fit.gamma
        alphas[f] = fit.alpha
        intercepts[f] = fit.intercept
        if design.primal:
            coef[f] = fit.coef
            rows = design.train_rows(held, fit.gamma)
        else:
            coef[f, train] = fit.coef
            assert design.base is not None
            rows = design.kernel(design.base[np.ix_(held, train)], fit.gamma)
        residuals[held] = Y[held] - (rows @ fit.coef + fit.intercept)
    return {
        "cv_fold_": folds,
        "cv_gamma_": gammas,
        "cv_alpha_": alphas,
        "cv_coef_": coef,
        "cv_intercept_": intercepts,
        "cv_residuals_": residuals,
    }


def calibration_predictions(
    model: Any, z: NDArray[np.float64], mu: NDArray[np.float64], rows_for: Any
) -> NDArray[np.float64]:
    """``μ̂_{m(i)}(x)`` for new bags under every training bag's calibration model.

    Parameters
    ----------
    model : fitted ridge
    z : ndarray of shape (n, p)
        The model's own design rows of the new bags (closed form).
    mu : ndarray of shape (n, k)
        The model's predictions at them.
    rows_for : callable
        ``gamma -> (n, p)`` design rows of the new bags for another ``γ`` (CV+).

    Returns
    -------
    ndarray of shape (n, T, k)
    """
    if getattr(model, "calibration_", "jackknife+") == "cv+":
        K = model.cv_coef_.shape[0]
        fold_mu = np.empty((z.shape[0], K, model.cv_coef_.shape[2]))
        for f in range(K):
            g = model.cv_gamma_[f]
            rows = rows_for(None if np.isnan(g) else float(g))
            fold_mu[:, f] = batch_invariant_matmul(rows, model.cv_coef_[f]) + model.cv_intercept_[f]
        return fold_mu[:, model.cv_fold_, :]
    w = batch_invariant_matmul(z, model.loo_smoother_)
    e = model.loo_residuals_
    codes = getattr(model, "calibration_groups_", None)
    if codes is None:
        drop = w[:, :, None] * e[None, :, :]
    else:
        blocks = GroupBlocks(codes)
        drop = blocks.group_sums(w[:, :, None] * e[None, :, :])[:, blocks.codes, :]
    loo = mu[:, None, :] - drop
    loo += (1.0 - w.sum(axis=1))[:, None, None] * model.loo_intercept_shift_[None, :, :]
    return loo


def interval_scales(model: Any, domain_scores: NDArray[np.float64] | None) -> tuple[Any, Any]:
    """``(σ(new bags), σ_i of the training bags)`` of the normalised scores, or
    ``(None, None)`` without scaling (``interval_scaling="none"``, or a model with no
    domain calibration)."""
    if getattr(model, "interval_scaling", "none") != "domain" or domain_scores is None:
        return None, None
    train = getattr(model, "domain_scores_", None)
    if train is None:
        return None, None
    return np.maximum(1.0, domain_scores), np.maximum(1.0, np.asarray(train))
