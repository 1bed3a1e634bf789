"""The task embedding: a sample's distribution as a point, and its place among the
training samples (paper 004, Blanchard et al., §5 and §7).

Cells are standardised by the training reference and mapped by random Fourier
features of a Gaussian kernel (Rahimi & Recht), ``z(x) = √(2/D) cos(Wᵀx̃ + b)``, with
the median heuristic's bandwidth; a task's embedding is the mean of ``z`` over its
cells (the kernel mean embedding's random-feature form, paper 004 eq. 9), at most
``embedding_points`` of them drawn independently of their order. Tasks compare by a
Gaussian kernel on embedding distances, ``k_P(P, P') = exp(-γ ‖μ_P - μ_P'‖²)``, ``γ``
the inverse median squared distance between training tasks; the Nyström map over the
``N`` training tasks, ``ψ(P) = Λ^{-1/2} Uᵀ k_P(P_train, P)``, is exact on them and
vanishes for a task unlike all of them (the kernel cell model then answers with its
pooled part).

A new task is *out of range* when its distance to the nearest training task exceeds
``range_factor`` times the largest such distance among the training tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ...bags import Bags, subsample_rows

__all__ = ["TaskMap", "fit_task_map"]

#: Cells drawn for the median heuristic's bandwidth.
BANDWIDTH_CELLS = 1000
#: Most Nyström components kept (the leading ones): bounds the kernel model's size
#: at ``(1 + MAX_COMPONENTS)`` times the cell features.
MAX_COMPONENTS = 16


@dataclass(frozen=True)
class TaskMap:
    """Cell features and task embeddings of one fitted model (plain arrays)."""

    center: NDArray[np.float64]
    scale: NDArray[np.float64]
    weights: NDArray[np.float64]
    phases: NDArray[np.float64]
    gamma: float
    train_embeddings: NDArray[np.float64]
    basis: NDArray[np.float64]
    range_threshold: float
    distance_scale: float
    embedding_points: int
    seed: int

    def as_state(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TaskMap:
        return cls(**state)

    def standardise(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        return (x - self.center) / self.scale

    def random_features(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """``z(x)`` of cells ``x`` (n, d) in the model's space: (n, D)."""
        d = self.weights.shape[1]
        return np.sqrt(2.0 / d) * np.cos(self.standardise(x) @ self.weights + self.phases)

    def cell_features(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """The kernel cell model's features: ``[z(x), x̃ / √d, 1]`` (the Gaussian part
        plus the low-capacity linear part and an offset)."""
        xs = self.standardise(x)
        return np.hstack(
            [self.random_features(x), xs / np.sqrt(xs.shape[1]), np.ones((xs.shape[0], 1))]
        )

    def embedding_rows(self, x: NDArray[np.float64]) -> NDArray[np.int64]:
        """The rows of task ``x`` its embedding is the mean over: at most
        ``embedding_points`` (a seeded draw), in the canonical order of its cells
        (:func:`.reference.canonical_cells`), whatever order they came in."""
        return subsample_rows(
            Bags.from_arrays([x]), self.embedding_points, self.seed, canonical=True
        )

    def embed(self, tasks: list[NDArray[np.float64]]) -> NDArray[np.float64]:
        """Each task's mean embedding (tasks x D), over its :meth:`embedding_rows`."""
        out = [self.random_features(x[self.embedding_rows(x)]).mean(axis=0) for x in tasks]
        return np.array(out)

    def sq_distances(self, embeddings: NDArray[np.float64]) -> NDArray[np.float64]:
        """Squared embedding distances of ``embeddings`` to the training tasks'."""
        return _sq_distances(embeddings, self.train_embeddings)

    def context(self, embeddings: NDArray[np.float64]) -> NDArray[np.float64]:
        """The Nyström task features ``ψ`` of task embeddings (tasks x components)."""
        return self.context_at(self.sq_distances(embeddings))

    def context_at(self, sq: NDArray[np.float64]) -> NDArray[np.float64]:
        """:meth:`context` from the tasks' squared distances to the training tasks."""
        return np.einsum("tn,nr->tr", np.exp(-self.gamma * sq), self.basis)


def _sq_distances(a: NDArray[np.float64], b: NDArray[np.float64]) -> NDArray[np.float64]:
    """Squared distances between the rows of ``a`` and ``b``, each computed on its own
    (no matrix product, whose blocking depends on how many rows come together): a
    task's distances are the same to the bit whatever tasks it is sent with."""
    return ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=2)


def fit_task_map(
    tasks: list[NDArray[np.float64]],
    n_components: int,
    embedding_points: int,
    range_factor: float,
    seed: int,
) -> TaskMap:
    """The :class:`TaskMap` of the training tasks (cells x markers each, as the cell
    model sees them)."""
    rng = np.random.default_rng([seed, 44])
    pooled = np.vstack(tasks)
    center = pooled.mean(axis=0)
    scale = pooled.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    draw = (pooled[rng.choice(pooled.shape[0], min(BANDWIDTH_CELLS, pooled.shape[0]), False)]
            - center) / scale  # fmt: skip
    half = draw.shape[0] // 2
    dist = np.sqrt(((draw[:half] - draw[half : 2 * half]) ** 2).sum(axis=1))
    sigma = float(np.median(dist)) or 1.0
    d = pooled.shape[1]
    weights = rng.normal(0.0, 1.0 / sigma, (d, n_components))
    phases = rng.uniform(0.0, 2.0 * np.pi, n_components)
    partial = TaskMap(
        center, scale, weights, phases, 1.0, np.zeros((0, n_components)), np.zeros((0, 0)),
        np.inf, 1.0, embedding_points, seed,
    )  # fmt: skip
    emb = partial.embed(tasks)
    sq = _sq_distances(emb, emb)
    n = sq.shape[0]
    off = sq[~np.eye(n, dtype=bool)]
    gamma = 1.0 / (float(np.median(off)) if off.size and np.median(off) > 0 else 1.0)
    vals, vecs = np.linalg.eigh(np.exp(-gamma * sq))
    keep = np.argsort(vals)[::-1][:MAX_COMPONENTS]
    keep = keep[vals[keep] > 1e-8 * vals.max()]
    basis = vecs[:, keep] / np.sqrt(vals[keep])
    nearest = np.sqrt(sq + np.diag(np.full(n, np.inf))).min(axis=1) if n > 1 else np.zeros(1)
    return TaskMap(
        center, scale, weights, phases, gamma, emb, basis,
        range_factor * float(nearest.max()) if n > 1 else np.inf,
        float(np.median(nearest)) if n > 1 and np.median(nearest) > 0 else 1.0,
        embedding_points, seed,
    )  # fmt: skip
