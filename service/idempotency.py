"""``Idempotency-Key``: a retried request gets the stored answer, not a second computation.

The answer to a keyed request (its status, headers and body) is stored in the service's
database (:mod:`.database`) with a fingerprint of the request (method, path, query,
content type and encoding, accept, body), so every replica replays it. A key belongs to
the API key that sent it: each API key has its own keys. A request with the same key
and fingerprint replays it (header ``Idempotent-Replayed: true``); the same key with
another request is refused (422). Concurrent requests with one key, on one replica or
several, wait for the first one's answer: the first claims the key (a row without an
answer, leased to its replica and renewed while it computes); the others poll it. If
the claiming replica dies, its lease runs out and a waiting request takes the key over.
Answers that invite a retry (429, 5xx) are not kept: the claim is dropped.

Claims and answers are written by the service's group commit (:mod:`.group_commit`),
with the audit records: the records of requests that finish together share one
transaction and one fsync.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from bagserve.core.hashing import chunks_sha256, text_sha256
from starlette.requests import Request
from starlette.responses import Response

from .database import Database
from .errors import Problem, problem_response
from .group_commit import GroupCommit, Transaction
from .jobs import replica_id

__all__ = ["IdempotencyStore", "fingerprint"]

_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")
_KEPT_HEADERS = (
    "content-type",
    "x-model-name",
    "x-model-version",
    "x-model-sha256",
    "x-input-sha256",
    "x-request-sha256",
    "bagserve-status",
    "bagserve-classes",
    "location",
)


#: Bodies from this size on are hashed in a thread (hashlib releases the GIL): 256 MiB
#: take about half a second, which the event loop must not wait for.
_HASH_INLINE_BYTES = 1 << 20


async def fingerprint(request: Request, body: bytes | memoryview) -> str:
    """sha256 of what makes a request the same request: method, path, query,
    content type and encoding, accept, and the body.
    """
    parts = (
        request.method,
        request.url.path,
        str(request.url.query),
        request.headers.get("content-type", ""),
        request.headers.get("content-encoding", ""),
        request.headers.get("accept", ""),
    )
    chunks = [*(f"{part}\0" for part in parts), body]
    if len(body) < _HASH_INLINE_BYTES:
        return chunks_sha256(chunks)
    return await asyncio.to_thread(chunks_sha256, chunks)


class IdempotencyStore:
    """Stored answers to keyed requests, kept ``ttl`` seconds, shared by the replicas.

    Parameters
    ----------
    db : Database
    ttl : float
        Seconds an answer is replayed.
    lease : float
        Seconds a replica holds a key it computes without renewing the claim.
    owner : str, optional
        This replica's name.
    writer : GroupCommit, optional
        The writer to share (the service's, shared with its audit trail); by default
        one of the store's own.
    """

    #: Seconds between looks at a key another request is computing.
    wait_poll = 0.05

    def __init__(
        self,
        db: Database,
        ttl: float,
        *,
        lease: float = 30.0,
        owner: str | None = None,
        writer: GroupCommit | None = None,
    ) -> None:
        self.db = db
        self.writer = writer or GroupCommit(db)
        self.ttl = ttl
        self.lease = lease
        self.owner = owner or replica_id()
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}

    # ------------------------------------------------------------------ storage
    def _begin(self, key_hash: str, fp: str, tx: Transaction) -> tuple[str, dict[str, Any] | None]:
        """``("mine", None)`` when this request now holds the key, ``("replay",
        record)``, ``("wait", None)`` while another request computes it, or
        ``("reused", None)`` for a key used by another request."""
        now = time.time()
        cur = tx.cur
        inserted = cur.execute(
            "INSERT INTO idempotency (key_hash, fingerprint, created, owner, lease_until) "
            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (key_hash) DO NOTHING",
            (key_hash, fp, now, self.owner, now + self.lease),
        ).rowcount
        if inserted == 1:
            return "mine", None
        lock = " FOR UPDATE" if self.db.dialect == "postgresql" else ""
        row = cur.execute(
            "SELECT fingerprint, stored, lease_until, status, headers, body "
            "FROM idempotency WHERE key_hash = %s" + lock,
            (key_hash,),
        ).fetchone()
        if row is None:  # deleted in between (an answer not kept): try again
            return "wait", None
        fingerprint_, stored, lease_until, status, headers, body = row
        answered = stored is not None
        expired = answered and now - float(stored) > self.ttl
        abandoned = not answered and float(lease_until or 0) < now
        if expired or abandoned:
            cur.execute(
                "UPDATE idempotency SET fingerprint = %s, created = %s, stored = NULL, "
                "owner = %s, lease_until = %s, status = NULL, headers = NULL, body = NULL "
                "WHERE key_hash = %s",
                (fp, now, self.owner, now + self.lease, key_hash),
            )
            return "mine", None
        if fingerprint_ != fp:
            return "reused", None
        if not answered:
            return "wait", None
        return "replay", {
            "status": int(status),
            "headers": json.loads(headers),
            "body": bytes(body),
        }

    def _renew(self, key_hash: str, tx: Transaction) -> None:
        tx.cur.execute(
            "UPDATE idempotency SET lease_until = %s WHERE key_hash = %s AND owner = %s "
            "AND stored IS NULL",
            (time.time() + self.lease, key_hash, self.owner),
        )

    def _store(self, key_hash: str, response: Response, tx: Transaction) -> None:
        headers = {k: v for k, v in response.headers.items() if k.lower() in _KEPT_HEADERS}
        tx.cur.execute(
            "UPDATE idempotency SET stored = %s, status = %s, headers = %s, body = %s, "
            "owner = NULL, lease_until = NULL WHERE key_hash = %s AND owner = %s",
            (
                time.time(),
                response.status_code,
                json.dumps(headers),
                bytes(response.body),
                key_hash,
                self.owner,
            ),
        )

    def _drop(self, key_hash: str, tx: Transaction) -> None:
        tx.cur.execute(
            "DELETE FROM idempotency WHERE key_hash = %s AND owner = %s AND stored IS NULL",
            (key_hash, self.owner),
        )

    def sweep(self) -> int:
        """Delete answers older than the ttl; how many."""
        with self.db.transaction() as cur:
            return cur.execute(
                "DELETE FROM idempotency WHERE stored IS NOT NULL AND stored < %s",
                (time.time() - self.ttl,),
            ).rowcount

    # ------------------------------------------------------------------ use
    async def run(
        self,
        key: str,
        fp: str,
        produce: Callable[[], Awaitable[Response]],
        *,
        owner: str | None = None,
    ) -> Response:
        """The stored answer for ``key`` (same fingerprint ``fp``), or ``produce()``'s,
        stored when it is final; 422 when the key was used for another request.

        Keys belong to the API key that sent them (``owner``, its id): another API key
        using the same ``Idempotency-Key`` gets its own computation, never the first
        one's answer, and never learns that the key was used.
        """
        if not _KEY.match(key):
            raise Problem(
                400,
                "Idempotency-Key must be 1 to 255 printable ASCII characters",
                slug="invalid-idempotency-key",
            )
        # Without API keys every caller is the same tenant (and records kept from before
        # tenants keep their hash).
        key_hash = text_sha256(key if owner is None else f"{owner}\0{key}")
        # Requests on this replica queue here; other replicas' through the database.
        lock = self._locks.setdefault(key_hash, asyncio.Lock())
        self._users[key_hash] = self._users.get(key_hash, 0) + 1
        try:
            async with lock:
                return await self._replay_or_produce(key_hash, fp, produce)
        finally:
            # The last request of a key drops its lock: keys are not remembered here.
            self._users[key_hash] -= 1
            if not self._users[key_hash]:
                del self._users[key_hash], self._locks[key_hash]

    async def _replay_or_produce(
        self, key_hash: str, fp: str, produce: Callable[[], Awaitable[Response]]
    ) -> Response:
        while True:
            state, record = await self.writer.run(partial(self._begin, key_hash, fp))
            if state == "mine":
                break
            if state == "reused":
                raise Problem(
                    422,
                    "this Idempotency-Key was used for a different request",
                    slug="idempotency-key-reused",
                )
            if state == "replay":
                assert record is not None
                headers = {**record["headers"], "Idempotent-Replayed": "true"}
                media = headers.pop("content-type", None)
                return Response(
                    record["body"],
                    status_code=record["status"],
                    headers=headers,
                    media_type=media,
                )
            await asyncio.sleep(self.wait_poll)
        return await self._produce(key_hash, produce)

    async def _produce(self, key_hash: str, produce: Callable[[], Awaitable[Response]]) -> Response:
        keeper = asyncio.ensure_future(self._keep(key_hash))
        kept = False
        try:
            try:
                response = await produce()
            except Problem as exc:
                if exc.status < 500 and exc.status != 429:
                    response = problem_response(
                        None,
                        exc.status,
                        exc.detail,
                        errors=exc.errors,
                        slug=exc.slug,
                        headers=exc.headers,
                    )
                    await self._keep_answer(key_hash, response)
                    kept = True
                raise
            if response.status_code < 500 and response.status_code != 429:
                await self._keep_answer(key_hash, response)
                kept = True
            return response
        finally:
            keeper.cancel()
            if not kept:
                # Shielded: a request cancelled mid-way still frees its key.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.writer.run(partial(self._drop, key_hash)))

    async def _keep_answer(self, key_hash: str, response: Response) -> None:
        """Store the answer, durably, before it leaves."""
        await self.writer.run(partial(self._store, key_hash, response), len(response.body))

    async def _keep(self, key_hash: str) -> None:
        while True:
            await asyncio.sleep(self.lease / 3)
            with contextlib.suppress(Exception):
                await self.writer.run(partial(self._renew, key_hash))
