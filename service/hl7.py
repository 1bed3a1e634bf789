"""Predictions as HL7 v2.5.1 ``ORU^R01`` messages: the one builder of every door.

Most laboratory information systems and interface engines take results as HL7 v2
over MLLP. ``Accept: application/hl7-v2`` on a predict route, a forwarded job
(:mod:`.hl7_delivery`) and ``bagserve predict --hl7`` all send the message
:func:`oru_r01` builds (ER7, segments ended by carriage returns), built and
validated with hl7apy against the 2.5.1 message structure:

* ``MSH``: MSH-3/4 (sending application and facility) and MSH-5/6 (receiving
  application and facility) from the settings (:class:`Parties`; interface engines
  route on them); MSH-10, the message control id, 20 random base32 characters
  (100 bits, :func:`new_control_id`), which the receiver's ACK must echo;
* ``PID`` when the caller names the patient (``patient``, PID-3);
* per bag an ``ORC`` (``RE``: observations follow; ORC-2/3 the placer and filler
  order numbers) and an ``OBR`` (OBR-2 the bag's placer order number, OBR-3
  ``request id/bag id``, OBR-4 the model's output code, OBR-7 when the sample was
  acquired, OBR-25 the result status) with its ``OBX`` segments:

  * regressors: one ``NM`` OBX with the UCUM unit, OBX-7 the clinical reference range
    (``low - high``, ``>low`` or ``<high``) and OBX-8 ``H``/``L``/``N`` against it;
  * classifiers: one ``CWE`` OBX with the class coding;
  * per-cell classifiers: two ``NM`` OBX per population, cells and percent;

  every OBX with OBX-11 the status under the model's out-of-domain policy (``F``
  final, ``P`` preliminary, ``X`` withheld: no value), OBX-17 (observation method) the
  model and OBX-18 (equipment instance) its name, version and manifest sha256;
* ``NTE`` after each bag's first OBX, always in this order: the interval (or
  prediction set), the applicability domain (score, nearest training samples), why a
  value was withheld.

Placer order numbers (``order``) are one per bag: a placer order number names one
order, so a request with several bags gives as many, in the bags' order, or none.

A bag outside the model's applicability domain is never a plain normal result: every
OBX of it carries OBX-8 ``A`` (HL7 table 0078 "abnormal", its one flag not tied to a
numeric range) alone, under every policy, and no ``H``/``L``/``N`` verdict on the
normal range (the value is not judged against it); its OBX-11 is the policy's.

Free text (bag ids, class labels, codes, model names, notes) is escaped for ER7:
the delimiters ``| ^ & ~ \\`` become ``\\F\\ \\S\\ \\T\\ \\R\\ \\E\\``, carriage
returns, line feeds and tabs become spaces and every other control character (the
MLLP frame bytes ``0x0b`` and ``0x1c`` among them) is dropped, so no text can end a
field, a segment or the frame.

OBX-7 is an ``ST`` that HL7 writes ``lower limit-upper limit`` (its own example,
potassium, reads ``3.5 - 4.5``): with a negative bound ``-1-0.4`` reads two ways.
bagserve always writes the two limits separated by a hyphen between spaces, ``-1 -
0.4``, ``-2 - -1``: a number's own minus sign is never followed by a space.
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
from bagserve.core.artifact_info import ArtifactInfo
from bagserve.core.results import CellPrediction, ClassificationPrediction, Prediction

from .errors import Problem
from .explanations import summary_text
from .query_values import checked

if TYPE_CHECKING:
    from .settings import Settings

__all__ = [
    "HL7_V2",
    "ID_PATTERN",
    "OUTSIDE_DOMAIN",
    "Parties",
    "check_orders",
    "hl7_references",
    "new_control_id",
    "oru_r01",
]

#: The media type of HL7 v2 messages in ER7 (pipe) encoding.
HL7_V2 = "application/hl7-v2"
#: OBX-11 / OBR-25 result status by the answer's status (HL7 table 0085).
_RESULT_STATUS = {"final": "F", "preliminary": "P", "withheld": "X"}
#: OBX-8 of every observation of a bag outside the applicability domain (table 0078).
OUTSIDE_DOMAIN = "A"
#: Patient identifiers and placer order numbers: safe in any HL7 field as they are.
ID_PATTERN = r"^[A-Za-z0-9._\-]{1,64}$"
_ID = re.compile(ID_PATTERN)
#: ER7 escapes of the delimiters; C0 and C1 control characters and DEL dropped, line
#: breaks and tabs made spaces.
_ESCAPE = {
    **dict.fromkeys([*range(0x20), *range(0x7F, 0xA0)]),
    **{ord(c): " " for c in "\t\r\n"},
    **{ord(c): f"\\{e}\\" for c, e in zip("\\|^&~", "EFSTR", strict=True)},
}
#: The alphabet of control ids (RFC 4648 base32).
_BASE32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"


def new_control_id() -> str:
    """A fresh message control id (MSH-10): 20 base32 characters of 100 random bits,
    the field's whole length, never cut from anything longer."""
    bits = secrets.randbits(100)
    return "".join(_BASE32[(bits >> (5 * k)) & 31] for k in range(20))


