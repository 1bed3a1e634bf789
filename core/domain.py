"""Applicability domain: how far a new bag lies from the bags a model was trained on.

Every model of the core compares bags through an embedding whose distance is a
distribution distance (sliced Wasserstein, MMD, Hellinger, ...). The domain check asks,
in that geometry, whether a new bag looks like the training bags:

* **score**: the mean embedding distance from the bag to its ``k`` nearest training
  bags, in units of the median of the same quantity over the training bags (each
  measured against the *other* training bags, leave-one-out). A typical training bag
  scores about 1; a bag from another instrument, species or panel scores far more.
* **out of range**: the score exceeds the conformal quantile of the training bags' own
  leave-one-out scores at level ``quantile`` (conformal anomaly detection, Laxhammar &
  Falkman, Ann. Math. Artif. Intell. 74, 2015; Vovk, Gammerman & Shafer, *Algorithmic
  Learning in a Random World*, 2005, ch. 4). If a new bag and the training bags are
  exchangeable, it is flagged with probability at most ``1 - quantile``; with fewer than
  ``1 / (1 - quantile) - 1`` training bags the threshold is the largest training score.
* **nearest**: the training bags nearest to it, nearest first, and the model's kernel
  between them and the bag where the model has a radial kernel.

:class:`DomainReport` is the answer for a batch of bags; :class:`DomainCalibration`
holds what the check needs from training, as plain arrays that model artifacts store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "DEFAULT_QUANTILE",
    "NEAREST",
    "DomainCalibration",
    "DomainReport",
    "knn_mean_distances",
]

#: Training bags the score averages over (fewer when there are fewer other bags).
K_NEAREST = 3
#: Nearest training bags named in a report.
NEAREST = 3
#: Level of the out-of-range threshold: at most 5% of in-domain bags are flagged.
DEFAULT_QUANTILE = 0.95


def _measured(values: NDArray[np.float64], i: int) -> float | None:
    """Entry ``i`` as a float, ``None`` where it is NaN (not measured)."""
    v = float(values[i])
    return None if np.isnan(v) else v


@dataclass(frozen=True)
class DomainReport:
    """How far each bag lies from the training data (its applicability domain).

    Attributes
    ----------
    score : ndarray of shape (n_bags,)
        Distance to the nearest training bags in units calibrated on the training bags
        (about 1 for a typical training bag; see the module docstring).
    out_of_range : ndarray of bool, shape (n_bags,)
        The bag is unlike the training data: its answer deserves less trust.
    nearest : ndarray of int, shape (n_bags, k)
        Indices of the nearest training bags, nearest first; ``-1`` pads rows when
        there are fewer than ``k`` training bags.
    similarities : ndarray of shape (n_bags, k)
        The model's kernel between the bag and each of ``nearest`` (NaN where the model
        has no radial kernel, 0 where padded).
    distance : ndarray of shape (n_bags,)
        The embedding distance to the nearest training bag, uncalibrated.
    fallback : ndarray of bool, shape (n_bags,)
        The bag was out of range and answered by the model's invariant fallback
        (marginal transfer with ``normalise="auto"``); all false by default.
    disagreement : ndarray of shape (n_bags,)
        How differently the model and its fallback answered the bag (share of cells
        labelled differently, or root mean square difference); NaN where not
        measured (no fallback, or the bag was already out of range), the default.
    relabelled : ndarray of shape (n_bags,)
        Share of the bag's cells whose label a refinement by the bag's own cells
        changed (marginal transfer, ``refine_ == "mixture"``); NaN where none ran,
        the default.
    calibration_moved : ndarray of shape (n_bags, n_markers) or None
        Where a per-marker map moved the bags first (marginal transfer calibrated by
        a batch's reference control or by landmarks): per marker, the median
        displacement of the bag's cells, in the training control's standard
        deviations (control) or the training samples' (landmarks; 0 where the bag
        was left as measured); ``None`` for other calibrations.
    calibration_worse : ndarray of bool, shape (n_bags, n_markers), or None
        The markers the map moved further from the training batch: from the
        training control on control cells it was not fitted on (control), from the
        training populations' places (landmarks, whose map is refused where its
        evidence lies in such markers).
    calibration_by : ndarray of str, shape (n_bags,), or None
        Which map ``calibration_moved`` and ``calibration_worse`` describe:
        ``"control"`` or ``"landmarks"``.
    calibration_refused : ndarray of bool, shape (n_bags,), or None
        Landmarks: the bags whose map was refused (answered as measured because the
        map's gain lay in the markers it made worse).
    suspect_markers : ndarray of bool, shape (n_bags, n_markers), or None
        Marginal transfer: the markers of each bag not measured as the training
        batch measures them (cells all at one value, a copy of another marker, or a
        cell a thousand training SDs off), each of which puts the bag out of range;
        ``None`` for other models.
    calibrated : ndarray of str, shape (n_bags,), or None
        How each bag was calibrated to the training batch before it was labelled
        (marginal transfer: ``"control"``, ``"landmarks"``, ``"standardise"``; ``""``
        where it was not); ``None`` for models that do not calibrate.
    calibration_shift : ndarray of shape (n_bags,) or None
        How far that calibration moved each bag, in training standard deviations (the
        largest over markers of a cell's median displacement); beyond what instrument
        shifts need, the bag is out of range. ``None`` for models that do not calibrate.
    """

    score: NDArray[np.float64]
    out_of_range: NDArray[np.bool_]
    nearest: NDArray[np.int64]
    similarities: NDArray[np.float64]
    distance: NDArray[np.float64]
    fallback: NDArray[np.bool_] | None = None
    disagreement: NDArray[np.float64] | None = None
    relabelled: NDArray[np.float64] | None = None
    calibration_moved: NDArray[np.float64] | None = None
    calibration_worse: NDArray[np.bool_] | None = None
    calibration_by: NDArray[np.str_] | None = None
    calibration_refused: NDArray[np.bool_] | None = None
    suspect_markers: NDArray[np.bool_] | None = None
    calibrated: NDArray[np.str_] | None = None
    calibration_shift: NDArray[np.float64] | None = None

    def __post_init__(self) -> None:
        # Frozen: the defaults are set once, as arrays like the others.
        if self.fallback is None:
            object.__setattr__(self, "fallback", np.zeros(np.shape(self.out_of_range), bool))
        if self.disagreement is None:
            object.__setattr__(self, "disagreement", np.full(np.shape(self.out_of_range), np.nan))
        if self.relabelled is None:
            object.__setattr__(self, "relabelled", np.full(np.shape(self.out_of_range), np.nan))

    def disagreement_of(self, i: int) -> float | None:
        """Bag ``i``'s disagreement, ``None`` where it was not measured."""
        return _measured(self.disagreement, i)

    def calibration_shift_of(self, i: int) -> float | None:
        """How far bag ``i``'s calibration moved it, ``None`` where not measured."""
        return None if self.calibration_shift is None else _measured(self.calibration_shift, i)

    def calibrated_of(self, i: int) -> str | None:
        """How bag ``i`` was calibrated, ``None`` where it was not."""
        if self.calibrated is None:
            return None
        return str(self.calibrated[i]) or None

    def relabelled_of(self, i: int) -> float | None:
        """Bag ``i``'s share of relabelled cells, ``None`` where no refinement ran."""
        return _measured(self.relabelled, i)

    def nearest_of(self, i: int) -> list[int]:
        """The nearest training bags of bag ``i``, padding dropped."""
        return [int(t) for t in self.nearest[i] if t >= 0]

    def similarities_of(self, i: int) -> list[float]:
        """The similarities of bag ``i`` to :meth:`nearest_of`."""
        pairs = zip(self.similarities[i], self.nearest[i], strict=True)
        return [float(s) for s, t in pairs if t >= 0]


def knn_mean_distances(
    sq: NDArray[np.float64], k: int, *, leave_one_out: bool = False
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Mean distance of each row's ``k`` nearest columns, and the columns by distance.

    Parameters
    ----------
    sq : ndarray of shape (n, T)
        Squared embedding distances (negative round-off is clipped).
    k : int
    leave_one_out : bool, default=False
        ``sq`` is the square training matrix and each row must skip itself.

    Returns
    -------
    mean : ndarray of shape (n,)
    order : ndarray of int, shape (n, T)
        Columns sorted by distance, nearest first (ties in column order).
    """
    d = np.sqrt(np.maximum(sq, 0.0))
    if leave_one_out:
        d = d.copy()
        np.fill_diagonal(d, np.inf)
    order = np.argsort(d, axis=1, kind="stable")
    k = max(1, min(k, d.shape[1] - (1 if leave_one_out else 0)))
    nearest = np.take_along_axis(d, order[:, :k], axis=1)
    return nearest.mean(axis=1), order


@dataclass(frozen=True)
class DomainCalibration:
    """What the domain check keeps from training.

    Attributes
    ----------
    k : int
        Nearest training bags the score averages over.
    scale : float
        Median leave-one-out ``k``-nearest distance among the training bags.
    scores : ndarray of shape (T,)
        The training bags' own leave-one-out scores.
    threshold : float
        Scores above it are out of range.
    quantile : float
        The level ``threshold`` was taken at.
    """

    k: int
    scale: float
    scores: NDArray[np.float64]
    threshold: float
    quantile: float

    @classmethod
    def fit(
        cls, loo_distances: NDArray[np.float64], k: int, quantile: float = DEFAULT_QUANTILE
    ) -> DomainCalibration:
        """Calibrate on the training bags' leave-one-out ``k``-nearest mean distances.

        Parameters
        ----------
        loo_distances : ndarray of shape (T,)
            For each training bag, the mean distance to its ``k`` nearest *other*
            training bags (:func:`knn_mean_distances` with ``leave_one_out=True``).
        k : int
        quantile : float, default=0.95
        """
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must lie in (0, 1), got {quantile!r}")
        T = loo_distances.shape[0]
        scale = float(np.median(loo_distances))
        if not scale > 0.0:  # duplicated training bags: fall back to the mean, then 1
            scale = float(loo_distances.mean()) or 1.0
        scores = loo_distances / scale
        # Finite-sample conformal quantile: the ceil(q (T + 1))-th smallest score.
        rank = min(T, int(np.ceil(quantile * (T + 1))))
        threshold = float(np.sort(scores)[rank - 1])
        return cls(k=k, scale=scale, scores=scores, threshold=threshold, quantile=quantile)

    def report(
        self,
        sq_new: NDArray[np.float64],
        similarity: Callable[[NDArray[np.float64]], NDArray[np.float64]] | None = None,
    ) -> DomainReport:
        """The report for new bags from their squared distances to the training bags.

        Parameters
        ----------
        sq_new : ndarray of shape (n_bags, T)
        similarity : callable, optional
            The model's kernel as a function of squared distances; without one the
            similarities are NaN.
        """
        raw, order = knn_mean_distances(sq_new, self.k)
        score = raw / self.scale
        width = min(NEAREST, sq_new.shape[1])
        nearest = np.full((sq_new.shape[0], NEAREST), -1, dtype=np.int64)
        nearest[:, :width] = order[:, :width]
        sims = np.zeros((sq_new.shape[0], NEAREST))
        picked = np.take_along_axis(sq_new, order[:, :width], axis=1)
        sims[:, :width] = np.nan if similarity is None else similarity(picked)
        first = np.take_along_axis(sq_new, order[:, :1], axis=1)[:, 0]
        return DomainReport(
            score=score,
            out_of_range=score > self.threshold,
            nearest=nearest,
            similarities=sims,
            distance=np.sqrt(np.maximum(first, 0.0)),
        )

    def to_state(self) -> dict[str, object]:
        """As fitted attributes of an estimator (plain values that artifacts store)."""
        return {
            "domain_k_": self.k,
            "domain_scale_": self.scale,
            "domain_scores_": self.scores,
            "domain_threshold_": self.threshold,
            "domain_quantile_": self.quantile,
        }

    @classmethod
    def from_state(cls, owner: object) -> DomainCalibration | None:
        """The calibration an estimator stored with :meth:`to_state` (``None`` for a
        model fitted before the domain check existed)."""
        if not hasattr(owner, "domain_scale_"):
            return None
        return cls(
            k=int(owner.domain_k_),  # type: ignore[attr-defined]
            scale=float(owner.domain_scale_),  # type: ignore[attr-defined]
            scores=np.asarray(owner.domain_scores_),  # type: ignore[attr-defined]
            threshold=float(owner.domain_threshold_),  # type: ignore[attr-defined]
            quantile=float(owner.domain_quantile_),  # type: ignore[attr-defined]
        )
