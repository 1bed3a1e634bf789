"""Predictions as HL7 v2.5.1 ``ORU^R01`` messages, and their delivery over MLLP.

Most laboratory information systems and interface engines take results as HL7 v2
over MLLP. ``Accept: application/hl7-v2`` on a predict route answers one ``ORU^R01``
message (ER7, segments ended by carriage returns), built and validated with hl7apy
against the 2.5.1 message structure:

* ``MSH``: bagserve as the sending application; the message control id is the
  request id's first 20 characters (MSH-10 holds 20);
* ``PID`` when the caller names the patient (``?patient=``, PID-3);
* per bag an ``OBR`` (OBR-2 the caller's placer order number ``?order=``, OBR-3
  ``request id/bag id``, OBR-4 the model's output code, OBR-7 when the sample was
  acquired, OBR-25 the result status) and its ``OBX`` segments:

  * regressors: one ``NM`` OBX with the UCUM unit, OBX-7 the clinical reference range
    and OBX-8 ``H``/``L``/``N`` against it, only inside the applicability domain;
  * classifiers: one ``CWE`` OBX with the class coding;
  * per-cell classifiers: two ``NM`` OBX per population, cells and percent;

  every OBX with OBX-11 the status under the model's out-of-domain policy (``F``
  final, ``P`` preliminary, ``X`` withheld: no value), OBX-17 (observation method) the
  model and OBX-18 (equipment instance) its name, version and manifest sha256;
* ``NTE`` after each bag's first OBX, always in this order: the interval (or
  prediction set), the applicability domain (score, nearest training samples), why a
  value was withheld.

:func:`send` delivers a message over MLLP (``\\x0b message \\x1c\\x0d``) and checks the
``ACK``: ``AA`` accepted; ``AE`` (application error) is retried, ``AR`` (rejected)
is not; a dropped connection or a timeout is retried with backoff.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from bagserve.core.runtime import (
    ArtifactInfo,
    CellPrediction,
    ClassificationPrediction,
    Prediction,
)

from .errors import Problem

__all__ = ["HL7_V2", "Ack", "MllpError", "hl7_references", "oru_r01", "parse_mllp_url", "send"]

#: The media type of HL7 v2 messages in ER7 (pipe) encoding.
HL7_V2 = "application/hl7-v2"
_START, _END = b"\x0b", b"\x1c\x0d"
#: OBX-11 / OBR-25 result status by the answer's status (HL7 table 0085).
_RESULT_STATUS = {"final": "F", "preliminary": "P", "withheld": "X"}
#: Characters HL7 reserves as delimiters, in the message's default encoding.
_RESERVED = re.compile(r"[|^~\\&\r\n]")
_ID = re.compile(r"^[A-Za-z0-9._\-]{1,64}$")


def hl7_references(params: Mapping[str, Any]) -> dict[str, str]:
    """``patient`` (PID-3) and ``order`` (OBR-2) query parameters, checked (422)."""
    out: dict[str, str] = {}
    for name in ("patient", "order"):
        value = params.get(name)
        if value is None:
            continue
        if not _ID.match(str(value)):
            raise Problem(
                422,
                f"{name} must be 1 to 64 letters, digits, '.', '_' or '-' (an HL7 "
                f"identifier), got {value!r}",
            )
        out[name] = str(value)
    return out


def _text(value: Any, limit: int = 500) -> str:
    """Free text for a field: HL7's delimiters replaced (escaping them would be read
    back as text by many receivers), at most ``limit`` characters."""
    return _RESERVED.sub(" ", str(value))[:limit]


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


def oru_r01(
    result: Prediction,
    ids: list[str],
    provenance: Mapping[str, Any],
    info: ArtifactInfo,
    *,
    inputs: Sequence[str] | None = None,
    coverage: float | None = None,
    refs: Mapping[str, str] | None = None,
    acquired: Sequence[str | None] | None = None,
    when: datetime | None = None,
) -> str:
    """The answer as one HL7 v2.5.1 ``ORU^R01`` message (see the module docstring),
    segments ended by carriage returns, validated by hl7apy."""
    from hl7apy.core import Message

    refs = dict(refs or {})
    model = provenance["model"]
    request_id = str(provenance["request_id"])
    when = when or datetime.now(UTC)
    msg = Message("ORU_R01", version="2.5.1", validation_level=2)
    msh = msg.msh
    msh.msh_3 = "bagserve"
    msh.msh_4 = "bagserve"
    msh.msh_7 = _ts(when)
    msh.msh_9 = "ORU^R01^ORU_R01"
    msh.msh_10 = request_id.replace("-", "")[:20]
    msh.msh_11 = "P"
    msh.msh_12 = "2.5.1"
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
        f"{_text(model['name'], 100)}/{_text(model['version'], 20)}^bagserve^{model['sha256']}^L"
    )
    for i, bag in enumerate(ids):
        status = result.status_of(i)
        order = group.add_group("ORU_R01_ORDER_OBSERVATION")
        obr = order.obr
        obr.obr_1 = str(i + 1)
        if "order" in refs:
            obr.obr_2 = refs["order"]
        obr.obr_3 = f"{_text(request_id, 60)}/{_text(bag, 130)}^bagserve"
        obr.obr_4 = code
        observed = _acquired_ts(acquired[i] if acquired else None)
        if observed:
            obr.obr_7 = observed
        obr.obr_22 = _ts(when)
        obr.obr_25 = _RESULT_STATUS[status]
        rows = _observations(result, i, info, str(model["name"]), code)
        notes = _notes(result, i, info, coverage)
        for k, (kind, identifier, value, unit, extra) in enumerate(rows, start=1):
            obs = order.add_group("ORU_R01_OBSERVATION")
            obx = obs.obx
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
            if status != "withheld" and extra.get("flag"):
                obx.obx_8 = extra["flag"]
            obx.obx_11 = _RESULT_STATUS[status]
            if observed:
                obx.obx_14 = observed
            obx.obx_17 = method
            obx.obx_18 = equipment
            if k == 1:
                for n, text in enumerate(notes, start=1):
                    nte = obs.add_segment("NTE")
                    nte.nte_1 = str(n)
                    nte.nte_2 = "L"
                    nte.nte_3 = _text(text, 1000)
    msg.validate()
    return msg.to_er7() + "\r"


def _observations(
    result: Prediction, i: int, info: ArtifactInfo, name: str, code: str
) -> list[tuple[str, str, str, str, dict[str, str]]]:
    """Bag ``i``'s OBX rows: (value type, identifier, value, unit, extra fields)."""
    coding = info.output_coding
    if isinstance(result, CellPrediction):
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
    if isinstance(result, ClassificationPrediction):
        label = result.labels[i].item()
        c = coding.class_coding(name, label)
        return [("CWE", code, _cwe(c.code, c.display or c.code, "L"), "", {})]
    unit = f"{coding.unit}^{coding.unit_display or coding.unit}^UCUM" if coding.unit else ""
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
    outside = result.domain is not None and bool(result.domain.out_of_range[i])
    if rng is not None:
        low, high = rng
        extra["range"] = (
            f"{low:g}-{high:g}" if low is not None and high is not None
            else f">{low:g}" if low is not None else f"<{high:g}"  # type: ignore[str-format]
        )  # fmt: skip
        if not outside:
            # Outside the domain the value is not judged against the normal range.
            extra["flag"] = (
                "L" if low is not None and value < low
                else "H" if high is not None and value > high
                else "N"
            )  # fmt: skip
    return [("NM", code, f"{value:.15g}", unit, extra)]


