"""Leave-tasks-out search of the marginal-transfer hyperparameters.

:class:`FoldEvaluator` scores a candidate configuration on every fold; the solver
strategy scores one fold over the whole ridge path (one factorisation per fold covers
every ``λ``). The evaluator caches, per fold, the fold's own embedding (fitted on its
training tasks only) and point bandwidth, and the points each held-out task is scored
on, so candidates that share them pay once. :func:`coordinate_search` walks the grid.

Everything the search needs from the estimator arrives in a :class:`SearchSetup`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..bags import Bags
from ..kernels import DistanceKernel
from ..progress import progress_bar
from ..representations.base import BagRepresentation, Embedding
from ._transfer_strategy import (
    KernelParameters,
    SolverStrategy,
    TrainingData,
    ValidationFold,
    task_similarity,
)

__all__ = [
    "FoldEvaluator",
    "SearchSetup",
    "coordinate_search",
    "mean_squared_error",
    "misclassification_rate",
]

#: A hyperparameter value still to be resolved on the tasks at hand:
#: ``("absolute", v)`` or ``("relative", factor of the median heuristic)``.
Spec = tuple[str, float]
Folds = list[tuple[NDArray[np.int64], NDArray[np.int64]]]


def misclassification_rate(scores: NDArray[np.float64], y: NDArray[np.float64]) -> float:
    """Share of points whose label (sign, or one-vs-rest argmax) is wrong."""
    if scores.shape[1] == 1:
        return float(np.mean(np.sign(scores[:, 0]) != np.sign(y[:, 0])))
    return float(np.mean(np.argmax(scores, 1) != np.argmax(y, 1)))


def mean_squared_error(scores: NDArray[np.float64], y: NDArray[np.float64]) -> float:
    """Mean squared error over points and outputs."""
    return float(np.mean((scores - y) ** 2))


@dataclass(frozen=True)
class SearchSetup:
    """What the search needs from the estimator, passed explicitly.

    Attributes
    ----------
    data : TrainingData
        The training tasks, their targets, the fit's feature maps and loss.
    emb_tasks : Bags
        The training tasks as their embeddings see them (subsampled).
    folds : list of (train, val) task index arrays
    alphas : ndarray
        Ridge grid ``λ``; every evaluation covers all of it.
    task_kernel : DistanceKernel
        ``k_P`` on squared embedding distances.
    fit_embedding : callable ``(emb_tasks, factor) -> (representation, embedding)``
        Fits the task representation, its bandwidth scaled by ``factor``.
    resolve_sigma : callable ``(spec, points) -> float``
        The point bandwidth of a spec, relative ones on the given points.
    resolve_gamma : callable ``(spec, sq_distances) -> float or None``
        ``γ`` of ``k_P`` of a spec, relative ones on the given task distances.
    error : callable ``(scores, targets) -> float``
        Validation error of one task.
    cv_points : int
        Points per held-out task it is scored on.
    seed : int
        Seed of the held-out points' subsample.
    """

    data: TrainingData
    emb_tasks: Bags
    folds: Folds
    alphas: NDArray[np.float64]
    task_kernel: DistanceKernel
    fit_embedding: Callable[[Bags, float], tuple[BagRepresentation, Embedding]]
    resolve_sigma: Callable[[Spec, NDArray[np.float64]], float]
    resolve_gamma: Callable[[Spec | None, NDArray[np.float64]], float | None]
    error: Callable[[NDArray[np.float64], NDArray[np.float64]], float]
    cv_points: int
    seed: int


class FoldEvaluator:
    """Validation errors of candidate configurations, with caches shared across them."""

    def __init__(self, setup: SearchSetup, strategy: SolverStrategy):
        self.setup = setup
        self.strategy = strategy
        self._embeddings: dict[
            tuple[int, float], tuple[NDArray[np.float64], NDArray[np.float64], Any]
        ] = {}
        self._sigmas: dict[tuple[int, Spec], float] = {}
        self._held_out: dict[int, tuple[NDArray[np.float64], NDArray[np.float64]]] = {}
        self._strategy_cache: dict[Hashable, Any] = {}

    def _fold_embedding(
        self, f: int, factor: float
    ) -> tuple[NDArray[np.float64], NDArray[np.float64], tuple[Embedding, Embedding]]:
        """Squared distances among fold ``f``'s training tasks and from its held-out tasks,
        and both embeddings, with a representation fitted on its training tasks only."""
        key = (f, factor)
        if key not in self._embeddings:
            train, val = self.setup.folds[f]
            rep, emb = self.setup.fit_embedding(self.setup.emb_tasks[train], factor)
            val_emb = rep.embed(self.setup.emb_tasks[val])
            self._embeddings[key] = (emb.sq_distances(), val_emb.sq_distances(emb), (emb, val_emb))
        return self._embeddings[key]

    def _sigma(self, f: int, spec: Spec) -> float:
        """The point bandwidth of fold ``f``: relative values use its training points only."""
        if (f, spec) not in self._sigmas:
            train_points = self.setup.data.tasks[self.setup.folds[f][0]].points
            self._sigmas[(f, spec)] = self.setup.resolve_sigma(spec, train_points)
        return self._sigmas[(f, spec)]

    def _held_out_points(self, v: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Points (at most ``cv_points``, drawn per task) held-out task ``v`` is scored on."""
        if v not in self._held_out:
            tasks, Y = self.setup.data.tasks, self.setup.data.Y
            lo, hi = int(tasks.offsets[v]), int(tasks.offsets[v + 1])
            pick = np.arange(lo, hi)
            if pick.size > self.setup.cv_points:
                # Seeded per task: a task is scored on the same points in every fold.
                rng = np.random.default_rng([self.setup.seed, v])
                pick = np.sort(rng.choice(pick, self.setup.cv_points, replace=False))
            self._held_out[v] = (tasks.points[pick], Y[pick])
        return self._held_out[v]

    def score(self, cand: dict[str, Any]) -> NDArray[np.float64]:
        """Mean validation error (per task, then over folds) for each ``λ`` of the grid."""
        setup = self.setup
        errors = np.zeros(setup.alphas.size)
        for f, (train, val) in enumerate(setup.folds):
            if cand["tau"] == 1.0:
                # The pooled model ignores the tasks' distributions: no embedding to fit.
                sq_tr = np.zeros((train.size, train.size))
                sq_va = np.zeros((val.size, train.size))
                embeddings = None
            else:
                sq_tr, sq_va, embeddings = self._fold_embedding(f, cand["emb"])
            gamma = setup.resolve_gamma(cand["gamma"], sq_tr)
            fold = ValidationFold(
                data=setup.data,
                train=train,
                val=val,
                params=KernelParameters(
                    sigma=self._sigma(f, cand["sigma"]), tau=cand["tau"], gamma=gamma
                ),
                kp_train=task_similarity(setup.task_kernel, sq_tr, gamma),
                kp_val=task_similarity(setup.task_kernel, sq_va, gamma),
                embeddings=embeddings,
                held_out=[self._held_out_points(int(v)) for v in val],
                error=setup.error,
            )
            errors += self.strategy.fold_errors(fold, setup.alphas, self._strategy_cache)
        return errors / len(setup.folds)


