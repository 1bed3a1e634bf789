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

from bagserve.core.artifact_info import ArtifactInfo
from bagserve.core.results import (
    Prediction,
)

from .explanations import summary_text
from .fhir_observation import PARTICIPANT, REQUEST, SHA256, V2_SECTION, Observations, flag
from .query_values import checked

__all__ = ["FHIR_JSON", "bundle", "references"]

#: The FHIR R4 JSON media type (answered with ``fhirVersion=4.0``).
FHIR_JSON = "application/fhir+json"
#: ``?subject=`` and ``?specimen=``: a reference to a resource of that type on the
#: server the bundle is filed on, relative (``Patient/123``, optionally a version). An
#: absolute URL could name another server, a ``urn:uuid`` nothing in the bundle.
_REFERENCES = {
    name: re.compile(rf"^{kind}/[A-Za-z0-9\-.]{{1,64}}(/_history/[A-Za-z0-9\-.]{{1,64}})?$")
    for name, kind in (("subject", "Patient"), ("specimen", "Specimen"))
}
#: What FHIR search escapes in a token's system and value (``\``, ``|``, ``,``, ``$``).
_SEARCH_SPECIAL = re.compile(r"([\\|,$])")


#: A FHIR ``dateTime``: a date (year, month, day) or a date and time with its zone.
_DATETIME = re.compile(r"^\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|[+-]\d{2}:\d{2}))?$")


def references(params: Mapping[str, Any]) -> dict[str, str]:
    """The ``subject``, ``specimen`` and ``effective`` query parameters, checked (422
    otherwise)."""
    out: dict[str, str] = {}
    effective = params.get("effective")
    if effective is not None:
        out["effective"] = checked(
            "effective",
            str(effective),
            _DATETIME,
            "a FHIR dateTime: a date (2026-11-25) or a date and time with its zone "
            "(2026-11-25T09:30:00+01:00)",
        )
    for name, kind in (("subject", "Patient"), ("specimen", "Specimen")):
        value = params.get(name)
        if value is not None:
            out[name] = checked(
                name,
                str(value),
                _REFERENCES[name],
                f"a FHIR reference to a {kind}, relative to the FHIR server the bundle is "
                f"filed on ({kind}/<id>, such as {kind}/123): not another resource type, "
                "an absolute URL or a urn:uuid",
            )
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
    space = uuid.uuid5(uuid.NAMESPACE_URL, f"{REQUEST}:{request_id}")
    device_url = f"urn:uuid:{uuid.uuid5(space, 'device')}"
    effective = [
        refs.get("effective") or _effective(acquired[i] if acquired else None, timezone)
        for i in range(len(ids))
    ]
    builder = Observations(
        result, provenance, info, coverage, refs, when, inputs, device_url, performer
    )
    observations = _observations(builder, ids, space, effective, explanations)
    report_url = f"urn:uuid:{uuid.uuid5(space, 'report')}"
    report = _report(result, ids, builder, [u for u, _ in observations], effective)
    provenance_id = str(uuid.uuid5(space, "provenance"))
    entries = [
        _entry(device_url, builder.device, _if_none_exist(SHA256, builder.model["sha256"])),
        *(
            _entry(url, obs, _if_none_exist(REQUEST, obs["identifier"][0]["value"]))
            for url, obs in observations
        ),
        _entry(report_url, report, _if_none_exist(REQUEST, request_id)),
        _provenance_entry(
            provenance_id,
            _provenance(
                provenance_id,
                [report_url, *(u for u, _ in observations)],
                when,
                device_url,
                ids,
                [builder.digest(i) for i in range(len(ids))],
            ),
        ),
    ]
    return {
        "resourceType": "Bundle",
        "identifier": {"system": REQUEST, "value": request_id},
        "type": "transaction",
        "timestamp": when,
        "entry": entries,
    }


def _observations(
    builder: Observations,
    ids: list[str],
    space: uuid.UUID,
    effective: list[str | None],
    explanations: Sequence[Mapping[str, Any]] | None,
) -> list[tuple[str, dict[str, Any]]]:
    """Each bag's Observation with its entry URL; a released bag's carries its
    explanation's one-line text as a note."""
    observations = [
        (f"urn:uuid:{uuid.uuid5(space, str(i))}", builder.of(i, bag, effective[i]))
        for i, bag in enumerate(ids)
    ]
    for i, (_, obs) in enumerate(observations):
        if explanations is not None and builder.result.released(i):
            obs.setdefault("note", []).append({"text": summary_text(explanations[i])})
    return observations


def _provenance_entry(provenance_id: str, resource: dict[str, Any]) -> dict[str, Any]:
    """The Provenance's Bundle entry."""
    return {
        "fullUrl": f"urn:uuid:{provenance_id}",
        "resource": resource,
        # Provenance has no identifier to create on: a PUT to an id derived from the
        # request id makes a retry replace it instead of filing it twice.
        "request": {"method": "PUT", "url": f"Provenance/{provenance_id}"},
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
    builder: Observations,
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
        "identifier": [{"system": REQUEST, "value": builder.request_id}],
        "status": _report_status(statuses),
        "category": [{"coding": [{"system": V2_SECTION, "code": "LAB", "display": "Laboratory"}]}],
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
        report["conclusionCode"] = [flag("EX", text=text)]
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
                    "coding": [{"system": PARTICIPANT, "code": "performer", "display": "Performer"}]
                },
                "who": {"reference": device_url},
            }
        ],
        "entity": [
            {
                "role": "source",
                "what": {
                    "identifier": {"system": SHA256, "value": digest},
                    "display": f"sample {bag}",
                },
            }
            for bag, digest in zip(ids, digests, strict=True)
        ],
    }


def _instant(when: datetime) -> str:
    """A FHIR ``instant``: seconds and a zone are required."""
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
