"""The typed answers of a model: what :class:`~bagserve.core.runtime.ModelRuntime` returns.

* :class:`ModelKind`: what a model answers for each bag.
* :class:`RegressionPrediction`, :class:`ClassificationPrediction`,
  :class:`ConditionalPrediction` and :class:`CellPrediction`, each with the bag sizes,
  an applicability-domain report (:class:`~bagserve.core.domain.DomainReport`) where
  the model has one, a prediction interval where one was asked for and the model gives
  one, and a status per bag (``FINAL``, ``PRELIMINARY``, ``WITHHELD``: what the
  out-of-domain policy of :mod:`bagserve.core.policy` made of it).
* They turn into named arrays and back (:meth:`Prediction.to_arrays`,
  :func:`prediction_from_arrays`), which is how they cross a process boundary.

Plain data: nothing here imports an estimator, the runtime or the policy.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from .domain import DomainReport

__all__ = [
    "FINAL",
    "PRELIMINARY",
    "RESULT_TYPES",
    "STATUSES",
    "WITHHELD",
    "CellPrediction",
    "ClassificationPrediction",
    "ConditionalPrediction",
    "ModelKind",
    "Prediction",
    "RegressionPrediction",
    "prediction_from_arrays",
]

#: The status of a bag's answer (:mod:`bagserve.core.policy` decides which).
FINAL, PRELIMINARY, WITHHELD = "final", "preliminary", "withheld"
STATUSES = (FINAL, PRELIMINARY, WITHHELD)


class ModelKind(enum.StrEnum):
    """What a model answers for each bag."""

    #: A value (or a vector of values) per bag.
    REGRESSION = "regression"
    #: A class per bag, with a score per class.
    CLASSIFICATION = "classification"
    #: A conditional distribution per bag: its mean, quantiles, exceedance probabilities.
    CONDITIONAL = "conditional"
    #: A label (or value) per point, and per bag a report on how close it is to the
    #: training bags.
    CELL = "cell"


@dataclass(frozen=True)
class Prediction(abc.ABC):
    """What every model answers, besides its own values.

    Attributes
    ----------
    sizes : ndarray of int, shape (n_bags,)
        Points in each bag, in request order.
    domain : DomainReport or None
        Applicability domain of each bag, for models that have one.
    interval : ndarray of shape (n_bags, 2) or None
        A prediction interval ``[lo, hi]`` per bag, when one was asked for and the
        model gives one.
    clipped : ndarray of int, shape (n_bags,), or None
        Points of each bag that lay outside the training range and were clipped into
        it (representations with a bounded domain).
    status : ndarray of str, shape (n_bags,), or None
        ``"final"``, ``"preliminary"`` or ``"withheld"`` per bag, from the model's
        out-of-domain policy (:mod:`bagserve.core.policy`); ``None`` reads as final.
    """

    kind: ClassVar[ModelKind]

    sizes: NDArray[np.int64]
    domain: DomainReport | None = field(default=None, kw_only=True)
    interval: NDArray[np.float64] | None = field(default=None, kw_only=True)
    clipped: NDArray[np.int64] | None = field(default=None, kw_only=True)
    status: NDArray[Any] | None = field(default=None, kw_only=True)

    @property
    def n_bags(self) -> int:
        return int(self.sizes.shape[0])

    def status_of(self, i: int) -> str:
        """Bag ``i``'s status (:mod:`bagserve.core.policy`)."""
        return FINAL if self.status is None else str(self.status[i])

    def released(self, i: int) -> bool:
        """Whether bag ``i``'s value may be shown (not withheld by the policy)."""
        return self.status_of(i) != WITHHELD

    def prediction_set(self, i: int) -> list[Any] | None:
        """The classes in bag ``i``'s conformal prediction set; None where the answer
        has no sets (every kind but a classification asked with a coverage)."""
        return None

    @property
    @abc.abstractmethod
    def estimate(self) -> NDArray[Any]:
        """The model's answer: one row per bag (per point for per-cell models)."""

    def to_arrays(self) -> dict[str, NDArray[Any]]:
        """Every field as a named array (``domain.score``, ...); absent fields omitted."""
        out: dict[str, NDArray[Any]] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if dataclasses.is_dataclass(value):
                for g in dataclasses.fields(value):
                    part = getattr(value, g.name)
                    if part is not None:
                        out[f"{f.name}.{g.name}"] = np.asarray(part)
            else:
                out[f.name] = np.asarray(value)
        return out


@dataclass(frozen=True)
class RegressionPrediction(Prediction):
    """Bag-level values.

    Attributes
    ----------
    values : ndarray of shape (n_bags,) or (n_bags, n_outputs)
    """

    kind: ClassVar[ModelKind] = ModelKind.REGRESSION
    values: NDArray[np.float64] = field(kw_only=True)

    @property
    def estimate(self) -> NDArray[np.float64]:
        return self.values


