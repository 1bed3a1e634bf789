"""Instrument-like perturbations: what the search judges every candidate under.

With one training batch, held-out samples of that batch cannot show what a new
instrument does to the markers, so a choice made on them prefers whatever fits the
training instrument best (issue 44: the capacity rule that dropped a linear blend cost
a new batch 1.7 points). The search instead passes each held-out sample through a
drawn *instrument* before any calibration or model sees it, in the family of effects a
cytometer's batch has:

* per marker, a monotone non-linear gain ``x ↦ a x + b + c w tanh((x - m) / w)`` (a
  changed detector voltage stretches and moves a marker, and bends it around a level
  ``m``; units of the marker's standard deviation ``s``: ``log a ~ N(0, 0.2² k²)``,
  ``b ~ N(0, (0.4 s k)²)``, ``c ~ U(0, 0.5)``, ``w = s / 2``, ``k =`` :data:`STRENGTH`);
* spillover: each marker receives ``ε ~ U(0, 0.05)`` of another marker's signal (a
  compensation off by a few percent), the one effect per-marker maps cannot undo.

The constants differ on purpose from :func:`~core.datasets.emulate_batches`' (the
benchmark's generator): a search tuned to the generator it is measured on flatters
itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["Instrument", "draw_instruments"]


@dataclass(frozen=True)
class Instrument:
    """One drawn instrument: per marker a gain, an offset, a bend and a spill."""

    gain: NDArray[np.float64]
    offset: NDArray[np.float64]
    bend: NDArray[np.float64]
    level: NDArray[np.float64]
    width: NDArray[np.float64]
    spill_from: NDArray[np.int64]
    spill: NDArray[np.float64]

    def __call__(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """``x`` (cells x markers) as this instrument would have measured it."""
        mixed = x + self.spill * x[:, self.spill_from]
        bent = self.bend * self.width * np.tanh((mixed - self.level) / self.width)
        return self.gain * mixed + self.offset + bent


#: Scale of the gains and offsets: the held-out sample stands for a new batch, which
#: differs from the training batch by two instruments, each drawn as above: the
#: difference of two independent draws has √2 times one's standard deviation.
STRENGTH = float(np.sqrt(2.0))


def draw_instruments(
    reference: NDArray[np.float64], n: int, rng: np.random.Generator
) -> list[Instrument]:
    """``n`` instruments scaled to the ``reference`` cells (cells x markers).

    Parameters
    ----------
    reference : ndarray of shape (m, d)
        Training cells: their standard deviation per marker sets the units, their
        quantiles between 20 % and 80 % the bends' levels.
    n : int
    rng : numpy Generator
    """
    d = reference.shape[1]
    sd = reference.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    levels = np.quantile(reference, np.linspace(0.2, 0.8, 7), axis=0)
    out = []
    for _ in range(n):
        others = (np.arange(d) + rng.integers(1, max(d, 2), d)) % d if d > 1 else np.zeros(1, int)
        out.append(
            Instrument(
                gain=np.exp(rng.normal(0.0, 0.2 * STRENGTH, d)),
                offset=rng.normal(0.0, 0.4 * STRENGTH, d) * sd,
                bend=rng.uniform(0.0, 0.5, d),
                level=levels[rng.integers(0, levels.shape[0], d), np.arange(d)],
                width=0.5 * sd,
                spill_from=others.astype(np.int64),
                spill=rng.uniform(0.0, 0.05, d) if d > 1 else np.zeros(1),
            )
        )
    return out
