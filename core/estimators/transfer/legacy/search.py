"""The hyperparameter search of the marginal-transfer models.

Leave-tasks-out folds (leave-one-batch-out where batches are named), the grid of each
hyperparameter around its median heuristic, and the search itself: the per-task
normalisation first (:func:`~.cv.choose_normalisation`), then the kernel
(:func:`~.cv.coordinate_search`), the refinement, the reject rule and, with a
fallback or batches, their own choices (:mod:`.fallback`,
:mod:`.calibration`). The fold evaluations live in :mod:`.cv`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray
from sklearn.base import clone

from ....bags import Bags, BagValidationError, subsample_bags
from ....representations.base import BagRepresentation, Embedding
from ....representations.mean import _median_distance
from ....selection import leave_one_group_out_folds, leave_tasks_out_folds, median_heuristic_gamma
from .cv import (
    FoldEvaluator,
    SearchSetup,
    choose_normalisation,
    choose_refinement,
    coordinate_search,
    mean_squared_error,
    misclassification_rate,
)
from .fallback import _fits_linear_pooled
from .refine import refine_scores
from .reject import choose_reject
from .strategy import SolverStrategy

__all__ = [
    "ALPHA_GRID",
    "BANDWIDTH_FACTORS",
    "EMBEDDING_BANDWIDTH_FACTORS",
    "TASK_GAMMA_FACTORS",
    "TAU_GRID",
    "SearchMixin",
]

#: Default ridge grid ``λ`` of the weighted objective (per-task mean loss ~ 1).
ALPHA_GRID = np.logspace(-6, -1, 6)
#: Default shares of pooling searched besides the pooled model itself (τ = 1).
TAU_GRID = (0.0, 0.2)
#: Multipliers of the median heuristic searched for each bandwidth or ``γ``; the
#: search is coordinate-wise (see ``_search``), so each grid costs its length, not
#: the product of all lengths.
BANDWIDTH_FACTORS = (0.5, 1.0, 2.0)
TASK_GAMMA_FACTORS = (0.3, 1.0, 3.0)
#: The embedding's own bandwidth stays at its median heuristic by default: searching it
#: (×{0.5, 1, 2}) fits an embedding per fold and factor and costs more than it gained
#: on the benchmarks; give ``embedding`` a fixed bandwidth to set it yourself.
EMBEDDING_BANDWIDTH_FACTORS = (1.0,)


class SearchMixin:
    """Folds, grids and the search (mixed into the estimator)."""

    def _folds(
        self, n_tasks: int, groups: NDArray[Any] | None
    ) -> tuple[list[Any], list[Any] | None]:
        """Leave-tasks-out folds, and leave-one-batch-out folds when ``groups`` names
        two batches or more (else ``None``)."""
        by_task = leave_tasks_out_folds(n_tasks, self.cv, self.cv_repeats, self.seed_)
        if groups is not None and np.unique(groups).size > 1:
            return by_task, leave_one_group_out_folds(groups)
        return by_task, None

    def _make_embedding(self) -> BagRepresentation:
        if self.embedding is not None:
            rep = clone(self.embedding)
        else:
            rep = self._strategy().default_embedding(self.n_components)
        params = rep.get_params(deep=False)
        if "random_state" in params and params["random_state"] is None:
            rep.set_params(random_state=self.seed_)
        return rep

    def _fit_embedding(
        self, emb_tasks: Bags, factor: float, base: float | None = None
    ) -> tuple[BagRepresentation, Embedding]:
        """The task representation fitted on ``emb_tasks``, its bandwidth ``factor`` times
        ``base`` (default: its own median heuristic on ``emb_tasks``), and their
        embedding."""
        rep = self._make_embedding()
        if base is not None:
            rep = rep.set_params(bandwidth=factor * base).fit(emb_tasks)
        else:
            rep = rep.fit(emb_tasks)
            if factor != 1.0:
                rep = rep.set_params(bandwidth=factor * rep.bandwidth_).fit(emb_tasks)
        emb = rep.embed(emb_tasks)
        self._strategy().check_embedding(emb)
        return rep, emb

    def _embedding_bandwidth(self, emb_tasks: Bags) -> float | None:
        """The base bandwidth the task representation takes on ``emb_tasks`` (its median
        heuristic), or None when it is fixed."""
        if not self._searches_embedding_bandwidth():
            return None
        return float(self._make_embedding().fit(emb_tasks).bandwidth_)

    def _searches_embedding_bandwidth(self) -> bool:
        rep = self._make_embedding()
        return "bandwidth" in rep.get_params(deep=False) and rep.get_params()["bandwidth"] is None

    def _grid(self, strategy: SolverStrategy) -> tuple[dict[str, list[Any]], NDArray[np.float64]]:
        """Values the search may visit for each hyperparameter (first = default), and the
        ridge grid ``λ``."""
        # Relative values are resolved on the tasks at hand: a fold's training tasks
        # during the search, all training tasks in the final fit.
        if self.point_kernel_ == "linear":
            sigmas: list[Any] = [("absolute", 1.0)]
        elif self.point_bandwidth is None:
            sigmas = [("relative", f) for f in BANDWIDTH_FACTORS]
        else:
            sigmas = [("absolute", float(v)) for v in np.atleast_1d(self.point_bandwidth)]
            if any(not v > 0 for _, v in sigmas):
                raise ValueError(f"point_bandwidth must be > 0, got {self.point_bandwidth!r}")
        alphas = ALPHA_GRID if self.alpha is None else np.atleast_1d(np.asarray(self.alpha, float))
        if np.any(alphas <= 0):
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")
        if self.pooling:
            taus: list[float] = [1.0]
        elif strategy.fixed_tau is not None:
            taus = [strategy.fixed_tau]
        elif self.tau is None:
            taus = [*TAU_GRID, 1.0]
        else:
            taus = [float(v) for v in np.atleast_1d(self.tau)]
            if any(not 0.0 <= t <= 1.0 for t in taus):
                raise ValueError(f"tau must lie in [0, 1], got {self.tau!r}")
        if self.task_gamma is None:
            gammas: list[Any] = [("relative", f) for f in TASK_GAMMA_FACTORS]
        else:
            gammas = [("absolute", float(v)) for v in np.atleast_1d(self.task_gamma)]
        if taus == [1.0]:
            gammas = [None]
        embs = list(EMBEDDING_BANDWIDTH_FACTORS) if self._searches_embedding_bandwidth() else [1.0]
        if taus == [1.0]:
            embs = [1.0]
        return {"sigma": sigmas, "tau": taus, "gamma": gammas, "emb": embs}, alphas

    def _sigma_value(self, spec: tuple[str, float], points: NDArray[np.float64]) -> float:
        """The point bandwidth ``σ`` of a spec; relative ones scale the median distance."""
        kind, value = spec
        if kind == "absolute":
            return value
        return value * self._point_median(points)

    def _point_median(self, points: NDArray[np.float64]) -> float:
        """The median distance of ``points`` (a subsample drawn with ``seed_``): the
        search's evaluator of a normalisation and the final fit on it (the fallback's
        too) ask for the same one, computed once per fit
        (:func:`~..representations.mean.sharing_median_distances`)."""
        return _median_distance(points, "gaussian", np.random.default_rng(self.seed_))

    def _gamma_value(self, spec: tuple[str, float] | None, sq: NDArray[np.float64]) -> float | None:
        """``γ`` of ``k_P`` of a spec; relative ones scale the median heuristic on ``sq``."""
        if spec is None:
            return None
        kind, value = spec
        if kind == "absolute":
            return value
        return value * median_heuristic_gamma(sq, self.task_kernel_) if sq.shape[0] > 1 else value

    def _search(
        self,
        strategy: SolverStrategy,
        variants: dict[str, Bags],
        Y: NDArray[np.float64],
        grid: dict[str, list[Any]],
        alphas: NDArray[np.float64],
        groups: NDArray[Any] | None,
        raw: Bags,
    ) -> tuple[str, dict[str, Any]]:
        """Cross-validation: the normalisation (:func:`~.cv.choose_normalisation`)
        when there is a choice, then the kernel (:func:`~.cv.coordinate_search`)
        on the tasks so normalised. Sets ``selection_``; returns the normalisation and
        the best configuration.

        A classifier's kernel chosen on leave-tasks-out folds beside an invariant
        fallback then faces the pooled linear model
        (:meth:`~.fallback.FallbackMixin._choose_capacity`): alone, or both
        averaged where the folds cannot tell them apart by a clear margin; the
        refinement and the reject rule are chosen for what answers."""
        N = len(next(iter(variants.values())))
        if N < 2:
            raise BagValidationError(
                [
                    "choosing hyperparameters needs at least 2 training tasks; fix "
                    "normalise, point_bandwidth, task_gamma, tau and alpha to fit on one task"
                ]
            )
        folds, batch_folds = self._folds(N, groups)
        evaluators = {}
        for name, tasks in variants.items():
            emb_tasks = subsample_bags(tasks, self.embedding_points, self.seed_, canonical=True)
            setup = SearchSetup(
                data=self._training_data(tasks, Y, self.loss_),
                emb_tasks=emb_tasks,
                folds=folds,
                alphas=alphas,
                task_kernel=self.task_kernel_,
                fit_embedding=self._fit_embedding,
                resolve_sigma=self._sigma_value,
                resolve_gamma=self._gamma_value,
                error=misclassification_rate if self._is_classifier else mean_squared_error,
                cv_points=self.cv_points,
                seed=self.seed_,
                embedding_bandwidth=self._embedding_bandwidth,
            )
            evaluators[name] = FoldEvaluator(setup, strategy)
        record = None
        chosen = next(iter(variants))
        if len(variants) > 1:
            # Compared as the pooled model where the strategy has one: the cheapest fit,
            # and the one a normalisation's effect on the points shows in alone.
            pooled = 1.0 in grid["tau"]
            cand = {
                "sigma": grid["sigma"][len(grid["sigma"]) // 2],
                "tau": 1.0 if pooled else grid["tau"][0],
                "gamma": None if pooled else grid["gamma"][len(grid["gamma"]) // 2],
                "emb": 1.0 if pooled else grid["emb"][len(grid["emb"]) // 2],
            }
            chosen, record = choose_normalisation(evaluators, cand)
        # Each model is chosen on folds like the tasks it will answer. With a fallback
        # for the tasks out of range, the primary answers tasks like the training ones
        # (leave-tasks-out); a model that answers every task, new batches included, is
        # chosen leave-one-batch-out when batches are named.
        with_fallback = self.normalise == "auto" and chosen != "standard"
        searched = evaluators[chosen]
        if batch_folds is None or with_fallback:
            self.selection_ = coordinate_search(searched, grid)
            self.selection_["cv"] = "leave-tasks-out"
        else:
            searched = searched.on_folds(batch_folds)
            self.selection_ = coordinate_search(searched, grid)
            self.selection_["cv"] = "leave-one-batch-out"
        members = [(searched, self.selection_["best"])]
        if (
            with_fallback
            and self._is_classifier
            and self.point_kernel_ != "linear"
            and _fits_linear_pooled(searched.strategy, self.loss_)
        ):
            members = self._choose_capacity(searched, Y)
        self.selection_["refine"] = self._choose_refinement(members)
        rest = self._rest_code()
        thresholds = self._reject_options()
        if rest is not None and thresholds is not None:
            seed = self.seed_
            refined = self.selection_["refine"]["chosen"] == "mixture"
            self.selection_["reject"] = choose_reject(
                members,
                (lambda x, s: refine_scores(x, s, seed)[0]) if refined else None,
                rest,
                thresholds,
            )
        if with_fallback:
            self._choose_fallback(evaluators, chosen, grid, Y, batch_folds, record)
        self.selection_["normalisation"] = record
        if batch_folds is not None and self.calibrate == "auto":
            self.selection_["calibration"] = self._choose_calibration(
                raw, members, chosen, batch_folds, record
            )
        return chosen, self.selection_["best"]

    def _choose_refinement(
        self, members: list[tuple[FoldEvaluator, dict[str, Any]]], for_fallback: bool = False
    ) -> dict:
        """Whether the model of ``members`` refines its answers by the per-task mixture
        (:func:`~.refine.refine_scores`), by its folds (``refine="auto"``;
        otherwise as fixed, the fold errors recorded alike), and its fold errors as it
        answers (a blend: its worse member, fold by fold).

        The primary model answers tasks like its folds': it refines only where they
        show the refinement helps by more than their noise. The fallback answers tasks
        unlike every training task, where the task's own populations say most and
        folds of tasks like the training ones may show no gain (the fallback may err on
        none of them): it refines unless its folds show the refinement hurting on
        average. Before, it refined unless they showed harm beyond their noise; on
        samples emulated from real ones (populations no Gaussian describes) that kept a
        refinement whose fold error was 0.2 to 1.7 points higher, and it lowered the new
        batch's accuracy by 0.9 and 2.2 points (GvHD gated cells, bench/README.md).
        """
        if "mixture" not in self._refinements():
            none = np.max([ev.per_fold(best) for ev, best in members], axis=0)
            return {"chosen": "none", "fold_errors": {"none": none}}
        seed = self.seed_
        record = choose_refinement(
            members, lambda x, s: refine_scores(x, s, seed)[0], "mixture", unless_worse=for_fallback
        )
        if self.refine != "auto":
            record["chosen"] = self.refine
        return record
