"""The two classes a saved model of the design before issue 44 loads as, and their
answer path (the package docstring lists its steps). Models saved before one of its
attributes existed read as they did: each ``getattr`` default below.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from ....bags import Bags, BagValidationError, as_bags, normalise_each_bag, subsample_bags
from ....domain import DomainReport
from ....representations.base import Embedding
from ..reports import TaskPrediction, TaskReport
from ..trees import tree_scores
from .calibration import (
    Landmarks,
    landmarks_calibrated,
    mapped_by_control,
    mapped_out_of_range,
)
from .refine import refine_scores
from .reject import far_from_populations, reject_scores
from .reports import domain_report, task_reports
from .scoring import FeatureMaps, KernelParameters, NewTasks, scorer, task_similarity

__all__ = ["MarginalTransferClassifier", "MarginalTransferRegressor"]


def _as_tasks(X: Any) -> Bags:
    """Tasks as :class:`Bags`; a single 2-D array is one task."""
    if isinstance(X, np.ndarray) and X.ndim == 2:
        return Bags.from_arrays([X])
    return as_bags(X)


class _MarginalTransfer(BaseEstimator):
    """A loaded model of the design before issue 44. Its parameters are those it was
    fitted with, stored verbatim; an answer reads ``solver``, ``task_map`` and
    ``embedding_points`` (and ``normalise``, ``point_kernel`` for models saved before
    ``normalise_``, ``point_kernel_``)."""

    _is_classifier = False

    def __init__(
        self,
        solver: str = "random_features",
        task_map: str = "nystroem",
        loss: str | None = None,
        embedding: Any = None,
        embedding_points: int | None = 500,
        task_kernel: str = "gaussian",
        task_gamma: Any = None,
        point_kernel: str | None = None,
        point_bandwidth: Any = None,
        tau: Any = None,
        pooling: bool = False,
        alpha: Any = None,
        epsilon: float = 0.1,
        n_components: int = 128,
        cv: int = 5,
        cv_repeats: int = 1,
        cv_points: int = 2000,
        range_factor: float = 1.5,
        max_exact_points: int = 4000,
        normalise: str = "auto",
        refine: str = "auto",
        unassigned: Any = None,
        reject: Any = "auto",
        calibrate: str = "auto",
        random_state: Any = None,
    ):
        self.solver = solver
        self.task_map = task_map
        self.loss = loss
        self.embedding = embedding
        self.embedding_points = embedding_points
        self.task_kernel = task_kernel
        self.task_gamma = task_gamma
        self.point_kernel = point_kernel
        self.point_bandwidth = point_bandwidth
        self.tau = tau
        self.pooling = pooling
        self.alpha = alpha
        self.epsilon = epsilon
        self.n_components = n_components
        self.cv = cv
        self.cv_repeats = cv_repeats
        self.cv_points = cv_points
        self.range_factor = range_factor
        self.max_exact_points = max_exact_points
        self.normalise = normalise
        self.refine = refine
        self.unassigned = unassigned
        self.reject = reject
        self.calibrate = calibrate
        self.random_state = random_state

    def fit(self, *args: Any, **kwargs: Any) -> _MarginalTransfer:
        """Not any more: a model of the design before issue 44 only loads and answers."""
        raise TypeError(
            "this is a marginal-transfer model saved before issue 44's rebuild: it loads "
            "and answers as it did, and cannot be fitted again; fit "
            f"bagserve.core.{type(self).__name__} (the current design) instead"
        )

    def _feature_maps(self) -> FeatureMaps:
        """``k_X`` and the random draws of the fit."""
        # Models saved before the linear part and the resolved kernel read as before.
        return FeatureMaps(
            getattr(self, "point_kernel_", None) or self.point_kernel or "gaussian",
            self.point_frequencies_,
            self.joint_frequencies_,
            getattr(self, "linear_centre_", None),
            getattr(self, "linear_scale_", None),
        )

    def _normalise(self, tasks: Bags) -> Bags:
        """Tasks normalised as the fit chose."""
        # Models saved before normalise_ existed had normalise "none" or "standard".
        how = getattr(self, "normalise_", None) or self.normalise
        return normalise_each_bag(tasks, how, getattr(self, "quantile_reference_", None))

    def _task_similarities(self, tasks: Bags) -> tuple[Embedding, NDArray[np.float64]]:
        problems = []
        if tasks.dim != self.n_features_in_:
            problems.append(
                f"tasks have {tasks.dim} marker column(s) but the model was fitted "
                f"on {self.n_features_in_}"
            )
        # A task's distribution (the model's other input) needs 2 points at least.
        problems += [
            f"task {int(t)} has a single point: its distribution cannot be estimated"
            for t in np.flatnonzero(tasks.sizes < 2)
        ]
        if problems:
            raise BagValidationError(problems)
        sub = subsample_bags(tasks, self.embedding_points, self.seed_, canonical=True)
        emb = self.embedding_.embed(sub)
        return emb, emb.sq_distances(self.train_embedding_)

    def _reports(self, sq_new: NDArray[np.float64]) -> list[TaskReport]:
        return task_reports(
            task_similarity(self.task_kernel_, sq_new, self.task_gamma_),
            sq_new,
            self.range_threshold_,
            getattr(self, "fallback_", None) is not None,
        )

    def _scores_per_task(
        self, raw: Bags, control: ArrayLike | None = None
    ) -> tuple[list[NDArray[np.float64]], list[TaskReport]]:
        """Scores and reports of tasks as they arrived (steps 1 to 5 of the package
        docstring). Each model refines its own answers; whichever answered, the
        reject rule acts on the ±1-coded scores."""
        check_is_fitted(self, "tau_")
        raw, by_control = mapped_by_control(
            raw,
            control,
            getattr(self, "control_quantiles_", None),
            getattr(self, "control_scale_", None),
        )
        tasks = self._normalise(raw)
        emb, sq_new = self._task_similarities(tasks)
        reports = self._reports(sq_new)
        if control is None:
            raw, calibrated = self._calibrated(raw, reports)
        else:
            calibrated = {}
            reports = [
                replace(r, calibrated="control", calibration=q)
                for r, q in zip(reports, by_control, strict=True)
            ]
        if calibrated:
            tasks = self._normalise(raw)
            emb, sq_new = self._task_similarities(tasks)
        for i, arrived in calibrated.items():
            reports[i] = replace(arrived, fallback=False)
        far = [i for i, r in enumerate(reports) if r.fallback]
        near = [i for i, r in enumerate(reports) if not r.fallback]
        threshold = getattr(self, "disagreement_threshold_", None)
        check = getattr(self, "fallback_", None) is not None and threshold is not None
        asked = list(range(len(reports))) if check else far
        fallback_answers: dict[int, tuple[NDArray[np.float64], TaskReport]] = {}
        if asked:
            answered, their = self.fallback_._scores_per_task(raw[np.array(asked)])
            fallback_answers = dict(zip(asked, zip(answered, their, strict=True), strict=True))
        scores: list[NDArray[np.float64]] = [np.empty((0, 0))] * len(reports)
        if near:
            if far:
                # Score only the tasks this model answers.
                tasks = tasks[np.array(near)]
                emb, sq_new = self._task_similarities(tasks)
            answered = self._model_scores(raw[np.array(near)], tasks, emb, sq_new)
            relabelled: list[float | None] = [None] * len(near)
            if getattr(self, "refine_", "none") == "mixture":
                refined = [
                    refine_scores(np.asarray(tasks[t]), sc, self.seed_)
                    for t, sc in enumerate(answered)
                ]
                answered = [sc for sc, _ in refined]
                relabelled = [share for _, share in refined]
            for i, sc, share in zip(near, answered, relabelled, strict=True):
                scores[i] = sc
                reports[i] = replace(reports[i], relabelled=share)
                if check and i not in calibrated:
                    d = self._disagreement(sc, fallback_answers[i][0])
                    unlike = d > threshold
                    reports[i] = replace(
                        reports[i],
                        out_of_range=reports[i].out_of_range or unlike,
                        fallback=unlike,
                        disagreement=d,
                    )
        for i in range(len(reports)):
            if reports[i].fallback:
                scores[i], theirs = fallback_answers[i]
                reports[i] = replace(reports[i], relabelled=theirs.relabelled)
        reject = getattr(self, "reject_threshold_", None)
        if reject is not None:
            scores = [reject_scores(sc, self.rest_code_, reject) for sc in scores]
        return scores, reports

    def _model_scores(
        self, raw: Bags, tasks: Bags, emb: Embedding, sq_new: NDArray[np.float64]
    ) -> list[NDArray[np.float64]]:
        """This model's scores of ``tasks`` (``raw`` as they arrived, normalised; ``emb``
        and ``sq_new`` their embedding and distances to the training tasks), before any
        refinement or reject rule: its boosted trees or its solver, averaged with its
        blend partner's where it has one. A partner's ``shares_task_view_`` says it
        normalises and embeds tasks as this model does."""
        trees = getattr(self, "trees_", None)
        if trees is not None:
            # Every cell is scored on its own: all tasks go through the trees at once.
            answered = np.split(tree_scores(trees, tasks.points), tasks.offsets[1:-1])
        else:
            scores, attributes = scorer(self.solver, self.task_map)
            new = NewTasks(
                tasks=tasks,
                embedding=emb,
                task_similarity=task_similarity(self.task_kernel_, sq_new, self.task_gamma_),
                params=KernelParameters(self.point_bandwidth_, self.tau_, self.task_gamma_),
                maps=self._feature_maps(),
            )
            # Read leniently, as task_basis_ always was: a missing attribute reads None.
            answered = scores({name: getattr(self, name, None) for name in attributes}, new)
        blend = getattr(self, "blend_", None)
        if blend is not None:
            if getattr(blend, "shares_task_view_", False):
                partner = blend._model_scores(raw, tasks, emb, sq_new)
            else:  # models saved before the partner recorded it
                partner = blend._primary_scores(raw)
            answered = [(a + b) / 2.0 for a, b in zip(answered, partner, strict=True)]
        return answered

    def _primary_scores(self, raw: Bags) -> list[NDArray[np.float64]]:
        """The primary model's scores of ``raw``, whatever their range (no fallback,
        refinement or reject rule; a blend averaged)."""
        tasks = self._normalise(raw)
        emb, sq_new = self._task_similarities(tasks)
        return self._model_scores(raw, tasks, emb, sq_new)

    def _calibrated(
        self, raw: Bags, reports: list[TaskReport]
    ) -> tuple[Bags, dict[int, TaskReport]]:
        """``raw`` with the tasks ``calibration_`` calibrates calibrated to the training
        reference (:mod:`.calibration`), and those tasks' reports."""
        how = getattr(self, "calibration_", "none")
        if how == "none":
            return raw, {}
        if how != "landmarks":
            return mapped_out_of_range(
                raw, reports, how, self.calibration_quantiles_, self.calibration_points_, self.seed_
            )
        landmarks = Landmarks(
            self.landmark_centres_,
            getattr(self, "landmark_spread_", None),
            self.rest_code_,
            self.landmark_scale_,
            self.landmark_threshold_,
        )
        has_fallback = getattr(self, "fallback_", None) is not None
        return landmarks_calibrated(
            raw, reports, self._primary_scores, landmarks, has_fallback, self.seed_
        )

    def _disagreement(self, a: NDArray[np.float64], b: NDArray[np.float64]) -> float:
        """Share of points labelled differently from scores ``a`` and ``b`` (classifiers),
        or the root mean square difference of the values (regressors)."""
        if self._is_classifier:
            return float(np.mean(self._decode(a) != self._decode(b)))
        return float(np.sqrt(np.mean((a - b) ** 2)))

    @staticmethod
    def _squeeze(s: NDArray[np.float64]) -> NDArray[np.float64]:
        return s[:, 0] if s.shape[1] == 1 else s

    def domain_report(self, reports: list[TaskReport]) -> DomainReport:
        """The :class:`~core.domain.DomainReport` of tasks from their :class:`TaskReport`
        (:func:`~.reports.domain_report`)."""
        return domain_report(reports, self.task_sq_distances_)

    def domain_check(self, X: Any, control: ArrayLike | None = None) -> DomainReport:
        """How far each new task lies from the training tasks (:meth:`domain_report`)."""
        return self.domain_report(self.task_report(X, control))

    def task_report(self, X: Any, control: ArrayLike | None = None) -> list[TaskReport]:
        """Each new task's :class:`TaskReport`; where a fallback, a refinement or a
        calibration takes part, the tasks are scored as :meth:`predict` scores them."""
        check_is_fitted(self, "tau_")
        fallback = getattr(self, "fallback_", None)
        refines = getattr(self, "refine_", "none") == "mixture" or (
            fallback is not None and getattr(fallback, "refine_", "none") == "mixture"
        )
        calibrates = getattr(self, "calibration_", "none") != "none" or control is not None
        if getattr(self, "disagreement_threshold_", None) is not None or refines or calibrates:
            return self._scores_per_task(_as_tasks(X), control)[1]
        return self._reports(self._task_similarities(self._normalise(_as_tasks(X)))[1])

    def predict_tasks(self, X: Any, control: ArrayLike | None = None) -> list[TaskPrediction]:
        """Per task: a prediction for every point, the scores, and the :class:`TaskReport`
        (``control``: the reference control measured in the tasks' batch, for a model
        fitted with the training batch's)."""
        scores, reports = self._scores_per_task(_as_tasks(X), control)
        return [
            TaskPrediction(self._decode(s), self._squeeze(s), r)
            for s, r in zip(scores, reports, strict=True)
        ]

    def predict(self, X: Any, control: ArrayLike | None = None) -> NDArray[Any]:
        """A label (or value) for every point of the tasks, task after task."""
        scores, _ = self._scores_per_task(_as_tasks(X), control)
        return self._decode(np.concatenate(scores))


