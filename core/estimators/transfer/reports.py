"""What the marginal-transfer models say about each new task besides its labels.

:class:`TaskReport` tells how a new task relates to the training tasks (distance,
similarity, out of range, which model answered, how much a refinement changed, whether
it was calibrated); :class:`TaskPrediction` carries it with the task's labels and scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ...alignment import MarkerQuality
from ...domain import NEAREST, DomainReport

__all__ = ["TaskPrediction", "TaskReport", "calibration_arrays", "domain_report", "task_report"]


@dataclass(frozen=True)
class TaskReport:
    """How a new task relates to the training tasks.

    Attributes
    ----------
    nearest_tasks : ndarray of int
        Training tasks sorted by decreasing similarity (at most 3).
    similarities : ndarray of float
        ``k_P`` to those tasks (1 = identical embedding, → 0 far away).
    distance : float
        Hilbertian embedding distance to the nearest training task.
    out_of_range : bool
        ``distance`` exceeds ``range_factor`` times the largest nearest-neighbour
        distance among the training tasks: the task is unlike every training task,
        and a ``τ > 0`` model answers with its pooled part there. With a fallback,
        also when ``disagreement`` exceeds ``range_factor`` times what the two
        models' cross-validation errors allow on tasks like the training ones. Also
        when the task's landmark map, past the gate, was refused
        (``calibration.refused``): it shows an instrument the model did not undo.
        Also when a marker of the task is not measured as the training batch
        measures it (:func:`~.reference.suspect_markers`): its cells all read one
        value on it (the training cells vary on every marker,
        :func:`~.inputs.check_training_spread`), it is an affine copy of another
        marker (the same channel read twice), or a cell lies beyond a thousand
        training standard deviations on it. No calibration can find the scale of
        the first two, the third inflates the sample's moments, and the task's
        distance says nothing of any (such samples were labelled about half right,
        as in range).
    fallback : bool
        The task was out of range and was answered by the model's invariant
        fallback (``normalise="auto"`` only: a model of per-task standardised tasks,
        see :class:`MarginalTransferClassifier`).
    disagreement : float or None
        How differently the primary model and the fallback answer the task: the
        share of its points they label differently (classifiers), or the root mean
        square difference of their values (regressors). ``None`` without a fallback,
        or where only the fallback was asked (the task was already out of range).
    relabelled : float or None
        Share of the task's points whose label the per-task mixture changed (the
        model that answered refines, ``refine_ == "mixture"``); ``None`` where no
        refinement ran.
    calibrated : str or None
        How the task, out of range, was calibrated to the training reference before
        the primary model answered it (``calibration_``: ``"quantile"`` or ``"mmd"``),
        or ``"control"`` where its batch's reference control mapped it before any
        model saw it; ``None`` where it was not. Without a control, the distance and
        the flag are the task's own, as it arrived; with one, the mapped task's.
    calibration : MarkerQuality or None
        With a control or landmarks (``by`` says which): per marker, how far the map
        moved this task's cells, and the distance to the training batch before and
        after the map, the control's on cells it was not fitted on or the task's
        populations' to the training populations' places (``worse``: the markers it
        made worse, or that refused a landmark map where the task was left as
        measured).
    shift : float or None
        How far the calibration moved the task (the largest over markers of a cell's
        median displacement, in training standard deviations;
        :func:`~.calibration.shift`). Beyond what the drawn instruments needed
        (times ``range_factor``), the task is out of range however it looks once
        calibrated. ``None`` for models before issue 44.
    suspect : ndarray of bool, shape (d,), or None
        The markers not measured as the training batch measures them
        (:func:`~.reference.suspect_markers`, which put the task out of range):
        which channel a lab should look at. ``None`` for models without the check.
    """

    nearest_tasks: NDArray[np.int64]
    similarities: NDArray[np.float64]
    distance: float
    out_of_range: bool
    fallback: bool = False
    disagreement: float | None = None
    relabelled: float | None = None
    calibrated: str | None = None
    calibration: MarkerQuality | None = None
    shift: float | None = None
    suspect: NDArray[np.bool_] | None = None


@dataclass
class TaskPrediction:
    """Labels (or values) and scores of every point of one task, plus its report."""

    predictions: NDArray[Any]
    scores: NDArray[np.float64]
    report: TaskReport = field(repr=False)


def calibration_arrays(reports: list[TaskReport]) -> dict[str, Any]:
    """The :class:`~core.domain.DomainReport` fields of how tasks were calibrated:
    by which calibration each, with a control or landmarks how the map moved each
    marker and which it made worse, and the markers not measured as the training
    batch measures them."""
    out: dict[str, Any] = {"calibrated": np.array([r.calibrated or "" for r in reports])}
    if any(r.shift is not None for r in reports):
        out["calibration_shift"] = np.array(
            [np.nan if r.shift is None else r.shift for r in reports]
        )
    if reports and all(r.suspect is not None for r in reports):
        out["suspect_markers"] = np.array([r.suspect for r in reports])
    if reports and all(r.calibration is not None for r in reports):
        out["calibration_moved"] = np.array([r.calibration.moved for r in reports])
        out["calibration_worse"] = np.array([r.calibration.worse for r in reports])
        out["calibration_by"] = np.array([r.calibration.by for r in reports])
        out["calibration_refused"] = np.array([r.calibration.refused for r in reports])
    return out


def task_report(
    task_map: Any,
    sq: NDArray[np.float64],
    how: str,
    quality: Any,
    moved: float,
    limit: float,
    suspect: NDArray[np.bool_] | None = None,
) -> TaskReport:
    """A new task's report from its squared embedding distances ``sq`` to the training
    tasks (:class:`~.task_map.TaskMap`), the calibration it had, that calibration's
    quality and shift ``moved``, the largest shift in range (``limit``), and the
    markers not measured as the training batch measures them (``suspect``,
    :func:`~.reference.suspect_markers`): with one, the task is out of range."""
    dist = np.sqrt(sq)
    order = np.argsort(dist, kind="stable")[:3]
    return TaskReport(
        nearest_tasks=order,
        similarities=np.exp(-task_map.gamma * sq[order]),
        distance=float(dist[order[0]]),
        out_of_range=bool(
            dist[order[0]] > task_map.range_threshold
            or moved > limit
            or (quality is not None and quality.refused)
            or (suspect is not None and suspect.any())
        ),
        calibrated=None if how == "none" else how,
        calibration=quality,
        shift=moved,
        suspect=suspect,
    )


def domain_report(reports: list[TaskReport], distance_scale: float) -> DomainReport:
    """The :class:`~core.domain.DomainReport` of tasks from their reports: the distance
    to the nearest training task in units of ``distance_scale`` (the median such
    distance among the training tasks), and the out-of-range flag."""
    nearest = np.full((len(reports), NEAREST), -1, dtype=np.int64)
    sims = np.zeros((len(reports), NEAREST))
    for i, r in enumerate(reports):
        nearest[i, : r.nearest_tasks.size] = r.nearest_tasks[:NEAREST]
        sims[i, : r.similarities.size] = r.similarities[:NEAREST]
    distance = np.array([r.distance for r in reports], dtype=np.float64)
    return DomainReport(
        score=distance / distance_scale,
        out_of_range=np.array([r.out_of_range for r in reports], dtype=bool),
        nearest=nearest,
        similarities=sims,
        distance=distance,
        **calibration_arrays(reports),
    )
