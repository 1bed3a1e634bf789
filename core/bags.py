"""Bags of points stored as one stacked array plus offsets.

A *bag* is a finite sample ``{x_1, ..., x_n} ⊂ R^d`` from an unknown distribution,
optionally with non-negative weights (the empirical measure ``Σ_i c_i δ_{x_i}``). A
collection of ``T`` bags is stored like a CSR matrix: ``points`` of shape ``(N, d)``
with ``N = Σ_t n_t``, ``offsets`` of shape ``(T + 1,)`` so that bag ``t`` is
``points[offsets[t]:offsets[t + 1]]``, and optional ``weights`` of shape ``(N,)``
normalised to sum to one inside every bag. Per-bag reductions are segment
operations on the stacked arrays, never Python loops over points.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .errors import BagValidationError
from .marker_maps import MarkerMap

__all__ = [
    "QUANTILE_LEVELS",
    "BagValidationError",
    "Bags",
    "align_quantiles",
    "as_bags",
    "bag_quantiles",
    "lexicographic_order",
    "normalise_each_bag",
    "segment_sum",
    "standardise_each_bag",
    "subsample_bags",
    "subsample_rows",
]


def _describe_nonfinite(values: NDArray[np.float64]) -> str:
    bad = ~np.isfinite(values)
    n_bad = int(bad.sum())
    row, col = np.argwhere(bad)[0]
    kinds = []
    if np.isnan(values).any():
        kinds.append("NaN")
    if np.isinf(values).any():
        kinds.append("Inf")
    return f"{n_bad} non-finite value(s) ({'/'.join(kinds)}), first at row {row}, column {col}"


def _bag_problems(
    index: int, array: NDArray[Any], dim: int | None, label: str = "bag"
) -> list[str]:
    """Problems of one candidate bag, as sentences naming the bag."""
    problems = []
    if array.ndim != 2:
        problems.append(
            f"{label} {index}: expected a 2-D array (n_points, n_features), got shape {array.shape}"
        )
        return problems
    if array.shape[0] == 0:
        problems.append(f"{label} {index} is empty (0 points)")
    if dim is not None and array.shape[1] != dim:
        problems.append(
            f"{label} {index} has {array.shape[1]} feature column(s), expected {dim} "
            "(the number of columns of the first bag)"
        )
    elif array.shape[1] == 0:
        problems.append(f"{label} {index} has 0 feature columns")
    if array.size and not np.isfinite(array).all():
        problems.append(f"{label} {index}: {_describe_nonfinite(array)}")
    return problems


def _weight_problems(index: int, w: NDArray[Any], n_points: int) -> list[str]:
    if w.ndim != 1 or w.shape[0] != n_points:
        return [
            f"bag {index}: weights have shape {w.shape}, expected ({n_points},) "
            "(one weight per point)"
        ]
    if not np.isfinite(w).all():
        return [f"bag {index}: weights contain NaN or Inf"]
    problems = []
    if (w < 0).any():
        problems.append(
            f"bag {index}: {int((w < 0).sum())} negative weight(s), "
            f"first at row {int(np.argmax(w < 0))}"
        )
    elif w.sum() <= 0:
        problems.append(f"bag {index}: weights sum to zero")
    return problems


class Bags:
    """A collection of bags of points in ``R^d``, stacked with offsets.

    Build one with :meth:`from_arrays`. Indexing with an integer returns that bag's
    points (a read-only view of shape ``(n_t, d)``); indexing with a slice, an integer
    array or a boolean mask returns a new :class:`Bags`, weights included, so
    scikit-learn's cross-validation splitters can subset it.

    Parameters
    ----------
    points : ndarray of shape (N, d)
        All points, bag after bag.
    offsets : ndarray of shape (T + 1,)
        ``offsets[0] == 0``, ``offsets[-1] == N``, strictly increasing.
    weights : ndarray of shape (N,), optional
        Non-negative point weights; normalised here so that each bag sums to one.
        ``None`` means uniform weights ``1 / n_t``.
    validate : bool, default=True
        Check shapes, finiteness and weights. Internal callers that build bags from
        already validated bags pass ``False``.
    """

    __slots__ = ("_offsets", "_points", "_weights")

    def __init__(
        self,
        points: ArrayLike,
        offsets: ArrayLike,
        weights: ArrayLike | None = None,
        *,
        validate: bool = True,
    ):
        pts = np.ascontiguousarray(points, dtype=np.float64)
        off = np.asarray(offsets, dtype=np.int64)
        if validate:
            _check_stacked(pts, off)
        w = None
        if weights is not None:
            w = np.asarray(weights, dtype=np.float64)
            if validate:
                problems = []
                if w.shape != (pts.shape[0],):
                    raise BagValidationError(
                        [f"weights have shape {w.shape}, expected ({pts.shape[0]},)"]
                    )
                for t in range(len(off) - 1):
                    problems += _weight_problems(
                        t, w[off[t] : off[t + 1]], int(off[t + 1] - off[t])
                    )
                if problems:
                    raise BagValidationError(problems)
            w = w / segment_sum(w, off)[np.repeat(np.arange(len(off) - 1), np.diff(off))]
            w.flags.writeable = False
        pts.flags.writeable = False
        off.flags.writeable = False
        self._points = pts
        self._offsets = off
        self._weights = w

    # ------------------------------------------------------------------ building
    @classmethod
    def from_stored(
        cls,
        points: NDArray[np.float64],
        offsets: NDArray[np.int64],
        weights: NDArray[np.float64] | None,
    ) -> Bags:
        """Bags as :attr:`points`, :attr:`offsets` and :attr:`weights` held them, kept as
        they are: the weights are normalised already, and normalising them again would
        move their last bits (a stored model must compute as it did when saved)."""
        bags = cls(points, offsets, None, validate=False)
        if weights is not None:
            w = np.asarray(weights, dtype=np.float64)
            w.flags.writeable = False
            bags._weights = w
        return bags

    @classmethod
    def from_arrays(
        cls,
        arrays: Sequence[ArrayLike] | NDArray[Any],
        weights: Sequence[ArrayLike | None] | None = None,
    ) -> Bags:
        """Stack a list of 2-D arrays (one per bag) into :class:`Bags`.

        Parameters
        ----------
        arrays : sequence of array-like of shape (n_t, d), or ndarray of shape (T, n, d)
            The bags. All must have the same number of columns ``d``.
        weights : sequence of (array-like of shape (n_t,) or None), optional
            Per-point non-negative weights for each bag (``None`` entries mean
            uniform); normalised per bag.

        Raises
        ------
        BagValidationError
            Listing every malformed bag: wrong number of dimensions, a column count
            different from the first bag's, NaN/Inf, an empty bag, and weights of the
            wrong length, negative, non-finite or summing to zero.
        """
        if isinstance(arrays, Bags):
            return arrays
        if isinstance(arrays, np.ndarray) and arrays.ndim == 3:
            arrays = list(arrays)
        if isinstance(arrays, np.ndarray | str) or not isinstance(arrays, Sequence):
            shape = getattr(arrays, "shape", None)
            raise BagValidationError(
                [
                    "expected a sequence of 2-D arrays (one per bag) or a 3-D array "
                    f"(n_bags, n_points, n_features), got {type(arrays).__name__}"
                    + (f" of shape {shape}" if shape is not None else "")
                ]
            )
        if len(arrays) == 0:
            raise BagValidationError(["no bags given (an empty list)"])
        problems: list[str] = []
        converted = []
        dim = None
        for t, a in enumerate(arrays):
            try:
                arr = np.asarray(a, dtype=np.float64)
            except (TypeError, ValueError) as exc:
                problems.append(f"bag {t}: not convertible to a numeric array ({exc})")
                converted.append(None)
                continue
            if dim is None and arr.ndim == 2:
                dim = arr.shape[1]
            problems += _bag_problems(t, arr, dim)
            converted.append(arr)
        w_list = None
        if weights is not None:
            if len(weights) != len(arrays):
                problems.append(f"got weights for {len(weights)} bag(s) but {len(arrays)} bag(s)")
            else:
                w_list = []
                for t, (arr, w) in enumerate(zip(converted, weights, strict=True)):
                    n = arr.shape[0] if arr is not None and arr.ndim == 2 else 0
                    if w is None:
                        w_list.append(np.ones(n))
                        continue
                    wa = np.asarray(w, dtype=np.float64)
                    if arr is not None and arr.ndim == 2:
                        problems += _weight_problems(t, wa, n)
                    w_list.append(wa)
        if problems:
            raise BagValidationError(problems)
        sizes = np.array([a.shape[0] for a in converted], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        points = np.concatenate(converted, axis=0)
        stacked_w = None if w_list is None else np.concatenate(w_list)
        return cls(points, offsets, stacked_w, validate=False)

    # --------------------------------------------------------------- properties
    @property
    def points(self) -> NDArray[np.float64]:
        """All points, shape ``(N, d)`` (read-only)."""
        return self._points

    @property
    def offsets(self) -> NDArray[np.int64]:
        """Bag boundaries, shape ``(T + 1,)`` (read-only)."""
        return self._offsets

    @property
    def weights(self) -> NDArray[np.float64] | None:
        """Per-point weights normalised per bag, or ``None`` for uniform weights."""
        return self._weights

    @property
    def dim(self) -> int:
        """Number of features (columns) of every point."""
        return int(self._points.shape[1])

    @property
    def sizes(self) -> NDArray[np.int64]:
        """Number of points of each bag, shape ``(T,)``."""
        return np.diff(self._offsets)

    @property
    def n_points(self) -> int:
        """Total number of points ``N``."""
        return int(self._points.shape[0])

    @property
    def shape(self) -> tuple[int]:
        """``(T,)``: lets scikit-learn count and subset bags like array rows."""
        return (len(self),)

    @property
    def is_weighted(self) -> bool:
        """Whether the bags carry explicit (non-uniform) weights."""
        return self._weights is not None

    def point_weights(self) -> NDArray[np.float64]:
        """Per-point weights, shape ``(N,)``: explicit ones, or ``1 / n_t``."""
        if self._weights is not None:
            return self._weights
        return np.repeat(1.0 / self.sizes, self.sizes)

    def bag_index(self) -> NDArray[np.int64]:
        """The bag number of every point, shape ``(N,)``."""
        return np.repeat(np.arange(len(self)), self.sizes)

    def bag_weights(self, t: int) -> NDArray[np.float64]:
        """Weights of bag ``t`` (uniform if the bags are unweighted)."""
        t = self._check_index(t)
        lo, hi = self._offsets[t], self._offsets[t + 1]
        if self._weights is None:
            return np.full(hi - lo, 1.0 / (hi - lo))
        return self._weights[lo:hi]

    # ------------------------------------------------------------------ protocol
    def __len__(self) -> int:
        return int(self._offsets.shape[0] - 1)

    def __iter__(self) -> Iterator[NDArray[np.float64]]:
        for t in range(len(self)):
            yield self._points[self._offsets[t] : self._offsets[t + 1]]

    def __repr__(self) -> str:
        sizes = self.sizes
        return (
            f"Bags(n_bags={len(self)}, dim={self.dim}, n_points={self.n_points}, "
            f"sizes={int(sizes.min())}..{int(sizes.max())}, weighted={self.is_weighted})"
        )

    def _check_index(self, t: int) -> int:
        n = len(self)
        if not -n <= t < n:
            raise IndexError(f"bag index {t} out of range for {n} bag(s)")
        return t % n

    def __getitem__(self, key: Any) -> NDArray[np.float64] | Bags:
        # scikit-learn's _safe_indexing calls X[key, ...] on objects with a shape.
        if isinstance(key, tuple):
            if len(key) == 2 and key[1] is Ellipsis:
                key = key[0]
            else:
                raise IndexError("Bags support one index (a bag number, slice or array)")
        if isinstance(key, int | np.integer):
            t = self._check_index(int(key))
            return self._points[self._offsets[t] : self._offsets[t + 1]]
        if isinstance(key, slice):
            idx = np.arange(len(self))[key]
        else:
            idx = np.asarray(key)
            if idx.dtype == bool:
                if idx.shape != (len(self),):
                    raise IndexError(f"boolean mask of shape {idx.shape} for {len(self)} bag(s)")
                idx = np.flatnonzero(idx)
            elif idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
                raise IndexError("bags are indexed by an int, a slice, or a 1-D int/bool array")
            if idx.size and (idx.max() >= len(self) or idx.min() < -len(self)):
                raise IndexError(f"bag index out of range for {len(self)} bag(s)")
            idx = idx % len(self)
        return self.take(idx)

    def take(self, indices: NDArray[np.integer]) -> Bags:
        """A new :class:`Bags` with the bags at ``indices`` (in that order).

        Weights are carried over bit for bit, not normalised again, so a bag selected
        alone or with others has exactly the weights it had in ``self``.
        """
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size == 0:
            raise BagValidationError(["selection contains no bags"])
        sizes = self.sizes[indices]
        starts = self._offsets[indices]
        # Point positions of every selected bag, built without a loop over points.
        new_offsets = np.concatenate([[0], np.cumsum(sizes)])
        rows = np.repeat(starts - new_offsets[:-1], sizes) + np.arange(new_offsets[-1])
        out = Bags(self._points[rows], new_offsets, validate=False)
        if self._weights is not None:
            # Whole bags keep their weights as they are: they are normalised per bag
            # already, and normalising again is not idempotent in floating point (a
            # bag's sum is 1 only to within an ulp, and dividing by it can move every
            # weight by an ulp, again at the next selection). Renormalising here made a
            # bag's weights, and so its embedding and prediction, differ in the last
            # bits between ``bags`` and ``bags[[t]]``.
            w = self._weights[rows]
            w.flags.writeable = False
            out._weights = w
        return out


def _check_stacked(points: NDArray[np.float64], offsets: NDArray[np.int64]) -> None:
    problems = []
    if points.ndim != 2:
        raise BagValidationError([f"points must be 2-D (N, d), got shape {points.shape}"])
    if offsets.ndim != 1 or offsets.shape[0] < 2:
        raise BagValidationError(["offsets must be 1-D with at least two entries"])
    if offsets[0] != 0 or offsets[-1] != points.shape[0]:
        raise BagValidationError(
            [f"offsets must start at 0 and end at {points.shape[0]} (the number of points)"]
        )
    sizes = np.diff(offsets)
    for t in np.flatnonzero(sizes <= 0):
        problems.append(
            f"bag {t} is empty (0 points)" if sizes[t] == 0 else f"bag {t}: offsets decrease"
        )
    if points.shape[1] == 0:
        problems.append("points have 0 feature columns")
    if not np.isfinite(points).all():
        bad_rows = np.flatnonzero(~np.isfinite(points).all(axis=1))
        for t in np.unique(np.searchsorted(offsets, bad_rows, side="right") - 1):
            lo, hi = offsets[t], offsets[t + 1]
            problems.append(f"bag {t}: {_describe_nonfinite(points[lo:hi])}")
    if problems:
        raise BagValidationError(problems)


def segment_sum(values: NDArray[Any], offsets: NDArray[np.int64]) -> NDArray[Any]:
    """Sum ``values`` (along axis 0) over each segment ``offsets[t]:offsets[t+1]``.

    Segments must be non-empty (bags always are).
    """
    return np.add.reduceat(values, offsets[:-1], axis=0)


def as_bags(X: Bags | Sequence[ArrayLike] | NDArray[Any]) -> Bags:
    """Coerce ``X`` (a :class:`Bags`, a list of 2-D arrays or a 3-D array) to :class:`Bags`."""
    if isinstance(X, Bags):
        return X
    return Bags.from_arrays(X)


def subsample_bags(bags: Bags, size: int | None, seed: int, *, canonical: bool = False) -> Bags:
    """At most ``size`` points of every bag, chosen independently of point order.

    Each bag larger than ``size`` is put in lexicographic row order before a draw
    seeded by ``(seed, n_points)``, so the same cells give the same subsample however
    they are ordered (and predictions that depend on it are reproducible). Weights of
    the kept points are kept and renormalised. With ``canonical=True`` the bags left
    whole are put in lexicographic order too, so that everything computed from the
    result (sums included) is bit for bit the same for any order of the input cells.
    """
    if not canonical and (size is None or bags.sizes.max() <= size):
        return bags
    rows = subsample_rows(bags, size, seed, canonical=canonical)
    sizes = bags.sizes if size is None else np.minimum(bags.sizes, size)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    w = None if bags.weights is None else bags.weights[rows]
    return Bags(bags.points[rows], offsets, w, validate=False)


def lexicographic_order(points: NDArray[np.float64]) -> NDArray[np.int64]:
    """The order of ``points``' rows by their first column, then the second, ...: the
    canonical order of a bag's cells, ``np.lexsort(points.T[::-1])``.

    Where the first column has no ties (cells measured on a continuous scale) that
    order is the first column's alone, a single stable sort instead of one per
    column; otherwise it is ``np.lexsort``'s.
    """
    if points.ndim == 2 and points.shape[0] > 1 and points.shape[1] > 0:
        order = np.argsort(points[:, 0], kind="stable")
        first = points[order, 0]
        if np.all(first[1:] > first[:-1]):
            return order
    return np.lexsort(points.T[::-1])


def subsample_rows(
    bags: Bags, size: int | None, seed: int, *, canonical: bool = False
) -> NDArray[np.int64]:
    """The rows of ``bags.points`` that :func:`subsample_bags` keeps, bag after bag in
    its order: for indexing what goes with the points (labels, targets)."""
    keep = []
    for t in range(len(bags)):
        lo, hi = int(bags.offsets[t]), int(bags.offsets[t + 1])
        n = hi - lo
        pts = bags.points[lo:hi]
        if size is not None and n > size:
            order = lexicographic_order(pts)
            pick = np.sort(np.random.default_rng([seed, n]).choice(n, size, replace=False))
            keep.append(lo + order[pick])
        elif canonical:
            keep.append(lo + lexicographic_order(pts))
        else:
            keep.append(np.arange(lo, hi))
    return np.concatenate(keep).astype(np.int64)


def standardise_each_bag(bags: Bags) -> Bags:
    """Each bag's points centred and scaled by that bag's own (weighted) mean and
    standard deviation per coordinate; a constant coordinate is only centred.

    The simplest per-sample normalisation against batch effects (an affine change of
    every marker per sample): it is undone exactly, whatever the sample's proportions.
    """
    idx = bags.bag_index()
    w = bags.weights if bags.weights is not None else (1.0 / bags.sizes)[idx]
    x = bags.points
    mean = segment_sum(w[:, None] * x, bags.offsets)
    centred = x - mean[idx]
    sd = np.sqrt(segment_sum(w[:, None] * centred**2, bags.offsets))
    sd = np.where(sd > 0, sd, 1.0)
    return Bags(centred / sd[idx], bags.offsets, bags.weights, validate=False)


def normalise_each_bag(bags: Bags, how: str, reference: NDArray[np.float64] | None) -> Bags:
    """Bags after the per-bag normalisation ``how``: ``"standard"`` (each bag by its own
    mean and standard deviation, :func:`standardise_each_bag`), ``"quantile"`` (each
    bag's marker quantiles mapped onto ``reference``, :func:`align_quantiles`) or
    ``"none"``."""
    if how == "standard":
        return standardise_each_bag(bags)
    if how == "quantile":
        if reference is None:
            raise ValueError("the quantile normalisation needs reference quantiles")
        return align_quantiles(bags, reference)
    if how != "none":
        raise ValueError(f"normalisation must be 'none', 'standard' or 'quantile', got {how!r}")
    return bags


#: Quantile levels of :func:`align_quantiles`' landmarks: dense in the tails, where
#: instruments and stains distort most, and few enough that each is well estimated
#: from a few hundred cells.
QUANTILE_LEVELS = np.array([0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99])


def bag_quantiles(bags: Bags, levels: NDArray[np.float64] = QUANTILE_LEVELS) -> NDArray[np.float64]:
    """Per-bag, per-coordinate quantiles, shape ``(n_bags, len(levels), dim)``.

    Weighted bags use their weights (the inverse of the weighted empirical CDF at each
    level, as ``np.quantile``'s ``inverted_cdf``); unweighted ones interpolate linearly.
    """
    out = np.empty((len(bags), levels.size, bags.dim))
    for t in range(len(bags)):
        lo, hi = int(bags.offsets[t]), int(bags.offsets[t + 1])
        x = bags.points[lo:hi]
        if bags.weights is None:
            out[t] = np.quantile(x, levels, axis=0)
            continue
        order = np.argsort(x, axis=0, kind="stable")
        cdf = np.cumsum(bags.weights[lo:hi][order], axis=0)
        cdf /= cdf[-1]
        # First sorted point whose cumulative weight reaches the level, per column.
        pos = np.minimum((cdf[None, :, :] < levels[:, None, None]).sum(axis=1), hi - lo - 1)
        out[t] = np.take_along_axis(np.take_along_axis(x, order, axis=0), pos, axis=0)
    return out


def align_quantiles(
    bags: Bags, reference: NDArray[np.float64], levels: NDArray[np.float64] = QUANTILE_LEVELS
) -> Bags:
    """Each bag's coordinates mapped so that its quantiles land on ``reference``.

    A landmark alignment in the spirit of CytoNorm (Van Gassen et al., Cytometry A
    2020): per coordinate, a monotone piecewise-linear map through the points
    (bag quantile, reference quantile) at ``levels``, continued linearly past the
    outer landmarks with the slopes of the outer segments. It removes any monotone
    distortion of a marker that leaves the population proportions alone, which
    per-bag standardisation (affine only) does not; like standardisation it moves
    populations when a sample's proportions differ from the reference's.

    Parameters
    ----------
    bags : Bags
    reference : ndarray of shape (len(levels), dim)
        Target quantiles, non-decreasing down each column (e.g. the mean of the
        training bags' :func:`bag_quantiles`).
    levels : ndarray
        The quantile levels both refer to.
    """
    q = bag_quantiles(bags, levels)
    x = bags.points
    out = np.empty_like(x)
    for t in range(len(bags)):
        lo, hi = int(bags.offsets[t]), int(bags.offsets[t + 1])
        out[lo:hi] = MarkerMap.between(q[t], reference)(x[lo:hi])
    return Bags(out, bags.offsets, bags.weights, validate=False)
