"""Predictions as HL7 FHIR R4: a ``transaction`` Bundle a FHIR server files as it is.

``Accept: application/fhir+json`` on a predict route answers a ``transaction`` Bundle:

* one ``Observation`` per bag, and a ``DiagnosticReport`` for the request whose
  ``result`` lists them, whose ``status`` follows the bags' statuses under the model's
  out-of-domain policy, whose ``conclusion`` says so in words and whose
  ``conclusionCode`` is ``EX`` (v3 ObservationInterpretation "outside threshold")
  when a bag lies outside the applicability domain, under every policy; both are
  created conditionally on bagserve's request identifier (``ifNoneExist``, escaped
  for FHIR search), so a retried submission files nothing twice;
* the model as a ``Device`` (name, version, manifest sha256, the signer of a signed
  release), created conditionally on its sha256 and referenced by the Observations'
  ``device``;
* a ``Provenance`` (``PUT`` with an id derived from the request id, so a retry
  replaces it) whose agent is that Device, whose entities are the inputs by their
  sha256, recorded when the answer was made.

Each Observation carries:

* ``code``: the model's output coding from its training configuration (``[fhir]``,
  :mod:`bagserve.core.fhir_coding`), bagserve's own code system otherwise;
* the value: ``valueQuantity`` (regressors, conditional means; UCUM unit when
  configured), ``valueCodeableConcept`` (classifiers, with the class codings), or for
  per-cell classifiers one ``component`` per class whose ``valueRatio`` is the class's
  cells over the bag's cells (count and fraction in one);
* the prediction interval as a ``component`` with a ``valueRange``. It is not put in
  ``referenceRange``: FHIR defines that as the normal range a value is judged against,
  and a receiving system would flag patients against the model's uncertainty.
  A clinical normal range configured for the model (``[fhir] reference_range``) is the
  ``referenceRange``, with the high/low/normal ``interpretation`` it implies;
* ``interpretation`` ``EX`` (v3 ObservationInterpretation "outside threshold") when the
  bag lies outside the model's applicability domain, and a ``note`` naming the nearest
  training bags;
* ``derivedFrom``: a contained ``DocumentReference`` whose ``masterIdentifier`` is the
  sha256 of the bag's file (or cells) and whose attachment names the bag;
* ``effectiveDateTime``: ``?effective=`` when given, else when the instrument acquired
  the sample (FCS ``$BEGINDATETIME``, or ``$DATE``/``$BTIM`` in the instruments' zone,
  ``BAGSERVE_FHIR_TIMEZONE``; the date alone without one);
* ``performer`` from ``BAGSERVE_FHIR_PERFORMER``; ``subject`` and ``specimen`` when the
  caller gives them, as references relative to the FHIR server (``?subject=Patient/123``,
  ``?specimen=Specimen/9``; other types, absolute URLs and ``urn:uuid`` are refused),
  ``issued``, and an identifier ``request id/bag id``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

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

from .errors import Problem
from .explanations import summary_text

__all__ = ["FHIR_JSON", "bundle", "references"]

#: The FHIR R4 JSON media type (answered with ``fhirVersion=4.0``).
FHIR_JSON = "application/fhir+json"
#: Identifier systems and codes of bagserve's own (no registry assigns these).
_SHA256 = "urn:bagserve:sha256"
#: The sha256 of the public key that signed the model release (OpenSSF model-signing).
_SIGNER_KEY = "urn:bagserve:signer-key-sha256"
_REQUEST = "urn:bagserve:request-id"
#: The sha256 of a request body (several samples may share one).
_REQUEST_SHA256 = "urn:bagserve:request-sha256"
_ABSENT = "http://terminology.hl7.org/CodeSystem/data-absent-reason"
#: Observation.status by the status of an answer (:mod:`bagserve.core.policy`).
_STATUS = {"final": "final", "preliminary": "preliminary", "withheld": "cancelled"}
_PREDICTION = "urn:bagserve:prediction"
_CATEGORY = "http://terminology.hl7.org/CodeSystem/observation-category"
_INTERPRETATION = "http://terminology.hl7.org/CodeSystem/v3-ObservationInterpretation"
_REFERENCE_MEANING = "http://terminology.hl7.org/CodeSystem/referencerange-meaning"
_V2_SECTION = "http://terminology.hl7.org/CodeSystem/v2-0074"
_PARTICIPANT = "http://terminology.hl7.org/CodeSystem/provenance-participant-type"
#: ``?subject=`` and ``?specimen=``: a reference to a resource of that type on the
#: server the bundle is filed on, relative (``Patient/123``, optionally a version). An
#: absolute URL could name another server, a ``urn:uuid`` nothing in the bundle.
_REFERENCES = {
    name: re.compile(rf"^{kind}/[A-Za-z0-9\-.]{{1,64}}(/_history/[A-Za-z0-9\-.]{{1,64}})?$")
    for name, kind in (("subject", "Patient"), ("specimen", "Specimen"))
}
#: What FHIR search escapes in a token's system and value (``\``, ``|``, ``,``, ``$``).
_SEARCH_SPECIAL = re.compile(r"([\\|,$])")
_FLAGS = {
    "EX": "outside threshold",
    "H": "High",
    "L": "Low",
    "N": "Normal",
}


#: A FHIR ``dateTime``: a date (year, month, day) or a date and time with its zone.
_DATETIME = re.compile(r"^\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|[+-]\d{2}:\d{2}))?$")


def references(params: Mapping[str, Any]) -> dict[str, str]:
    """The ``subject``, ``specimen`` and ``effective`` query parameters, checked (422
    otherwise)."""
    out: dict[str, str] = {}
    effective = params.get("effective")
    if effective is not None:
        if not _DATETIME.match(str(effective)):
            raise Problem(
                422,
                "effective must be a FHIR dateTime: a date (2026-11-25) or a date and time "
                f"with its zone (2026-11-25T09:30:00+01:00), got {effective!r}",
            )
        out["effective"] = str(effective)
    for name, kind in (("subject", "Patient"), ("specimen", "Specimen")):
        value = params.get(name)
        if value is None:
            continue
        if not _REFERENCES[name].match(str(value)):
            raise Problem(
                422,
                f"{name} must be a FHIR reference to a {kind}, relative to the FHIR server "
                f"the bundle is filed on ({kind}/<id>, such as {kind}/123): not another "
                f"resource type, an absolute URL or a urn:uuid; got {value!r}",
            )
        out[name] = str(value)
    return out


def bundle(
    result: Prediction,
    ids: list[str],
    provenance: Mapping[str, Any],
    info: ArtifactInfo,
    *,
    inputs: list[str] | None = None,
    coverage: float | None = None,
    refs: Mapping[str, str] | None = None,
    issued: datetime | None = None,
    acquired: Sequence[str | None] | None = None,
    performer: str | None = None,
    timezone: str | None = None,
    explanations: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The answer as a FHIR R4 ``transaction`` Bundle (see the module docstring).

    Each Observation's ``status`` is the bag's status under the model's out-of-domain
    policy (:mod:`core.policy`): ``final``, ``preliminary``, or, for a withheld answer,
    ``cancelled`` with no value and a ``dataAbsentReason`` that says why. A bag outside
    the applicability domain is interpreted ``EX`` only: never ``N``, ``H`` or ``L``
    beside it, which a report showing the first interpretation would file as normal.

    Parameters
    ----------
    result : Prediction
        The runtime's typed answer.
    ids : list of str
        Bag ids, in request order.
    provenance : mapping
        ``model`` (name, version, sha256), ``request_id``, ``request_sha256``, as
        heads every bagserve answer. Its ``warnings`` are the request's, about any of
        its bags: each Observation carries only its own bag's (from its domain report
        and clipped cells), never another sample's.
    info : ArtifactInfo
        The model's artifact: its output coding, estimator, training bag names.
    inputs : list of str, optional
        The sha256 of each bag's input: its file as uploaded, or its cells.
    coverage : float, optional
        The coverage of the interval or prediction set, when one was asked for.
    refs : mapping, optional
        ``subject``, ``specimen`` and ``effective`` (see :func:`references`).
    issued : datetime, optional
        When the answer was made (now by default).
    acquired : sequence of str or None, optional
        Per bag, when the instrument acquired it (:attr:`bagserve.core.io.Sample.
        acquired`); ``effective`` in ``refs`` overrides it.
    performer : str, optional
        Who performs the test (``Organization/lab-1``).
    timezone : str, optional
        The instruments' IANA time zone, for acquisition times written without one.
    explanations : sequence of mapping, optional
        Per bag, its explanation document (``?explain=true``): a released bag's
        Observation gains its one-line text as a note (no cell data).
    """
    when = _instant(issued or datetime.now(UTC))
    request_id = str(provenance["request_id"])
    refs = dict(refs or {})
    # Deterministic entry URLs: the same request (an idempotent replay) names its
    # resources the same way.
    space = uuid.uuid5(uuid.NAMESPACE_URL, f"{_REQUEST}:{request_id}")
    device_url = f"urn:uuid:{uuid.uuid5(space, 'device')}"
    effective = [
        refs.get("effective") or _effective(acquired[i] if acquired else None, timezone)
        for i in range(len(ids))
    ]
    builder = _Observations(
        result, provenance, info, coverage, refs, when, inputs, device_url, performer
    )
    observations = [
        (f"urn:uuid:{uuid.uuid5(space, str(i))}", builder.of(i, bag, effective[i]))
        for i, bag in enumerate(ids)
    ]
    for i, (_, obs) in enumerate(observations):
        if explanations is not None and result.released(i):
            obs.setdefault("note", []).append({"text": summary_text(explanations[i])})
    report_url = f"urn:uuid:{uuid.uuid5(space, 'report')}"
    report = _report(result, ids, builder, [u for u, _ in observations], effective)
    provenance_id = str(uuid.uuid5(space, "provenance"))
    entries = [
        _entry(device_url, builder.device, _if_none_exist(_SHA256, builder.model["sha256"])),
        *(
            _entry(url, obs, _if_none_exist(_REQUEST, obs["identifier"][0]["value"]))
            for url, obs in observations
        ),
        _entry(report_url, report, _if_none_exist(_REQUEST, request_id)),
        {
            "fullUrl": f"urn:uuid:{provenance_id}",
            "resource": _provenance(
                provenance_id,
                [report_url, *(u for u, _ in observations)],
                when,
                device_url,
                ids,
                [builder.digest(i) for i in range(len(ids))],
            ),
            # Provenance has no identifier to create on: a PUT to an id derived from
            # the request id makes a retry replace it instead of filing it twice.
            "request": {"method": "PUT", "url": f"Provenance/{provenance_id}"},
        },
    ]
    return {
        "resourceType": "Bundle",
        "identifier": {"system": _REQUEST, "value": request_id},
        "type": "transaction",
        "timestamp": when,
        "entry": entries,
    }


