"""HL7 v2 messages over MLLP: one exchange with a laboratory system, and its ACK.

MLLP frames a message as ``\\x0b message \\x1c\\x0d`` on a TCP connection; the
receiver answers an ``ACK`` in the same frame. :func:`attempt` makes one exchange,
bounded as a whole by ``timeout`` seconds (connecting, sending, waiting for and
reading the ACK), and says what came of it; it never raises for what the peer does.
An ACK accepts the message only if it acknowledges that message's control id
(MSA-2 = MSH-10): ``AA`` (``CA`` in enhanced mode) accepts it, ``AR``/``CR`` rejects
it (sending the same message again changes nothing), ``AE``/``CE`` (an application
error), no answer, a dropped connection or an answer that is no ACK are worth
another try.

:func:`send` is the command line's delivery (``bagserve predict --hl7``): tries with
exponential backoff until accepted. The service's is the queue of
:mod:`.hl7_delivery`, which makes one :func:`attempt` per claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["Ack", "Attempt", "MllpError", "attempt", "control_id_of", "parse_mllp_url", "send"]

_START, _END = b"\x0b", b"\x1c\x0d"
#: An ACK longer than this is no ACK.
_MAX_ACK = 1 << 20
#: MSA-1 codes that accept the message, and those that refuse it for good.
ACCEPTED = ("AA", "CA")
REFUSED = ("AR", "CR")


class MllpError(RuntimeError):
    """A message that was not accepted: the last try's ACK code (``None`` without
    one) and what went wrong."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Attempt:
    """What one exchange came to.

    Attributes
    ----------
    ack : str or None
        The ACK's code (MSA-1), None without a readable ACK.
    error : str or None
        Why the message is not accepted (None when it is).
    """

    ack: str | None
    error: str | None = None

    @property
    def accepted(self) -> bool:
        return self.error is None and self.ack in ACCEPTED

    @property
    def refused(self) -> bool:
        """The receiver rejected the message itself: sending it again is pointless."""
        return self.ack in REFUSED


@dataclass(frozen=True)
class Ack:
    """An accepting ACK: ``code`` (MSA-1), the ``control_id`` it acknowledges and the
    ``attempts`` it took."""

    code: str
    control_id: str
    attempts: int


def parse_mllp_url(url: str) -> tuple[str, int]:
    """``mllp://host:port`` to ``(host, port)``; ValueError naming the problem."""
    parts = urlsplit(url)
    if parts.scheme != "mllp" or not parts.hostname or parts.port is None:
        raise ValueError(f"an MLLP peer is written mllp://HOST:PORT, got {url!r}")
    return parts.hostname, parts.port


def control_id_of(message: str) -> str:
    """A message's control id (MSH-10)."""
    fields = message.split("\r", 1)[0].split("|")
    return fields[9] if fields[0] == "MSH" and len(fields) > 9 else ""


async def _exchange(data: bytes, host: str, port: int) -> bytes:
    """Send one framed message, read one framed answer (without its frame)."""
    reader, writer = await asyncio.open_connection(host, port, limit=_MAX_ACK)
    try:
        writer.write(_START + data + _END)
        await writer.drain()
        try:
            framed = await reader.readuntil(_END)
        except asyncio.IncompleteReadError as exc:
            raise ConnectionError("the peer closed the connection before its ACK") from exc
        except asyncio.LimitOverrunError as exc:
            raise ConnectionError(f"no end of the ACK in {_MAX_ACK} bytes") from exc
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    start = framed.find(_START)
    return framed[start + 1 : -len(_END)]


def _read_ack(raw: bytes) -> tuple[str, str, str]:
    """(MSA-1 code, MSA-2 control id, MSA-3 text) of an ACK; raises if it is none."""
    from hl7apy.parser import parse_message

    text = raw.decode("utf-8", "replace").replace("\n", "\r")
    ack = parse_message(text, find_groups=False, validation_level=2)
    msa = ack.msa
    code = msa.msa_1.to_er7()
    if not code:
        raise ValueError("no MSA-1 acknowledgment code")
    return code, msa.msa_2.to_er7(), msa.msa_3.to_er7() if msa.msa_3 else ""


async def attempt(message: str, host: str, port: int, timeout: float) -> Attempt:
    """One exchange of ``message`` with the peer, ``timeout`` seconds at most in all."""
    control = control_id_of(message)
    try:
        raw = await asyncio.wait_for(_exchange(message.encode("utf-8"), host, port), timeout)
    except TimeoutError:
        return Attempt(None, f"no ACK within {timeout:g} s")
    except OSError as exc:  # refused, reset, unreachable; ConnectionError is one
        return Attempt(None, f"{type(exc).__name__}: {exc}")
    try:
        code, acked, text = _read_ack(raw)
    except Exception as exc:  # hl7apy raises several kinds for what is not an ACK
        return Attempt(None, f"unreadable ACK ({type(exc).__name__}: {exc})")
    if acked != control:
        return Attempt(code, f"ACK for another message ({acked!r}, sent {control!r})")
    if code in ACCEPTED:
        return Attempt(code)
    return Attempt(code, f"{code}: {text or 'no reason given'}")


def send(
    message: str,
    url: str,
    *,
    timeout: float = 10.0,
    retries: int = 3,
    backoff: float = 1.0,
    log: logging.Logger | Any = None,
) -> Ack:
    """Deliver ``message`` to the MLLP peer at ``url`` and return its accepting ACK.

    Each try is :func:`attempt`; all but a rejection (``AR``) are retried ``retries``
    times, ``backoff`` seconds after the first and twice as long after each next.

    Raises
    ------
    MllpError
        Not accepted: the last ACK's code and text, or the last connection error.
    """
    host, port = parse_mllp_url(url)
    control = control_id_of(message)

    async def tries() -> Ack:
        last = Attempt(None, "no attempt")
        for n in range(1, retries + 2):
            last = await attempt(message, host, port, timeout)
            if last.accepted:
                return Ack(str(last.ack), control, n)
            if log is not None:
                log.warning("MLLP %s attempt %d of %d: %s", url, n, retries + 1, last.error)
            if last.refused:
                break
            if n <= retries:
                await asyncio.sleep(backoff * 2 ** (n - 1))
        raise MllpError(f"{url}: the message {control!r} was not accepted ({last.error})", last.ack)

    return asyncio.run(tries())
