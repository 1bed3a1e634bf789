"""The typed result of an explanation and the summaries a person can read.

:class:`Explanation` holds, for one bag, each cell's signed contribution to each output
(the regression value, or each class's score), the baseline and the prediction, and
computes the summaries: by population (given a label per cell: gates, or a per-cell
model's classes), by marker, and the top cells with their marker values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["Explanation", "MarkerEffect", "PopulationShare", "TopCell"]


@dataclass(frozen=True)
class PopulationShare:
    """The contribution of the cells of one population (one label)."""

    label: str
    n_cells: int
    fraction: float
    contribution: NDArray[np.float64]


@dataclass(frozen=True)
class MarkerEffect:
    """How a marker's position among the cells goes with their contributions.

    ``effect[k] = Σ_x c_x,k · z_x`` with ``z`` the marker standardised within the bag:
    positive when cells high on the marker push output ``k`` up (and cells low on it
    pull it down); its unit is the output's.
    """

    marker: str
    effect: NDArray[np.float64]


@dataclass(frozen=True)
class TopCell:
    """One cell among the largest contributions, with its marker values."""

    index: int
    contribution: float
    values: NDArray[np.float64]


@dataclass
class Explanation:
    """Per-cell contributions to one bag's prediction.

    Attributes
    ----------
    method : {"exact", "influence", "assignment"}
        ``"exact"``: ``baseline + contributions.sum(axis=0) == prediction`` to rounding
        (the model is linear in the bag's measure). ``"influence"``: each contribution
        is the cell's weight times the derivative of the model along the empirical
        measure towards that cell (:mod:`core.explanations.cells`); they sum to about zero,
        and the baseline is the prediction minus their sum. ``"assignment"``: a
        per-cell model's answer (the share of cells in each class, or their mean value),
        each cell's own part of it plus, where the model reads the sample's context, the
        cell's first-order effect through it (:mod:`core.estimators.transfer.explain`);
        ``baseline`` is 0 and the sum holds to rounding.
    outputs : list of str
        What each column is: ``["prediction"]``, an output's index, or a class.
    prediction : ndarray of shape (k,)
        The model's outputs at the bag (class scores for a classifier).
    baseline : ndarray of shape (k,)
        The intercept (exact), or ``prediction - total`` (influence).
    contributions : ndarray of shape (n_cells, k)
    points : ndarray of shape (n_cells, d)
        The cells as the model saw them (after the model's preprocessing).
    markers : list of str
        Marker names of the columns of ``points`` (``"x0"``, ... when unnamed).
    labels : ndarray of shape (n_cells,) or None
        A per-cell model's label of each cell: the populations :meth:`to_dict`
        summarises by when given none.
    """

    method: Literal["exact", "influence", "assignment"]
    outputs: list[str]
    prediction: NDArray[np.float64]
    baseline: NDArray[np.float64]
    contributions: NDArray[np.float64]
    points: NDArray[np.float64] = field(repr=False)
    markers: list[str]
    labels: NDArray[Any] | None = field(default=None, repr=False)

    @property
    def total(self) -> NDArray[np.float64]:
        """``Σ_x c_x`` per output."""
        return self.contributions.sum(axis=0)

    def output_index(self, output: str | int | None) -> int:
        """Column of ``output`` (a name, an index; ``None``: the last, the positive
        class of a binary classifier)."""
        if output is None:
            return len(self.outputs) - 1
        if isinstance(output, int | np.integer):
            return int(output)
        names = [str(o) for o in self.outputs]
        if str(output) not in names:
            raise ValueError(f"unknown output {output!r}; the outputs are {names}")
        return names.index(str(output))

    def by_population(self, labels: ArrayLike) -> list[PopulationShare]:
        """Contributions summed over the cells of each label (a gate, a population).

        ``labels`` has one entry per cell; populations come in decreasing order of
        their absolute contribution to the last output.
        """
        lab = np.asarray(labels)
        n = self.contributions.shape[0]
        if lab.shape != (n,):
            raise ValueError(f"got {lab.size} label(s) for {n} cell(s)")
        names, codes = np.unique(lab.astype(str), return_inverse=True)
        sums = np.zeros((names.size, self.contributions.shape[1]))
        np.add.at(sums, codes, self.contributions)
        counts = np.bincount(codes, minlength=names.size)
        order = np.argsort(-np.abs(sums[:, -1]), kind="stable")
        return [
            PopulationShare(str(names[i]), int(counts[i]), float(counts[i]) / max(n, 1), sums[i])
            for i in order
        ]

    def by_marker(self) -> list[MarkerEffect]:
        """Per marker, ``Σ_x c_x z_x`` with ``z`` the marker's within-bag z-score (see
        :class:`MarkerEffect`), in decreasing order of its size for the last output."""
        X = self.points
        sd = X.std(axis=0)
        z = (X - X.mean(axis=0)) / np.where(sd > 0, sd, 1.0)
        effect = z.T @ self.contributions  # (d, k)
        order = np.argsort(-np.abs(effect[:, -1]), kind="stable")
        return [MarkerEffect(self.markers[j], effect[j]) for j in order]

    def top_cells(
        self, n: int = 10, output: str | int | None = None, sign: Literal[1, -1, 0] = 0
    ) -> list[TopCell]:
        """The ``n`` cells of largest contribution to ``output``: by absolute value
        (``sign=0``), the most positive (``1``) or the most negative (``-1``)."""
        c = self.contributions[:, self.output_index(output)]
        key = np.abs(c) if sign == 0 else sign * c
        n = max(0, min(int(n), c.size))
        if n == 0:
            return []
        pick = np.argpartition(-key, n - 1)[:n]
        pick = pick[np.argsort(-key[pick], kind="stable")]
        return [TopCell(int(i), float(c[i]), self.points[i].copy()) for i in pick]

    def to_dict(self, *, top: int = 10, labels: ArrayLike | None = None) -> dict[str, Any]:
        """A JSON-ready summary (no per-cell arrays): method, baseline, total,
        prediction, by marker, by population (with ``labels``, or the per-cell model's
        own :attr:`labels`) and the top cells."""
        labels = self.labels if labels is None else labels
        out: dict[str, Any] = {
            "method": self.method,
            "outputs": [str(o) for o in self.outputs],
            "n_cells": int(self.contributions.shape[0]),
            "prediction": self.prediction.tolist(),
            "baseline": self.baseline.tolist(),
            "total": self.total.tolist(),
            "by_marker": [
                {"marker": m.marker, "effect": m.effect.tolist()} for m in self.by_marker()
            ],
            "top_cells": [
                {
                    "index": c.index,
                    "contribution": c.contribution,
                    "values": dict(zip(self.markers, c.values.tolist(), strict=True)),
                }
                for c in self.top_cells(top)
            ],
        }
        if labels is not None:
            out["by_population"] = [
                {
                    "population": p.label,
                    "n_cells": p.n_cells,
                    "fraction": p.fraction,
                    "contribution": p.contribution.tolist(),
                }
                for p in self.by_population(labels)
            ]
        return out
