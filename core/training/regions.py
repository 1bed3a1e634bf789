"""Where a bag-level model looks: held-out explanations averaged into marker regions.

A reviewer asks of a trained model whether it reads biology or an artefact (debris at
the lowest scatter, doublets at the highest, a compensation error in one channel). For
every training sample, the model of its cross-validation fold (preprocessing fitted on
that fold's training samples, the final model's ``γ`` and ``λ``, so that no search is
repeated) explains it (:func:`core.explain`); each cell's contribution is added to the
region it falls in, per marker: the fifth of that marker's range among the fold's
training cells it lies in. The table is the mean over samples of each region's summed
contribution, per output (the value, or each class's score): large entries show the
regions that carry the model.

The same numbers come from training in memory and from streamed training, which never
holds the training cells: both count each sample's cells and sum its contributions on
a fine grid of each marker's transformed values (:data:`GRID` bins between the smallest
and largest value of the training data; the fold's scaling is increasing, so the
regions are the same before and after it), one sample at a time, and take the fifths
from the counts (:class:`RegionSums`). A bin belongs to the fifth its middle cell falls
in, so a region's edge is placed to within one bin (1/1024 of the marker's range).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray
from sklearn.base import BaseEstimator

from ..bags import Bags
from ..io import Preprocessing

__all__ = [
    "BINS",
    "GRID",
    "MarkerGrid",
    "RegionSums",
    "bag_region_sums",
    "explanation_sums",
    "fold_explainer",
    "held_out_cell_regions",
    "held_out_regions",
]

#: The regions of each marker: fifths of its training cells.
BINS = ("lowest fifth", "second fifth", "middle fifth", "fourth fifth", "highest fifth")
#: Fine bins per marker on which cells are counted and contributions summed.
GRID = 1024


@dataclass(frozen=True)
class MarkerGrid:
    """:data:`GRID` equal bins per marker over ``[low, high]`` (transformed values)."""

    low: NDArray[np.float64]
    high: NDArray[np.float64]

    def bins(self, x: NDArray[np.float64]) -> NDArray[np.intp]:
        """The bin of every value, shape (n, d); values outside go to the end bins."""
        span = np.where(self.high > self.low, self.high - self.low, 1.0)
        z = (x - self.low) * (GRID / span)
        np.clip(z, 0.0, GRID - 1.0, out=z)
        return z.astype(np.intp)


def bag_region_sums(
    grid: MarkerGrid, x: NDArray[np.float64], contributions: Sequence[NDArray[np.float64]]
) -> tuple[NDArray[np.float64], list[NDArray[np.float64]]]:
    """One sample's cell counts per bin, (d, GRID), and for each of its explanations
    (contributions (n, k) of the cells ``x`` (n, d)) the sums per bin, (d, GRID, k)."""
    b = grid.bins(x)
    d = x.shape[1]
    flat = b + (np.arange(d) * GRID)[None, :]  # marker j's bins at j·GRID
    counts = np.bincount(flat.ravel(), minlength=d * GRID).reshape(d, GRID).astype(np.float64)
    sums = []
    for c in contributions:
        k = c.shape[1]
        s = np.empty((d, GRID, k))
        for o in range(k):
            w = np.broadcast_to(c[:, o, None], flat.shape).ravel()
            s[:, :, o] = np.bincount(flat.ravel(), weights=w, minlength=d * GRID).reshape(d, GRID)
        sums.append(s)
    return counts, sums


@dataclass
class RegionSums:
    """The folds' training-cell counts and held-out contribution sums, per bin.

    ``add`` takes one sample's :func:`bag_region_sums` (in any order: counts are whole
    numbers, and the sums differ by rounding only); ``table`` gives the regions.
    """

    folds: Sequence[tuple[NDArray[np.int64], NDArray[np.int64]]]
    n_markers: int
    train_counts: NDArray[np.float64] = field(init=False)
    held_out: NDArray[np.float64] | None = field(init=False, default=None)
    n_samples: int = field(init=False, default=0)
    outputs: list[str] = field(init=False, default_factory=list)
    method: str = field(init=False, default="exact")

    def __post_init__(self) -> None:
        self.train_counts = np.zeros((len(self.folds), self.n_markers, GRID))
        self._training_folds: dict[int, list[int]] = {}
        self._held_out_folds: dict[int, list[int]] = {}
        for f, (train, val) in enumerate(self.folds):
            for t in train:
                self._training_folds.setdefault(int(t), []).append(f)
            for t in val:
                self._held_out_folds.setdefault(int(t), []).append(f)

    def held_out_in(self, t: int) -> list[int]:
        """The folds that hold sample ``t`` out (one per repeat of the folds)."""
        return self._held_out_folds.get(int(t), [])

    def add(
        self,
        t: int,
        counts: NDArray[np.float64],
        sums: Sequence[NDArray[np.float64]],
        outputs: Sequence[str],
        method: str,
    ) -> None:
        """Sample ``t``'s counts and its sums, one per fold of :meth:`held_out_in`."""
        self.add_counts(t, counts)
        for f, s in zip(self.held_out_in(t), sums, strict=True):
            self.add_held_out(f, s, outputs, method)

    def add_counts(self, t: int, counts: NDArray[np.float64]) -> None:
        """Sample ``t``'s cell counts, to every fold it trains."""
        for f in self._training_folds.get(int(t), []):
            self.train_counts[f] += counts

    def add_held_out(
        self, f: int, sums: NDArray[np.float64], outputs: Sequence[str], method: str
    ) -> None:
        """One held-out sample's contribution sums under fold ``f``'s model."""
        if self.held_out is None:
            self.held_out = np.zeros((len(self.folds), self.n_markers, GRID, sums.shape[2]))
            self.outputs = list(outputs)
        self.held_out[f] += sums
        self.n_samples += 1
        if method != "exact":
            self.method = method

    def table(self, markers: Sequence[str]) -> dict[str, Any] | None:
        """The report's table (see :func:`held_out_regions`), or None without samples."""
        if self.held_out is None or self.n_samples == 0:
            return None
        total = np.zeros((self.n_markers, len(BINS), self.held_out.shape[3]))
        cuts = np.arange(1, len(BINS)) / len(BINS)
        for f in range(len(self.folds)):
            counts = self.train_counts[f]
            cum = np.cumsum(counts, axis=1)
            n = np.maximum(cum[:, -1:], 1.0)
            middle = (cum - 0.5 * counts) / n  # the training-cell level of a bin's middle
            for j in range(self.n_markers):
                region = np.searchsorted(cuts, middle[j], side="right")
                for o in range(total.shape[2]):
                    total[j, :, o] += np.bincount(
                        region, weights=self.held_out[f, j, :, o], minlength=len(BINS)
                    )
        return {
            "outputs": self.outputs,
            "markers": list(markers),
            "regions": list(BINS),
            "n_samples": self.n_samples,
            "method": self.method,
            "mean_contribution": (total / self.n_samples).tolist(),
        }


