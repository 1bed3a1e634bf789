"""Marginal transfer (issue 44): calibrate every sample, then label its cells.

The estimators compose plain parts with explicit inputs and outputs: :mod:`.calibration`,
:mod:`.task_map`, :mod:`.cell_models`, :mod:`.search`, :mod:`.open_set` (the guide page
``docs/guide/marginal-transfer.md`` says how they fit together and what was removed).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from ...bags import BagValidationError
from ...blas import one_thread
from ...domain import DomainReport
from ...explanations.result import Explanation
from .calibration import calibrate, fit_control, landmark_gain_limit, shift, standardised
from .cell_models import cell_scores, fit_cell_model
from .envelope import shift_envelope
from .explain import explain_task
from .inputs import (
    as_task_list,
    check_parameters,
    check_training_spread,
    concatenated_labels,
    control_cells,
    one_vs_rest_codes,
    regression_targets,
    rest_code,
    seed_of,
)
from .landmarks import REFUSAL_SHARE
from .open_set import apply_reject, far_from_populations, population_statistics
from .reference import SD_FLOOR, Reference, fit_reference, suspect_markers
from .reports import TaskPrediction, TaskReport, domain_report, task_report
from .search import Problem, Selection, candidates, choose, without_control
from .task_map import TaskMap, fit_task_map

__all__ = ["MarginalTransferClassifier", "MarginalTransferRegressor"]


class _MarginalTransfer(BaseEstimator):
    """Shared implementation; see :class:`MarginalTransferClassifier`."""

    _is_classifier = False

    def __init__(
        self,
        *,
        calibrate: str = "auto",
        cell_model: str = "auto",
        unassigned: Any = None,
        cv: int = 3,
        cv_points: int = 500,
        perturbations: int = 6,
        n_components: int = 128,
        embedding_points: int = 500,
        range_factor: float = 1.5,
        random_state: Any = None,
    ):
        self.calibrate = calibrate
        self.cell_model = cell_model
        self.unassigned = unassigned
        self.cv = cv
        self.cv_points = cv_points
        self.perturbations = perturbations
        self.n_components = n_components
        self.embedding_points = embedding_points
        self.range_factor = range_factor
        self.random_state = random_state

    # ================================================================= fitting
    def fit(
        self,
        X: Any,
        y: ArrayLike,
        groups: ArrayLike | None = None,
        control: ArrayLike | None = None,
    ) -> _MarginalTransfer:
        """Fit on labelled training tasks.

        Parameters
        ----------
        X : Bags, list of (cells x markers) arrays, or one 2-D array (one task)
        y : labels (or values) of every cell, concatenated task after task, or a
            list with one array per task
        groups : array-like of shape (n_tasks,), optional
            The batch of each task: with two or more, the search leaves one batch out
            (the real shift) instead of drawing instruments, and the landmark gate's
            limit holds each task out of its own batch only.
        control : array-like of shape (m, d), optional
            The training batch's reference control: a new batch's control then maps
            its samples onto the training batch (``predict_tasks(..., control=)``).
        """
        check_parameters(self, self._is_classifier)
        tasks = as_task_list(X)
        check_training_spread(tasks)
        Y = self._encode(concatenated_labels(y, tasks))
        d = tasks[0].shape[1]
        g = None if groups is None else np.asarray(groups)
        if g is not None and g.shape != (len(tasks),):
            raise BagValidationError([f"groups has {g.shape[0]} entries for {len(tasks)} tasks"])
        cells = None if control is None else control_cells(control, d)
        if cells is not None and g is not None and np.unique(g).size > 1:
            raise ValueError(
                "a reference control belongs to one batch: fit with groups of one batch, "
                "or without the control"
            )
        codes = np.argmax(Y, axis=1) if self._is_classifier else None
        rest = self._rest_code()
        calibrations, models = candidates(
            self.calibrate, self.cell_model, self._is_classifier, cells is not None
        )
        seed = seed_of(self.random_state)
        with one_thread():
            gain_limit = None
            if "landmarks" in {without_control(c, self._is_classifier) for c in calibrations}:
                gain_limit = landmark_gain_limit(tasks, codes, self.cv, seed, self.range_factor, g)
            if len(calibrations) * len(models) > 1:
                problem = Problem(
                    tasks, Y, codes, rest, cells, g, calibrations, models, self.cv,
                    self.cv_points, self.perturbations, self.n_components,
                    self.embedding_points, gain_limit, seed,
                )  # fmt: skip
                selection = choose(problem)
            else:
                fixed = calibrations[0]
                without = without_control(fixed, self._is_classifier)
                selection = Selection(fixed, without, models[0], None)
            self._fit_final(tasks, Y, codes, rest, cells, selection, seed, gain_limit)
        self.n_features_in_ = d
        return self

    def _fit_final(
        self,
        tasks: list[NDArray[np.float64]],
        Y: NDArray[np.float64],
        codes: NDArray[np.int64] | None,
        rest: int | None,
        control: NDArray[np.float64] | None,
        selection: Selection,
        seed: int,
        gain_limit: float | None,
    ) -> None:
        reference = fit_reference(tasks, codes, control, gain_limit, REFUSAL_SHARE)
        floor = SD_FLOOR * reference.sd
        standard = selection.calibration == "standardise"
        cells = [standardised(x, floor) for x in tasks] if standard else tasks
        task_map = fit_task_map(
            cells, self.n_components, self.embedding_points, self.range_factor, seed
        )
        self.reference_ = reference.as_state()
        used = tuple(dict.fromkeys([selection.calibration, selection.calibration_without_control]))
        envelope = shift_envelope(tasks, reference, used, control, self.perturbations, seed)
        self.shift_limits_ = {c: self.range_factor * v for c, v in envelope.items()}
        self.task_map_ = task_map.as_state()
        self.cell_model_ = fit_cell_model(
            selection.cell_model, cells, Y, task_map, self._is_classifier, seed
        )
        self.calibration_ = selection.calibration
        self.calibration_without_control_ = selection.calibration_without_control
        self.reject_threshold_ = selection.reject_threshold
        self.selection_ = selection.record()
        self.seed_ = seed
        if self._is_classifier:
            self.population_means_, self.population_precisions_ = population_statistics(
                np.vstack(cells), codes, int(Y.shape[1]), rest
            )

    def _rest_code(self) -> int | None:
        return None

    # ================================================================= answering
    def _parts(self) -> tuple[Reference, TaskMap]:
        check_is_fitted(self, "cell_model_")
        return Reference.from_state(self.reference_), TaskMap.from_state(self.task_map_)

    def _calibrated(
        self, X: Any, control: ArrayLike | None
    ) -> tuple[list[NDArray[np.float64]], list[Any], list[str]]:
        """The tasks in the cell model's space, each one's calibration quality (with a
        control), shift (:func:`.calibration.shift`) and markers not measured as the
        training batch measures them (:func:`.reference.suspect_markers`), and each
        one's calibration: the model's own (or its best without a control where the
        batch's is not given), or none where its landmarks show no instrument
        (:func:`.calibration.calibrate`)."""
        reference, _ = self._parts()
        tasks = as_task_list(X)
        bad = [f"task {i}: {t.shape[1]} marker column(s), the model has {self.n_features_in_}"
               for i, t in enumerate(tasks) if t.shape[1] != self.n_features_in_]  # fmt: skip
        if bad:
            raise BagValidationError(bad)
        how = self.calibration_
        if control is None and how == "control":
            how = self.calibration_without_control_
        fitted = None
        if control is not None:
            cells = control_cells(control, self.n_features_in_, reference.control_scale)
            # The map is fitted where it is used; a model without a training control
            # refuses a batch's control whatever it was to calibrate by.
            if how == "control" or reference.control_quantiles is None:
                fitted = fit_control(cells, reference)
        out = [calibrate(how, x, reference, fitted) for x in tasks]
        ran = [r for _, _, r in out]
        moved = [shift(r, x, z, reference) for x, (z, _, r) in zip(tasks, out, strict=True)]
        suspect = [suspect_markers(x, reference) for x in tasks]
        return (
            [z for z, _, _ in out],
            [(q, m, f) for (_, q, _), m, f in zip(out, moved, suspect, strict=True)],
            ran,
        )

    def _scores_per_task(
        self, X: Any, control: ArrayLike | None
    ) -> tuple[list[NDArray[np.float64]], list[NDArray[np.int64]], list[TaskReport]]:
        _, task_map = self._parts()
        tasks, qualities, how = self._calibrated(X, control)
        emb = task_map.embed(tasks)
        sq = task_map.sq_distances(emb)
        psi = task_map.context_at(sq)
        scores, codes, reports = [], [], []
        with one_thread():
            for i, z in enumerate(tasks):
                s = cell_scores(self.cell_model_, z, task_map, psi[i], self._is_classifier)
                scores.append(s)
                codes.append(self._codes(s))
                quality, moved, suspect = qualities[i]
                limit = self.shift_limits_.get(how[i], np.inf)
                reports.append(task_report(task_map, sq[i], how[i], quality, moved, limit, suspect))
        return scores, codes, reports

    def _codes(self, s: NDArray[np.float64]) -> NDArray[np.int64]:
        return np.zeros(0, dtype=np.int64)

    def domain_report(self, reports: list[TaskReport]) -> DomainReport:
        """The :class:`~core.domain.DomainReport` of tasks from their reports
        (:func:`.reports.domain_report`)."""
        return domain_report(reports, self._parts()[1].distance_scale)

    def task_report(self, X: Any, control: ArrayLike | None = None) -> list[TaskReport]:
        """Each new task's :class:`TaskReport` (as :meth:`predict_tasks` reports it)."""
        return self._scores_per_task(X, control)[2]

    def domain_check(self, X: Any, control: ArrayLike | None = None) -> DomainReport:
        """How far each new task lies from the training tasks (:meth:`domain_report`)."""
        return self.domain_report(self.task_report(X, control))

    def predict_tasks(self, X: Any, control: ArrayLike | None = None) -> list[TaskPrediction]:
        """Per task: a prediction for every cell, the scores, and the :class:`TaskReport`.

        ``control``: the reference control measured in the tasks' batch, for a model
        fitted with the training batch's: every task is mapped by it first, and its
        report says how (:attr:`TaskReport.calibration`)."""
        scores, codes, reports = self._scores_per_task(X, control)
        return [
            TaskPrediction(self._decode(s, c), self._squeeze(s), r)
            for s, c, r in zip(scores, codes, reports, strict=True)
        ]

    def predict(self, X: Any, control: ArrayLike | None = None) -> NDArray[Any]:
        """A label (or value) for every cell, task after task."""
        return np.concatenate([t.predictions for t in self.predict_tasks(X, control)])

    def explain(
        self, X: Any, *, control: ArrayLike | None = None, markers: ArrayLike | None = None
    ) -> Explanation:
        """Which cells moved one sample's answer (its shares of cells per class, or their
        mean value), cell by cell (:func:`.explain.explain_task`)."""
        tasks, _, _ = self._calibrated(X, control)
        if len(tasks) != 1:
            raise BagValidationError([f"explain takes one sample, got {len(tasks)}"])
        with one_thread():
            return explain_task(
                as_task_list(X)[0], tasks[0], self._parts()[1], self.cell_model_,
                self._codes if self._is_classifier else None,
                getattr(self, "classes_", None), markers,
            )  # fmt: skip


class MarginalTransferClassifier(ClassifierMixin, _MarginalTransfer):
    """Label every cell of a new, unlabelled sample from labelled training samples.

    Each sample is first calibrated to the training batch (:mod:`.calibration`:
    ``"none"``, ``"standardise"``, ``"control"`` from the batch's reference control,
    or ``"landmarks"`` from its populations), then every cell is labelled by the cell
    model (:mod:`.cell_models`: a pooled LDA, the marginal-transfer kernel of paper
    004, or boosted trees). Both are chosen by folds that hold out training samples
    and pass them through drawn instruments (:mod:`.search`); the guide page
    ``docs/guide/marginal-transfer.md`` explains each part and the benchmark behind it.

    Parameters
    ----------
    calibrate : {"auto", "control", "landmarks", "standardise", "none"}, default="auto"
        ``"auto"``: chosen by the folds (``"control"`` only for a model fitted with a
        control; with one, the best calibration without a control is kept too and
        used for a batch whose control is not given).
    cell_model : {"auto", "linear", "kernel", "trees"}, default="auto"
    unassigned : label or None
        The rest label (cells no gate claims): a class while fitting; at prediction a
        cell also joins it where no population's score reaches the threshold the
        folds chose (``reject_threshold_``, None: no rule; :mod:`.open_set`).
    cv : int, default=3
        Folds of training samples (with one batch).
    cv_points : int, default=500
        Cells per sample in the folds (a seeded draw), training and held out.
    perturbations : int, default=6
        Instruments drawn per held-out sample.
    n_components : int, default=128
        Random Fourier features of the cell kernel and the task embedding.
    embedding_points : int, default=500
        Cells per task its embedding is computed from.
    range_factor : float, default=1.5
        A task is out of range beyond this factor times the largest nearest-task
        distance among the training tasks.
    random_state : int, Generator or None

    Attributes
    ----------
    classes_, calibration_, calibration_without_control_, cell_model_ (the fitted
    cell model's arrays), reject_threshold_, selection_ (the search's record),
    reference_, task_map_, population_means_, population_precisions_
    """

    _is_classifier = True

    def _encode(self, y: NDArray[Any]) -> NDArray[np.float64]:
        self.classes_, Y = one_vs_rest_codes(y)
        return Y

    def _rest_code(self) -> int | None:
        return rest_code(self.classes_, self.unassigned)

    def _codes(self, s: NDArray[np.float64]) -> NDArray[np.int64]:
        rest = self._rest_code()
        threshold = getattr(self, "reject_threshold_", None)
        if rest is None:
            return np.argmax(s, axis=1)
        return apply_reject(s, rest, threshold)

    def _decode(self, s: NDArray[np.float64], codes: NDArray[np.int64]) -> NDArray[Any]:
        return self.classes_[codes]

    def _squeeze(self, s: NDArray[np.float64]) -> NDArray[np.float64]:
        return s[:, 1] if s.shape[1] == 2 else s

    def decision_function(self, X: Any, control: ArrayLike | None = None) -> NDArray[np.float64]:
        """Scores per cell: ``(n,)`` for two classes (positive means ``classes_[1]``),
        else ``(n, n_classes)``, in the ±1 coding."""
        return np.concatenate([t.scores for t in self.predict_tasks(X, control)])

    def decode_scores(self, scores: NDArray[np.float64]) -> NDArray[Any]:
        """The labels of scores as :meth:`decision_function` gives them."""
        s = np.asarray(scores, dtype=np.float64)
        full = np.column_stack([-s, s]) if s.ndim == 1 else s
        return self.classes_[self._codes(full)]

    def far_from_populations(
        self,
        X: Any,
        labels: NDArray[Any],
        level: float = 0.999,
        control: ArrayLike | None = None,
    ) -> NDArray[np.bool_]:
        """Whether each cell lies beyond the χ² quantile ``level`` of squared
        Mahalanobis distance from the population it was labelled with, measured on
        the calibrated cells as the model saw them (:func:`.open_set.far_from_populations`)."""
        tasks, _, _ = self._calibrated(X, control)
        points = np.vstack(tasks)
        labels = np.asarray(labels)
        if labels.shape[0] != points.shape[0]:
            raise BagValidationError(
                [f"got {labels.shape[0]} label(s) for {points.shape[0]} point(s)"]
            )
        codes = np.searchsorted(self.classes_, labels)
        return far_from_populations(
            points, codes, self.population_means_, self.population_precisions_, level
        )


class MarginalTransferRegressor(RegressorMixin, _MarginalTransfer):
    """Predict a value for every cell of a new sample from labelled training samples:
    as :class:`MarginalTransferClassifier` with a ridge (``"linear"``) or the
    marginal-transfer kernel ridge (``"kernel"``) as cell model, scored by the root
    mean square error; no landmarks (they need populations) and no trees."""

    def _encode(self, y: NDArray[Any]) -> NDArray[np.float64]:
        Y = regression_targets(y)
        self.y_ndim_ = np.ndim(y)
        return Y

    def _decode(self, s: NDArray[np.float64], codes: NDArray[np.int64]) -> NDArray[np.float64]:
        return s[:, 0] if self.y_ndim_ == 1 else s

    def _squeeze(self, s: NDArray[np.float64]) -> NDArray[np.float64]:
        return s[:, 0] if self.y_ndim_ == 1 else s
