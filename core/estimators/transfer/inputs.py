"""What the marginal-transfer estimators accept: their parameters, checked in one
place (scikit-learn's parameter-constraint convention), and their data: tasks, labels
and a batch's reference control, each refused with a message naming the problem."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ...alignment import CONTROL_LEVELS
from ...bags import Bags, BagValidationError, as_bags
from .calibration import CALIBRATIONS
from .cell_models import CELL_MODELS
from .reference import SD_FLOOR

__all__ = [
    "LARGEST_VALUE",
    "as_task_list",
    "check_parameters",
    "check_training_spread",
    "concatenated_labels",
    "control_cells",
    "one_vs_rest_codes",
    "regression_targets",
    "rest_code",
    "seed_of",
]

#: Each parameter's check, in one place: (accepted values or a predicate, what to say).
CONSTRAINTS: dict[str, tuple[Any, str]] = {
    "calibrate": (("auto", *CALIBRATIONS), f"'auto' or one of {CALIBRATIONS}"),
    "cell_model": (("auto", *CELL_MODELS), f"'auto' or one of {CELL_MODELS}"),
    "cv": (lambda v: isinstance(v, int) and v >= 2, "an integer >= 2"),
    "cv_points": (lambda v: isinstance(v, int) and v >= 50, "an integer >= 50"),
    "perturbations": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "n_components": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "embedding_points": (lambda v: isinstance(v, int) and v >= 2, "an integer >= 2"),
    "range_factor": (lambda v: isinstance(v, int | float) and v > 0, "a number > 0"),
}


#: The largest magnitude of a value the estimators compute on: float32's, the widest
#: an FCS file stores. Beyond about 1e154 a square overflows: the moments, the landmark
#: map and the cell models' products turned such a sample into NaN or Inf scores (or a
#: refusal that blamed NaN the sample did not hold).
LARGEST_VALUE = float(np.finfo(np.float32).max)


def _too_large(cells: NDArray[np.float64], what: str) -> list[str]:
    """A sentence per marker column of ``cells`` holding a value beyond
    :data:`LARGEST_VALUE`, naming ``what`` holds it."""
    # Column extremes first: no cells-sized temporary on a sample of 10^6 cells that
    # is, as nearly every one is, within range.
    high, low = cells.max(axis=0), cells.min(axis=0)
    columns = np.flatnonzero((high > LARGEST_VALUE) | (low < -LARGEST_VALUE))
    return [
        f"{what}, column {j}: {np.count_nonzero(np.abs(cells[:, j]) > LARGEST_VALUE)} "
        f"value(s) beyond ±{LARGEST_VALUE:.3g} (the largest {max(high[j], -low[j]):.3g}); "
        "no measurement is that large (float32's range, as FCS stores it)"
        for j in columns
    ]


def as_task_list(X: Any) -> list[NDArray[np.float64]]:
    """Tasks as a list of (cells x markers) float arrays; one 2-D array is one task.
    A task of a single cell, or with a value beyond :data:`LARGEST_VALUE`, is named."""
    if isinstance(X, np.ndarray) and X.ndim == 2:
        X = [X]
    bags: Bags = as_bags(X)
    tasks = [np.asarray(bags[i], dtype=np.float64) for i in range(len(bags))]
    problems = [f"task {i}: a single cell" for i, n in enumerate(bags.sizes) if n < 2]
    for i, x in enumerate(tasks):
        problems += _too_large(x, f"task {i}")
    if problems:
        raise BagValidationError(problems)
    return tasks


#: A training marker must span more than this many of float32's steps at its level.
LEAST_STEPS = 16


def check_training_spread(tasks: list[NDArray[np.float64]]) -> None:
    """Refuse training tasks on which a marker column does not vary: every training
    cell at one value, or within :data:`LEAST_STEPS` of float32's steps at that
    value (its smallest normal step near zero). Such a marker tells no cell from
    another, and no spread is there to calibrate a new sample's by: scikit-learn's
    LDA failed with an IndexError where no marker varied, and a model fitted with one
    flagged every new sample that read one value on it too. A marker read about 1e8
    times its spread from zero, which no FCS file can store, lost its populations to
    rounding in the landmark map (its scales 4 % off the same cells read near zero).

    Raises
    ------
    BagValidationError
        Naming each such column, its value range and what is expected.
    """
    low = np.min([x.min(axis=0) for x in tasks], axis=0)
    high = np.max([x.max(axis=0) for x in tasks], axis=0)
    least = np.maximum(
        float(np.finfo(np.float32).tiny),
        LEAST_STEPS * np.spacing(np.maximum(np.abs(low), np.abs(high)).astype(np.float32)),
    )
    problems = [
        f"column {j}: every training cell reads {low[j]:.6g}"
        + ("" if high[j] == low[j] else f" to {high[j]:.6g}")
        + f" (a spread of at most {least[j]:.3g}, {LEAST_STEPS} float32 steps at that "
        "level); a marker must vary across the training cells to tell them apart: "
        "leave it out of the panel"
        for j in np.flatnonzero(high - low <= least)
    ]
    if problems:
        raise BagValidationError(problems)


def control_cells(
    control: ArrayLike, dim: int, scale: NDArray[np.float64] | None = None
) -> NDArray[np.float64]:
    """A batch's reference control as cells x ``dim`` markers, enough for the quantile
    map's levels, finite, and spread on every marker between its outer levels: more
    than :data:`~.reference.SD_FLOOR` times ``scale`` (the training control's standard
    deviation; without it, more than float32's smallest normal step). A control
    piled on one value maps a whole range of its batch's cells onto one value, or
    one value onto a range: its samples were moved by 6e8 training standard
    deviations."""
    cells = np.asarray(control, dtype=np.float64)
    if cells.ndim != 2 or cells.shape[1] != dim:
        raise BagValidationError(
            [f"the control has shape {cells.shape}; the samples have {dim} markers"]
        )
    if cells.shape[0] < 2 * CONTROL_LEVELS.size:
        raise BagValidationError(
            [
                f"the reference control has {cells.shape[0]} cells; at least "
                f"{2 * CONTROL_LEVELS.size} cells are needed ({CONTROL_LEVELS.size} "
                "quantile levels)"
            ]
        )
    if not np.isfinite(cells).all():
        raise BagValidationError(["the reference control contains NaN or Inf"])
    problems = _too_large(cells, "the reference control")
    ends = np.quantile(cells, CONTROL_LEVELS[[0, -1]], axis=0)
    least = np.finfo(np.float32).tiny if scale is None else SD_FLOOR * np.asarray(scale)
    problems += [
        f"the reference control, column {j}: its cells between the "
        f"{100 * CONTROL_LEVELS[0]:g} % and {100 * CONTROL_LEVELS[-1]:g} % quantiles read "
        f"{ends[0, j]:.6g}"
        + ("" if ends[1, j] == ends[0, j] else f" to {ends[1, j]:.6g}")
        + "; a control must vary on every marker to map it onto the training batch's"
        for j in np.flatnonzero(ends[1] - ends[0] <= least)
    ]
    if problems:
        raise BagValidationError(problems)
    return cells


def check_parameters(estimator: Any, classifier: bool) -> None:
    """Refuse a parameter of ``estimator`` outside :data:`CONSTRAINTS`, naming it, what
    it must be and what it is, and a regressor's parameters that need classes."""
    for name, (rule, expected) in CONSTRAINTS.items():
        value = getattr(estimator, name)
        if not (rule(value) if callable(rule) else value in rule):
            raise ValueError(f"{name} must be {expected}, got {value!r}")
    if classifier:
        return
    if estimator.calibrate == "landmarks" or estimator.cell_model == "trees":
        raise ValueError("calibrate='landmarks' and cell_model='trees' need classes")
    if estimator.unassigned is not None:
        raise ValueError("unassigned names a rest label: classifiers only")


def concatenated_labels(y: ArrayLike, tasks: list[NDArray[np.float64]]) -> NDArray[Any]:
    """Every cell's label (or target), task after task, from one array or a list of one
    per task; a count that does not match the cells is named."""
    sizes = [t.shape[0] for t in tasks]
    if isinstance(y, list | tuple) and len(y) == len(tasks) and all(np.ndim(v) >= 1 for v in y):
        problems = [
            f"task {t}: {len(v)} label(s) for {n} point(s)"
            for t, (v, n) in enumerate(zip(y, sizes, strict=True))
            if len(v) != n
        ]
        if problems:
            raise BagValidationError(problems)
        y = np.concatenate([np.asarray(v) for v in y])
    y = np.asarray(y)
    if y.shape[0] != sum(sizes):
        raise BagValidationError(
            [f"got {y.shape[0]} label(s) for {sum(sizes)} point(s) in {len(tasks)} task(s)"]
        )
    return y


def one_vs_rest_codes(y: NDArray[Any]) -> tuple[NDArray[Any], NDArray[np.float64]]:
    """The classes of cell labels ``y`` and their one-vs-rest ±1 codes (cells x
    classes, two columns for two classes)."""
    if y.ndim != 1:
        raise BagValidationError([f"labels must be 1-D (one per point), got shape {y.shape}"])
    classes, codes = np.unique(y, return_inverse=True)
    if classes.size < 2:
        raise BagValidationError([f"need at least 2 classes, got only {classes[0]!r}"])
    Y = -np.ones((y.shape[0], classes.size))
    Y[np.arange(y.shape[0]), codes] = 1.0
    return classes, Y


def regression_targets(y: NDArray[Any]) -> NDArray[np.float64]:
    """Cell targets as a float matrix (cells x outputs), finite."""
    Y = np.asarray(y, dtype=np.float64)
    if Y.ndim not in (1, 2):
        raise BagValidationError([f"targets must be 1-D or 2-D, got shape {Y.shape}"])
    if not np.isfinite(Y).all():
        raise BagValidationError(["targets contain NaN or Inf"])
    return Y.reshape(Y.shape[0], -1)


def rest_code(classes: NDArray[Any], unassigned: Any) -> int | None:
    """The class code of the rest label ``unassigned`` (None for none); a label the
    training data lack is named."""
    if unassigned is None:
        return None
    hit = np.flatnonzero(classes == unassigned)
    if hit.size == 0:
        raise BagValidationError(
            [f"unassigned={unassigned!r} names no training label (labels: {classes.tolist()})"]
        )
    return int(hit[0])


def seed_of(random_state: Any) -> int:
    """The integer seed of ``random_state`` (None: 0; a Generator: one draw of it)."""
    if random_state is None or isinstance(random_state, int | np.integer):
        return int(random_state or 0)
    return int(np.random.default_rng(random_state).integers(2**31))