def _entry(url: str, resource: dict[str, Any], if_none_exist: str) -> dict[str, Any]:
    """A transaction entry that creates ``resource`` unless one with its identifier
    exists already (FHIR conditional create)."""
    return {
        "fullUrl": url,
        "resource": resource,
        "request": {
            "method": "POST",
            "url": resource["resourceType"],
            "ifNoneExist": if_none_exist,
        },
    }


def _if_none_exist(system: str, value: str) -> str:
    """The conditional-create search for an identifier: system and value escaped for
    FHIR search (a ``,`` would split the value into two OR-ed ones, a ``|`` move the
    system), then for the URL."""
    token = f"{_search_escape(system)}|{_search_escape(value)}"
    return "identifier=" + quote(token, safe="")


def _search_escape(text: str) -> str:
    return _SEARCH_SPECIAL.sub(r"\\\1", text)


def _effective(acquired: str | None, timezone: str | None) -> str | None:
    """A FHIR dateTime from an acquisition time: as written when it has a zone (or is a
    date), in ``timezone`` when it has none, the date alone without a timezone (FHIR
    requires a zone with a time of day)."""
    if acquired is None:
        return None
    if _DATETIME.match(acquired):
        return acquired
    if timezone is None:
        return acquired[:10]
    from zoneinfo import ZoneInfo

    local = datetime.fromisoformat(acquired).replace(tzinfo=ZoneInfo(timezone))
    return local.isoformat(timespec="seconds")