@dataclass(frozen=True)
class Parties:
    """Who sends and who receives: MSH-3/4/5/6 (each an HL7 ``HD``, written as
    ``namespace`` or ``namespace^universal id^id type``; checked by the settings).

    Attributes
    ----------
    sending_application, sending_facility, receiving_application, receiving_facility : str
        ``""`` leaves the field empty.
    """

    sending_application: str = "bagserve"
    sending_facility: str = ""
    receiving_application: str = ""
    receiving_facility: str = ""

    @classmethod
    def from_settings(cls, settings: Settings) -> Parties:
        """The parties the service's settings (``BAGSERVE_HL7_SENDING_APPLICATION``,
        ...) name."""
        return cls(
            settings.hl7_sending_application,
            settings.hl7_sending_facility or "",
            settings.hl7_receiving_application or "",
            settings.hl7_receiving_facility or "",
        )


def hl7_references(params: Any) -> dict[str, Any]:
    """``patient`` (PID-3) and the placer order numbers ``order`` (OBR-2, one per bag,
    repeated in the bags' order) of a query, checked (422).

    ``params`` is a query (``getlist`` gives every ``order``) or a mapping whose
    ``order`` is a string or a list. The answer has ``patient`` and ``orders`` when
    given, as stored with a job.
    """
    out: dict[str, Any] = {}
    patient = params.get("patient")
    if patient is not None:
        out["patient"] = _identifier("patient", patient)
    if hasattr(params, "getlist"):
        given = list(params.getlist("order"))
    else:
        raw = params.get("order")
        given = [] if raw is None else [raw] if isinstance(raw, str) else list(raw)
    orders = [_identifier("order", o) for o in given]
    repeated = sorted({o for o in orders if orders.count(o) > 1})
    if repeated:
        raise Problem(
            422,
            f"order {repeated[0]!r} is given twice: a placer order number names one order, "
            "so each bag needs its own",
        )
    if orders:
        out["orders"] = orders
    return out


def _identifier(name: str, value: Any) -> str:
    return checked(name, value, _ID, "1 to 64 letters, digits, '.', '_' or '-' (an HL7 identifier)")


def check_orders(orders: Sequence[str], n_bags: int) -> None:
    """Raise 422 unless there is one placer order number per bag (or none)."""
    if orders and len(orders) != n_bags:
        raise Problem(
            422,
            f"{len(orders)} placer order number(s) for {n_bags} bag(s): a placer order "
            "number names one order, so give one per bag, in the bags' order "
            "(order=A&order=B, or --order A --order B), or none",
        )


def _text(value: Any, limit: int = 500) -> str:
    """Free text for a field: at most ``limit`` characters of it, then ER7-escaped
    and without control characters (see the module docstring)."""
    return str(value)[:limit].translate(_ESCAPE)


def _ts(when: datetime) -> str:
    """An HL7 DTM with its zone (``YYYYMMDDHHMMSS+ZZZZ``)."""
    return when.strftime("%Y%m%d%H%M%S%z")


def _acquired_ts(acquired: str | None) -> str:
    """An FCS acquisition time as an HL7 DTM (local time without zone, as written)."""
    if not acquired:
        return ""
    digits = re.sub(r"[^0-9]", "", acquired[:19])
    zone = re.search(r"(Z|[+-]\d{2}:\d{2})$", acquired)
    if zone and len(acquired) > 10:
        digits += "+0000" if zone.group(1) == "Z" else zone.group(1).replace(":", "")
    return digits


def _cwe(code: str, text: str, system: str) -> str:
    return f"{_text(code, 20)}^{_text(text, 199)}^{_text(system, 20)}"


def _range(low: float | None, high: float | None) -> str:
    """OBX-7 for a reference range (see the module docstring for the form)."""
    if low is not None and high is not None:
        return f"{low:g} - {high:g}"
    return f">{low:g}" if low is not None else f"<{high:g}"


