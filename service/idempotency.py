"""``Idempotency-Key``: a retried request gets the stored answer, not a second computation.

The answer to a keyed request (its status, headers and body) is written to disk with a
fingerprint of the request (method, path, query, content type, accept, body). A request
with the same key and fingerprint replays it (header ``Idempotent-Replayed: true``);
the same key with another request is refused (422). Concurrent requests with one key
wait for the first one's answer. Answers that invite a retry (429, 5xx) are not kept.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bagserve.core.atomic import atomic_write_json
from bagserve.core.hashing import chunks_sha256, text_sha256
from starlette.requests import Request
from starlette.responses import Response

from .errors import Problem

__all__ = ["IdempotencyStore", "fingerprint"]

_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")
_KEPT_HEADERS = (
    "content-type",
    "x-model-name",
    "x-model-version",
    "x-model-sha256",
    "x-input-sha256",
    "location",
)


def fingerprint(request: Request, body: bytes | memoryview) -> str:
    """sha256 of what makes a request the same request: method, path, query,
    content type, accept, and the body.
    """
    parts = (
        request.method,
        request.url.path,
        str(request.url.query),
        request.headers.get("content-type", ""),
        request.headers.get("accept", ""),
    )
    return chunks_sha256([*(f"{part}\0" for part in parts), body])


class IdempotencyStore:
    """Stored answers to keyed requests, one file per key, kept ``ttl`` seconds.

    Parameters
    ----------
    directory : Path
    ttl : float
        Seconds an answer is replayed.
    """

    def __init__(self, directory: Path, ttl: float):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ttl = ttl
        self._locks: dict[str, asyncio.Lock] = {}

    def _path(self, key: str) -> Path:
        return self.directory / (text_sha256(key) + ".json")

    def _load(self, key: str) -> dict | None:
        path = self._path(key)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if time.time() - record["stored"] > self.ttl:
            path.unlink(missing_ok=True)
            return None
        return record

    def _store(self, key: str, fp: str, response: Response) -> None:
        record = {
            "stored": time.time(),
            "fingerprint": fp,
            "status": response.status_code,
            "headers": {k: v for k, v in response.headers.items() if k.lower() in _KEPT_HEADERS},
            "body": base64.b64encode(response.body).decode(),
        }
        atomic_write_json(self._path(key), record)

    async def run(self, key: str, fp: str, produce: Callable[[], Awaitable[Response]]) -> Response:
        """The stored answer for ``key`` (same fingerprint ``fp``), or ``produce()``'s,
        stored when it is final; 422 when the key was used for another request.
        """
        if not _KEY.match(key):
            raise Problem(
                400,
                "Idempotency-Key must be 1 to 255 printable ASCII characters",
                slug="invalid-idempotency-key",
            )
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            record = self._load(key)
            if record is not None:
                if record["fingerprint"] != fp:
                    raise Problem(
                        422,
                        "this Idempotency-Key was used for a different request",
                        slug="idempotency-key-reused",
                    )
                headers = {**record["headers"], "Idempotent-Replayed": "true"}
                media = headers.pop("content-type", None)
                return Response(
                    base64.b64decode(record["body"]),
                    status_code=record["status"],
                    headers=headers,
                    media_type=media,
                )
            try:
                response = await produce()
            except Problem as exc:
                if exc.status < 500 and exc.status != 429:
                    from .errors import problem_response

                    response = problem_response(
                        None,
                        exc.status,
                        exc.detail,
                        errors=exc.errors,
                        slug=exc.slug,
                        headers=exc.headers,
                    )
                    self._store(key, fp, response)
                raise
            if response.status_code < 500 and response.status_code != 429:
                self._store(key, fp, response)
            return response