def _notes(result: Prediction, i: int, info: ArtifactInfo, coverage: float | None) -> list[str]:
    """NTE texts for bag ``i``, always in this order: interval or set, domain, withheld."""
    out = []
    level = f"{100 * coverage:g}% " if coverage is not None else ""
    released = result.released(i)
    if released and result.interval is not None:
        lo, hi = (float(v) for v in result.interval[i])
        out.append(f"{level}prediction interval: {lo:.6g} to {hi:.6g}")
    if released and isinstance(result, ClassificationPrediction) and result.sets is not None:
        members = ", ".join(str(c) for c in result.set_of(i)) or "empty"
        out.append(f"{level}prediction set: {members}")
    domain = result.domain
    if domain is not None:
        out.append(info.domain_note(domain, i))
        if not released:
            out.append(info.withheld_reason(domain, i))
    return out


# ------------------------------------------------------------------ MLLP
class MllpError(RuntimeError):
    """A message that was not accepted: no ACK after the retries, or ``AE``/``AR``."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Ack:
    """The receiver's answer: ``code`` (MSA-1: ``AA``, ``AE``, ``AR``, or ``CA``/``CE``/
    ``CR`` in enhanced mode), ``text`` (MSA-3), ``attempts`` it took."""

    code: str
    text: str
    control_id: str
    attempts: int

    @property
    def accepted(self) -> bool:
        return self.code in ("AA", "CA")


def parse_mllp_url(url: str) -> tuple[str, int]:
    """``mllp://host:port`` to ``(host, port)``; ValueError naming the problem."""
    parts = urlsplit(url)
    if parts.scheme != "mllp" or not parts.hostname or parts.port is None:
        raise ValueError(f"an MLLP peer is written mllp://HOST:PORT, got {url!r}")
    return parts.hostname, parts.port


