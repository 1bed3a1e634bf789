"""Random features with the exact Nyström task map (``task_map="nystroem"``, the default).

Random Fourier features ``z(x)`` for ``k_X`` and the Nyström map of ``k_P`` over the
``N`` training tasks, ``ψ(P) = Λ^{-1/2} Uᵀ k_P(P_train, P)`` with ``U Λ Uᵀ = K_P``,
make the joint feature

    φ(P, x) = s(P) ⊗ z(x),      s(P) = [√τ, √(1-τ) ψ(P)],

whose inner products are ``z(x)ᵀz(x') (τ + (1-τ) ψ(P)ᵀψ(P'))``: the product kernel of
paper 004 eq. 8, exactly so in ``P`` on the training tasks. For a task unlike all of them
``ψ(P) → 0`` and the model falls back to its pooled part ``√τ w_0``. The weighted ridge
(eq. 7, squared loss) is solved from per-task statistics of ``z``, never forming ``φ``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from ....bags import Bags
from ....blas import one_thread
from ....kernels import batch_invariant_matmul
from ....representations.base import n_threads_for
from .cv import reused_across_fits
from .solvers import _CHUNK_POINTS, _DUAL_MAX_POINTS, TaskStatistics, task_ridge_path
from .strategy import (
    POINT_BLOCK,
    FeatureMaps,
    NewTasks,
    RandomFeatureStrategy,
    TrainingData,
    TrainingProblem,
    ValidationFold,
    held_out_error,
)

__all__ = ["NystroemFeatureStrategy", "nystroem_basis", "task_coordinates", "task_statistics"]


def nystroem_basis(task_gram: NDArray[np.float64]) -> NDArray[np.float64]:
    """``M = U Λ^{-1/2}`` over the training tasks, so that ``ψ(P) = Mᵀ k_P(train, P)``.

    Eigenvalues below ``1e-10`` times the largest are dropped: near-duplicate tasks
    would otherwise blow up ``Λ^{-1/2}``.
    """
    vals, vecs = np.linalg.eigh(task_gram)
    keep = vals > max(vals.max(), 1e-300) * 1e-10
    return vecs[:, keep] / np.sqrt(vals[keep])


def task_coordinates(
    kp: NDArray[np.float64], basis: NDArray[np.float64] | None, tau: float
) -> NDArray[np.float64]:
    """``s(P) = [√τ, √(1-τ) ψ(P)]`` for each row of ``kp`` (``k_P`` to the training tasks).

    The pooled model (``τ = 1``, no basis) has the single coordinate 1.
    """
    n = kp.shape[0]
    if tau == 1.0 or basis is None:
        return np.ones((n, 1))
    psi = batch_invariant_matmul(kp, basis)
    return np.hstack([np.full((n, 1), np.sqrt(tau)), np.sqrt(1.0 - tau) * psi])


#: Points to compute, in all, from which the tasks' statistics are spread over the cores
#: (below, starting the threads costs more than they save).
_PARALLEL_POINTS = 20_000


def task_statistics(
    maps: FeatureMaps,
    tasks: Bags,
    Y: NDArray[np.float64],
    sigma: float,
    which: NDArray[np.int64] | None = None,
    into: TaskStatistics | None = None,
    rows: Mapping[int, NDArray[np.int64]] | None = None,
    rows_into: dict[int, NDArray[np.float64]] | None = None,
) -> TaskStatistics:
    """Per-task ``A_i = Σ_j z zᵀ / n_i`` and ``b_i = Σ_j z yᵀ / n_i`` in one pass over points.

    Only the tasks ``which`` (default: all) are computed, into ``into`` when given
    (the rows it has are kept): the folds of a search fill in the tasks they train on.
    Tasks are computed on all cores at once when there are enough points, each exactly
    as it would be alone.
    The features themselves are kept when there are few points in all, for the dual
    solver (each task then fits in one chunk). For a computed task ``t`` in ``rows``,
    the features of its points ``rows[t]`` (rows of ``tasks.points``, ascending) go
    into ``rows_into[t]``: a search's held-out points, whose features are then not
    computed again (each row's features depend on its point only, so they are the
    same bits).
    """
    N, k = len(tasks), Y.shape[1]
    keep = tasks.n_points <= min(_DUAL_MAX_POINTS, _CHUNK_POINTS)
    if into is None:
        D = maps.point_features(tasks.points[:1], sigma).shape[1]
        into = TaskStatistics(
            np.zeros((N, D, D)),
            np.zeros((N, D, k)),
            [None] * N if keep else None,
            [None] * N if keep else None,
            np.zeros(N, dtype=bool),
        )
    todo = [int(t) for t in (range(N) if which is None else which) if not into.done[t]]

    def one(t: int) -> None:
        lo, hi = int(tasks.offsets[t]), int(tasks.offsets[t + 1])
        wanted = rows.get(t) if rows is not None and rows_into is not None else None
        parts = []
        for c0 in range(lo, hi, _CHUNK_POINTS):
            c1 = min(hi, c0 + _CHUNK_POINTS)
            Z = maps.point_features(tasks.points[c0:c1], sigma)
            into.A[t] += Z.T @ Z
            into.B[t] += Z.T @ Y[c0:c1]
            if keep:
                into.Z[t], into.Y[t] = Z, Y[c0:c1]
            if wanted is not None:
                parts.append(Z[wanted[(wanted >= c0) & (wanted < c1)] - c0])
        into.A[t] /= hi - lo
        into.B[t] /= hi - lo
        into.done[t] = True
        if wanted is not None and rows_into is not None:
            rows_into[t] = np.concatenate(parts)

    threads = min(n_threads_for(-1), len(todo))
    if threads > 1 and int(tasks.sizes[todo].sum()) >= _PARALLEL_POINTS:
        # Tasks on all cores, one BLAS thread each: the features' cos/sin and the
        # products release the GIL, each task writes its own rows, and every task is
        # computed as alone (the same bits).
        with one_thread(), ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, todo))
    else:
        for t in todo:
            one(t)
    return into


class NystroemFeatureStrategy(RandomFeatureStrategy):
    """Weighted ridge on ``s(P) ⊗ z(x)``, coefficients ``θ`` of shape (1 + r, D, k)."""

    fitted_attributes: ClassVar[tuple[str, ...]] = ("coef_", "task_basis_")
    # A fold reads the shared statistics and writes only its own held-out features.
    concurrent_folds: ClassVar[bool] = True

    def prepare_folds(
        self,
        data: TrainingData,
        folds: list[tuple[float, NDArray[np.int64]]],
        cache: dict[Hashable, Any],
        held_out_rows: Mapping[int, NDArray[np.int64]] | None = None,
    ) -> None:
        # Statistics per bandwidth, filled in for the tasks the folds train on (all at
        # once: tasks are spread over the cores): every configuration at that bandwidth
        # reuses them, and so does every fold. The features of the points a task is
        # scored on when held out come along with its statistics.
        for sigma in dict.fromkeys(s for s, _ in folds):
            train = np.unique(np.concatenate([t for s, t in folds if s == sigma]))
            key = ("statistics", sigma)
            cache[key] = data.statistics[sigma] = task_statistics(
                data.maps,
                data.tasks,
                data.Y,
                sigma,
                train,
                cache.get(key) or data.statistics.get(sigma),
                held_out_rows,
                cache.setdefault(("held-out features", sigma), {}),
            )

    def release_search(self, cache: dict[Hashable, Any]) -> None:
        # The held-out tasks' features of every bandwidth the search evaluated (20-26
        # MB each on the GvHD example, 1.4 GB over the training's kept caches); a
        # later fit at a bandwidth met again computes them in fold_errors, the same
        # bits (each row's features depend on its point only), in milliseconds. The
        # statistics, costly to compute again, stay.
        for key in [k for k in list(cache) if isinstance(k, tuple) and k[0] == "held-out features"]:
            cache.pop(key, None)

    def fold_errors(
        self, fold: ValidationFold, alphas: NDArray[np.float64], cache: dict[Hashable, Any]
    ) -> NDArray[np.float64]:
        data, params = fold.data, fold.params
        key = ("statistics", params.sigma)
        basis = None if params.tau == 1.0 else nystroem_basis(fold.kp_train)
        S = task_coordinates(fold.kp_train, basis, params.tau)
        Sv = task_coordinates(fold.kp_val, basis, params.tau)
        # Validation errors do not need the final fit's precision.
        thetas = task_ridge_path(S, cache[key], fold.train, alphas, rtol=1e-4)
        # The held-out tasks' features at this bandwidth serve every configuration; a
        # fold writes only its own held-out tasks' (prepare_folds made the dict).
        features = cache.setdefault(("held-out features", params.sigma), {})
        for v, (pts, _) in zip(fold.val, fold.held_out, strict=True):
            if int(v) not in features:
                features[int(v)] = data.maps.point_features(pts, params.sigma)
        Zv = [features[int(v)] for v in fold.val]
        errs = np.zeros(alphas.size)
        for li, theta in enumerate(thetas):
            # Per held-out task j its own weights V[j] = Σ_a s_a(P_j) θ_a.
            V = np.einsum("ta,apk->tpk", Sv, theta)
            errs[li] = held_out_error(fold, [Z @ V[j] for j, Z in enumerate(Zv)])
        return errs

    def fit(self, problem: TrainingProblem) -> dict[str, Any]:
        data, params = problem.data, problem.params
        N = len(data.tasks)
        maps = data.maps
        # The search's statistics of these tasks, completed; or, for training's widened
        # refit on the same tasks at the same σ, those of the fit before.
        known = data.statistics.get(params.sigma)
        if known is not None:
            stats = task_statistics(maps, data.tasks, data.Y, params.sigma, into=known)
        else:
            stats = reused_across_fits(
                (
                    "nystroem statistics",
                    data.tasks,
                    data.Y,
                    maps.point_kernel,
                    maps.point_frequencies,
                    maps.linear_centre,
                    maps.linear_scale,
                    params.sigma,
                ),
                lambda: task_statistics(maps, data.tasks, data.Y, params.sigma),
            )
        basis = None if params.tau == 1.0 else nystroem_basis(problem.task_gram)
        S = task_coordinates(problem.task_gram, basis, params.tau)
        (theta,) = task_ridge_path(S, stats, np.arange(N), np.array([problem.alpha]))
        return {"coef_": theta, "task_basis_": basis}

    def _task_weights(self, fitted: Mapping[str, Any], new: NewTasks) -> NDArray[np.float64]:
        """``s(P)`` of each new task, shape (n_new, 1 + r)."""
        return task_coordinates(new.task_similarity, fitted["task_basis_"], new.params.tau)

    def task_scores(self, fitted: Mapping[str, Any], new: NewTasks) -> list[NDArray[np.float64]]:
        S = self._task_weights(fitted, new)
        # f(P, x) = z(x)ᵀ V(P) with V(P) = Σ_a s_a(P) θ_a: one small matrix per task.
        V = np.einsum("ta,apk->tpk", S, fitted["coef_"])
        sigma = new.params.sigma
        return [
            np.concatenate(
                [
                    batch_invariant_matmul(
                        new.maps.point_features(pts[c0 : c0 + _CHUNK_POINTS], sigma),
                        V[t],
                        POINT_BLOCK,
                    )
                    for c0 in range(0, pts.shape[0], _CHUNK_POINTS)
                ]
            )
            for t, pts in enumerate(new.tasks)
        ]

    def joint_features(self, fitted: Mapping[str, Any], new: NewTasks) -> list[NDArray[np.float64]]:
        S = self._task_weights(fitted, new)
        out = []
        for t, pts in enumerate(new.tasks):
            Z = new.maps.point_features(pts, new.params.sigma)
            # Row-wise Kronecker product s(P) ⊗ z(x), ordered as θ's (a, D) axes.
            out.append((S[t][:, None, None] * Z.T[None]).transpose(2, 0, 1).reshape(Z.shape[0], -1))
        return out
