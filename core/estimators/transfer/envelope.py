"""How far a calibration may move a sample before the sample is out of range.

A calibration that maps a sample onto the training batch also hides how unlike the
training samples the sample was as measured: a tube of beads, every marker 50 units
up, is mapped by its landmarks onto the training populations and then looks like
them. What an instrument can do to a sample is what the model was chosen under (the
drawn instruments of :mod:`.perturbation`): each training sample passed through them
and calibrated gives the largest move of each calibration (:func:`.calibration.shift`),
and a new sample moved more than ``range_factor`` times that is out of range, whatever
it looks like once calibrated.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .calibration import calibrate, fit_control, shift
from .perturbation import draw_instruments
from .reference import Reference

__all__ = ["shift_envelope"]

#: Cells of each training sample the envelope is measured on (a seeded draw).
ENVELOPE_CELLS = 500


def shift_envelope(
    tasks: list[NDArray[np.float64]],
    reference: Reference,
    calibrations: tuple[str, ...],
    control: NDArray[np.float64] | None,
    perturbations: int,
    seed: int,
) -> dict[str, float]:
    """Per calibration, the largest :func:`.calibration.shift` of a training sample seen
    through ``perturbations`` drawn instruments (its batch's ``control`` through the
    same instrument)."""
    rng = np.random.default_rng([seed, 9])
    out = dict.fromkeys(calibrations, 0.0)
    for x in tasks:
        if x.shape[0] > ENVELOPE_CELLS:
            x = x[np.sort(rng.choice(x.shape[0], ENVELOPE_CELLS, replace=False))]
        for inst in draw_instruments(x, perturbations, rng):
            seen = inst(x)
            fitted = None if control is None else fit_control(inst(control), reference)
            for c in calibrations:
                if c == "control" and fitted is None:
                    continue
                z, _, ran = calibrate(c, seen, reference, fitted)
                out[c] = max(out[c], shift(ran, seen, z, reference))
    return out