def coordinate_search(evaluator: FoldEvaluator, grid: dict[str, list[Any]]) -> dict[str, Any]:
    """Leave-tasks-out CV, coordinate-wise as the authors' code does it.

    (1) the pooled model (``τ = 1``) over the point bandwidths; (2) at that bandwidth,
    ``(τ, γ_P)``; (3) the embedding bandwidth; (4) the point bandwidth again. Every
    evaluation covers the whole ``λ`` grid. The best configuration seen wins, the pooled
    model included.

    Parameters
    ----------
    evaluator : FoldEvaluator
    grid : dict
        Values of ``"sigma"``, ``"tau"``, ``"gamma"`` and ``"emb"`` (first = default).

    Returns
    -------
    dict
        The selection record: every configuration evaluated with its CV error per
        ``λ``, the ``λ`` grid, the folds, and the best configuration with its ``alpha``.
    """
    alphas = evaluator.setup.alphas
    seen: dict[tuple[Any, ...], NDArray[np.float64]] = {}
    # At most: the point bandwidths three times, (τ, γ_P) pairs, embedding bandwidths.
    n_sigma = len(grid["sigma"])
    bound = 3 * n_sigma + len(grid["tau"]) * len(grid["gamma"]) + len(grid["emb"])
    bar = progress_bar(bound, "marginal transfer: search", "config")

    def errors(c: dict[str, Any]) -> float:
        key = (c["sigma"], c["tau"], c["gamma"], c["emb"])
        if c["tau"] == 1.0:
            # The pooled model has no task kernel: one evaluation per point bandwidth.
            key = (c["sigma"], 1.0, None, 1.0)
            c = {"sigma": c["sigma"], "tau": 1.0, "gamma": None, "emb": 1.0}
        if key not in seen:
            seen[key] = evaluator.score(c)
            bar.update(1)
        return float(seen[key].min())

    def best_of(options: list[dict[str, Any]]) -> dict[str, Any]:
        return min(options, key=errors)

    current = {k: v[0] for k, v in grid.items()}
    if 1.0 in grid["tau"]:
        current = best_of([{**current, "sigma": s, "tau": 1.0} for s in grid["sigma"]])
    others = [t for t in grid["tau"] if t != 1.0]
    if others:
        base = {**current}
        current = best_of(
            [
                {**base, "tau": t, "gamma": g, "emb": grid["emb"][len(grid["emb"]) // 2]}
                for t in others
                for g in grid["gamma"]
            ]
        )
        current = best_of([{**current, "emb": e} for e in grid["emb"]])
        current = best_of([{**current, "sigma": s} for s in grid["sigma"]])
    if 1.0 in grid["tau"]:
        pooled = best_of([{**current, "sigma": s, "tau": 1.0} for s in grid["sigma"]])
        current = min([current, pooled], key=errors)
    bar.close()
    key = min(seen, key=lambda k: seen[k].min())
    best = {"sigma": key[0], "tau": key[1], "gamma": key[2], "emb": key[3]}
    best["alpha"] = float(alphas[int(np.argmin(seen[key]))])
    return {
        "evaluated": [
            {"sigma": k[0], "tau": k[1], "gamma": k[2], "emb": k[3], "cv_error": v.tolist()}
            for k, v in seen.items()
        ],
        "alpha_grid": alphas,
        "folds": evaluator.setup.folds,
        "best": best,
    }
