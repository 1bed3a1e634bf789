"""Request bodies in: read within the size limit, then decoded into bags.

* The body is read incrementally and refused with 413 as soon as it passes the limit
  (before it is all read), and at once when ``Content-Length`` already says so.
* Large NPY and JSON bodies of known length are read straight into a shared buffer
  that the workers map (:func:`read_body`), so the points reach a worker without a copy.
* :func:`decode_bags` turns a body of any accepted type into bags, multipart included,
  from the bytes alone: a stored job's body decodes exactly as the request did.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from starlette.datastructures import Headers
from starlette.formparsers import MultiPartException, MultiPartParser

from .codecs import (
    ACCEPTED,
    FILE_KINDS,
    JSON,
    MULTIPART,
    NPY,
    OCTET,
    IncomingBag,
    decode_body,
    decode_file,
)
from .codecs import media_type as media_type_of
from .errors import Problem
from .wire import MEMFD_MIN_BYTES, BufferPool, SharedBuffer

__all__ = [
    "SHARED_TYPES",
    "accepted_content_type",
    "decode_bags",
    "markers_param",
    "read_body",
    "read_limited",
]

#: Bodies that are read straight into a shared buffer when large enough: the formats
#: read without a copy (NPY), whose array then reaches the worker without one either,
#: and JSON, which is parsed from the buffer's warm pages instead of a fresh join.
SHARED_TYPES = (NPY, OCTET, JSON)


def accepted_content_type(request: Request) -> str:
    """The request's media type, or 415 before the body is read."""
    ctype = media_type_of(request.headers.get("content-type"))
    if ctype not in ACCEPTED:
        raise Problem(
            415,
            f"unsupported content type {ctype or '(none)'!r}; expected one of {list(ACCEPTED)}",
            slug="unsupported-media-type",
        )
    return ctype


def markers_param(text: str | None) -> list[str] | None:
    """The ``markers`` query parameter (comma-separated names of an NPY body's columns)."""
    return [m.strip() for m in text.split(",")] if text else None


async def read_limited(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Problem(413, f"the body ({int(declared)} bytes) exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Problem(413, f"the body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(
    request: Request, limit: int, buffers: BufferPool | None
) -> tuple[bytes | memoryview, SharedBuffer | None]:
    """The body, and the shared buffer it was read into, if any (413 as in read_limited).

    A large NPY body of known length is written, chunk by chunk, into a reused shared
    buffer of ``buffers`` (a memory file the workers already map) rather than joined
    into bytes and copied into a fresh memory file for the worker: that saves two
    copies of the body and, above all, allocating the memory file's pages for every
    request. A large JSON body goes the same way (its pages are warm; a join allocates
    and faults in fresh ones). The body is then a read-only view of the buffer; the
    caller gives the buffer back to ``buffers`` when the request is over.
    """
    declared = request.headers.get("content-length")
    if (
        buffers is None
        or declared is None
        or not declared.isdigit()
        or not MEMFD_MIN_BYTES <= int(declared) <= limit
        or media_type_of(request.headers.get("content-type")) not in SHARED_TYPES
    ):
        return await read_limited(request, limit), None
    size = int(declared)
    buffer = buffers.lease(size)
    try:
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
    except BaseException:
        buffers.give_back(buffer)
        raise
    return memoryview(target).toreadonly()[:end], buffer


async def decode_bags(
    content_type: str, body: bytes | memoryview, markers: list[str] | None, default_id: str
) -> tuple[list[IncomingBag], list[str]]:
    """The bags of a body, and the problems found while decoding them.

    Parameters
    ----------
    content_type : str
        The whole ``Content-Type`` header (a multipart body needs its boundary).
    body : bytes or memoryview
    markers : list of str or None
        Column names of an NPY body (the ``markers`` query parameter).
    default_id : str
        The id of a single bag that names none (the ``id`` query parameter).
    """
    ctype = media_type_of(content_type)
    if ctype != MULTIPART:
        return decode_body(ctype, body, markers, default_id)
    form = await _multipart(content_type, bytes(body))
    bags, errors = [], []
    for i, (part, value) in enumerate(form.multi_items()):
        if not hasattr(value, "read"):
            continue
        name = value.filename or f"{part}-{i}"
        suffix = name.lower().removesuffix(".gz").rsplit(".", 1)[-1]
        kind = suffix if suffix in FILE_KINDS else None
        try:
            bags.append(decode_file(await value.read(), name, kind, markers))
        except Problem as exc:
            errors += exc.errors or [exc.detail]
    if not bags and not errors:
        raise Problem(422, "the multipart body holds no files", slug="invalid-request")
    return bags, errors


async def _multipart(content_type: str, body: bytes):  # -> FormData
    async def stream() -> AsyncIterator[bytes]:
        yield body

    parser = MultiPartParser(Headers({"content-type": content_type}), stream())
    try:
        return await parser.parse()
    except MultiPartException as exc:
        raise Problem(
            400, f"malformed multipart body: {exc.message}", slug="invalid-request"
        ) from None
