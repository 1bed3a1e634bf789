"""Calibrate a sample to the training batch before any model sees it (issue 44, point 1).

Every map here is increasing within each marker, so no calibration reorders a
sample's cells on a marker or invents a population:

* ``"control"``: the batch's reference control mapped onto the training batch's
  control, quantile by quantile (:func:`core.alignment.control_map`, CytoNorm's
  idea), and the same map applied to every sample of the batch. The control's
  biology is the reference's, so a sample's own proportions are kept.
* ``"landmarks"`` (classifiers): the per-marker scale and shift under which the
  sample is most likely under the training cells' populations (:mod:`.landmarks`),
  where its likelihood gain is evidence of an instrument (the gate,
  :func:`landmark_gain_limit`) and the map brings the sample's populations to their
  places (the refusal, :func:`.landmarks.landmark_map`).
* ``"standardise"``: each sample by its own mean and standard deviation per marker;
  the training samples alike, so the cell model lives in standardised units. Undoes
  a per-sample affine effect, but a sample whose populations' proportions differ
  from the training samples' is moved too (biology read as batch).
* ``"none"``: the cells as measured (asked for, never chosen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ...alignment import MarkerQuality, control_map
from .landmarks import PLACE_SHARE, landmark_gain, landmark_map
from .reference import SD_FLOOR, Reference, fit_reference, sample_moments

__all__ = [
    "CALIBRATIONS",
    "ControlFit",
    "calibrate",
    "fit_control",
    "landmark_gain_limit",
    "shift",
    "standardised",
]

#: Every calibration, fewest assumptions first (the one-standard-error rule's order):
#: the control assumes only that it is the same material in every batch; landmarks,
#: that the sample's populations sit where the training populations do; the moments,
#: that the sample's proportions are the training samples' (biology read as batch).
#: ``"none"`` is never chosen, only asked for: every sample is calibrated.
CALIBRATIONS = ("control", "landmarks", "standardise", "none")


def standardised(x: NDArray[np.float64], floor: NDArray[np.float64]) -> NDArray[np.float64]:
    """``x`` by its own mean and standard deviation per marker (``floor``: the smallest
    standard deviation divided by)."""
    m, s = sample_moments(x, floor)
    return (x - m) / s


def landmark_gain_limit(
    tasks: list[NDArray[np.float64]],
    codes: NDArray[np.int64],
    cv: int,
    seed: int,
    factor: float,
    groups: NDArray[Any] | None = None,
) -> float:
    """The landmark gain (:func:`.landmarks.landmark_gain`) a sample may show and still
    be a new patient of the training batch: ``factor`` times the largest gain of a
    training sample under the mixture of the others (``cv`` folds of samples, drawn by
    ``seed``). Held out, not in-sample: a sample's own cells in the mixture lower its
    gain (on the 12 real GvHD samples, at most 0.94 in-sample against 1.37 held out).

    With ``groups`` (each training sample's batch), a sample is held out from the other
    samples of its own batch only. Across batches its gain is an instrument's, the
    very shift the gate is there to let through: on the real three-centre data, two
    centres' samples held out from each other set a limit that left the third
    centre's samples as measured. A batch of one sample shows nothing; with no batch
    of two, the limit is 0, and every map that raises the likelihood runs.

    A held-out sample holding a population (:data:`.landmarks.PLACE_SHARE` of its
    cells or more) that the samples it is held out from lack shows nothing either:
    its gain is that population's, not an instrument's. Held out of a sample of one
    population, a sample's gain was 300 times its batch's others', and no new sample
    was calibrated.
    """
    batch = (
        np.zeros(len(tasks), np.int64)
        if groups is None
        else np.unique(groups, return_inverse=True)[1]
    )
    rng = np.random.default_rng([seed, 4])
    offsets = np.cumsum([0, *(t.shape[0] for t in tasks)])
    gains = []
    for b in np.unique(batch):
        members = np.flatnonzero(batch == b)
        order = members[rng.permutation(members.size)]
        for held in np.array_split(order, min(cv, members.size)):
            train = np.setdiff1d(members, held)
            if train.size == 0:
                continue
            rows = np.concatenate([np.arange(offsets[t], offsets[t + 1]) for t in train])
            reference = fit_reference([tasks[t] for t in train], codes[rows], None)
            known = np.zeros(codes.max() + 1, dtype=bool)
            known[codes[rows]] = True
            gains += [
                landmark_gain(tasks[t], reference)[2]
                for t in held
                if _populations_known(codes[offsets[t] : offsets[t + 1]], known)
            ]
    return factor * max(max(gains, default=0.0), 0.0)


def _populations_known(codes: NDArray[np.int64], known: NDArray[np.bool_]) -> bool:
    """Whether every population holding :data:`.landmarks.PLACE_SHARE` or more of a
    sample's cells (their population ``codes``) is ``known``."""
    counts = np.bincount(codes, minlength=known.size)
    return bool(np.all(known[counts >= PLACE_SHARE * codes.size]))


@dataclass(frozen=True)
class ControlFit:
    """A batch's control map onto the training batch's control, fitted once per batch,
    and its quality (:func:`core.alignment.control_map`)."""

    mapping: Any
    quality: MarkerQuality
    unit: NDArray[np.float64]


def fit_control(control: NDArray[np.float64], reference: Reference) -> ControlFit:
    """The map of the batch whose reference ``control`` (cells x markers) is given.

    Raises
    ------
    ValueError
        The model was fitted without the training batch's control.
    """
    if reference.control_quantiles is None or reference.control_scale is None:
        raise ValueError(
            "this model was fitted without a reference control (fit(..., control=)): "
            "a batch's control has nothing to be mapped onto"
        )
    mapping, quality = control_map(control, reference.control_quantiles, reference.control_scale)
    unit = np.where(reference.control_scale > 0, reference.control_scale, 1.0)
    return ControlFit(mapping, quality, unit)


def calibrate(
    how: str, x: NDArray[np.float64], reference: Reference, control: ControlFit | None
) -> tuple[NDArray[np.float64], MarkerQuality | None, str]:
    """Sample ``x`` (cells x markers) in the cell model's space, calibrated by ``how``;
    with a control or landmarks, the map's quality for this sample (how far it moved
    each marker, and the markers it made worse); and the calibration that ran.

    Landmarks run only where they are evidence of an instrument: a sample whose
    landmark map raises its likelihood no more than a training sample's own map does
    (``reference.landmark_gain_limit``) is a new patient of the training batch, left
    as measured (``"none"``). On the 12 real GvHD samples, left out four at a time,
    landmarks on every sample labelled 0.833 of the cells against 0.870 as measured.
    The gains measured (3 seeds, 3,000 cells; the guide page
    ``docs/guide/marginal-transfer.md`` has the table): a held-out training sample at
    most 1.95 (real GvHD patients, four splits), 2.78, 0.29 and 2.51 (the emulated
    GvHD, FlowSOM and synthetic batches' own samples); a sample of another emulated
    batch at least 1.77, 3.45 and 30.5. The GvHD ranges overlap.

    A landmark map past the gate is still refused where its gain lies in markers it
    moves away from the sample's populations' places (:func:`.landmarks.landmark_map`):
    the sample is answered as measured, its quality names those markers, each moved
    by 0, and says it was refused (``refused``: the sample shows an instrument the
    model did not undo, out of range however it looks). A sample the gate leaves as
    measured names none: its map made nothing worse.

    Raises
    ------
    ValueError
        ``how="control"`` without the batch's control map.
    """
    if how == "none":
        return x, None, how
    if how == "standardise":
        return standardised(x, SD_FLOOR * reference.sd), None, how
    if how == "landmarks":
        fit = landmark_map(x, reference)
        limit = reference.landmark_gain_limit
        if limit is not None and fit.gain <= limit:
            return x, fit.held_back(), "none"
        if fit.refused:
            return x, fit.refusal(), "none"
        z = x * fit.scale + fit.shift
        return z, fit.quality(np.median(np.abs(z - x), axis=0) / reference.sd), how
    if how != "control":
        raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {how!r}")
    if control is None:
        raise ValueError("calibration 'control' needs the batch's reference control")
    mapped = control.mapping(x)
    moved = np.median(np.abs(mapped - x), axis=0) / control.unit
    q = control.quality
    return mapped, MarkerQuality(moved, q.before, q.after, q.worse), how


def shift(how: str, x: NDArray[np.float64], z: NDArray[np.float64], reference: Reference) -> float:
    """How far calibration ``how`` moved sample ``x`` to ``z`` (its cells in the cell
    model's space): the largest over markers of the median displacement of a cell, in
    the training samples' standard deviations of that marker, with ``z`` read back in
    the training batch's units (a standardised sample is put at the training samples'
    mean and spread first)."""
    if how == "none":
        return 0.0
    if how == "standardise":
        z = z * reference.sd + reference.mean
    return float(np.max(np.median(np.abs(z - x), axis=0) / reference.sd))
