"""One model runtime: a saved artifact that knows what it answers, and answers it typed.

Everything that predicts with a saved model goes through here: the ``bagserve predict``
and ``bagserve evaluate`` commands, the service's worker processes, and (through
:class:`ArtifactInfo`, which reads the manifest only) the service's registry and its
encoders. Nothing else decides from an estimator's class what kind of answer a model
gives, how its input is aligned and preprocessed, or how its answer is shaped.

* :class:`ArtifactInfo`: a verified manifest: kind, panel, preprocessing, sizes, hashes.
* :class:`ModelRuntime`: the info plus the fitted estimator; :meth:`ModelRuntime.predict`
  returns one of the typed results below.
* Results: :class:`RegressionPrediction`, :class:`ClassificationPrediction`,
  :class:`ConditionalPrediction` and :class:`CellPrediction`, each with the bag sizes,
  an applicability-domain report (:class:`DomainReport`) where the model has one, and a
  prediction interval where one was asked for and the model gives one. They turn into
  named arrays and back (:meth:`Prediction.to_arrays`, :func:`prediction_from_arrays`),
  which is how they cross a process boundary.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numpy.typing import NDArray

# The estimators (scikit-learn, scipy) are imported where a model is loaded or its
# class asked about: reading a manifest (ArtifactInfo, ``bagserve models list``) does
# without them.
from .artifacts import (
    ARRAY_DIR,
    ArtifactError,
    VerifiedArtifact,
    estimator_class,
    load_verified,
    read_manifest,
    read_verified,
)
from .bags import Bags
from .domain import DomainReport
from .fhir_coding import OutputCoding
from .hashing import bytes_sha256
from .io import Panel, Preprocessing, Sample
from .policy import DEFAULT_POLICY, FINAL, POLICIES, WITHHELD, statuses, withheld_reason

if TYPE_CHECKING:
    from .explanations import Explanation

__all__ = [
    "ArtifactInfo",
    "CellPrediction",
    "ClassificationPrediction",
    "ConditionalPrediction",
    "DomainReport",
    "ModelKind",
    "ModelRuntime",
    "Prediction",
    "RegressionPrediction",
    "kind_of",
    "prediction_from_arrays",
]

#: Bag-level models predict chunks of bags of at most this many points in all (a bag
#: larger than that is a chunk of its own): it bounds the memory of one call.
CHUNK_POINTS = 2_000_000


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


def kind_of(cls: type) -> ModelKind:
    """The kind of answer of a core estimator class (the one place that decides it)."""
    from sklearn.base import ClassifierMixin

    from .estimators import ConditionalMeanEmbedding
    from .estimators.transfer import is_cell_model

    if is_cell_model(cls):
        return ModelKind.CELL
    if issubclass(cls, ConditionalMeanEmbedding):
        return ModelKind.CONDITIONAL
    if issubclass(cls, ClassifierMixin):
        return ModelKind.CLASSIFICATION
    return ModelKind.REGRESSION


#: :func:`kind_of` of the core's estimator classes, by name, so that reading a manifest
#: does not import every estimator to ask its class hierarchy (tests/test_imports.py
#: checks it against :func:`kind_of`). A name not listed is asked :func:`kind_of`.
_KNOWN_KINDS: dict[str, ModelKind] = {
    "ConditionalMeanEmbedding": ModelKind.CONDITIONAL,
    "DistributionRidge": ModelKind.REGRESSION,
    "DistributionRidgeClassifier": ModelKind.CLASSIFICATION,
    "MarginalTransferClassifier": ModelKind.CELL,
    "MarginalTransferRegressor": ModelKind.CELL,
}


# ----------------------------------------------------------------------------- results
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
        out-of-domain policy (:mod:`core.policy`); ``None`` reads as final.
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
        """Bag ``i``'s status (:mod:`core.policy`)."""
        return FINAL if self.status is None else str(self.status[i])

    def released(self, i: int) -> bool:
        """Whether bag ``i``'s value may be shown (not withheld by the policy)."""
        return self.status_of(i) != WITHHELD

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


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ArtifactInfo:
    """What an artifact's manifest says about the model, without loading its arrays.

    Parameters
    ----------
    path : Path
        The artifact directory.
    manifest : dict
        Its manifest, as :func:`~bagserve.core.artifacts.read_manifest` returns it.
    """

    path: Path
    manifest: dict[str, Any] = field(repr=False)

    @classmethod
    def read(cls, path: str | Path, *, verify: bool = True) -> ArtifactInfo:
        """Read (and by default verify every hash of) the artifact at ``path``."""
        return cls(Path(path), read_manifest(path, verify=verify))

    @property
    def estimator(self) -> str:
        """The estimator's class name."""
        return str(self.manifest["estimator"]["class"])

    @cached_property
    def kind(self) -> ModelKind:
        """What the model answers (:class:`ModelKind`)."""
        known = _KNOWN_KINDS.get(self.estimator)
        return known if known is not None else kind_of(estimator_class(self.estimator))

    @cached_property
    def classifies(self) -> bool:
        """The model answers classes (per bag, or per point for per-cell models)."""
        from sklearn.base import ClassifierMixin

        return issubclass(estimator_class(self.estimator), ClassifierMixin)

    @cached_property
    def training_names(self) -> list[str]:
        """Names of the training bags (file names), in the model's order; empty for a
        model trained from arrays or before names were recorded."""
        bags = self.metadata.get("training_bags") or []
        names = [str(b.get("name", "")) if isinstance(b, Mapping) else str(b) for b in bags]
        # Models trained before names were stable recorded paths relative to the
        # configuration: the file name is all an answer should show of them.
        return [n.replace("\\", "/").rsplit("/", 1)[-1] for n in names]

    def nearest_names(self, domain: DomainReport, i: int) -> list[str]:
        """The nearest training bags of bag ``i`` of a domain report, by name (file
        name), or ``#index`` where the artifact records no names."""
        names = self.training_names
        return [names[t] if t < len(names) else f"#{t}" for t in domain.nearest_of(i)]

    def domain_of(self, domain: DomainReport, i: int) -> dict[str, Any]:
        """Bag ``i``'s domain report as JSON: ``score``, ``out_of_range``, ``nearest``,
        ``fallback``, ``disagreement``, ``relabelled``."""
        return {
            "score": float(domain.score[i]),
            "out_of_range": bool(domain.out_of_range[i]),
            "nearest": self.nearest_names(domain, i),
            "fallback": bool(domain.fallback[i]),
            "disagreement": domain.disagreement_of(i),
            "relabelled": domain.relabelled_of(i),
        }

    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self.manifest.get("metadata") or {})

    @property
    def out_of_domain_policy(self) -> str:
        """What answers do for a bag outside the applicability domain (:mod:`core.policy`):
        the training configuration's ``[serving] out_of_domain``, else the default."""
        policy = (self.metadata.get("serving") or {}).get("out_of_domain", DEFAULT_POLICY)
        # A policy this version does not know (a newer bagserve's) fails safe.
        return policy if policy in POLICIES else "withhold"

    def domain_note(self, domain: DomainReport, i: int) -> str:
        """Bag ``i``'s applicability domain in words, for a report's notes (FHIR
        ``note``, HL7 ``NTE``): in or out, its score, its nearest training samples, and
        whether the fallback answered."""
        nearest = ", ".join(self.nearest_names(domain, i)) or "not recorded"
        score = float(domain.score[i])
        if not bool(domain.out_of_range[i]):
            return (
                f"Within the model's applicability domain (score {score:.4g}); nearest "
                f"training samples: {nearest}."
            )
        fallback = domain.fallback is not None and bool(domain.fallback[i])
        return (
            f"Outside the model's applicability domain (score {score:.4g}): the sample is "
            f"unlike every training sample; nearest training samples: {nearest}."
            + (" Answered by the model's fallback on the per-sample standardised sample."
               if fallback else "")
        )  # fmt: skip

    def withheld_reason(self, domain: DomainReport, i: int) -> str:
        """Why bag ``i``'s answer was withheld, with its nearest training samples."""
        threshold = self._state.get("domain_threshold_")
        nearest = ", ".join(self.nearest_names(domain, i)) or "not recorded"
        return (
            withheld_reason(float(domain.score[i]), None if threshold is None else float(threshold))
            + f"; nearest training samples: {nearest}"
        )

    @property
    def sha256(self) -> str:
        """The manifest's own digest: it covers every file of the artifact."""
        return str(self.manifest["manifest_sha256"])

    @cached_property
    def panel(self) -> Panel | None:
        """The input markers, matched by name; ``None`` for models trained on arrays."""
        spec = self.metadata.get("panel")
        return Panel.from_json(spec) if spec else None

    @cached_property
    def preprocessing(self) -> Preprocessing:
        """The preprocessing fitted with the model, applied before every prediction."""
        spec = self.metadata.get("preprocessing")
        return Preprocessing.from_json(spec) if spec else Preprocessing()

    @cached_property
    def output_coding(self) -> OutputCoding:
        """How the output is coded in FHIR answers: the training configuration's
        ``[fhir]`` table, or bagserve's own code system (:mod:`core.fhir_coding`)."""
        meta = self.metadata
        name = str(meta.get("name") or self.path.parent.name)
        return OutputCoding.from_json(meta.get("fhir"), name, meta.get("description"))

    @property
    def markers(self) -> list[str]:
        """Marker names in the model's column order (empty without a panel)."""
        return list(self.panel.markers) if self.panel is not None else []

    @property
    def _state(self) -> dict[str, Any]:
        return (self.manifest.get("model") or {}).get("state") or {}

    @property
    def n_features(self) -> int:
        """Columns each bag must have."""
        return int(self._state["n_features_in_"])

    @property
    def n_outputs(self) -> int:
        """Outputs per bag (regression and conditional models; 1 otherwise)."""
        return int(self._state.get("n_outputs_", 1))

    @cached_property
    def classes(self) -> list[str] | None:
        """The class labels of a classifier (bag-level or per-cell), as text, in the
        order of its score columns; None for other models.

        Read from the artifact's ``classes_`` array alone, its bytes checked against the
        manifest's sha256 first: answers' table columns are named by it before any bag
        is predicted (:mod:`bagserve.service.tables`).
        """
        # Only classifiers store classes_ (read without importing the estimators).
        ref = self._state.get("classes_")
        if not isinstance(ref, Mapping) or "__array__" not in ref:
            return None
        rel = f"{ARRAY_DIR}/{ref['__array__']}.npy"
        digest = (self.manifest.get("files") or {}).get(rel)
        try:
            data = (self.path / rel).read_bytes()
        except OSError as exc:
            raise ArtifactError(f"{self.path}: file {rel} is unreadable ({exc})") from exc
        if digest is None or bytes_sha256(data) != digest:
            raise ArtifactError(
                f"{self.path}: file {rel} does not match its sha256 (tampered or truncated)"
            )
        array = np.load(io.BytesIO(data), allow_pickle=False)
        return [str(c) for c in array.tolist()]

    def check_servable(self) -> None:
        """Refuse what a service predicting on bags cannot serve.

        Raises
        ------
        ArtifactError
            A pickle artifact (never loaded by a service), or a conditional model
            fitted on points rather than bags.
        """
        if self.manifest["estimator"].get("format") != "arrays":
            raise ArtifactError("pickle artifacts are not served")
        if (
            self.kind is ModelKind.CONDITIONAL
            and self.manifest["model"]["params"].get("representation") is None
        ):
            raise ArtifactError(
                "a ConditionalMeanEmbedding on points (no representation) cannot be served: "
                "the service predicts on bags"
            )

    def distribution_query_problem(self) -> str | None:
        """Why quantiles or exceedance probabilities cannot be asked of this model
        (``None`` when they can: a conditional model with a scalar output)."""
        if self.kind is not ModelKind.CONDITIONAL:
            return (
                "quantiles and exceed need a conditional model (ConditionalMeanEmbedding); "
                f"this is a {self.estimator}"
            )
        if self.n_outputs != 1:
            return f"quantiles and exceed need a scalar output; the model has {self.n_outputs}"
        return None

    @property
    def calibrated(self) -> bool:
        """The model stores what intervals, prediction sets and calibrated probabilities
        need (the held-out residuals of bag-level ridge models)."""
        state = self._state
        held_out = "loo_residuals_" in state or "cv_residuals_" in state
        return held_out or self.kind is ModelKind.CONDITIONAL

    def interval_problem(self, coverage: float) -> str | None:
        """Why an interval (or set) of ``coverage`` cannot be asked of this model
        (``None`` when it can)."""
        if not 0.0 < coverage < 1.0:
            return f"interval coverage must lie strictly between 0 and 1, got {coverage!r}"
        if self.kind is ModelKind.CELL:
            return "per-cell models give labels and a domain report, no interval"
        if not self.calibrated:
            return (
                f"this {self.estimator} was saved before intervals existed (no "
                "leave-one-bag-out residuals): retrain it to get intervals"
            )
        if self.n_outputs != 1 and self.kind is not ModelKind.CLASSIFICATION:
            return f"intervals need a scalar output; the model has {self.n_outputs}"
        return None

    @property
    def probability_temperature(self) -> float | None:
        """The temperature of a per-cell classifier's class probabilities, fitted by
        training on out-of-fold scores (:mod:`core.calibration`); None without one."""
        spec = self.metadata.get("probability_calibration")
        return None if not spec else float(spec["temperature"])

    def probability_problem(self) -> str | None:
        """Why per-cell class probabilities cannot be asked of this model (``None``
        when they can)."""
        if self.kind is not ModelKind.CELL or not self.classifies:
            return "class probabilities per cell come from per-cell classifiers only"
        if self.probability_temperature is None:
            return (
                "this model has no probability calibration (trained outside `bagserve "
                "train`, or before it calibrated): retrain it with `bagserve train`"
            )
        return None

    def far_cells_problem(self) -> str | None:
        """Why cells far from every population cannot be reported unassigned by this
        model (``None`` when they can: a per-cell classifier that kept its
        populations' statistics)."""
        if self.kind is not ModelKind.CELL or not self.classifies:
            return "unassigned cells come from per-cell classifiers only"
        state = (self.manifest.get("model") or {}).get("state") or {}
        if "population_means_" not in state:
            return (
                "this model keeps no statistics of its populations (trained before "
                "bagserve reported cells far from them): retrain it with `bagserve train`"
            )
        return None

    def control_problem(self, control: Bags | None = None) -> str | None:
        """Why a batch's reference control cannot map bags for this model (``None``
        when it can: a per-cell model fitted with its training batch's control and,
        given ``control``, one bag of at least 2 cells per quantile level)."""
        if self.kind is not ModelKind.CELL:
            return "a batch's reference control calibrates per-cell models only"
        state = (self.manifest.get("model") or {}).get("state") or {}
        # The design since issue 44 keeps it in its reference; the frozen one, alone.
        reference = (state.get("reference_") or {}).get("__dict__") or {}
        if state.get("control_quantiles_") is None and reference.get("control_quantiles") is None:
            return (
                "this model was trained without a reference control ([data] control in "
                "its training configuration): a batch's control has nothing to map onto"
            )
        if control is None:
            return None
        if len(control) != 1:
            return f"a batch has one reference control, got {len(control)} bags"
        from .alignment import CONTROL_LEVELS

        if control.n_points < 2 * CONTROL_LEVELS.size:
            return (
                f"the reference control has {control.n_points} cells; at least "
                f"{2 * CONTROL_LEVELS.size} are needed"
            )
        return None

    def card(self) -> str:
        """The model card (Markdown, :func:`core.card.render_card`) with provenance."""
        from .card import render_card

        return render_card(
            self.metadata,
            estimator=self.estimator,
            kind=str(self.kind),
            created=self.manifest.get("created"),
            sha256=self.sha256,
            libraries=self.manifest.get("libraries"),
        )

    def describe(self) -> dict[str, Any]:
        """A JSON summary: estimator, kind, panel, preprocessing, metrics, hashes."""
        meta = self.metadata
        return {
            "estimator": self.estimator,
            "kind": str(self.kind),
            "panel": None if self.panel is None else self.panel.to_json(),
            "n_markers": self.n_features,
            "preprocessing": meta.get("preprocessing"),
            "metrics": meta.get("metrics"),
            "description": meta.get("description"),
            "created": self.manifest.get("created"),
            "training_data_sha256": meta.get("training_data_sha256"),
            "sha256": self.sha256,
            "out_of_domain": self.out_of_domain_policy,
            **self.answer_shape(),
        }

    def answer_shape(self) -> dict[str, Any]:
        """What shapes the model's answers, as JSON: ``kind``, ``classes``,
        ``n_outputs``, ``calibrated`` (class probabilities, intervals and sets),
        ``intervals`` (an interval or set can be asked), ``cell_probabilities``. A
        table's columns follow from it and the request alone
        (:class:`bagserve.service.tables.TableLayout`), locally or from a service's
        ``GET /v1/models/{name}``."""
        return {
            "kind": str(self.kind),
            "classes": self.classes,
            "n_outputs": self.n_outputs,
            "calibrated": self.calibrated,
            "intervals": self.interval_problem(0.9) is None,
            "cell_probabilities": self.probability_problem() is None,
        }