def _report_status(statuses: list[str]) -> str:
    """DiagnosticReport.status from its bags' statuses."""
    if all(s == "withheld" for s in statuses):
        return "cancelled"
    if "withheld" in statuses:
        return "partial"  # some values withheld: the report is incomplete
    if "preliminary" in statuses:
        return "preliminary"
    return "final"


def _report(
    result: Prediction,
    ids: list[str],
    builder: _Observations,
    results: list[str],
    effective: list[str | None],
) -> dict[str, Any]:
    """The request's DiagnosticReport: its Observations, a status and a conclusion."""
    statuses = [result.status_of(i) for i in range(len(ids))]
    domain = result.domain
    words = []
    for i, bag in enumerate(ids):
        text = f"{bag}: {statuses[i]}"
        if domain is not None and bool(domain.out_of_range[i]):
            text += (
                f", outside the model's applicability domain (score {float(domain.score[i]):.3g})"
            )
        if statuses[i] == "withheld":
            text += ", value withheld"
        words.append(text)
    c = builder.coding
    report: dict[str, Any] = {
        "resourceType": "DiagnosticReport",
        "identifier": [{"system": _REQUEST, "value": builder.request_id}],
        "status": _report_status(statuses),
        "category": [{"coding": [{"system": _V2_SECTION, "code": "LAB", "display": "Laboratory"}]}],
        "code": {"coding": [c.code.to_json()], "text": c.code.display or c.code.code},
    }
    if "subject" in builder.refs:
        report["subject"] = {"reference": builder.refs["subject"]}
    if len(set(effective)) == 1 and effective[0] is not None:
        report["effectiveDateTime"] = effective[0]
    report["issued"] = builder.issued
    if builder.performer:
        report["performer"] = [{"reference": builder.performer}]
    if "specimen" in builder.refs:
        report["specimen"] = [{"reference": builder.refs["specimen"]}]
    report["result"] = [{"reference": u} for u in results]
    model = builder.model
    report["conclusion"] = (
        f"bagserve model {model['name']} version {model['version']}: " + "; ".join(words) + "."
    )
    outside = [bag for i, bag in enumerate(ids) if domain is not None and domain.out_of_range[i]]
    if outside:
        # Coded, not only in words: a receiving system that files the report as it is
        # still sees that it holds results it must not read as normal.
        text = "outside the model's applicability domain: " + ", ".join(outside)
        report["conclusionCode"] = [_flag("EX", text=text)]
    return report


