"""Calibrating a new sample to the training reference, as a model of the design before
issue 44 does before it answers (models saved with it load and answer as they did).

A sample from another instrument or centre carries the same populations at moved and
reshaped marker intensities. The model maps it back, monotone per marker, by what it
recorded at fit (``calibration_``):

* ``"quantile"``: per marker, the sample's quantiles at a few levels mapped onto the
  reference's, piecewise linearly (:func:`~core.bags.align_quantiles`; the landmark
  idea of CytoNorm, Van Gassen et al., *Cytometry A* 97, 2020);
* ``"landmarks"`` (classifiers): every marker shifted so that the sample's
  populations, as the model labels them, sit on the training populations' centres,
  the labels renewed on the shifted sample and the shift refitted, a few times
  (:func:`landmark_aligned`; the landmark registration of Hahne et al., *Cytometry A*
  77, 2010, with the model's own gates for landmarks);
* ``"mmd"``: a per-marker monotone piecewise-linear map through knots at the sample's
  own quantiles, then an affine map of all markers, fitted by gradient steps on the
  maximum mean discrepancy to the reference cells (:func:`~.mmd.mmd_map`; the calibration
  idea of DeepCyTOF, Li et al., *Bioinformatics* 33, 2017, without a network).

Which tasks are calibrated: by ``"quantile"`` or ``"mmd"`` every task out of range
(:func:`mapped_out_of_range`); by ``"landmarks"`` a task out of range where no
invariant fallback answers it, and a task in range whose populations sit farther from
the training ones than any training task's do, which is then out of range too
(:func:`landmarks_calibrated`). A batch's reference control, given with the samples,
maps every one of them first instead (:func:`mapped_by_control`,
:func:`core.alignment.control_map`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from ....alignment import control_map
from ....bags import Bags, BagValidationError, align_quantiles
from ....blas import one_thread
from ....representations.base import n_threads_for
from ..reports import TaskReport
from .mmd import mmd_map

__all__ = [
    "CALIBRATIONS",
    "Landmarks",
    "calibrate",
    "landmark_aligned",
    "landmark_shift",
    "landmarks_calibrated",
    "mapped_by_control",
    "mapped_out_of_range",
]

#: The calibrations a model may choose among, simplest first (``"landmarks"`` needs
#: the model's labels: classifiers only, see the estimator).
CALIBRATIONS = ("none", "landmarks", "quantile", "mmd")
#: Rounds of labelling and shifting of the landmark calibration.
LANDMARK_ITERATIONS = 3
#: Cells of a new task its landmark shift is estimated on (a seeded draw).
LANDMARK_POINTS = 5000
#: A population takes part in the landmark shift with at least this many cells.
LANDMARK_MIN_CELLS = 20


def landmark_shift(
    x: NDArray[np.float64],
    codes: NDArray[np.int64],
    centres: NDArray[np.float64],
    skip: int | None = None,
    spread: NDArray[np.float64] | None = None,
) -> NDArray[np.float64] | None:
    """The per-marker shift that moves the sample's population centres onto the
    training ones, each population weighted by its share of the sample (and, given
    ``spread``, by the inverse of its variance on each marker).

    With ``spread`` the shift is the inverse-variance weighted mean of the centres'
    differences: a population's centre is estimated with variance ``σ²/n``, so a
    tight, large population says most, and a diffuse one (a rest class that is a
    mixture, whose centre moves with its parts' proportions) little.

    Parameters
    ----------
    x : ndarray of shape (n, d)
        The sample's cells, as they arrived.
    codes : ndarray of shape (n,)
        Each cell's population (column of ``centres``), as the model labels it.
    centres : ndarray of shape (n_classes, d)
        The training populations' centres, on the cells as they arrived.
    skip : int, optional
        A class that is no population (the rest class): not a landmark.
    spread : ndarray of shape (n_classes, d), optional
        Every training population's variance per marker.

    Returns
    -------
    ndarray of shape (d,) or None
        ``None`` when fewer than two populations have :data:`LANDMARK_MIN_CELLS`
        cells (one landmark cannot tell a shift from a different population).
    """
    counts = np.bincount(codes, minlength=centres.shape[0]).astype(np.float64)
    use = counts >= LANDMARK_MIN_CELLS
    if skip is not None:
        use[skip] = False
    use &= np.isfinite(centres).all(axis=1)
    if use.sum() < 2:
        return None
    sums = np.zeros_like(centres)
    np.add.at(sums, codes, x)
    mine = sums[use] / counts[use, None]
    w = np.repeat(counts[use, None], centres.shape[1], axis=1)
    if spread is not None:
        w = w / np.maximum(spread[use], 1e-12)
    w = w / w.sum(axis=0)
    return (w * (centres[use] - mine)).sum(axis=0)


def calibrate(
    tasks: Bags,
    how: Literal["none", "quantile", "mmd"],
    reference_quantiles: NDArray[np.float64],
    reference_points: NDArray[np.float64] | None = None,
    random_state: int = 0,
) -> Bags:
    """Every task calibrated to the reference by ``how`` (:data:`CALIBRATIONS`).

    Parameters
    ----------
    tasks : Bags
    how : {"none", "quantile", "mmd"}
    reference_quantiles : ndarray of shape (len(QUANTILE_LEVELS), d)
        The reference's marker quantiles (``"quantile"``).
    reference_points : ndarray of shape (m, d), optional
        Cells of the reference (``"mmd"``; e.g. a few thousand drawn from the
        training tasks).
    """
    if how == "none":
        return tasks
    if how == "quantile":
        return align_quantiles(tasks, reference_quantiles)
    if how == "landmarks":
        raise ValueError("the landmark calibration needs a model's labels (the estimator's)")
    if how != "mmd":
        raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {how!r}")
    if reference_points is None:
        raise ValueError("the MMD calibration needs reference_points")

    def one(t: int) -> NDArray[np.float64]:
        return mmd_map(np.asarray(tasks[t]), reference_points, random_state)

    # Each task's map is fitted on its own (its own draws from random_state), so the
    # tasks run on all cores at once, one BLAS thread each, and give what they give
    # alone: 150 steps of exponentials and small products, which release the GIL
    # (about a second a task here; with batches named, the calibration's choice maps
    # every training task and was most of the fit). A request's one task runs alone.
    threads = min(n_threads_for(-1), len(tasks))
    with one_thread(), ThreadPoolExecutor(threads) as pool:
        mapped = list(pool.map(one, range(len(tasks))))
    return Bags(np.vstack(mapped), tasks.offsets, tasks.weights, validate=False)


@dataclass(frozen=True)
class Landmarks:
    """What the landmark calibration of a fitted classifier compares a task with.

    Attributes
    ----------
    centres, spread : ndarray of shape (n_classes, d)
        The training populations' centres and variances per marker, on the cells as
        they arrived (``spread`` None for models saved without it).
    rest : int or None
        The rest class's column (no landmark).
    scale : ndarray of shape (d,)
        The training cells' standard deviation per marker.
    threshold : float
        The largest shift a training task's populations show, times ``range_factor``.
    """

    centres: NDArray[np.float64]
    spread: NDArray[np.float64] | None
    rest: int | None
    scale: NDArray[np.float64]
    threshold: float


def landmark_aligned(
    x: NDArray[np.float64],
    scores: Callable[[Bags], list[NDArray[np.float64]]],
    landmarks: Landmarks,
    seed: int,
    only_beyond: bool = False,
) -> NDArray[np.float64] | None:
    """One task shifted per marker until its populations, as ``scores`` (the primary
    model's) label them, sit on the training populations' centres
    (:func:`landmark_shift`, :data:`LANDMARK_ITERATIONS` rounds). With
    ``only_beyond``, None unless the first shift exceeds what the training tasks show.

    The shift (one number per marker) is estimated on at most :data:`LANDMARK_POINTS`
    of the task's cells, a seeded draw.
    """
    sample = x
    if x.shape[0] > LANDMARK_POINTS:
        rng = np.random.default_rng([seed, x.shape[0]])
        sample = x[np.sort(rng.choice(x.shape[0], LANDMARK_POINTS, replace=False))]
    z = sample
    shift = None
    for round_ in range(LANDMARK_ITERATIONS):
        (answer,) = scores(Bags.from_arrays([z]))
        codes = np.argmax(answer, axis=1) if answer.shape[1] > 1 else (answer[:, 0] > 0)
        step = landmark_shift(
            sample, codes.astype(np.int64), landmarks.centres, landmarks.rest, landmarks.spread
        )
        if step is None:
            break
        if only_beyond and round_ == 0:
            size = float(np.linalg.norm(step / landmarks.scale))
            if size <= landmarks.threshold:
                return None
        shift = step
        z = sample + shift
    if shift is None:
        return None if only_beyond else x
    return x + shift


def mapped_by_control(
    raw: Bags,
    control: Any,
    reference: NDArray[np.float64] | None,
    scale: NDArray[np.float64] | None,
) -> tuple[Bags, list[Any]]:
    """``raw`` mapped by its batch's ``control`` onto the training batch (whose control
    the model kept as its quantiles ``reference`` and spread ``scale``), and each
    task's :class:`~core.alignment.MarkerQuality`; ``raw`` as it is without one."""
    if control is None:
        return raw, [None] * len(raw)
    if reference is None:
        raise ValueError(
            "this model was fitted without a reference control (fit(..., control=)): "
            "a batch's control has nothing to be mapped onto"
        )
    cells = np.asarray(control, dtype=np.float64)
    if cells.ndim != 2 or cells.shape[1] != raw.dim:
        raise BagValidationError(
            [f"the control has shape {cells.shape}; the samples have {raw.dim} markers"]
        )
    if not np.isfinite(cells).all():
        raise BagValidationError(["the control contains NaN or Inf"])
    mapping, quality = control_map(cells, reference, scale)
    mapped = mapping(raw.points)
    unit = np.where(scale > 0, scale, 1.0)
    moved = np.abs(mapped - raw.points) / unit
    qualities = [
        replace(quality, moved=np.median(moved[lo:hi], axis=0))
        for lo, hi in zip(raw.offsets[:-1], raw.offsets[1:], strict=True)
    ]
    return Bags(mapped, raw.offsets, raw.weights, validate=False), qualities


def _replaced(
    raw: Bags, reports: list[TaskReport], which: list[int], done: Any, how: str
) -> tuple[Bags, dict[int, TaskReport]]:
    """``raw`` with tasks ``which`` replaced by ``done`` (in order), and those tasks'
    reports marked calibrated by ``how``."""
    arrays = [np.asarray(raw[t]) for t in range(len(raw))]
    for j, t in enumerate(which):
        arrays[t] = np.asarray(done[j])
    return Bags.from_arrays(arrays), {t: replace(reports[t], calibrated=how) for t in which}


def mapped_out_of_range(
    raw: Bags,
    reports: list[TaskReport],
    how: str,
    quantiles: NDArray[np.float64],
    points: NDArray[np.float64] | None,
    seed: int,
) -> tuple[Bags, dict[int, TaskReport]]:
    """``raw`` with every task out of range (by its report) calibrated by ``how``
    (``"quantile"`` or ``"mmd"``) onto the training reference's ``quantiles`` and
    ``points``, and those tasks' reports (their own, as they arrived)."""
    far = [i for i, r in enumerate(reports) if r.out_of_range]
    if not far:
        return raw, {}
    done = calibrate(raw[np.array(far)], how, quantiles, points, seed)  # type: ignore[arg-type]
    return _replaced(raw, reports, far, done, how)


def landmarks_calibrated(
    raw: Bags,
    reports: list[TaskReport],
    scores: Callable[[Bags], list[NDArray[np.float64]]],
    landmarks: Landmarks,
    has_fallback: bool,
    seed: int,
) -> tuple[Bags, dict[int, TaskReport]]:
    """``raw`` with the tasks the landmark calibration shifts shifted (see the module
    docstring; ``scores``: the primary model's), and their reports as they arrived,
    flagged out of range."""
    reports = list(reports)
    far = [i for i, r in enumerate(reports) if r.out_of_range]
    done, moved = [], []
    for t in range(len(raw)):
        if t in far and has_fallback:
            continue
        shifted = landmark_aligned(
            np.asarray(raw[t]), scores, landmarks, seed, only_beyond=t not in far
        )
        if shifted is not None:
            done.append(shifted)
            moved.append(t)
            reports[t] = replace(reports[t], out_of_range=True)
    return _replaced(raw, reports, moved, done, "landmarks")
