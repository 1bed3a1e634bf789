"""A prediction's FHIR R4 Observations, one per bag (:class:`Observations`), and the
codes and building blocks they share with the rest of the Bundle (:mod:`.fhir`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
from bagserve.core.artifact_info import ArtifactInfo
from bagserve.core.fhir_coding import CATEGORIES, UCUM, Coding, OutputCoding
from bagserve.core.results import (
    CellPrediction,
    ClassificationPrediction,
    ConditionalPrediction,
    Prediction,
)

from bagserve import __version__

#: Identifier systems and codes of bagserve's own (no registry assigns these).
SHA256 = "urn:bagserve:sha256"
#: The sha256 of the public key that signed the model release (OpenSSF model-signing).
_SIGNER_KEY = "urn:bagserve:signer-key-sha256"
REQUEST = "urn:bagserve:request-id"
#: The sha256 of a request body (several samples may share one).
_REQUEST_SHA256 = "urn:bagserve:request-sha256"
_ABSENT = "http://terminology.hl7.org/CodeSystem/data-absent-reason"
#: Observation.status by the status of an answer (:mod:`bagserve.core.policy`).
_STATUS = {"final": "final", "preliminary": "preliminary", "withheld": "cancelled"}
_PREDICTION = "urn:bagserve:prediction"
_CATEGORY = "http://terminology.hl7.org/CodeSystem/observation-category"
_INTERPRETATION = "http://terminology.hl7.org/CodeSystem/v3-ObservationInterpretation"
_REFERENCE_MEANING = "http://terminology.hl7.org/CodeSystem/referencerange-meaning"
V2_SECTION = "http://terminology.hl7.org/CodeSystem/v2-0074"
PARTICIPANT = "http://terminology.hl7.org/CodeSystem/provenance-participant-type"
_FLAGS = {
    "EX": "outside threshold",
    "H": "High",
    "L": "Low",
    "N": "Normal",
}


class Observations:
    """Builds bag ``i``'s Observation; what is the same for every bag is made once."""

    def __init__(
        self,
        result: Prediction,
        provenance: Mapping[str, Any],
        info: ArtifactInfo,
        coverage: float | None,
        refs: dict[str, str],
        issued: str,
        inputs: list[str] | None,
        device_url: str,
        performer: str | None,
    ) -> None:
        self.result, self.info, self.coverage, self.issued = result, info, coverage, issued
        self.model = dict(provenance["model"])
        self.request_id = str(provenance["request_id"])
        self.request_sha256 = str(provenance.get("request_sha256", ""))
        self.inputs = inputs
        self.coding: OutputCoding = info.output_coding
        self.refs = refs
        self.device = _device(self.model, info.estimator)
        self.device_url = device_url
        self.performer = performer

    def digest(self, i: int) -> str:
        """Bag ``i``'s sha256: its file's (or its cells'), else the request body's."""
        return self.inputs[i] if self.inputs is not None else self.request_sha256

    # ------------------------------------------------------------------ the resource
    def of(self, i: int, bag_id: str, effective: str | None = None) -> dict[str, Any]:
        c = self.coding
        obs: dict[str, Any] = {
            "resourceType": "Observation",
            "contained": [self._input(bag_id, i)],
            "identifier": [{"system": REQUEST, "value": f"{self.request_id}/{bag_id}"}],
            "status": _STATUS[self.result.status_of(i)],
            "category": [
                {
                    "coding": [
                        {
                            "system": _CATEGORY,
                            "code": c.category,
                            "display": CATEGORIES[c.category],
                        }
                    ]
                }
            ],
            "code": {"coding": [c.code.to_json()], "text": c.code.display or c.code.code},
        }
        if "subject" in self.refs:
            obs["subject"] = {"reference": self.refs["subject"]}
        if effective is not None:
            obs["effectiveDateTime"] = effective
        obs["issued"] = self.issued
        if self.performer:
            obs["performer"] = [{"reference": self.performer}]
        if self.result.released(i):
            value, components = self._value(self.result, i)
        else:
            value, components = self._withheld(i), []
        obs.update(value)
        flags, notes = self._interpretation(i, value)
        if flags:
            obs["interpretation"] = flags
        if notes:
            obs["note"] = [{"text": n} for n in notes]
        if "specimen" in self.refs:
            obs["specimen"] = {"reference": self.refs["specimen"]}
        obs["device"] = {
            "reference": self.device_url,
            "display": f"bagserve model {self.model['name']} version {self.model['version']}",
        }
        if c.reference_range is not None and "valueQuantity" in value:
            obs["referenceRange"] = [self._reference_range()]
        obs["derivedFrom"] = [{"reference": "#input", "display": f"bag {bag_id}"}]
        if components:
            obs["component"] = components
        return obs

    def _input(self, bag_id: str, i: int = 0) -> dict[str, Any]:
        """The sample the bag came from, by the sha256 of its file (or of its cells, for
        cells sent as numbers); the request body's sha256 beside it."""
        digest = self.digest(i)
        doc: dict[str, Any] = {
            "resourceType": "DocumentReference",
            "id": "input",
            "masterIdentifier": {"system": SHA256, "value": digest},
            "status": "current",
            "description": (
                f"sample {bag_id}: the master identifier is the sha256 of its file as "
                "uploaded (of its cells, for cells sent as numbers)"
            ),
            "content": [{"attachment": {"title": bag_id}}],
        }
        if self.request_sha256:
            doc["identifier"] = [{"system": _REQUEST_SHA256, "value": self.request_sha256}]
        return doc

    def _withheld(self, i: int) -> dict[str, Any]:
        """No value, and why (the model's out-of-domain policy withheld it)."""
        domain = self.result.domain
        assert domain is not None
        return {
            "dataAbsentReason": {
                "coding": [{"system": _ABSENT, "code": "unsupported", "display": "Unsupported"}],
                "text": self.info.withheld_reason(domain, i),
            }
        }

    # ------------------------------------------------------------------ values
    @functools.singledispatchmethod
    def _value(self, r: Prediction, i: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The Observation's ``value[x]`` and its components, by the kind of the
        result ``r`` (this builder's own): here a value (or one per output) and its
        interval."""
        return self._estimate(r, i)

    @_value.register
    def _(self, r: CellPrediction, i: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        components: list[dict[str, Any]] = []
        if r.classes is None:
            # A per-cell regressor: the bag's mean cell value.
            cells = np.asarray(r.labels_of(i), dtype=np.float64)
            components.append(
                _component(
                    _own("cell-mean", "Mean over the bag's cells"),
                    {"valueQuantity": self._quantity(float(cells.mean()))},
                )
            )
            return {}, components
        counts = r.counts[i] if r.counts is not None else None
        assert counts is not None
        total = int(counts.sum())
        for k, label in enumerate(r.classes.tolist()):
            coding = self.coding.class_coding(self.model["name"], label)
            components.append(
                _component(
                    coding,
                    {
                        "valueRatio": {
                            "numerator": _cells(int(counts[k])),
                            "denominator": _cells(total),
                        }
                    },
                    text=f"{label} cells",
                )
            )
        return {}, components

    @_value.register
    def _(self, r: ClassificationPrediction, i: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        name = self.model["name"]
        label = r.labels[i].item()
        coding = self.coding.class_coding(name, label)
        value = {"valueCodeableConcept": {"coding": [coding.to_json()], "text": str(label)}}
        components: list[dict[str, Any]] = []
        if r.probabilities is not None:
            for k, c in enumerate(r.classes.tolist()):
                components.append(
                    _component(
                        self.coding.class_coding(name, c),
                        {"valueQuantity": _probability(float(r.probabilities[i, k]))},
                        text=f"probability of {c}",
                    )
                )
        return value, components

    @_value.register
    def _(self, r: ConditionalPrediction, i: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        # The mean as any value, then the quantiles and exceedance probabilities.
        value, components = self._estimate(r, i)
        for level, q in zip(r.levels.tolist(), r.quantiles[i].tolist(), strict=True):
            components.append(
                _component(
                    _own(f"quantile-{level:g}", f"Quantile {level:g}"),
                    {"valueQuantity": self._quantity(q)},
                )
            )
        for t, p in zip(r.thresholds.tolist(), r.exceedance[i].tolist(), strict=True):
            components.append(
                _component(
                    _own(f"exceedance-{t:g}", f"Probability above {t:g}"),
                    {"valueQuantity": _probability(p)},
                )
            )
        return value, components

    def _estimate(self, r: Prediction, i: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Bag ``i``'s estimate as a quantity (one component per output for several)
        and its prediction interval."""
        components: list[dict[str, Any]] = []
        estimate = np.atleast_1d(np.asarray(r.estimate[i], dtype=np.float64))
        if estimate.size == 1:
            value = {"valueQuantity": self._quantity(float(estimate[0]))}
        else:
            value = {}
            for j, v in enumerate(estimate.tolist()):
                components.append(
                    _component(
                        _own(f"output-{j}", f"Output {j}"), {"valueQuantity": self._quantity(v)}
                    )
                )
        if r.interval is not None:
            lo, hi = (float(v) for v in r.interval[i])
            level = f"{100 * self.coverage:g}% " if self.coverage is not None else ""
            components.append(
                _component(
                    _own("prediction-interval", f"{level}prediction interval"),
                    {"valueRange": {"low": self._quantity(lo), "high": self._quantity(hi)}},
                )
            )
        return value, components

    def _quantity(self, value: float) -> dict[str, Any]:
        q: dict[str, Any] = {"value": _decimal(value)}
        if self.coding.unit is not None:
            q["unit"] = self.coding.unit_display or self.coding.unit
            q["system"] = UCUM
            q["code"] = self.coding.unit
        return q

    # ------------------------------------------------------------------ judgement
    def _interpretation(
        self, i: int, value: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Flags (applicability domain, reference range) and the notes that explain them."""
        flags: list[dict[str, Any]] = []
        notes: list[str] = []
        rng = self.coding.reference_range
        domain = self.result.domain
        outside = domain is not None and bool(domain.out_of_range[i])
        # Outside the domain the value is not judged against the normal range: EX only.
        if rng is not None and "valueQuantity" in value and not outside:
            v = value["valueQuantity"]["value"]
            low, high = rng
            code = (
                "L"
                if low is not None and v < low
                else "H"
                if high is not None and v > high
                else "N"
            )
            flags.append(flag(code))
        if domain is not None:
            if bool(domain.out_of_range[i]):
                flags.append(flag(code="EX", text="outside the model's applicability domain"))
            notes.append(self.info.domain_note(domain, i))
        r = self.result
        members = r.prediction_set(i) if r.released(i) else None
        if members is not None:
            level = f"{100 * self.coverage:g}% " if self.coverage is not None else ""
            notes.append(f"{level}prediction set: {', '.join(str(c) for c in members) or 'empty'}.")
        if getattr(r, "clipped", None) is not None and int(r.clipped[i]):
            notes.append(
                f"{int(r.clipped[i])} cells lay outside the training range and were clipped "
                "into it."
            )
        return flags, notes

    def _reference_range(self) -> dict[str, Any]:
        rng = self.coding.reference_range
        assert rng is not None
        out: dict[str, Any] = {}
        if rng[0] is not None:
            out["low"] = self._quantity(rng[0])
        if rng[1] is not None:
            out["high"] = self._quantity(rng[1])
        out["type"] = {
            "coding": [{"system": _REFERENCE_MEANING, "code": "normal", "display": "Normal Range"}]
        }
        return out


def _device(model: Mapping[str, Any], estimator: str) -> dict[str, Any]:
    """The model as a Device: name, version, sha256 of its manifest, and who signed the
    release (when the service requires signed models)."""
    identifiers = [{"system": SHA256, "value": str(model["sha256"])}]
    signer = model.get("signer")
    notes = []
    if signer:
        identifiers.append({"system": _SIGNER_KEY, "value": str(signer["key_sha256"])})
        notes.append(
            {
                "authorString": str(signer["signer"]),
                "text": (
                    f"Release signed by {signer['signer']} (public key sha256 "
                    f"{signer['key_sha256']}, OpenSSF model-signing); the signature was "
                    "verified when the model was loaded."
                ),
            }
        )
    device = {
        "resourceType": "Device",
        "identifier": identifiers,
        "status": "active",
        "manufacturer": "bagserve",
        "deviceName": [{"name": str(model["name"]), "type": "model-name"}],
        "type": {"text": f"bagserve {estimator} model"},
        "version": [
            {"type": {"text": "model"}, "value": str(model["version"])},
            {"type": {"text": "bagserve"}, "value": __version__},
        ],
    }
    if notes:
        device["note"] = notes
    return device


def _own(code: str, display: str) -> Coding:
    return Coding(_PREDICTION, code, display)


def _component(coding: Coding, value: dict[str, Any], *, text: str | None = None) -> dict[str, Any]:
    return {
        "code": {"coding": [coding.to_json()], "text": text or coding.display or coding.code},
        **value,
    }


def _cells(n: int) -> dict[str, Any]:
    return {"value": n, "unit": "cells", "system": UCUM, "code": "{cells}"}


def _probability(p: float) -> dict[str, Any]:
    return {"value": _decimal(p), "unit": "probability", "system": UCUM, "code": "1"}


def flag(code: str, text: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "coding": [{"system": _INTERPRETATION, "code": code, "display": _FLAGS[code]}]
    }
    if text:
        out["text"] = text
    return out


def _decimal(value: float) -> float:
    """A FHIR decimal: finite (JSON has no NaN), at most 15 significant digits kept."""
    if not np.isfinite(value):
        raise ValueError(f"a FHIR decimal must be finite, got {value!r}")
    return float(f"{value:.15g}")