class ModelRuntime:
    """A loaded model that aligns, preprocesses and predicts bags, with typed answers.

    Parameters
    ----------
    info : ArtifactInfo
    model : estimator
        The fitted estimator of the artifact.

    Examples
    --------
    >>> runtime = ModelRuntime.open("models/yeast-dose/1")  # doctest: +SKIP
    >>> bags = runtime.align([read_sample("Yeast_B1_B01.fcs")])  # doctest: +SKIP
    >>> runtime.predict(bags).values  # doctest: +SKIP
    """

    def __init__(self, info: ArtifactInfo, model: Any) -> None:
        self.info = info
        self.model = model
        self.kind = kind_of(type(model))

    @classmethod
    def open(cls, path: str | Path, *, mmap: bool = False, trusted: bool = False) -> ModelRuntime:
        """Load the artifact at ``path``: its files read once, verified, and computed
        from in memory (:func:`~bagserve.core.artifacts.read_verified`); changing the
        files afterwards changes none of its answers.

        Parameters
        ----------
        path : path
        mmap : bool, default=False
            Hold the arrays in a sealed anonymous memory file (read-only, shareable
            with other processes) instead of memory of this process.
        trusted : bool, default=False
            Allow a joblib (pickle) artifact.

        Raises
        ------
        ArtifactError
            The artifact does not verify (a file tampered with, truncated or missing),
            or cannot be loaded.
        """
        return cls.from_verified(read_verified(path, shared=mmap), trusted=trusted)

    @classmethod
    def from_verified(cls, verified: VerifiedArtifact, *, trusted: bool = False) -> ModelRuntime:
        """The runtime of an artifact read and verified already, in this process or
        in another one (:meth:`VerifiedArtifact.attach`): manifest and arrays both
        from its verified bytes."""
        info = ArtifactInfo(verified.path, verified.manifest)
        return cls(info, load_verified(verified, trusted=trusted))

    def align(self, samples: Sequence[Sample], *, compensated: bool = False) -> Bags:
        """Bags of the samples' columns, compensated as the model was trained, in the
        model's panel order (matched by name).

        Raises
        ------
        DataError
            A sample lacks one of the model's markers or, for a model that compensates,
            a spillover channel or its matrix (the error names it). With
            ``compensated=True`` the caller vouches that the cells were compensated
            already, and the model's compensation is skipped.
        """
        panel = self.info.panel
        compensation = self.info.preprocessing.compensation
        if not compensated:
            samples = [compensation.apply(s) for s in samples]
        if panel is None:
            return Bags.from_arrays([s.points for s in samples])
        return Bags.from_arrays([panel.select(s) for s in samples])

    def preprocess(self, bags: Bags) -> Bags:
        """The artifact's preprocessing (transforms, scaling) applied to aligned bags."""
        return self.info.preprocessing.apply(bags, self.info.markers)

    def predict(
        self,
        bags: Bags,
        *,
        quantiles: Sequence[float] = (),
        exceed: Sequence[float] = (),
        coverage: float | None = None,
        probabilities: bool = False,
        unassigned: float | None = None,
        control: Bags | None = None,
        preprocessed: bool = False,
    ) -> Prediction:
        """The model's typed answer for aligned bags.

        Parameters
        ----------
        bags : Bags
            Columns in the model's panel order (:meth:`align`).
        quantiles, exceed : sequence of float
            Quantile levels and exceedance thresholds (conditional models only).
        coverage : float in (0, 1), optional
            Add a prediction interval of this coverage to each bag's answer (conformal
            jackknife+ for regressors, the conditional quantiles ``(1 ∓ coverage) / 2``
            for conditional models) or a conformal prediction set (classifiers).
        probabilities : bool, default=False
            Per-cell classifiers: every cell's class probabilities (the population
            summary's mean probabilities come without asking).
        unassigned : float in (0, 1), optional
            Per-cell classifiers: cells beyond this χ² level of Mahalanobis distance
            from the population they were given (under its training covariance) are
            answered ``"unassigned"`` (:meth:`MarginalTransferClassifier.far_from_populations`),
            a row of their own in the population summary. The model's probabilities
            say nothing of that rule: asked together with ``probabilities`` it is
            refused, and the summary's mean probabilities are left out where it adds
            the row.
        control : Bags, optional
            Per-cell models fitted with a reference control: the control measured in
            the bags' batch (one bag, aligned like them), which maps every bag onto
            the training batch before the model answers
            (:meth:`MarginalTransferClassifier.predict_tasks`). Preprocessed with
            the bags.
        preprocessed : bool, default=False
            The bags (and the control) already went through :meth:`preprocess`.

        Returns
        -------
        Prediction
            A :class:`CellPrediction`, :class:`ClassificationPrediction`,
            :class:`ConditionalPrediction` or :class:`RegressionPrediction`.
        """
        problem = self.info.distribution_query_problem() if quantiles or exceed else None
        if problem is None and coverage is not None:
            problem = self.info.interval_problem(coverage)
        if problem is None and probabilities:
            problem = self.info.probability_problem()
        if problem is None and unassigned is not None:
            problem = self.info.far_cells_problem()
            if problem is None and not 0.0 < unassigned < 1.0:
                problem = f"unassigned must be a level in (0, 1) such as 0.999, got {unassigned!r}"
            if problem is None and probabilities:
                problem = "ask for probabilities or unassigned cells, not both"
        if problem is None and control is not None:
            problem = self.info.control_problem(control)
        if problem is not None:
            raise ValueError(problem)
        if not preprocessed:
            bags = self.preprocess(bags)
            control = None if control is None else self.preprocess(control)
        result = self._predict(
            bags, quantiles, exceed, coverage, probabilities, unassigned, control
        )
        # The one place the out-of-domain policy is applied: every door reads status.
        domain = result.domain
        status = statuses(
            self.info.out_of_domain_policy,
            None if domain is None else domain.out_of_range,
            result.n_bags,
        )
        return dataclasses.replace(result, status=status)

    def explain(self, bags: Bags, *, preprocessed: bool = False) -> list[Explanation]:
        """Per-cell contributions to each bag's prediction (:func:`core.explain`), the
        cells as the model sees them (after its preprocessing) and named by its panel.

        Raises
        ------
        ValueError
            A per-cell model (its sample-context part is not a door's answer).
        """
        if self.kind is ModelKind.CELL:
            raise ValueError("explanations apply to bag-level models, not per-cell ones")
        from .explanations import explain

        if not preprocessed:
            bags = self.preprocess(bags)
        markers = self.info.markers or None
        return [
            explain(self.model, bags.take(np.array([i])), markers=markers) for i in range(len(bags))
        ]

    def _predict(
        self,
        bags: Bags,
        quantiles: Sequence[float],
        exceed: Sequence[float],
        coverage: float | None,
        probabilities: bool,
        unassigned: float | None = None,
        control: Bags | None = None,
    ) -> Prediction:
        sizes = np.asarray(bags.sizes, dtype=np.int64)
        if self.kind is ModelKind.CELL:
            return self._predict_cells(bags, sizes, probabilities, unassigned, control)
        parts = [
            self._predict_chunk(bags[a:b], quantiles, exceed, coverage) for a, b in _chunks(sizes)
        ]
        merged = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k != "domain"}
        extra: dict[str, Any] = {
            "sizes": sizes,
            "clipped": self._clipped(bags),
            "domain": _concat_domains([p["domain"] for p in parts]),
            "interval": merged.get("interval"),
        }
        if self.kind is ModelKind.CONDITIONAL:
            return ConditionalPrediction(
                mean=merged["mean"],
                levels=np.asarray(quantiles, dtype=np.float64),
                quantiles=merged["quantiles"],
                thresholds=np.asarray(exceed, dtype=np.float64),
                exceedance=merged["exceedance"],
                **extra,
            )
        if self.kind is ModelKind.CLASSIFICATION:
            scores = merged["scores"]
            if scores.shape[1] == 1:  # binary: one margin for classes[1]
                scores = np.hstack([-scores, scores])
            return ClassificationPrediction(
                labels=merged["values"],
                classes=np.asarray(self.model.classes_),
                scores=scores,
                probabilities=merged.get("probabilities"),
                sets=merged.get("sets"),
                **extra,
            )
        return RegressionPrediction(values=merged["values"], **extra)

    def _predict_chunk(
        self,
        bags: Bags,
        quantiles: Sequence[float],
        exceed: Sequence[float],
        coverage: float | None,
    ) -> dict[str, Any]:
        """One chunk of bags, embedded once for the answer, its interval or set, and
        the domain check."""
        model = self.model
        emb = model.representation_.embed(bags)
        out: dict[str, Any] = {"domain": model.domain_check(emb)}
        if self.kind is ModelKind.CONDITIONAL:
            levels = list(quantiles)
            if coverage is not None:
                levels += [(1.0 - coverage) / 2.0, (1.0 + coverage) / 2.0]
            # One kernel evaluation for the mean and every quantity.
            mean, q, out["exceedance"] = model.summary(
                emb, np.asarray(levels, dtype=np.float64), np.asarray(exceed, dtype=np.float64)
            )
            out["mean"], out["quantiles"] = mean, q[:, : len(quantiles)]
            if coverage is not None:
                out["interval"] = q[:, len(quantiles) :]
            return out
        out["values"] = np.asarray(model.predict(emb))
        if self.kind is ModelKind.REGRESSION and coverage is not None:
            out["interval"] = np.asarray(
                model.predict_interval(emb, coverage, domain_scores=out["domain"].score)
            )
        if self.kind is ModelKind.CLASSIFICATION:
            scores = np.asarray(model.decision_function(emb))
            out["scores"] = scores[:, None] if scores.ndim == 1 else scores
            if self.info.calibrated:
                out["probabilities"] = np.asarray(model.predict_proba(emb))
            if coverage is not None:
                out["sets"] = np.asarray(
                    model.predict_set(emb, coverage, domain_scores=out["domain"].score)
                )
        return out

    def _predict_cells(
        self,
        bags: Bags,
        sizes: NDArray[np.int64],
        probabilities: bool,
        unassigned: float | None = None,
        control: Bags | None = None,
    ) -> CellPrediction:
        cells = None if control is None else control.points
        results = self.model.predict_tasks(bags, control=cells)
        labels = np.concatenate([r.predictions for r in results])
        domain = self.model.domain_report([r.report for r in results])
        classes = getattr(self.model, "classes_", None)
        if classes is None:
            return CellPrediction(labels=labels, sizes=sizes, domain=domain)
        classes = np.asarray(classes)
        codes = np.searchsorted(classes, labels)
        added = False
        if unassigned is not None:
            from .estimators.transfer.open_set import UNASSIGNED

            far = self.model.far_from_populations(bags, labels, unassigned, control=cells)
            rest = [k for k, c in enumerate(classes.tolist()) if c == UNASSIGNED]
            if not rest:
                # The model has no rest class: "unassigned" becomes a row of its own.
                classes = np.append(classes.astype(str), UNASSIGNED)
                rest, added = [classes.size - 1], True
            # Strings throughout: the answer crosses processes as plain arrays.
            labels = np.where(far, UNASSIGNED, labels.astype(str))
            codes = np.where(far, rest[0], codes)
        # Counts per (bag, class) in one bincount: bag index times K plus class code.
        bag_of = np.repeat(np.arange(sizes.shape[0]), sizes)
        counts = np.bincount(
            bag_of * classes.size + codes, minlength=sizes.shape[0] * classes.size
        ).reshape(sizes.shape[0], classes.size)
        temperature = self.info.probability_temperature
        mean_p = per_cell = None
        if temperature is not None and not added:
            from .calibration import probabilities as calibrated_probabilities

            per_cell = calibrated_probabilities(
                np.concatenate([r.scores for r in results]), temperature
            )
            # A bag's cells are contiguous (no bag is empty): sums by reduceat.
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            mean_p = np.add.reduceat(per_cell, starts, axis=0) / sizes[:, None]
        return CellPrediction(
            labels=labels,
            sizes=sizes,
            domain=domain,
            classes=classes,
            counts=counts.astype(np.int64),
            mean_probabilities=mean_p,
            probabilities=per_cell if probabilities else None,
        )

    def _clipped(self, bags: Bags) -> NDArray[np.int64] | None:
        # Representations with a bounded domain (density features) clip new points into
        # the training range: callers are told how many, per bag.
        rep = getattr(self.model, "representation_", None)
        if hasattr(rep, "clipped_counts"):
            return np.asarray(rep.clipped_counts(bags), dtype=np.int64)
        return None


def _concat_domains(parts: list[DomainReport | None]) -> DomainReport | None:
    if any(p is None for p in parts):
        return None
    # Fields no part has (a control's report on bag-level models) stay unset.
    fields = [
        f.name
        for f in dataclasses.fields(DomainReport)
        if all(getattr(p, f.name) is not None for p in parts)
    ]
    return DomainReport(
        **{f: np.concatenate([getattr(p, f) for p in parts]) for f in fields}  # type: ignore[arg-type]
    )


def _chunks(sizes: NDArray[np.int64], limit: int = CHUNK_POINTS) -> list[tuple[int, int]]:
    """Consecutive ranges of bags with at most ``limit`` points each (a larger bag
    alone); a loop over bags, never over points."""
    out = []
    start, n = 0, len(sizes)
    while start < n:
        stop, total = start + 1, int(sizes[start])
        while stop < n and total + int(sizes[stop]) <= limit:
            total += int(sizes[stop])
            stop += 1
        out.append((start, stop))
        start = stop
    return out
