"""Model selection without refitting: median heuristic and closed-form ridge LOO/GCV.

One eigendecomposition ``K = U diag(s) Uᵀ`` serves every ridge parameter: the hat
matrix of kernel ridge with the papers' scaling ``(K + λ T I)⁻¹`` is
``H_λ = U diag(s / (s + λT)) Uᵀ``, so fitted values, leverages ``h_i = H_ii``,
leave-one-out residuals ``(y_i - ŷ_i) / (1 - h_i)`` and the GCV score cost ``O(T²)``
per ``λ`` after the ``O(T³)`` decomposition. One distance matrix serves every
``γ`` (the kernel is an elementwise map of it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._random import check_generator
from .kernels import DistanceKernel

__all__ = [
    "CME_ALPHA_GRID",
    "DEFAULT_ALPHA_GRID",
    "GridEdgeWarning",
    "GroupBlocks",
    "gamma_grid",
    "grid_edge",
    "group_folds",
    "group_out_residuals",
    "leave_one_group_out_folds",
    "leave_tasks_out_folds",
    "median_heuristic_gamma",
    "ridge_selection_scores",
    "widen_grid",
]


class GridEdgeWarning(UserWarning):
    """A hyperparameter was chosen at the first or last value of its grid.

    The optimum may lie beyond the grid; the message names the parameter, the grid and
    the value (and, from training, what widening the grid found: see "Grid edges" in
    :mod:`core.training`).
    """


#: ``λ`` grid of paper 000 Appendix F: 25 log-spaced values from 1e-8 to 1e2.
DEFAULT_ALPHA_GRID = np.logspace(-8, 2, 25)

#: The conditional mean embedding's default ``λ`` grid of the cross-validation (in
#: the ``(K + λ n I)`` scaling).
CME_ALPHA_GRID = np.logspace(-7, 1, 17)

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


class GroupBlocks:
    """The bags of each group, batched by group size for vectorised block algebra.

    Leaving a whole group out needs, per group ``G``, a solve with the ``|G| x |G|``
    block of ``I - H``; groups of one size are stacked and solved together.

    Parameters
    ----------
    groups : array-like of shape (T,)
        The group of every bag (any hashable labels).

    Attributes
    ----------
    codes : ndarray of int, shape (T,)
        Each bag's group as an index into the distinct groups.
    n_groups : int
    batches : list of ndarray of int, shape (g, m)
        For each group size ``m``, the bag indices of the ``g`` groups of that size.
    """

    def __init__(self, groups: ArrayLike) -> None:
        labels = np.asarray(groups)
        if labels.ndim != 1:
            raise ValueError(f"groups must be 1-D, got shape {labels.shape}")
        _, self.codes = np.unique(labels, return_inverse=True)
        self.n_groups = int(self.codes.max()) + 1 if self.codes.size else 0
        order = np.argsort(self.codes, kind="stable")
        sizes = np.bincount(self.codes, minlength=self.n_groups)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.batches: list[NDArray[np.int64]] = []
        for m in np.unique(sizes):
            which = np.flatnonzero(sizes == m)
            self.batches.append(order[starts[which][:, None] + np.arange(m)[None, :]])

    @property
    def singletons(self) -> bool:
        """Every group holds one bag (leaving a group out is leaving one bag out)."""
        return self.n_groups == self.codes.size

    def group_sums(self, values: NDArray[np.float64]) -> NDArray[np.float64]:
        """Sums of ``values`` (..., T, k) over each group's bags: (..., n_groups, k)."""
        out = np.zeros((*values.shape[:-2], self.n_groups, values.shape[-1]))
        for idx in self.batches:
            out[..., self.codes[idx[:, 0]], :] = values[..., idx, :].sum(axis=-2)
        return out