@dataclass(frozen=True)
class ClassificationPrediction(Prediction):
    """Bag-level classes with a score per class.

    Attributes
    ----------
    labels : ndarray of shape (n_bags,)
        The predicted class of each bag.
    classes : ndarray of shape (n_classes,)
        The classes, in the order of the score columns.
    scores : ndarray of shape (n_bags, n_classes)
        Decision scores (higher means more likely); for two classes the binary margin
        ``s`` is given as ``[-s, s]``.
    probabilities : ndarray of shape (n_bags, n_classes) or None
        Calibrated class probabilities, where the model gives them.
    sets : ndarray of bool, shape (n_bags, n_classes), or None
        Conformal prediction sets (``True``: the class is in the bag's set), when a
        coverage was asked for.
    """

    kind: ClassVar[ModelKind] = ModelKind.CLASSIFICATION
    labels: NDArray[Any] = field(kw_only=True)
    classes: NDArray[Any] = field(kw_only=True)
    scores: NDArray[np.float64] = field(kw_only=True)
    probabilities: NDArray[np.float64] | None = field(default=None, kw_only=True)
    sets: NDArray[np.bool_] | None = field(default=None, kw_only=True)

    def set_of(self, i: int) -> list[Any]:
        """The classes in bag ``i``'s prediction set."""
        assert self.sets is not None
        return self.classes[self.sets[i]].tolist()

    def prediction_set(self, i: int) -> list[Any] | None:
        return None if self.sets is None else self.set_of(i)

    @property
    def estimate(self) -> NDArray[Any]:
        return self.labels


@dataclass(frozen=True)
class ConditionalPrediction(Prediction):
    """A conditional distribution per bag, read off the conditional mean embedding.

    Attributes
    ----------
    mean : ndarray of shape (n_bags,) or (n_bags, n_outputs)
    levels : ndarray of shape (n_levels,)
        Quantile levels asked for.
    quantiles : ndarray of shape (n_bags, n_levels)
    thresholds : ndarray of shape (n_thresholds,)
        Thresholds ``t`` asked for.
    exceedance : ndarray of shape (n_bags, n_thresholds)
        ``P(outcome > t)``.
    """

    kind: ClassVar[ModelKind] = ModelKind.CONDITIONAL
    mean: NDArray[np.float64] = field(kw_only=True)
    levels: NDArray[np.float64] = field(kw_only=True)
    quantiles: NDArray[np.float64] = field(kw_only=True)
    thresholds: NDArray[np.float64] = field(kw_only=True)
    exceedance: NDArray[np.float64] = field(kw_only=True)

    @property
    def estimate(self) -> NDArray[np.float64]:
        return self.mean


@dataclass(frozen=True)
class CellPrediction(Prediction):
    """A label (or value) for every point of every bag, bag after bag.

    Attributes
    ----------
    labels : ndarray of shape (n_points,) or (n_points, n_outputs)
        Points of bag ``i`` are ``labels[offsets[i]:offsets[i + 1]]``.
    domain : DomainReport
        Always present: how close each bag is to the training tasks.
    classes : ndarray of shape (n_classes,) or None
        Classifiers: the class names, as given at training.
    counts : ndarray of int, shape (n_bags, n_classes), or None
        Classifiers: cells of each bag given each class (the population summary).
    mean_probabilities : ndarray of shape (n_bags, n_classes) or None
        Calibrated classifiers: each class's probability averaged over the bag's cells,
        the expected fraction of the bag in that class.
    probabilities : ndarray of shape (n_points, n_classes) or None
        Every cell's class probabilities, when asked for.
    """

    kind: ClassVar[ModelKind] = ModelKind.CELL
    labels: NDArray[Any] = field(kw_only=True)
    classes: NDArray[Any] | None = field(default=None, kw_only=True)
    counts: NDArray[np.int64] | None = field(default=None, kw_only=True)
    mean_probabilities: NDArray[np.float64] | None = field(default=None, kw_only=True)
    probabilities: NDArray[np.float64] | None = field(default=None, kw_only=True)

    @property
    def estimate(self) -> NDArray[Any]:
        return self.labels

    @property
    def offsets(self) -> NDArray[np.int64]:
        return np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def labels_of(self, i: int) -> NDArray[Any]:
        """The labels of bag ``i``'s points."""
        o = self.offsets
        return self.labels[o[i] : o[i + 1]]

    def probabilities_of(self, i: int) -> NDArray[np.float64] | None:
        """The class probabilities of bag ``i``'s points, when they were asked for."""
        if self.probabilities is None:
            return None
        o = self.offsets
        return self.probabilities[o[i] : o[i + 1]]

    def population(self, i: int) -> list[dict[str, Any]] | None:
        """Bag ``i``'s population summary: per class its ``count`` of cells, their
        ``percent`` and (calibrated models) the ``mean_probability``; None for a
        per-cell regressor."""
        if self.classes is None or self.counts is None:
            return None
        counts = self.counts[i]
        total = max(int(counts.sum()), 1)
        rows = []
        for k, name in enumerate(self.classes.tolist()):
            row: dict[str, Any] = {
                "class": name,
                "count": int(counts[k]),
                "percent": 100.0 * float(counts[k]) / total,
            }
            if self.mean_probabilities is not None:
                row["mean_probability"] = float(self.mean_probabilities[i, k])
            rows.append(row)
        return rows


RESULT_TYPES: dict[ModelKind, type[Prediction]] = {
    t.kind: t
    for t in (RegressionPrediction, ClassificationPrediction, ConditionalPrediction, CellPrediction)
}


def prediction_from_arrays(kind: ModelKind | str, arrays: Mapping[str, NDArray[Any]]) -> Prediction:
    """The inverse of :meth:`Prediction.to_arrays` for a model of ``kind``."""
    cls = RESULT_TYPES[ModelKind(kind)]
    values: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for name, array in arrays.items():
        head, _, tail = name.partition(".")
        if tail:
            nested.setdefault(head, {})[tail] = array
        else:
            values[name] = array
    if "domain" in nested:
        values["domain"] = DomainReport(**nested["domain"])
    return cls(**values)