def _exchange(message: bytes, host: str, port: int, timeout: float) -> bytes:
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(_START + message + _END)
        buf = b""
        while _END not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("the peer closed the connection before its ACK")
            buf += chunk
            if len(buf) > 1 << 20:
                raise ConnectionError("no end of the ACK in 1 MiB")
    start = buf.find(_START)
    return buf[start + 1 : buf.index(_END)]


def _read_ack(raw: bytes) -> tuple[str, str, str]:
    from hl7apy.parser import parse_message

    text = raw.decode("utf-8", "replace").replace("\n", "\r")
    ack = parse_message(text, find_groups=False, validation_level=2)
    msa = ack.msa
    return msa.msa_1.to_er7(), msa.msa_2.to_er7(), msa.msa_3.to_er7() if msa.msa_3 else ""


def send(
    message: str,
    url: str,
    *,
    timeout: float = 10.0,
    retries: int = 3,
    backoff: float = 1.0,
    log: Any = None,
) -> Ack:
    """Deliver ``message`` to the MLLP peer at ``url`` and return its accepting ACK.

    A dropped connection, a timeout or an ``AE`` is retried ``retries`` times with
    exponential backoff; an ``AR`` is not (the receiver refuses the message itself).

    Raises
    ------
    MllpError
        Not accepted: the last ACK's code and text, or the last connection error.
    """
    host, port = parse_mllp_url(url)
    control = message.split("\r", 1)[0].split("|")[9] if message.startswith("MSH") else ""
    last = "no attempt"
    code: str | None = None
    for attempt in range(1, retries + 2):
        try:
            raw = _exchange(message.encode("utf-8"), host, port, timeout)
            code, acked, text = _read_ack(raw)
        except (OSError, ConnectionError) as exc:
            last, code = f"{type(exc).__name__}: {exc}", None
        except Exception as exc:  # an answer that is no readable ACK
            last, code = f"unreadable ACK ({type(exc).__name__}: {exc})", None
        else:
            if acked and control and acked != control:
                last = f"ACK for another message ({acked!r}, sent {control!r})"
            elif code in ("AA", "CA"):
                return Ack(code, text, acked, attempt)
            else:
                last = f"{code}: {text or 'no reason given'}"
                if code in ("AR", "CR"):
                    break  # rejected: sending the same message again changes nothing
        if log is not None:
            log.warning("MLLP %s attempt %d of %d: %s", url, attempt, retries + 1, last)
        if attempt <= retries:
            time.sleep(backoff * 2 ** (attempt - 1))
    raise MllpError(f"{url}: the message {control!r} was not accepted ({last})", code)
