"""The exact kernel strategy of marginal transfer (``solver="exact"``).

The kernel matrix of ``k̄`` (paper 004 eq. 8) over every training point, and the paper's
bias-free weighted SVM / SVR (§7.1) or weighted kernel ridge on it (eq. 7). The model is
``f(P, x) = Σ_ij r_ij k̄((P, x), (P_i, x_ij))``: the training points and the dual
coefficients ``r`` are the fitted state. Memory grows with the square of the number of
points, hence ``max_exact_points``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from ....kernels import batch_invariant_matmul
from .solvers import _CHUNK_POINTS, weighted_kernel_ridge, weighted_svm, weighted_svr
from .strategy import (
    POINT_BLOCK,
    KernelParameters,
    NewTasks,
    SolverStrategy,
    TrainingProblem,
    ValidationFold,
    held_out_error,
)

__all__ = ["ExactKernelStrategy", "solve_weighted"]

# Points per block of the kernel rows at prediction: each block holds a row per training
# point, so it is kept smaller than the feature chunks.
_KERNEL_ROWS = _CHUNK_POINTS // 8


def solve_weighted(
    K: NDArray[np.float64],
    Y: NDArray[np.float64],
    c: NDArray[np.float64],
    lam: float,
    loss: str,
    epsilon: float,
) -> NDArray[np.float64]:
    """Dual coefficients ``r`` (one column per output) of eq. 7 on the kernel matrix ``K``.

    ``c`` holds the weights ``1/(N n_i)`` of each point's task; ``loss`` picks weighted
    kernel ridge, the bias-free SVM (hinge) or SVR (ε-insensitive, width ``epsilon``).
    The margin losses are solved one output at a time (one-vs-rest for classes).
    """
    if loss == "squared":
        return weighted_kernel_ridge(K, Y, c, lam)
    cols = []
    for j in range(Y.shape[1]):
        if loss == "hinge":
            cols.append(weighted_svm(K, Y[:, j], c, lam))
        else:
            cols.append(weighted_svr(K, Y[:, j], c, lam, epsilon))
    return np.stack(cols, axis=1)


def _task_mix(params: KernelParameters, kp: NDArray[np.float64]) -> NDArray[np.float64]:
    """The task factor ``τ + (1 - τ) k_P`` of eq. 8."""
    return params.tau + (1.0 - params.tau) * kp


class ExactKernelStrategy(SolverStrategy):
    """Dual solvers on the exact kernel matrix of ``k̄`` (small data)."""

    fitted_attributes: ClassVar[tuple[str, ...]] = (
        "train_points_",
        "train_task_index_",
        "dual_coef_",
    )

    def size_problems(self, n_points: int, max_exact_points: int) -> list[str]:
        if n_points <= max_exact_points:
            return []
        return [
            f"the exact solver builds a {n_points} x {n_points} kernel "
            f"matrix (more than max_exact_points={max_exact_points}); use "
            "solver='random_features' or subsample the tasks"
        ]

    def fold_errors(
        self, fold: ValidationFold, alphas: NDArray[np.float64], cache: dict[Hashable, Any]
    ) -> NDArray[np.float64]:
        data, params = fold.data, fold.params
        sub = data.tasks[fold.train]
        local = sub.bag_index()
        K = data.maps.point_gram(sub.points, sub.points, params.sigma)
        K *= _task_mix(params, fold.kp_train[np.ix_(local, local)])
        c = np.repeat(1.0 / (fold.train.size * sub.sizes), sub.sizes)
        Ysub = np.concatenate(
            [data.Y[data.tasks.offsets[t] : data.tasks.offsets[t + 1]] for t in fold.train]
        )
        # The rows of k̄ from each held-out point to the training points do not depend on λ.
        rows = []
        for j, (pts, _) in enumerate(fold.held_out):
            Kv = data.maps.point_gram(pts, sub.points, params.sigma)
            Kv *= _task_mix(params, fold.kp_val[j][local])
            rows.append(Kv)
        errs = np.zeros(alphas.size)
        for li, lam in enumerate(alphas):
            coef = solve_weighted(K, Ysub, c, lam, data.loss, data.epsilon)
            errs[li] = held_out_error(fold, [Kv @ coef for Kv in rows])
        return errs

    def fit(self, problem: TrainingProblem) -> dict[str, Any]:
        data, params = problem.data, problem.params
        tasks = data.tasks
        task_index = tasks.bag_index()
        K = data.maps.point_gram(tasks.points, tasks.points, params.sigma)
        K *= _task_mix(params, problem.task_gram[np.ix_(task_index, task_index)])
        # Eq. 7: every task weighs 1/N, shared equally by its points.
        weights = np.repeat(1.0 / (len(tasks) * tasks.sizes), tasks.sizes)
        return {
            "train_points_": tasks.points.copy(),
            "train_task_index_": task_index,
            "dual_coef_": solve_weighted(
                K, data.Y, weights, problem.alpha, data.loss, data.epsilon
            ),
        }

    def task_scores(self, fitted: Mapping[str, Any], new: NewTasks) -> list[NDArray[np.float64]]:
        train_points = fitted["train_points_"]
        train_task_index = fitted["train_task_index_"]
        dual_coef = fitted["dual_coef_"]
        scores = []
        for t, pts in enumerate(new.tasks):
            mix = _task_mix(new.params, new.task_similarity[t][train_task_index])
            parts = []
            for c0 in range(0, pts.shape[0], _KERNEL_ROWS):
                K = new.maps.point_gram(pts[c0 : c0 + _KERNEL_ROWS], train_points, new.params.sigma)
                K *= mix
                parts.append(batch_invariant_matmul(K, dual_coef, POINT_BLOCK))
            scores.append(np.concatenate(parts))
        return scores
