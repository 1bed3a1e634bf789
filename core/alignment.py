"""A batch's reference control: the map that calibrates every sample of the batch.

One material (a control tube) measured in every batch; per marker, the batch's
control quantiles at :data:`CONTROL_LEVELS` are mapped onto the training batch's
control quantiles, and the same increasing map applied to every sample of the batch
(CytoNorm's idea, Van Gassen et al., *Cytometry A* 97, 2020, without its
clustering). :class:`MarkerQuality` says how far the map moved each marker and
whether it helped. The other calibrations of marginal transfer live with it
(:mod:`core.estimators.transfer.calibration`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from .marker_maps import MarkerMap

__all__ = ["CONTROL_LEVELS", "MarkerMap", "MarkerQuality", "control_map"]


#: Quantile levels of a batch's reference control matched to the training control's:
#: 101 levels, as CytoNorm's default, from 0.1 % to 99.9 % (its 0 and 1 levels are a
#: control's two most extreme cells).
CONTROL_LEVELS = np.linspace(0.001, 0.999, 101)


@dataclass(frozen=True)
class MarkerQuality:
    """How a calibration moved each marker of one sample, and whether it helped.

    Attributes
    ----------
    moved : ndarray of shape (d,)
        Median absolute displacement of the sample's cells, in units of the
        reference's standard deviation of that marker.
    before, after : ndarray of shape (d,)
        Distance of the control (or sample) to the reference on each marker, before
        and after the map: the mean absolute difference of their quantiles at
        :data:`CONTROL_LEVELS` (the 1-D Wasserstein-1 distance on those levels), in
        reference standard deviations.
    worse : ndarray of bool, shape (d,)
        Markers the map moved further from the reference (``after > before``) — the
        warning users of CytoNorm and cyCombine ask for.
    by : str
        The calibration: ``"control"``, or ``"landmarks"``, whose ``before`` and
        ``after`` are distances of the sample's populations to the training
        populations' places (:func:`core.estimators.transfer.landmarks.population_places`).
    refused : bool
        Landmarks: the map showed an instrument (its gain past the gate's limit) and
        was refused (:func:`core.estimators.transfer.landmarks.landmark_map`); the
        sample was answered as measured, and ``worse`` names the markers that
        refused it. Never for a control.
    """

    moved: NDArray[np.float64]
    before: NDArray[np.float64]
    after: NDArray[np.float64]
    worse: NDArray[np.bool_]
    by: str = "control"
    refused: bool = False


def control_map(
    control: NDArray[np.float64],
    reference_quantiles: NDArray[np.float64],
    reference_scale: NDArray[np.float64],
) -> tuple[MarkerMap, MarkerQuality]:
    """The map of a batch fitted on its reference control, and its quality.

    CytoNorm's idea (Van Gassen et al., *Cytometry A* 97, 2020) without its
    clustering: one material is measured in every batch; per marker, the batch's
    control quantiles at :data:`CONTROL_LEVELS` are mapped onto the training
    batch's control quantiles, and the same map is applied to every sample of the
    batch. The control's biology is the reference's, so matching its distribution
    moves no population: unlike a map fitted on each sample, a sample's own
    proportions are kept.

    The quality is measured where the map was not fitted: a map fitted on half the
    control's cells (every other cell) is judged on the other half, so a marker
    whose differences were noise, not instrument, shows up as made worse.

    Parameters
    ----------
    control : ndarray of shape (m, d)
        The batch's reference control, as measured (at least 2 cells per level's
        worth: ``m >= 2 * len(CONTROL_LEVELS)``).
    reference_quantiles : ndarray of shape (len(CONTROL_LEVELS), d)
        The training batch's control at the same levels.
    reference_scale : ndarray of shape (d,)
        The reference's standard deviation per marker (the unit of the report).
    """
    control = np.asarray(control, dtype=np.float64)
    if control.ndim != 2 or control.shape[1] != reference_quantiles.shape[1]:
        raise ValueError(
            f"the control has shape {control.shape}; expected cells x "
            f"{reference_quantiles.shape[1]} markers"
        )
    if control.shape[0] < 2 * CONTROL_LEVELS.size:
        raise ValueError(
            f"the control has {control.shape[0]} cells; at least "
            f"{2 * CONTROL_LEVELS.size} are needed for {CONTROL_LEVELS.size} quantile levels"
        )
    mapping = MarkerMap.between(np.quantile(control, CONTROL_LEVELS, axis=0), reference_quantiles)
    fit_half, check_half = control[0::2], control[1::2]
    half_map = MarkerMap.between(np.quantile(fit_half, CONTROL_LEVELS, axis=0), reference_quantiles)
    scale = np.where(reference_scale > 0, reference_scale, 1.0)

    def distance(cells: NDArray[np.float64]) -> NDArray[np.float64]:
        q = np.quantile(cells, CONTROL_LEVELS, axis=0)
        return np.mean(np.abs(q - reference_quantiles), axis=0) / scale

    before, after = distance(check_half), distance(half_map(check_half))
    moved = np.median(np.abs(mapping(control) - control), axis=0) / scale
    return mapping, MarkerQuality(moved, before, after, after > before)
