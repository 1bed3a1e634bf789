"""What a saved model's manifest says, without loading its arrays: :class:`ArtifactInfo`.

Its kind (:func:`kind_of`, the one place that decides it from the estimator's class),
panel, preprocessing, sizes and hashes, and the checks of what can be asked of it
(intervals, quantiles, per-cell probabilities, a batch's control). The service's
registry, its encoders and ``bagserve models list`` read models through it; the
estimators (scikit-learn, scipy) are imported only where a class must be asked.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .artifacts import ARRAY_DIR, ArtifactError, read_manifest
from .bags import Bags
from .domain import DomainReport
from .estimator_state import estimator_class
from .fhir_coding import OutputCoding
from .hashing import bytes_sha256
from .io import Panel, Preprocessing
from .policy import DEFAULT_POLICY, POLICIES, withheld_reason
from .results import ModelKind

__all__ = ["ArtifactInfo", "kind_of"]


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


#: :func:`kind_of` of the core's estimator classes by name, and whether each answers
#: classes, so that reading or describing a manifest (``GET /v1/models``, on the
#: server's event loop) imports no estimator (tests/test_imports.py checks it against
#: the class hierarchy). A name not listed is asked its class.
_KNOWN: dict[str, tuple[ModelKind, bool]] = {
    "ConditionalMeanEmbedding": (ModelKind.CONDITIONAL, False),
    "DistributionRidge": (ModelKind.REGRESSION, False),
    "DistributionRidgeClassifier": (ModelKind.CLASSIFICATION, True),
    "MarginalTransferClassifier": (ModelKind.CELL, True),
    "MarginalTransferRegressor": (ModelKind.CELL, False),
}


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
        known = _KNOWN.get(self.estimator)
        return known[0] if known is not None else kind_of(estimator_class(self.estimator))

    @cached_property
    def classifies(self) -> bool:
        """The model answers classes (per bag, or per point for per-cell models)."""
        known = _KNOWN.get(self.estimator)
        if known is not None:
            return known[1]
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