def _provenance(
    resource_id: str,
    targets: list[str],
    recorded: str,
    device_url: str,
    ids: list[str],
    digests: list[str],
) -> dict[str, Any]:
    """Who made the results (the model, as a Device) from what (each input by its
    sha256), and when."""
    return {
        "resourceType": "Provenance",
        "id": resource_id,
        "target": [{"reference": t} for t in targets],
        "recorded": recorded,
        "agent": [
            {
                "type": {
                    "coding": [
                        {"system": _PARTICIPANT, "code": "performer", "display": "Performer"}
                    ]
                },
                "who": {"reference": device_url},
            }
        ],
        "entity": [
            {
                "role": "source",
                "what": {
                    "identifier": {"system": _SHA256, "value": digest},
                    "display": f"sample {bag}",
                },
            }
            for bag, digest in zip(ids, digests, strict=True)
        ],
    }


class _Observations:
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
            "identifier": [{"system": _REQUEST, "value": f"{self.request_id}/{bag_id}"}],
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
            value, components = self._value(i)
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
            "masterIdentifier": {"system": _SHA256, "value": digest},
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
    def _value(self, i: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The Observation's ``value[x]`` and its components."""
        r, name = self.result, self.model["name"]
        components: list[dict[str, Any]] = []
        if isinstance(r, CellPrediction):
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
                coding = self.coding.class_coding(name, label)
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
        if isinstance(r, ClassificationPrediction):
            label = r.labels[i].item()
            coding = self.coding.class_coding(name, label)
            value = {"valueCodeableConcept": {"coding": [coding.to_json()], "text": str(label)}}
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
        if isinstance(r, ConditionalPrediction):
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
            flags.append(_flag(code))
        if domain is not None:
            if bool(domain.out_of_range[i]):
                flags.append(_flag(code="EX", text="outside the model's applicability domain"))
            notes.append(self.info.domain_note(domain, i))
        r = self.result
        if isinstance(r, ClassificationPrediction) and r.sets is not None and r.released(i):
            level = f"{100 * self.coverage:g}% " if self.coverage is not None else ""
            members = ", ".join(str(c) for c in r.set_of(i)) or "empty"
            notes.append(f"{level}prediction set: {members}.")
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
    identifiers = [{"system": _SHA256, "value": str(model["sha256"])}]
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


def _flag(code: str, text: str | None = None) -> dict[str, Any]:
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


def _instant(when: datetime) -> str:
    """A FHIR ``instant``: seconds and a zone are required."""
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