def fold_explainer(final: BaseEstimator) -> BaseEstimator:
    """An unfitted copy of the final model for a fold: its chosen ``γ`` and ``λ`` (no
    search again) and point predictions only (no conformal refits)."""
    from ..estimators._ridge_calibration import for_point_predictions

    params = {}
    if getattr(final, "gamma_", None) is not None and "gamma" in final.get_params():
        params["gamma"] = final.gamma_
    if getattr(final, "alpha_", None) is not None and "alpha" in final.get_params():
        params["alpha"] = final.alpha_
    return for_point_predictions(final).set_params(**params)


def explanation_sums(
    models: Mapping[int, BaseEstimator],
    folds_of_sample: Sequence[int],
    preps: Mapping[int, Preprocessing] | Sequence[Preprocessing],
    grid: MarkerGrid,
    x: NDArray[np.float64],
    markers: Sequence[str],
    weights: NDArray[np.float64] | None = None,
) -> tuple[NDArray[np.float64], list[NDArray[np.float64]], list[str], str] | None:
    """One sample's :func:`bag_region_sums` from the explanations of the models of the
    folds that hold it out (``x``: its transformed cells, with their ``weights`` if
    any; ``preps[f]`` scales them for fold ``f``), with the outputs and the method;
    None when the model has none."""
    from ..explanations import explain

    contributions, outputs, method = [], [], "exact"
    for f in folds_of_sample:
        scaled = preps[f].scale_points(x)
        bag = Bags(scaled, np.array([0, x.shape[0]]), weights, validate=False)
        try:
            e = explain(models[f], bag, markers=markers)
        except TypeError:
            return None
        contributions.append(e.contributions)
        outputs = list(e.outputs)
        if e.method == "influence":
            method = "influence"
    counts, sums = bag_region_sums(grid, x, contributions)
    return counts, sums, outputs, method


