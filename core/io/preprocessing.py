"""The per-cell preprocessing stored with a model and re-applied at prediction.

:class:`Preprocessing` chains a seeded subsample of huge bags (independent of cell
order), a transform (``arcsinh`` with a cofactor, ``log``) and per-marker standard
scaling learned on the training cells. The scaling is learned from per-bag
:class:`BagMoments`, so that training in memory, streaming from files or on a cluster
learns the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from ..bags import Bags, subsample_bags

__all__ = ["BagMoments", "Preprocessing", "Transform"]


Transform = Literal["none", "arcsinh", "log"]


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
    transform : {"none", "arcsinh", "log"}
        ``arcsinh(x / cofactor)``, or ``log10(max(x, log_floor))``.
    cofactor : float or mapping of marker to float
        One cofactor, or one per marker (panel names; others use ``default_cofactor``).
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
    mean_: list[float] | None = None
    std_: list[float] | None = None

    def __post_init__(self) -> None:
        if self.transform not in ("none", "arcsinh", "log"):
            raise ValueError(
                f"transform must be 'none', 'arcsinh' or 'log', got {self.transform!r}"
            )
        if self.scale not in ("none", "standard"):
            raise ValueError(f"scale must be 'none' or 'standard', got {self.scale!r}")
        if self.max_points is not None and self.max_points < 2:
            raise ValueError(f"max_points must be >= 2 or None, got {self.max_points}")

    def _cofactors(self, markers: Sequence[str]) -> NDArray[np.float64]:
        """One arcsinh cofactor per marker, in ``markers`` order."""
        if isinstance(self.cofactor, Mapping):
            return np.array([float(self.cofactor.get(m, self.default_cofactor)) for m in markers])
        return np.full(len(markers), float(self.cofactor))

    def _transform(self, x: NDArray[np.float64], markers: Sequence[str]) -> NDArray[np.float64]:
        if self.transform == "arcsinh":
            return np.arcsinh(x / self._cofactors(markers))
        if self.transform == "log":
            return np.log10(np.maximum(x, self.log_floor))
        return x

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
        t = self._transform(points, markers)
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

    def to_json(self) -> dict[str, Any]:
        """The chain and its learned scaling, as stored in a model's manifest."""
        cof = dict(self.cofactor) if isinstance(self.cofactor, Mapping) else self.cofactor
        return {
            "transform": self.transform,
            "cofactor": cof,
            "default_cofactor": self.default_cofactor,
            "log_floor": self.log_floor,
            "scale": self.scale,
            "max_points": self.max_points,
            "seed": self.seed,
            "mean_": self.mean_,
            "std_": self.std_,
        }

    @classmethod
    def from_json(cls, spec: Mapping[str, Any]) -> Preprocessing:
        """The preprocessing that :meth:`to_json` described, scaling included."""
        return cls(**dict(spec))
