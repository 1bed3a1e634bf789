"""Increasing maps of each marker: what every calibration of a sample applies.

A calibration of a batch effect that keeps each marker's order of cells cannot invent
a population the data do not show; every calibration of the core (quantile
alignment, a batch's reference control, population landmarks) is such a map, stored
as knots so a model artifact keeps it as plain arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["MarkerMap"]


@dataclass(frozen=True)
class MarkerMap:
    """An increasing map of each marker: piecewise linear through knots, continued
    past the outer knots with the outer segments' slopes.

    Attributes
    ----------
    inputs, outputs : ndarray of shape (k, d)
        Knots per marker (column): ``inputs`` strictly increasing and ``outputs``
        non-decreasing down each column, so the map keeps every marker's order of
        cells (no label the data do not support can appear).
    """

    inputs: NDArray[np.float64]
    outputs: NDArray[np.float64]

    @classmethod
    def between(cls, source: NDArray[np.float64], target: NDArray[np.float64]) -> MarkerMap:
        """The map taking quantiles ``source`` to ``target`` (both ``(k, d)`` at the
        same levels). Tied source quantiles (a marker piled up on a detector bound)
        are spread by a hair, as :func:`~core.bags.align_quantiles` does."""
        spread = 1e-9 * (1.0 + np.abs(source)) * np.arange(source.shape[0])[:, None]
        return cls(
            np.maximum.accumulate(source, axis=0) + spread, np.maximum.accumulate(target, axis=0)
        )

    def __call__(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """``x`` (cells x markers) mapped, marker by marker."""
        out = np.empty_like(x, dtype=np.float64)
        for j in range(x.shape[1]):
            xp, fp, v = self.inputs[:, j], self.outputs[:, j], x[:, j]
            low = (fp[1] - fp[0]) / (xp[1] - xp[0])
            high = (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
            y = np.interp(v, xp, fp)
            y = np.where(v < xp[0], fp[0] + (v - xp[0]) * low, y)
            out[:, j] = np.where(v > xp[-1], fp[-1] + (v - xp[-1]) * high, y)
        return out