def _training_grid(base: Preprocessing, raw: Bags, markers: list[str]) -> MarkerGrid:
    """The grid over every training cell, transformed (a fold's scaling is increasing,
    so the regions are the same before and after it)."""
    low = np.full(raw.dim, np.inf)
    high = np.full(raw.dim, -np.inf)
    for t in range(len(raw)):
        x = base.transform_points(raw[t], markers)
        low, high = np.minimum(low, x.min(axis=0)), np.maximum(high, x.max(axis=0))
    return MarkerGrid(low, high)


def held_out_cell_regions(
    raw: Bags,
    predictions: np.ndarray,
    classes: Sequence[Any] | None,
    folds: list[tuple[np.ndarray, np.ndarray]],
    pre_spec: Mapping[str, Any],
    markers: list[str],
) -> dict[str, Any] | None:
    """:func:`held_out_regions` of a per-cell model, from its cross-validated answers.

    A per-cell model's answer for a sample is the share of its cells in each class (a
    regressor's: the mean of its cells' values), and its explanation gives each cell
    its own part, ``1/n`` towards its label's share (``value / n``;
    :mod:`core.estimators.transfer.explain`, ``method="assignment"``): those parts,
    from the labels the held-out cells were given by their fold's model
    (``predictions``, every training cell in order), summed by region. The context
    part of the kernel cell model, which moves a share between a sample's cells and
    sums to zero over them, is left out. ``classes``: the classifier's classes (None
    for a regressor). None for a regressor of several outputs.
    """
    values = np.asarray(predictions)
    if classes is None and values.ndim != 1:
        return None
    base = Preprocessing(**pre_spec)
    grid = _training_grid(base, raw, markers)
    sums = RegionSums(folds, raw.dim)
    outputs = ["prediction"] if classes is None else [str(c) for c in classes]
    for t in range(len(raw)):
        x = base.transform_points(raw[t], markers)
        given = values[raw.offsets[t] : raw.offsets[t + 1]]
        if classes is None:
            parts = given.astype(np.float64)[:, None] / x.shape[0]
        else:
            parts = (given[:, None] == np.asarray(classes)[None, :]) / float(x.shape[0])
        # With repeated folds the answers are the last repeat's, for each of them.
        counts, held = bag_region_sums(grid, x, [parts] * len(sums.held_out_in(t)))
        sums.add(t, counts, held, outputs, "assignment")
    return sums.table(markers)


def held_out_regions(
    final: BaseEstimator,
    raw: Bags,
    y: np.ndarray,
    folds: list[tuple[np.ndarray, np.ndarray]],
    pre_spec: Mapping[str, Any],
    markers: list[str],
) -> dict[str, Any] | None:
    """Mean contribution of each (marker, fifth) region over the held-out samples.

    Returns ``None`` when the model has no explanation (a representation without one).

    Returns
    -------
    dict
        ``outputs``, ``markers``, ``regions`` (:data:`BINS`), ``n_samples``,
        ``method`` (``"exact"`` or ``"influence"``) and ``mean_contribution``, nested
        lists marker × region × output.
    """
    base = Preprocessing(**pre_spec)
    grid = _training_grid(base, raw, markers)

    def cells(t: int) -> Bags:
        return base.subsample(raw.take(np.array([t])))

    sums = RegionSums(folds, raw.dim)
    for t in range(len(raw)):
        counts, _ = bag_region_sums(grid, base.transform_points(cells(t).points, markers), [])
        sums.add_counts(t, counts)
    # Fold by fold: one fold's model (with its copy of the training cells) at a time.
    for f, (train, val) in enumerate(folds):
        pre = Preprocessing(**pre_spec).fit(raw[train], markers)
        model = fold_explainer(final).fit(pre.apply(raw[train], markers), y[train])
        for t in val:
            one = cells(int(t))
            x = base.transform_points(one.points, markers)
            got = explanation_sums({f: model}, [f], {f: pre}, grid, x, markers, one.weights)
            if got is None:
                return None
            _, held, outputs, method = got
            sums.add_held_out(f, held[0], outputs, method)
    return sums.table(markers)
