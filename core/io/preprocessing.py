"""The per-cell preprocessing stored with a model and re-applied at prediction.

:class:`Preprocessing` chains compensation (:mod:`.compensation`, applied to the whole
sample before the panel's columns are picked), a seeded subsample of huge bags
(independent of cell order), a per-marker transform and per-marker standard scaling
learned on the training cells. The scaling is learned from per-bag
:class:`BagMoments`, so that training in memory, streaming from files or on a cluster
learns the same numbers.

Transforms (one for all markers, overridden per marker by ``markers``):

* ``arcsinh``: ``arcsinh(x / cofactor)`` (cofactor 5 for mass cytometry, about 150 for
  fluorescence);
* ``log``: ``log10(max(x, log_floor))``;
* ``logicle``: the logicle scale of Parks, Roederer & Moore (2006, *Cytometry A*
  69:541), computed as Moore & Parks (2012, *Cytometry A* 81:273) and GatingML 2.0
  define it: ``y`` solves ``x = a e^{b y} - c e^{-d y} - f``, linear near zero (negative
  values kept) and ``log10``-like above; ``y = 1`` at ``x = T``;
* ``hyperlog``: Bagwell's (2005, *Cytometry A* 64:34) log-like scale in the GatingML 2.0
  form ``x = a e^{b y} + c y - f``.

The logicle and hyperlog parameters and their defaults, those of FlowJo, FlowKit and
GatingML 2.0: ``T = 262144`` (the top of the data, an 18-bit scale), ``W = 0.5``
(decades of the linear region), ``M = 4.5`` (decades of the full scale), ``A = 0``
(extra negative decades). Results are on GatingML's 0–1 scale; flowCore's
``logicleTransform`` gives ``M`` times the same numbers. Both are computed by
``flowutils`` (the FlowKit authors' C implementation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from ..bags import Bags, subsample_bags
from .compensation import Compensation
from .panel import normalise_marker
from .sample import Sample

__all__ = ["BagMoments", "Preprocessing", "Transform"]


Transform = Literal["none", "arcsinh", "log", "logicle", "hyperlog"]
TRANSFORMS = ("none", "arcsinh", "log", "logicle", "hyperlog")
#: Keys of a per-marker override in ``Preprocessing.markers``.
OVERRIDE_KEYS = frozenset({"transform", "cofactor", "T", "W", "M", "A"})


@dataclass(frozen=True)
class BagMoments:
    """Sufficient statistics of one bag for standard scaling (see :meth:`Preprocessing.fit`)."""

    count: int
    total: NDArray[np.float64]
    centred_squares: NDArray[np.float64]


@dataclass
class Preprocessing:
    """Per-cell preprocessing stored with a model (and re-applied at prediction).

    Parameters
    ----------
    transform : {"none", "arcsinh", "log", "logicle", "hyperlog"}
        The transform of every marker without an override (see the module docstring).
    cofactor : float or mapping of marker to float
        One cofactor, or one per marker (panel names; others use ``default_cofactor``).
    T, W, M, A : float
        Logicle and hyperlog parameters (defaults 262144, 0.5, 4.5, 0).
    markers : mapping of marker to mapping
        Per-marker overrides of ``transform``, ``cofactor``, ``T``, ``W``, ``M``, ``A``
        (e.g. ``{"FSC-A": {"transform": "none"}, "CD4": {"cofactor": 150}}``); markers
        are matched to the panel ignoring case and punctuation.
    compensation : Compensation, str or mapping
        ``"none"``, ``"file"`` or a matrix (:class:`Compensation`); applied by
        :meth:`compensate` to whole samples, before the panel's columns are picked.
    scale : {"none", "standard"}
        ``"standard"``: subtract the training cells' mean and divide by their standard
        deviation, per marker (learned by :meth:`fit`).
    max_points : int or None
        Keep at most this many cells per bag (seeded draw, independent of cell order).
    seed : int
    """

    transform: Transform = "none"
    cofactor: float | Mapping[str, float] = 5.0
    default_cofactor: float = 5.0
    log_floor: float = 1.0
    scale: Literal["none", "standard"] = "none"
    max_points: int | None = None
    seed: int = 0
    T: float = 262144.0
    W: float = 0.5
    M: float = 4.5
    A: float = 0.0
    markers: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    compensation: Compensation = field(default_factory=Compensation)
    mean_: list[float] | None = None
    std_: list[float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.compensation, Compensation):
            self.compensation = Compensation.from_config(self.compensation)
        self.markers = {str(k): dict(v) for k, v in dict(self.markers).items()}
        for marker, override in self.markers.items():
            unknown = set(override) - OVERRIDE_KEYS
            if unknown:
                raise ValueError(
                    f"markers.{marker}: unknown key(s) {sorted(unknown)}; "
                    f"expected some of {sorted(OVERRIDE_KEYS)}"
                )
        for where, spec in [("", self._spec({}))] + [
            (f"markers.{m}: ", self._spec(o)) for m, o in self.markers.items()
        ]:
            _check_spec(where, spec)
        if self.scale not in ("none", "standard"):
            raise ValueError(f"scale must be 'none' or 'standard', got {self.scale!r}")
        if self.max_points is not None and self.max_points < 2:
            raise ValueError(f"max_points must be >= 2 or None, got {self.max_points}")

    def _spec(self, override: Mapping[str, Any], cofactor: float | None = None) -> tuple:
        """``(transform, cofactor, T, W, M, A)`` of a marker with ``override``."""
        cof = self.cofactor if cofactor is None else cofactor
        return (
            str(override.get("transform", self.transform)),
            float(
                override.get("cofactor", self.default_cofactor if isinstance(cof, Mapping) else cof)
            ),
            *(float(override.get(k, getattr(self, k))) for k in ("T", "W", "M", "A")),
        )

    def column_specs(self, markers: Sequence[str]) -> list[tuple]:
        """The ``(transform, cofactor, T, W, M, A)`` of each marker, in ``markers`` order.

        Raises
        ------
        ValueError
            An override names a marker that is not among ``markers``.
        """
        keys = [normalise_marker(m) for m in markers]
        overrides = {normalise_marker(k): v for k, v in self.markers.items()}
        unknown = [k for k in self.markers if normalise_marker(k) not in keys]
        if unknown:
            raise ValueError(
                f"markers: override(s) for {unknown}, not in the panel {list(markers)}"
            )
        specs = []
        for m, k in zip(markers, keys, strict=True):
            cof = (
                float(self.cofactor.get(m, self.default_cofactor))
                if isinstance(self.cofactor, Mapping)
                else float(self.cofactor)
            )
            specs.append(self._spec(overrides.get(k, {}), cof))
        return specs

    def _transform(self, x: NDArray[np.float64], markers: Sequence[str]) -> NDArray[np.float64]:
        if len(markers) != x.shape[1]:  # a model without a panel: columns by position
            markers = [str(j) for j in range(x.shape[1])]
        specs = self.column_specs(markers)
        kinds = {s[0] for s in specs}
        if kinds == {"none"}:
            return x
        if kinds == {"arcsinh"}:  # the common case, in one vectorised pass
            return np.arcsinh(x / np.array([s[1] for s in specs]))
        out = np.array(x, dtype=np.float64, copy=True)
        for j, (kind, cofactor, T, W, M, A) in enumerate(specs):
            col = x[:, j]
            if kind == "arcsinh":
                out[:, j] = np.arcsinh(col / cofactor)
            elif kind == "log":
                out[:, j] = np.log10(np.maximum(col, self.log_floor))
            elif kind in ("logicle", "hyperlog"):
                from flowutils import transforms

                fn = transforms.logicle if kind == "logicle" else transforms.hyperlog
                out[:, j] = fn(np.ascontiguousarray(col), None, t=T, m=M, w=W, a=A)
        return out

    def fit(self, bags: Bags, markers: Sequence[str]) -> Preprocessing:
        """Learn the per-marker scaling from the (transformed) training cells.

        The moments are taken bag by bag and then combined (:meth:`fit_moments`), so
        that training which streams bags from files, locally or on a cluster, learns
        bit for bit the same scaling as training on bags held in memory.
        """
        if self.scale == "standard":
            stats = [
                self.bag_moments(bags.points[lo:hi], markers)
                for lo, hi in zip(bags.offsets[:-1], bags.offsets[1:], strict=True)
            ]
            self.fit_moments(stats)
        return self

    def bag_moments(self, points: NDArray[np.float64], markers: Sequence[str]) -> BagMoments:
        """Count, sum and centred sum of squares of one bag's transformed cells."""
        return self.transformed_moments(self._transform(points, markers))

    @staticmethod
    def transformed_moments(t: NDArray[np.float64]) -> BagMoments:
        """:meth:`bag_moments` of cells already transformed."""
        total = t.sum(axis=0)
        centred = t - total / t.shape[0]
        return BagMoments(int(t.shape[0]), total, np.einsum("ij,ij->j", centred, centred))

    def fit_moments(self, moments: Sequence[BagMoments]) -> Preprocessing:
        """Learn the scaling from per-bag moments (the pooled mean and standard deviation).

        Pooled centred sums of squares, ``M2 = Σ_b M2_b + Σ_b n_b (m_b - m)²``, are
        stable where the raw sums of squares would cancel (Chan, Golub, LeVeque 1983).
        """
        if self.scale != "standard":
            return self
        if not moments:
            raise ValueError("standard scaling needs at least one training bag")
        counts = np.array([m.count for m in moments], dtype=np.float64)
        sums = np.stack([m.total for m in moments])
        n = counts.sum()
        mean = sums.sum(axis=0) / n
        between = counts[:, None] * (sums / counts[:, None] - mean) ** 2
        m2 = np.stack([m.centred_squares for m in moments]).sum(axis=0) + between.sum(axis=0)
        std = np.sqrt(m2 / n)
        self.mean_ = mean.tolist()
        self.std_ = np.where(std > 0, std, 1.0).tolist()
        return self

    def apply(self, bags: Bags, markers: Sequence[str]) -> Bags:
        """Subsample, transform and scale bags whose columns follow ``markers``."""
        bags = self.subsample(bags)
        x = self.scale_points(self._transform(bags.points, markers))
        return Bags(x, bags.offsets, bags.weights, validate=False)

    def subsample(self, bags: Bags) -> Bags:
        """The first step of :meth:`apply`: at most ``max_points`` cells per bag."""
        if self.max_points is None:
            return bags
        return subsample_bags(bags, self.max_points, self.seed)

    def transform_points(
        self, points: NDArray[np.float64], markers: Sequence[str]
    ) -> NDArray[np.float64]:
        """The second step of :meth:`apply`: the per-cell transform, without scaling."""
        return self._transform(points, markers)

    def scale_points(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """The last step of :meth:`apply`: the learned scaling of transformed cells."""
        if self.scale != "standard":
            return x
        if self.mean_ is None or self.std_ is None:
            raise ValueError("standard scaling is not fitted: call fit() on the training bags")
        return (x - np.asarray(self.mean_)) / np.asarray(self.std_)

    def compensate(self, sample: Sample) -> Sample:
        """The first step, on a whole sample: its compensation (:class:`Compensation`)."""
        return self.compensation.apply(sample)

    def to_json(self) -> dict[str, Any]:
        """The chain and its learned scaling, as stored in a model's manifest."""
        cof = dict(self.cofactor) if isinstance(self.cofactor, Mapping) else self.cofactor
        return {
            "compensation": self.compensation.to_json(),
            "transform": self.transform,
            "cofactor": cof,
            "default_cofactor": self.default_cofactor,
            "log_floor": self.log_floor,
            "scale": self.scale,
            "max_points": self.max_points,
            "seed": self.seed,
            "T": self.T,
            "W": self.W,
            "M": self.M,
            "A": self.A,
            "markers": {k: dict(v) for k, v in self.markers.items()},
            "mean_": self.mean_,
            "std_": self.std_,
        }

    @classmethod
    def from_json(cls, spec: Mapping[str, Any]) -> Preprocessing:
        """The preprocessing that :meth:`to_json` described, scaling included."""
        return cls(**dict(spec))


def _check_spec(where: str, spec: tuple) -> None:
    """Refuse a transform or parameters that would give NaN or a meaningless scale."""
    kind, cofactor, T, W, M, A = spec
    if kind not in TRANSFORMS:
        raise ValueError(f"{where}transform must be one of {list(TRANSFORMS)}, got {kind!r}")
    if kind == "arcsinh" and not cofactor > 0:
        raise ValueError(f"{where}cofactor must be > 0, got {cofactor}")
    # The conditions of GatingML 2.0 for a valid logicle (and hyperlog) scale.
    if kind in ("logicle", "hyperlog") and not (
        T > 0 and M > 0 and 0 <= W <= M / 2 and -W <= A <= M - 2 * W
    ):
        raise ValueError(
            f"{where}{kind} needs T > 0, M > 0, 0 <= W <= M/2 and -W <= A <= M - 2W; "
            f"got T={T}, W={W}, M={M}, A={A}"
        )