def group_out_residuals(
    blocks: GroupBlocks,
    block_of: Callable[[NDArray[np.int64]], NDArray[np.float64]],
    resid_y: NDArray[np.float64],
    resid_1: NDArray[np.float64] | None,
    Y: NDArray[np.float64],
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Residuals of a linear smoother refitted without each group, in closed form.

    For any targets ``v``, the fit on every bag outside ``G`` equals the fit on all
    bags with ``v_G`` replaced by that refit's own predictions ``ṽ_G`` (the refit
    makes the errors on ``G`` zero and minimises the rest: it minimises the full
    objective, whose minimiser is unique). Hence ``(I - H)v`` at ``G`` is
    ``(I - H)_{GG}(v_G - ṽ_G)``, and the leave-group-out residual is

        e_G = (I - H)_{GG}⁻¹ ((I - H) v)_G.

    With an intercept the refit centres on the mean of the remaining targets,
    ``c_{-G}``: ``v = y - c_{-G}·1``, so ``((I - H)v)_G = r_G - c_{-G}·r¹_G`` with
    ``r = (I - H)y`` and ``r¹ = (I - H)1``. One group per bag gives the
    leave-one-out residuals (Sherman-Morrison, ``(I - H)_{ii} = 1 - h_i``).

    Parameters
    ----------
    blocks : GroupBlocks
    block_of : callable
        ``(g, m)`` bag indices to the ``(g, m, m)`` blocks of ``I - H`` (or a common
        positive multiple of ``I - H`` and of ``resid_y``, ``resid_1``).
    resid_y : ndarray of shape (T, k)
        ``(I - H) y`` (the same multiple).
    resid_1 : ndarray of shape (T,) or None
        ``(I - H) 1``; ``None`` without an intercept.
    Y : ndarray of shape (T, k)
        The raw targets (for ``c_{-G}``).

    Returns
    -------
    e : ndarray of shape (T, k)
        ``y_i - μ̂_{-G(i)}(x_i)``; ``inf`` where a block is singular (the smoother
        interpolates the group).
    shift : ndarray of shape (T, k)
        ``c_{-G(i)} - c``, how the intercept moves when bag ``i``'s group is left out
        (zeros without an intercept).
    """
    T = Y.shape[0]
    e = np.empty_like(resid_y)
    shift = np.zeros_like(Y)
    if resid_1 is not None:
        total = Y.sum(axis=0)
        group_total = blocks.group_sums(Y)
        sizes = np.bincount(blocks.codes, minlength=blocks.n_groups)
        with np.errstate(divide="ignore", invalid="ignore"):
            c_minus = (total[None, :] - group_total) / (T - sizes)[:, None]
        shift = c_minus[blocks.codes] - Y.mean(axis=0)[None, :]
    for idx in blocks.batches:
        rhs = resid_y[idx]  # (g, m, k)
        if resid_1 is not None:
            rhs = (
                rhs
                - (Y.mean(axis=0)[None, :] + shift[idx[:, 0]])[:, None, :]
                * resid_1[idx][:, :, None]
            )
        try:
            e[idx] = np.linalg.solve(block_of(idx), rhs)
        except np.linalg.LinAlgError:
            # One singular block spoils the batched solve: solve the batch group by group.
            for row, (g_idx, g_rhs) in enumerate(zip(idx, rhs, strict=True)):
                try:
                    e[g_idx] = np.linalg.solve(block_of(idx[row : row + 1])[0], g_rhs)
                except np.linalg.LinAlgError:
                    e[g_idx] = np.inf
    return e, shift


def group_folds(
    groups: ArrayLike | None, n_bags: int, n_folds: int, random_state: Any = None
) -> NDArray[np.int64]:
    """The fold of every bag: whole groups go together, groups shuffled into
    ``min(n_folds, n_groups)`` folds of near-equal numbers of groups; without groups
    every bag is its own group.

    Returns
    -------
    ndarray of int, shape (n_bags,)
        Fold indices ``0 .. K-1``.
    """
    codes = (
        np.arange(n_bags)
        if groups is None
        else np.unique(np.asarray(groups), return_inverse=True)[1]
    )
    n_groups = int(codes.max()) + 1
    k = max(2, min(int(n_folds), n_groups))
    perm = check_generator(random_state).permutation(n_groups)
    fold_of_group = np.empty(n_groups, dtype=np.int64)
    for f, part in enumerate(np.array_split(perm, k)):
        fold_of_group[part] = f
    return fold_of_group[codes]


def ridge_selection_scores(
    eigvals: NDArray[np.float64],
    eigvecs: NDArray[np.float64],
    Y: NDArray[np.float64],
    alphas: NDArray[np.float64],
    *,
    fit_intercept: bool,
    criterion: Literal["loo", "gcv"] = "loo",
    groups: GroupBlocks | None = None,
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
    groups : GroupBlocks, optional
        Leave whole groups out instead of single bags (exact, with ``λT`` fixed;
        :func:`group_out_residuals`): bags of one subject must not vouch for each
        other. Only with ``criterion="loo"``.

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
    if groups is not None and not groups.singletons:
        if criterion != "loo":
            raise ValueError("GCV cannot leave groups out: use criterion='loo' with groups")
        for a, lam in enumerate(alphas):
            f = s / (s + lam * T)
            fitted = U @ (f[:, None] * UtY)
            H1 = U @ (f * Ut1)
            # (I - H) y on the raw targets, and (I - H) 1 for the intercept.
            # HY = H(Yc) + H1·mean with an intercept (Yc = Y - mean), = H(Yc) without.
            resid_y = Y - fitted - (H1[:, None] * mean[None, :] if fit_intercept else 0.0)
            resid_1 = (1.0 - H1) if fit_intercept else None

            def block(idx: NDArray[np.int64], f: NDArray[np.float64] = f) -> NDArray[np.float64]:
                Ug = U[idx]  # (g, m, r)
                eye = np.eye(idx.shape[1])[None, :, :]
                return eye - np.einsum("gar,r,gbr->gab", Ug, f, Ug, optimize=True)

            resid, _ = group_out_residuals(groups, block, resid_y, resid_1, Y)
            scores[a] = np.mean(resid**2) if np.all(np.isfinite(resid)) else np.inf
        return scores
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


def leave_one_group_out_folds(
    groups: ArrayLike,
) -> list[tuple[NDArray[np.int64], NDArray[np.int64]]]:
    """One fold per group (batch, centre, run): its tasks are held out together.

    A model chosen by these folds is chosen for how it does on a batch it has not
    seen, which is how it will be used; leave-tasks-out folds that mix batches reward
    what only works within a batch.

    Parameters
    ----------
    groups : array-like of shape (n_tasks,)
        The group of every task; at least two distinct groups.

    Returns
    -------
    list of (train_tasks, validation_tasks)
        One pair per group, in the order of ``np.unique``.
    """
    groups = np.asarray(groups)
    values = np.unique(groups)
    if values.size < 2:
        raise ValueError(f"leave-one-group-out needs at least 2 groups, got {values.size}")
    return [(np.flatnonzero(groups != g), np.flatnonzero(groups == g)) for g in values]


def _numeric_values(grid: Sequence[Any]) -> NDArray[np.float64] | None:
    """The grid as finite floats, or ``None`` when it is not a list of real numbers
    (strings, booleans, ``None``, nested values: nothing has an order to run off)."""
    values = list(grid)
    if not all(
        isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool | np.bool_)
        for v in values
    ):
        return None
    out = np.asarray(values, dtype=np.float64)
    return out if out.ndim == 1 and np.all(np.isfinite(out)) else None


def grid_edge(grid: Sequence[Any] | ArrayLike, chosen: Any) -> Literal["low", "high"] | None:
    """Which end of a numeric grid the chosen value sits at, if any.

    A choice at the smallest or largest value of a grid says only that the optimum may
    lie beyond it: the search never looked further. Only grids where that question
    makes sense count: real numbers (not booleans or strings) with at least 3
    distinct values. With 2 values every choice is an edge and says nothing; a value
    given alone was not searched at all.

    Parameters
    ----------
    grid : sequence of numbers
        The values searched, in any order (the edges are the smallest and largest).
    chosen : number
        The value the search chose; compared with a relative tolerance of 1e-9, since
        grids pass through float conversions (TOML, JSON, ``np.logspace``).

    Returns
    -------
    {"low", "high"} or None
        ``"low"`` for the smallest value, ``"high"`` for the largest, ``None`` when
        the choice is inside the grid or the grid does not qualify.
    """
    values = _numeric_values(np.asarray(grid).tolist() if isinstance(grid, np.ndarray) else grid)
    if values is None or np.unique(values).size < 3:
        return None
    if isinstance(chosen, bool | np.bool_) or not isinstance(
        chosen, int | float | np.integer | np.floating
    ):
        return None
    c = float(chosen)
    if np.isclose(c, values.min(), rtol=1e-9, atol=0.0):
        return "low"
    if np.isclose(c, values.max(), rtol=1e-9, atol=0.0):
        return "high"
    return None


def widen_grid(
    grid: Sequence[Any] | ArrayLike,
    side: Literal["low", "high"],
    *,
    lower: float | None = None,
    upper: float | None = None,
) -> list[Any] | None:
    """The grid moved past its ``side`` edge so that the old edge sits in its middle.

    The ``n // 2`` values nearest the far end are dropped and as many new values are
    added past the edge, mirror images of the dropped side's spacing: the new grid
    keeps the old edge, the ``n - n // 2 - 1`` values next to it, and the same steps
    beyond it. For a regular grid this is a shift by ``n // 2`` steps (13 half-decade
    ``γ`` values around the median heuristic become 13 values centred on the old edge,
    3 more decades out). Why a shift rather than appending values: the search costs the
    same as the first one, and the old edge, the best value seen so far, stays in the
    grid, so the criterion that chose it can only find something at least as good; the
    values dropped were all worse than it.

    Positive grids are mirrored in log space (the library's positive hyperparameters,
    bandwidths, ridge parameters and counts, are scales, and a log mirror stays
    positive); grids holding zero or negative values are mirrored linearly. Grids of
    integers stay integers (rounded; duplicates and values no longer beyond the edge
    are dropped).

    Parameters
    ----------
    grid : sequence of numbers
        The grid searched (at least 3 distinct values; any order).
    side : {"low", "high"}
        The edge the choice sat at (:func:`grid_edge`).
    lower, upper : float, optional
        Bounds of the parameter's domain (e.g. 0 and 1 for a share); new values beyond
        them are clipped to the bound (and dropped if they repeat it).

    Returns
    -------
    list or None
        The widened grid in ascending order, or ``None`` when no new value fits past
        the edge (the edge is the domain's bound, or integers have no room left).
    """
    if side not in ("low", "high"):
        raise ValueError(f"side must be 'low' or 'high', got {side!r}")
    raw = np.asarray(grid).tolist() if isinstance(grid, np.ndarray) else list(grid)
    values = _numeric_values(raw)
    if values is None:
        raise ValueError(f"cannot widen a non-numeric grid {raw!r}")
    integer = all(isinstance(v, int | np.integer) for v in raw)
    values = np.unique(values)
    if values.size < 3:
        raise ValueError(f"cannot widen a grid of fewer than 3 distinct values: {raw!r}")
    log = bool(np.all(values > 0))
    n = values.size
    k = n // 2
    if side == "high":
        edge, kept, mirror = values[-1], values[k:], values[n - 1 - k : n - 1]
    else:
        edge, kept, mirror = values[0], values[: n - k], values[1 : k + 1]
    # The mirror image of v about the edge: e·(e/v) in log space, 2e - v otherwise.
    new = edge * (edge / mirror) if log else 2.0 * edge - mirror
    if lower is not None:
        new = np.maximum(new, lower)
    if upper is not None:
        new = np.minimum(new, upper)
    if integer:
        new = np.round(new)
        if log:
            new = new[new >= 1]  # a count rounded to 0 left the positive domain
    beyond = new > edge if side == "high" else new < edge
    new = np.unique(new[beyond])
    if new.size == 0:
        return None
    out = np.concatenate([kept, new])
    out = np.unique(out)
    if integer:
        return [int(v) for v in out]
    return [float(v) for v in out]
