"""Request bodies in: admitted, read within the size limit, never decoded here.

* A request is refused before its body is read when it cannot be served: 415 for a
  content type or encoding no worker decodes, 413 when ``Content-Length`` passes the
  body limit, and 503 (``Retry-After``) when every worker is busy and the queue is full,
  or when the bodies already waiting would leave no room for this one
  (``max_pending_bytes``): a crowd of large uploads cannot fill the server's memory.
* The body is read incrementally and refused with 413 as soon as it passes the limit.
* A body of known length from ``MEMFD_MIN_BYTES`` on is read straight into a shared
  buffer that the workers map, so it reaches the worker that decodes it without a copy.

Decoding happens in the worker processes (:mod:`.codecs`, :mod:`.tensors`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from .codecs import ACCEPTED, BodySpec, encoding_problem
from .codecs import media_type as media_type_of
from .errors import Problem
from .pool import WorkerPool
from .settings import Settings
from .wire import MEMFD_MIN_BYTES, SharedBuffer

__all__ = ["Intake", "ReceivedBody", "accepted_content_type", "body_spec", "markers_param"]


def accepted_content_type(request: Request) -> str:
    """The request's media type, or 415 before the body is read (also for a
    ``Content-Encoding`` that cannot be undone)."""
    ctype = media_type_of(request.headers.get("content-type"))
    if ctype not in ACCEPTED:
        raise Problem(
            415,
            f"unsupported content type {ctype or '(none)'!r}; expected one of {list(ACCEPTED)}",
            slug="unsupported-media-type",
        )
    check_encoding(request)
    return ctype


def check_encoding(request: Request) -> None:
    """415 for a ``Content-Encoding`` the workers cannot undo."""
    problem = encoding_problem(request.headers.get("content-encoding"))
    if problem is not None:
        raise Problem(415, problem, slug="unsupported-encoding")


def markers_param(text: str | None) -> list[str] | None:
    """The ``markers`` query parameter (comma-separated names of an NPY body's columns)."""
    return [m.strip() for m in text.split(",")] if text else None


def body_spec(request: Request, *, protocol: str = "v1") -> BodySpec:
    """How the request's body is to be decoded, from its headers and query."""
    qp = request.query_params
    return BodySpec(
        content_type=request.headers.get("content-type", ""),
        content_encoding=request.headers.get("content-encoding", ""),
        markers=markers_param(qp.get("markers")),
        default_id=qp.get("id") or None,
        protocol=protocol,
        header_length=request.headers.get("inference-header-content-length"),
    )


@dataclass
class ReceivedBody:
    """A request body as read: its bytes, the shared buffer they lie in (if any), and
    the seconds reading took."""

    data: bytes | memoryview
    lent: SharedBuffer | None
    seconds: float


class Intake:
    """Admission and reading of request bodies, and the bytes held by those waiting.

    Parameters
    ----------
    settings : Settings
        ``max_body_bytes``, ``max_pending_bytes`` and ``retry_after``.
    pool : WorkerPool
        Whose queue is checked before a body is read, and whose shared buffers large
        bodies are read into.
    """

    def __init__(self, settings: Settings, pool: WorkerPool) -> None:
        self.limit = settings.max_body_bytes
        self.pending_limit = max(settings.max_pending_bytes, settings.max_body_bytes)
        self.retry = {"Retry-After": str(settings.retry_after)}
        self.pool = pool
        #: Bytes of bodies read or being read whose request is not finished.
        self.pending = 0

    def _declared(self, request: Request) -> int | None:
        declared = request.headers.get("content-length")
        if declared is None:
            return None
        if not declared.isdigit():
            raise Problem(400, "Content-Length must be a number of bytes", slug="invalid-request")
        size = int(declared)
        if size > self.limit:
            raise Problem(413, f"the body ({size} bytes) exceeds the limit of {self.limit} bytes")
        return size

    def _reserve(self, size: int) -> None:
        if self.pending + size > self.pending_limit:
            raise Problem(
                503,
                f"the server holds {self.pending} bytes of request bodies waiting for a worker; "
                f"this one ({size} bytes) would pass the limit of {self.pending_limit}: "
                "retry later",
                headers=self.retry,
                slug="bodies-pending",
            )
        self.pending += size

    @contextlib.asynccontextmanager
    async def body(self, request: Request, *, compute: bool = True) -> AsyncIterator[ReceivedBody]:
        """Admit the request and read its body; the bytes it holds count against
        ``max_pending_bytes`` until the block ends.

        Parameters
        ----------
        request : Request
        compute : bool, default=True
            The body goes to a worker now: refused at once (503) while the queue is
            full, and read into a shared buffer when large. False for a job, which is
            stored and queued in the database.
        """
        if compute and self.pool.saturated:
            raise Problem(
                503,
                "all workers are busy and the queue is full; retry later",
                headers=self.retry,
                slug="queue-full",
            )
        declared = self._declared(request)
        held = 0
        lent: SharedBuffer | None = None
        t0 = time.perf_counter()
        try:
            if declared is not None:
                self._reserve(declared)
                held = declared
            buffers = self.pool.buffers if compute else None
            if buffers is not None and declared is not None and declared >= MEMFD_MIN_BYTES:
                lent = buffers.lease(declared)
                data: bytes | memoryview = await self._read_into(request, lent, declared)
            else:
                chunks, size = [], 0
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.limit:
                        raise Problem(413, f"the body exceeds the limit of {self.limit} bytes")
                    if size > held:  # no Content-Length: held as it arrives
                        self._reserve(size - held)
                        held = size
                    chunks.append(chunk)
                data = b"".join(chunks)
            yield ReceivedBody(data, lent, time.perf_counter() - t0)
        finally:
            self.pending -= held
            if lent is not None:
                self.pool.buffers.give_back(lent)  # type: ignore[union-attr]

    @staticmethod
    async def _read_into(request: Request, buffer: SharedBuffer, size: int) -> memoryview:
        """The body written chunk by chunk into ``buffer``; a read-only view of it."""
        target, end = buffer.map, 0
        async for chunk in request.stream():
            start, end = end, end + len(chunk)
            if end > size:  # the HTTP parser frames the body: not expected to happen
                raise Problem(
                    400,
                    f"the body is longer than its Content-Length ({size} bytes)",
                    slug="invalid-request",
                )
            target[start:end] = chunk
        return memoryview(target).toreadonly()[:end]