class MarginalTransferClassifier(ClassifierMixin, _MarginalTransfer):
    """A per-cell classifier saved by the design before issue 44, loaded.

    Scores are the one-vs-rest ridge (or hinge) codes ``±1``: one column for two
    classes (positive means ``classes_[1]``), else one per class.
    """

    _is_classifier = True

    def _decode(self, scores: NDArray[np.float64]) -> NDArray[Any]:
        if scores.shape[1] == 1:
            return self.classes_[(scores[:, 0] > 0).astype(int)]
        return self.classes_[np.argmax(scores, axis=1)]

    def decision_function(self, X: Any, control: ArrayLike | None = None) -> NDArray[np.float64]:
        """Scores per point: ``(n_points,)`` for two classes, else
        ``(n_points, n_classes)``."""
        scores, _ = self._scores_per_task(_as_tasks(X), control)
        return self._squeeze(np.concatenate(scores))

    def decode_scores(self, scores: NDArray[np.float64]) -> NDArray[Any]:
        """The labels of scores as :meth:`decision_function` gives them."""
        s = np.asarray(scores, dtype=np.float64)
        return self._decode(s[:, None] if s.ndim == 1 else s)

    def far_from_populations(
        self,
        X: Any,
        labels: NDArray[Any],
        level: float = 0.999,
        control: ArrayLike | None = None,
    ) -> NDArray[np.bool_]:
        """Whether each cell lies beyond the χ² quantile ``level`` of squared Mahalanobis
        distance from the training population it was labelled with (on the cells as
        the model sees them: mapped by ``control``, normalised); cells of the rest
        class are never far."""
        check_is_fitted(self, "population_means_")
        raw, _ = mapped_by_control(
            _as_tasks(X),
            control,
            getattr(self, "control_quantiles_", None),
            getattr(self, "control_scale_", None),
        )
        tasks = self._normalise(raw)
        labels = np.asarray(labels)
        if labels.shape[0] != tasks.n_points:
            raise BagValidationError(
                [f"got {labels.shape[0]} label(s) for {tasks.n_points} point(s)"]
            )
        codes = np.searchsorted(self.classes_, labels)
        return far_from_populations(
            tasks.points, codes, self.population_means_, self.population_precisions_, level
        )


class MarginalTransferRegressor(RegressorMixin, _MarginalTransfer):
    """A per-cell regressor saved by the design before issue 44, loaded."""

    def _decode(self, scores: NDArray[np.float64]) -> NDArray[np.float64]:
        return scores[:, 0] if self.y_ndim_ == 1 else scores
