"""How a loaded model of the design before issue 44 scores every cell of new tasks.

Every solver of that design fitted the model of paper 004 (Blanchard et al., JMLR 2021),
``f(P, x)`` in the RKHS of the product kernel

    k̄((P, x), (P', x')) = k_X(x, x') · (τ + (1 - τ) k_P(P, P'))               (eq. 8)

and stored its fitted arrays under these attribute names; what a saved model needs to
score new cells is here, one function per solver (:data:`SCORERS`):

* ``solver="exact"``: ``f(P, x) = Σ_ij r_ij k̄((P, x), (P_i, x_ij))`` over the
  training points (``train_points_``, ``train_task_index_``, ``dual_coef_``);
* ``solver="random_features"``, ``task_map="nystroem"``: ``f(P, x) = z(x)ᵀ V(P)``,
  ``V(P) = Σ_a s_a(P) θ_a`` with ``s(P) = [√τ, √(1-τ) ψ(P)]`` and the Nyström map
  ``ψ(P) = Mᵀ k_P(P_train, P)`` (``coef_``, ``task_basis_``);
* ``task_map="rff"``: the paper's two-layer random features (§7.2) on
  ``u = (√(2γ_P) Z_P, x / σ_X)`` (``coef_``).

Per-point products go in fixed blocks of rows, so a cell's score depends on that cell
(and its task) only, whatever else arrives with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ....bags import Bags
from ....kernels import (
    DistanceKernel,
    batch_invariant_matmul,
    point_kernel,
    random_fourier_features,
)
from ....representations.base import Embedding, FeatureEmbedding

__all__ = [
    "SCORERS",
    "FeatureMaps",
    "KernelParameters",
    "NewTasks",
    "scorer",
    "task_similarity",
]

#: Rows per block of the per-point products: with a fixed block, every point's score
#: depends on that point only, whatever batch it arrives in.
POINT_BLOCK = 256
#: Points per chunk whose features are computed at once (bounds memory).
CHUNK_POINTS = 1 << 15
#: Points per block of the exact kernel's rows: each holds a row per training point.
KERNEL_ROWS = CHUNK_POINTS // 8


@dataclass(frozen=True)
class KernelParameters:
    """The fitted parameters of ``k̄``: ``sigma`` of ``k_X`` (1 for the linear kernel),
    the share of pooling ``tau`` and ``gamma`` of ``k_P`` (``None``: ``k_P ≡ 1``)."""

    sigma: float
    tau: float
    gamma: float | None


def task_similarity(
    kernel: DistanceKernel, sq_distances: NDArray[np.float64], gamma: float | None
) -> NDArray[np.float64]:
    """``k_P`` from squared embedding distances; identically 1 for the pooled model."""
    return np.ones_like(sq_distances) if gamma is None else kernel(sq_distances, gamma)


@dataclass(frozen=True)
class FeatureMaps:
    """The point kernel ``k_X`` and the random draws of the fit.

    Attributes
    ----------
    point_kernel : {"gaussian", "linear", "gaussian+linear"}
        ``"gaussian+linear"`` is ``k_G(x, x') + x̃ᵀx̃' / d + 1`` with
        ``x̃ = (x - centre) / scale``.
    point_frequencies : ndarray of shape (m, d)
        Standard normal directions of the Gaussian part's random Fourier features.
    joint_frequencies : ndarray of shape (m, 2m + d) or None
        Second-layer directions of the paper's two-layer map (``task_map="rff"``).
    linear_centre, linear_scale : ndarray of shape (d,) or None
        ``x̃`` of the linear part.
    """

    point_kernel: str
    point_frequencies: NDArray[np.float64]
    joint_frequencies: NDArray[np.float64] | None = None
    linear_centre: NDArray[np.float64] | None = None
    linear_scale: NDArray[np.float64] | None = None

    def _linear_part(
        self, points: NDArray[np.float64], out: NDArray[np.float64] | None = None
    ) -> NDArray[np.float64]:
        """``[x̃ / √d, 1]``, whose inner products are ``x̃ᵀx̃' / d + 1`` (into ``out``,
        of ``d + 1`` columns, when given)."""
        centre = 0.0 if self.linear_centre is None else self.linear_centre
        scale = 1.0 if self.linear_scale is None else self.linear_scale
        if out is None:
            out = np.empty((points.shape[0], points.shape[1] + 1))
        np.divide(points - centre, scale * np.sqrt(points.shape[1]), out=out[:, :-1])
        out[:, -1] = 1.0
        return out

    def point_features(self, points: NDArray[np.float64], sigma: float) -> NDArray[np.float64]:
        """Rows ``z(x)`` with ``z(x)ᵀz(x') ≈ k_X(x, x')``: random Fourier features of
        the Gaussian, the exact map ``[x, 1]`` of the linear kernel, or both side by
        side."""
        if self.point_kernel == "linear":
            return np.hstack([points, np.ones((points.shape[0], 1))])
        if self.point_kernel != "gaussian+linear":
            return random_fourier_features(points, self.point_frequencies / sigma)
        d = points.shape[1]
        z = random_fourier_features(points, self.point_frequencies / sigma, d + 1)
        self._linear_part(points, out=z[:, -(d + 1) :])
        return z

    def point_gram(
        self, A: NDArray[np.float64], B: NDArray[np.float64], sigma: float
    ) -> NDArray[np.float64]:
        """The exact ``k_X`` between the rows of ``A`` and ``B``."""
        if self.point_kernel == "linear":
            return A @ B.T + 1.0
        K = point_kernel(A, B, "gaussian", sigma)
        if self.point_kernel == "gaussian+linear":
            K += self._linear_part(A) @ self._linear_part(B).T
        return K


@dataclass(frozen=True)
class NewTasks:
    """Tasks to score, seen through the fitted model: their embedding, ``k_P`` from
    each to each training task (n_new, N), the fitted parameters and draws."""

    tasks: Bags
    embedding: Embedding
    task_similarity: NDArray[np.float64]
    params: KernelParameters
    maps: FeatureMaps


#: A solver's scores: the fitted arrays by attribute name, the new tasks -> one
#: (n_points, n_outputs) array per task.
Scorer = Callable[[Mapping[str, Any], NewTasks], list[NDArray[np.float64]]]


def _task_mix(params: KernelParameters, kp: NDArray[np.float64]) -> NDArray[np.float64]:
    """The task factor ``τ + (1 - τ) k_P`` of eq. 8."""
    return params.tau + (1.0 - params.tau) * kp


def exact_scores(fitted: Mapping[str, Any], new: NewTasks) -> list[NDArray[np.float64]]:
    """``solver="exact"``: the dual coefficients against ``k̄`` to every training point."""
    train_points = fitted["train_points_"]
    train_task_index = fitted["train_task_index_"]
    dual_coef = fitted["dual_coef_"]
    scores = []
    for t, pts in enumerate(new.tasks):
        mix = _task_mix(new.params, new.task_similarity[t][train_task_index])
        parts = []
        for c0 in range(0, pts.shape[0], KERNEL_ROWS):
            K = new.maps.point_gram(pts[c0 : c0 + KERNEL_ROWS], train_points, new.params.sigma)
            K *= mix
            parts.append(batch_invariant_matmul(K, dual_coef, POINT_BLOCK))
        scores.append(np.concatenate(parts))
    return scores


def task_coordinates(
    kp: NDArray[np.float64], basis: NDArray[np.float64] | None, tau: float
) -> NDArray[np.float64]:
    """``s(P) = [√τ, √(1-τ) ψ(P)]`` for each row of ``kp`` (``k_P`` to the training
    tasks); the pooled model (``τ = 1``, no basis) has the single coordinate 1."""
    n = kp.shape[0]
    if tau == 1.0 or basis is None:
        return np.ones((n, 1))
    psi = batch_invariant_matmul(kp, basis)
    return np.hstack([np.full((n, 1), np.sqrt(tau)), np.sqrt(1.0 - tau) * psi])


def nystroem_scores(fitted: Mapping[str, Any], new: NewTasks) -> list[NDArray[np.float64]]:
    """``task_map="nystroem"``: ``z(x)ᵀ V(P)``, one small matrix ``V`` per task."""
    S = task_coordinates(new.task_similarity, fitted["task_basis_"], new.params.tau)
    V = np.einsum("ta,apk->tpk", S, fitted["coef_"])
    sigma = new.params.sigma
    return [
        np.concatenate(
            [
                batch_invariant_matmul(
                    new.maps.point_features(pts[c0 : c0 + CHUNK_POINTS], sigma),
                    V[t],
                    POINT_BLOCK,
                )
                for c0 in range(0, pts.shape[0], CHUNK_POINTS)
            ]
        )
        for t, pts in enumerate(new.tasks)
    ]


def paper_inputs(
    points: NDArray[np.float64], zp: NDArray[np.float64], gamma: float | None, sigma: float
) -> NDArray[np.float64]:
    """``u = (√(2γ_P) Z_P, x / σ_X)`` for every point of one task (paper 004 eq. 32);
    ``γ = None`` drops the task part (pooled model)."""
    scale = 0.0 if gamma is None else np.sqrt(2.0 * gamma)
    return np.hstack([np.broadcast_to(scale * zp, (points.shape[0], zp.shape[0])), points / sigma])


def paper_features(frequencies: NDArray[np.float64], u: NDArray[np.float64]) -> NDArray[np.float64]:
    """Second-layer random Fourier features of the unit Gaussian on ``u`` (the leading
    columns of directions drawn for the widest ``u``)."""
    return random_fourier_features(u, frequencies[:, : u.shape[1]])


def paper_scores(fitted: Mapping[str, Any], new: NewTasks) -> list[NDArray[np.float64]]:
    """``task_map="rff"``: the two-layer features of each point and its task's RFF
    embedding, times ``θ``."""
    frequencies = new.maps.joint_frequencies
    assert frequencies is not None
    embedding = new.embedding
    assert isinstance(embedding, FeatureEmbedding)
    features = embedding.features
    theta = fitted["coef_"][0]
    params = new.params
    return [
        np.concatenate(
            [
                batch_invariant_matmul(
                    paper_features(
                        frequencies,
                        paper_inputs(
                            pts[c0 : c0 + CHUNK_POINTS], features[t], params.gamma, params.sigma
                        ),
                    ),
                    theta,
                    POINT_BLOCK,
                )
                for c0 in range(0, pts.shape[0], CHUNK_POINTS)
            ]
        )
        for t, pts in enumerate(new.tasks)
    ]


#: Per solver: its scores and the fitted attributes they read (``task_map="rff"`` is
#: ``"paper"``).
SCORERS: dict[str, tuple[Scorer, tuple[str, ...]]] = {
    "exact": (exact_scores, ("train_points_", "train_task_index_", "dual_coef_")),
    "nystroem": (nystroem_scores, ("coef_", "task_basis_")),
    "paper": (paper_scores, ("coef_",)),
}


def scorer(solver: str, task_map: str) -> tuple[Scorer, tuple[str, ...]]:
    """The scores of the solver that ``solver`` and ``task_map`` name, and what they
    read of the model (as the model's parameters say, never stored)."""
    if solver not in ("exact", "random_features"):
        raise ValueError(f"solver must be 'exact' or 'random_features', got {solver!r}")
    if task_map not in ("nystroem", "rff"):
        raise ValueError(f"task_map must be 'nystroem' or 'rff', got {task_map!r}")
    if solver == "exact":
        return SCORERS["exact"]
    return SCORERS["paper" if task_map == "rff" else "nystroem"]
