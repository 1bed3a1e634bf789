"""The paper's two-layer random features (``task_map="rff"``, paper 004 §7.2).

A task's explicit RFF mean embedding ``Z_P`` is concatenated with the point, and a second
layer of random Fourier features on ``u = (√(2γ_P) Z_P, x / σ_X)`` approximates
``k_P · k_X`` by one unit Gaussian (eq. 32): ``τ = 0`` always. Kept for comparison with
the Nyström map: far from the training tasks these features do not vanish, and the model
predicts noise there.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from ....bags import Bags
from ....kernels import batch_invariant_matmul, random_fourier_features
from ....representations.base import BagRepresentation, Embedding, FeatureEmbedding
from ....representations.mean import MeanEmbedding
from .solvers import _CHUNK_POINTS, structured_ridge_path
from .strategy import (
    POINT_BLOCK,
    NewTasks,
    RandomFeatureStrategy,
    TrainingProblem,
    ValidationFold,
    held_out_error,
)

__all__ = ["PaperRFFStrategy", "paper_features", "paper_inputs"]


def paper_inputs(
    points: NDArray[np.float64], zp: NDArray[np.float64], gamma: float | None, sigma: float
) -> NDArray[np.float64]:
    """``u = (√(2γ_P) Z_P, x / σ_X)`` for every point of one task (paper 004 eq. 32).

    ``exp(-‖u - u'‖²/2) = k_P(P, P') k_X(x, x')`` for Gaussian ``k_P`` on the RFF
    embeddings and Gaussian ``k_X``; ``γ = None`` drops the task part (pooled model).
    """
    scale = 0.0 if gamma is None else np.sqrt(2.0 * gamma)
    return np.hstack([np.broadcast_to(scale * zp, (points.shape[0], zp.shape[0])), points / sigma])


def paper_features(frequencies: NDArray[np.float64], u: NDArray[np.float64]) -> NDArray[np.float64]:
    """Second-layer random Fourier features of the unit Gaussian on ``u``.

    The directions are drawn for the widest ``u`` the embedding may give; a narrower one
    uses their leading columns.
    """
    return random_fourier_features(u, frequencies[:, : u.shape[1]])


def _normal_equations(
    frequencies: NDArray[np.float64],
    tasks: Bags,
    Y: NDArray[np.float64],
    task_ids: NDArray[np.int64],
    embeddings: NDArray[np.float64],
    gamma: float | None,
    sigma: float,
    n_features: int,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """``A = Σ_ij c_ij φ φᵀ`` and ``B = Σ_ij c_ij φ yᵀ`` over tasks ``task_ids``, with the
    weights ``c_ij = 1/(N n_i)`` of eq. 7, shaped (1, F, ·) for the structured ridge.

    ``embeddings[j]`` is the RFF embedding of task ``task_ids[j]``.
    """
    N = task_ids.size
    A = np.zeros((1, n_features, n_features))
    B = np.zeros((1, n_features, Y.shape[1]))
    for j, t in enumerate(task_ids):
        lo, hi = int(tasks.offsets[t]), int(tasks.offsets[t + 1])
        for c0 in range(lo, hi, _CHUNK_POINTS):
            c1 = min(hi, c0 + _CHUNK_POINTS)
            Z = paper_features(
                frequencies, paper_inputs(tasks.points[c0:c1], embeddings[j], gamma, sigma)
            )
            A[0] += Z.T @ Z / ((hi - lo) * N)
            B[0] += Z.T @ Y[c0:c1] / ((hi - lo) * N)
    return A, B


def _features_of(embedding: Embedding) -> NDArray[np.float64]:
    assert isinstance(embedding, FeatureEmbedding)
    return embedding.features


class PaperRFFStrategy(RandomFeatureStrategy):
    """Weighted ridge on the two-layer features, coefficients ``θ`` of shape (1, F, k)."""

    fitted_attributes: ClassVar[tuple[str, ...]] = ("coef_",)
    fixed_tau: ClassVar[float | None] = 0.0

    def check_parameters(self, loss: str, point_kernel: str, tau: Any) -> None:
        super().check_parameters(loss, point_kernel, tau)
        if point_kernel != "gaussian":
            raise ValueError("task_map='rff' (paper 004 §7.2) needs point_kernel='gaussian'")
        if tau not in (None, 0, 0.0):
            raise ValueError(
                "task_map='rff' has no pooling share: leave tau=None and pooling=False "
                "(the pooled baseline is task_map='nystroem', pooling=True)"
            )

    def draw_joint_frequencies(
        self, rng: np.random.Generator, n_frequencies: int, dim: int
    ) -> NDArray[np.float64]:
        # Wide enough for an embedding of 2 n_frequencies features next to the point.
        return rng.standard_normal((n_frequencies, 2 * n_frequencies + dim))

    def default_embedding(self, n_components: int) -> BagRepresentation:
        return MeanEmbedding(method="rff", n_components=2 * max(1, int(n_components) // 2))

    def check_embedding(self, embedding: Embedding) -> None:
        if not (isinstance(embedding, FeatureEmbedding) and embedding.geometry == "euclidean"):
            raise ValueError(
                "task_map='rff' concatenates explicit embedding features with x (paper 004 "
                "eq. 32); use an embedding with Euclidean feature vectors, e.g. "
                "MeanEmbedding(method='rff')"
            )

    def fold_errors(
        self, fold: ValidationFold, alphas: NDArray[np.float64], cache: dict[Hashable, Any]
    ) -> NDArray[np.float64]:
        data, params = fold.data, fold.params
        frequencies = data.maps.joint_frequencies
        assert frequencies is not None and fold.embeddings is not None
        emb_train, emb_val = (_features_of(e) for e in fold.embeddings)
        A, B = _normal_equations(
            frequencies,
            data.tasks,
            data.Y,
            fold.train,
            emb_train,
            params.gamma,
            params.sigma,
            2 * frequencies.shape[0],
        )
        thetas = structured_ridge_path(np.ones((1, 1)), A, B, alphas)
        Zv = [
            paper_features(frequencies, paper_inputs(pts, emb_val[j], params.gamma, params.sigma))
            for j, (pts, _) in enumerate(fold.held_out)
        ]
        return np.array([held_out_error(fold, [Z @ theta[0] for Z in Zv]) for theta in thetas])

    def fit(self, problem: TrainingProblem) -> dict[str, Any]:
        data, params = problem.data, problem.params
        frequencies = data.maps.joint_frequencies
        assert frequencies is not None
        features = _features_of(problem.embedding)
        tasks = data.tasks
        F = paper_features(
            frequencies, paper_inputs(tasks.points[:1], features[0], params.gamma, params.sigma)
        ).shape[1]
        A, B = _normal_equations(
            frequencies,
            tasks,
            data.Y,
            np.arange(len(tasks)),
            features,
            params.gamma,
            params.sigma,
            F,
        )
        (theta,) = structured_ridge_path(np.ones((1, 1)), A, B, np.array([problem.alpha]))
        return {"coef_": theta}

    def joint_features(self, fitted: Mapping[str, Any], new: NewTasks) -> list[NDArray[np.float64]]:
        frequencies = new.maps.joint_frequencies
        assert frequencies is not None
        features = _features_of(new.embedding)
        return [
            paper_features(
                frequencies,
                paper_inputs(pts, features[t], new.params.gamma, new.params.sigma),
            )
            for t, pts in enumerate(new.tasks)
        ]

    def task_scores(self, fitted: Mapping[str, Any], new: NewTasks) -> list[NDArray[np.float64]]:
        frequencies = new.maps.joint_frequencies
        assert frequencies is not None
        features = _features_of(new.embedding)
        theta = fitted["coef_"][0]
        params = new.params
        return [
            np.concatenate(
                [
                    batch_invariant_matmul(
                        paper_features(
                            frequencies,
                            paper_inputs(
                                pts[c0 : c0 + _CHUNK_POINTS],
                                features[t],
                                params.gamma,
                                params.sigma,
                            ),
                        ),
                        theta,
                        POINT_BLOCK,
                    )
                    for c0 in range(0, pts.shape[0], _CHUNK_POINTS)
                ]
            )
            for t, pts in enumerate(new.tasks)
        ]