def oru_r01(
    result: Prediction,
    ids: list[str],
    provenance: Mapping[str, Any],
    info: ArtifactInfo,
    *,
    inputs: Sequence[str] | None = None,
    coverage: float | None = None,
    refs: Mapping[str, Any] | None = None,
    acquired: Sequence[str | None] | None = None,
    when: datetime | None = None,
    parties: Parties | None = None,
    control_id: str | None = None,
    explanations: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The answer as one HL7 v2.5.1 ``ORU^R01`` message (see the module docstring),
    segments ended by carriage returns, validated by hl7apy.

    Parameters
    ----------
    refs : mapping, optional
        ``patient`` and ``orders`` (:func:`hl7_references`).
    parties : Parties, optional
        MSH-3..6 (bagserve as the sending application by default).
    control_id : str, optional
        MSH-10 (:func:`new_control_id` by default).
    explanations : sequence of mapping, optional
        Per bag, its explanation document (``?explain=true``): a released bag's
        answer gains its one-line text (no cell data) as the last NTE.

    Raises
    ------
    Problem
        422 when the placer order numbers are not one per bag.
    """
    from hl7apy.core import Message

    refs = dict(refs or {})
    orders = list(refs.get("orders") or [])
    check_orders(orders, len(ids))
    parties = parties or Parties()
    model = provenance["model"]
    request_id = str(provenance["request_id"])
    when = when or datetime.now(UTC)
    msg = Message("ORU_R01", version="2.5.1", validation_level=2)
    _header(msg.msh, parties, when, control_id)
    group = msg.add_group("ORU_R01_PATIENT_RESULT")
    if "patient" in refs:
        pid = group.add_group("ORU_R01_PATIENT").pid
        pid.pid_1 = "1"
        pid.pid_3 = refs["patient"]
        pid.pid_5 = '""'  # the name is the LIS's to know: explicitly none here
    coding = info.output_coding
    code = _cwe(coding.code.code, coding.code.display or coding.code.code, "L")
    method = _cwe(str(model["name"]), f"bagserve model {model['name']} {model['version']}", "L")
    equipment = (
        f"{_text(model['name'], 100)}/{_text(model['version'], 20)}^bagserve^"
        f"{_text(model['sha256'], 64)}^L"
    )
    domain = result.domain
    for i, bag in enumerate(ids):
        status = result.status_of(i)
        outside = domain is not None and bool(domain.out_of_range[i])
        order = group.add_group("ORU_R01_ORDER_OBSERVATION")
        filler = f"{_text(request_id, 60)}/{_text(bag, 130)}^bagserve"
        orc = order.orc
        orc.orc_1 = "RE"  # observations to follow
        if orders:
            orc.orc_2 = orders[i]
        orc.orc_3 = filler
        obr = order.obr
        obr.obr_1 = str(i + 1)
        if orders:
            obr.obr_2 = orders[i]
        obr.obr_3 = filler
        obr.obr_4 = code
        observed = _acquired_ts(acquired[i] if acquired else None)
        if observed:
            obr.obr_7 = observed
        obr.obr_22 = _ts(when)
        obr.obr_25 = _RESULT_STATUS[status]
        rows = _observations(result, i, info, str(model["name"]), code)
        notes = _notes(result, i, info, coverage)
        if explanations is not None and result.released(i):
            notes.append(summary_text(explanations[i]))
        for k, row in enumerate(rows, start=1):
            obs = order.add_group("ORU_R01_OBSERVATION")
            _obx(obs.obx, k, row, status, outside, observed, (method, equipment))
            if k == 1:
                for n, text in enumerate(notes, start=1):
                    nte = obs.add_segment("NTE")
                    nte.nte_1 = str(n)
                    nte.nte_2 = "L"
                    nte.nte_3 = _text(text, 1000)
    msg.validate()
    return msg.to_er7() + "\r"


def _header(msh: Any, parties: Parties, when: datetime, control_id: str | None) -> None:
    """MSH: the parties (MSH-3..6, where set), the time, the message type, MSH-10."""
    for field, value in (
        ("msh_3", parties.sending_application),
        ("msh_4", parties.sending_facility),
        ("msh_5", parties.receiving_application),
        ("msh_6", parties.receiving_facility),
    ):
        if value:
            setattr(msh, field, value)
    msh.msh_7 = _ts(when)
    msh.msh_9 = "ORU^R01^ORU_R01"
    msh.msh_10 = control_id or new_control_id()
    msh.msh_11 = "P"
    msh.msh_12 = "2.5.1"


def _obx(
    obx: Any,
    k: int,
    row: tuple[str, str, str, str, dict[str, Any]],
    status: str,
    outside: bool,
    observed: str,
    producer: tuple[str, str],
) -> None:
    """OBX ``k`` of a bag: one row of :func:`_observations`; a withheld bag's value and
    range left empty; ``producer``: OBX-17 (method) and OBX-18 (equipment)."""
    kind, identifier, value, unit, extra = row
    obx.obx_1 = str(k)
    obx.obx_2 = kind
    obx.obx_3 = identifier
    if "sub" in extra:
        obx.obx_4 = extra["sub"]
    if status != "withheld" and value != "":
        obx.obx_5 = value
    if unit:
        obx.obx_6 = unit
    if status != "withheld" and extra.get("range"):
        obx.obx_7 = extra["range"]
    # Outside the domain the value is not judged against the normal range: it is
    # flagged abnormal, whatever the policy made of its status.
    flag = OUTSIDE_DOMAIN if outside else extra.get("flag")
    if flag:
        obx.obx_8 = flag
    obx.obx_11 = _RESULT_STATUS[status]
    if observed:
        obx.obx_14 = observed
    obx.obx_17, obx.obx_18 = producer


@functools.singledispatch
def _observations(
    result: Prediction, i: int, info: ArtifactInfo, name: str, code: str
) -> list[tuple[str, str, str, str, dict[str, str]]]:
    """Bag ``i``'s OBX rows: (value type, identifier, value, unit, extra fields), by the
    kind of the result: here a value (or one per output) with its unit and range."""
    coding = info.output_coding
    unit = (
        f"{_text(coding.unit, 20)}^{_text(coding.unit_display or coding.unit, 199)}^UCUM"
        if coding.unit
        else ""
    )
    values = np.atleast_1d(np.asarray(result.estimate[i], dtype=np.float64))
    if values.size > 1:
        # Several outputs: one OBX each, told apart by their sub-ID (no range applies).
        return [
            ("NM", code, f"{v:.15g}", unit, {"sub": str(j + 1)})
            for j, v in enumerate(values.tolist())
        ]
    value = float(values[0])
    extra: dict[str, str] = {}
    rng = coding.reference_range
    if rng is not None:
        low, high = rng
        extra["range"] = _range(low, high)
        extra["flag"] = (
            "L" if low is not None and value < low
            else "H" if high is not None and value > high
            else "N"
        )  # fmt: skip
    return [("NM", code, f"{value:.15g}", unit, extra)]


@_observations.register
def _(
    result: CellPrediction, i: int, info: ArtifactInfo, name: str, code: str
) -> list[tuple[str, str, str, str, dict[str, str]]]:
    coding = info.output_coding
    rows = []
    counts = result.counts[i] if result.counts is not None else None
    if counts is None or result.classes is None:
        # A per-cell regressor: the mean of the bag's cell values (as in FHIR).
        mean = float(np.mean(np.asarray(result.labels_of(i), dtype=np.float64)))
        return [("NM", code, f"{mean:.15g}", "", {"sub": "mean"})]
    total = max(int(counts.sum()), 1)
    for k, label in enumerate(result.classes.tolist()):
        c = coding.class_coding(name, label)
        ident = _cwe(c.code, c.display or c.code, "L")
        rows.append(("NM", ident, str(int(counts[k])), "{cells}^cells^UCUM", {"sub": "1"}))
        rows.append(
            ("NM", ident, f"{100 * int(counts[k]) / total:.6g}", "%^percent^UCUM", {"sub": "2"})
        )
    return rows


@_observations.register
def _(
    result: ClassificationPrediction, i: int, info: ArtifactInfo, name: str, code: str
) -> list[tuple[str, str, str, str, dict[str, str]]]:
    label = result.labels[i].item()
    c = info.output_coding.class_coding(name, label)
    return [("CWE", code, _cwe(c.code, c.display or c.code, "L"), "", {})]


def _notes(result: Prediction, i: int, info: ArtifactInfo, coverage: float | None) -> list[str]:
    """NTE texts for bag ``i``, always in this order: interval or set, domain, withheld."""
    out = []
    level = f"{100 * coverage:g}% " if coverage is not None else ""
    released = result.released(i)
    if released and result.interval is not None:
        lo, hi = (float(v) for v in result.interval[i])
        out.append(f"{level}prediction interval: {lo:.6g} to {hi:.6g}")
    members = result.prediction_set(i) if released else None
    if members is not None:
        out.append(f"{level}prediction set: {', '.join(str(c) for c in members) or 'empty'}")
    domain = result.domain
    if domain is not None:
        out.append(info.domain_note(domain, i))
        if not released:
            out.append(info.withheld_reason(domain, i))
    return out
