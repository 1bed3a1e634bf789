"""HL7 forwarding as a delivery queue, apart from the jobs whose answers it sends.

With ``BAGSERVE_HL7_FORWARD=mllp://HOST:PORT`` a finished job's answer is built into
its ``ORU^R01`` message (:func:`.hl7.oru_r01`, its control id fixed once) and queued
in the database (table ``hl7_deliveries``) in the transaction that stores the answer:
the job is ``succeeded`` at once, and a laboratory system that is slow, down or
silent holds no job slot and no worker.

Each replica runs one sender, an asyncio task of its own: it *claims* a due delivery
(one transaction, ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, the write lock on SQLite,
as the job queue claims jobs), leased to this replica for one try's time and
``BAGSERVE_LEASE`` more, so that two replicas never send one message at the same
time; it makes one try (:func:`.mllp.attempt`, ``BAGSERVE_HL7_TIMEOUT`` seconds at
most), stores what came of it and appends it to the audit trail (route
``hl7-forward``, one record per try, with the control id the ACK must echo). A
delivery is

* ``pending``: not accepted yet; tried again ``BAGSERVE_HL7_BACKOFF`` seconds after
  the first try, twice as long after each next (at most :data:`MAX_WAIT`);
* ``delivered``: an ``AA`` (or ``CA``) for its control id;
* ``undelivered``: refused (``AR``/``CR``: sending it again changes nothing), or not
  accepted after ``BAGSERVE_HL7_RETRIES`` retries or ``BAGSERVE_HL7_GIVE_UP`` seconds.

A replica that stops hands its claimed deliveries back; a replica that dies leaves
them to another once the lease runs out. Pending deliveries are in the database, so
a restarted service sends them; at start it also gives every undelivered one that
was not refused a new round of tries (a laboratory system down for longer than the
bound gets its results once the service is restarted). Resending is safe: a message
keeps its control id, by which a receiver recognises a duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .audit import AuditLog
from .database import Cursor, Database
from .mllp import REFUSED, Attempt, attempt, parse_mllp_url

__all__ = ["MAX_WAIT", "Delivery", "DeliveryQueue"]

log = logging.getLogger("bagserve.hl7")
#: The longest wait between two tries of one message, in seconds.
MAX_WAIT = 300.0
PENDING, DELIVERED, UNDELIVERED = "pending", "delivered", "undelivered"


@dataclass(frozen=True)
class Delivery:
    """A claimed delivery: the job, the message and how many tries it had."""

    job_id: str
    request_id: str
    api_key_id: str | None
    peer: str
    control_id: str
    message: str
    tries: int
    give_up: float


class DeliveryQueue:
    """The deliveries in the database and this replica's sender.

    Parameters
    ----------
    db : Database
    owner : str
        This replica's name (:func:`.jobs.replica_id`).
    timeout : float
        Seconds one try may take in all.
    retries : int
        Tries after the first before a message is undelivered.
    backoff : float
        Seconds before the first retry (doubled after each, at most :data:`MAX_WAIT`).
    give_up : float
        Seconds after queueing when a message is no longer retried.
    lease : float
        Seconds a claim outlives its try's ``timeout`` (a replica that died while
        sending lets another replica try that long after).
    poll : float
        Seconds between looks for due deliveries when idle.
    ttl : float
        Seconds a finished delivery's record is kept (as its job's).
    audit : AuditLog, optional
        Where each try is recorded.
    """

    def __init__(
        self,
        db: Database,
        *,
        owner: str,
        timeout: float = 10.0,
        retries: int = 10,
        backoff: float = 1.0,
        give_up: float = 3600.0,
        lease: float = 30.0,
        poll: float = 0.5,
        ttl: float = 86400.0,
        audit: AuditLog | None = None,
    ) -> None:
        self.db = db
        self.owner = owner
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.give_up, self.lease, self.poll, self.ttl = give_up, lease, poll, ttl
        self.audit = audit
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._concluding: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ storage
    def enqueue(
        self,
        job_id: str,
        *,
        request_id: str,
        api_key_id: str | None,
        peer: str,
        control_id: str,
        message: str,
    ) -> Callable[[Cursor], None]:
        """What queues ``message`` for ``peer``, to run in the transaction that stores
        the job's answer (:meth:`.jobs.JobStore.finish`'s ``also``)."""
        parse_mllp_url(peer)

        def insert(cur: Cursor) -> None:
            now = time.time()
            cur.execute(
                "INSERT INTO hl7_deliveries (job_id, request_id, api_key_id, peer, "
                "control_id, message, status, tries, created, updated, next_try, give_up) "
                "VALUES (%s, %s, %s, %s, %s, %s, 'pending', 0, %s, %s, %s, %s)",
                (job_id, request_id, api_key_id, peer, control_id, message, now, now, now,
                 now + self.give_up),
            )  # fmt: skip

        return insert

    def claim(self) -> Delivery | None:
        """Take the delivery due first, leased to this replica; None when none is due."""
        now = time.time()
        due = "status = 'pending' AND next_try <= %s AND (owner IS NULL OR lease_until < %s)"
        # A read first: idle replicas look often, and a look must not take the write lock.
        with self.db.transaction(write=False) as cur:
            found = cur.execute(f"SELECT 1 FROM hl7_deliveries WHERE {due} LIMIT 1", (now, now))
            if found.fetchone() is None:
                return None
        lock = " FOR UPDATE SKIP LOCKED" if self.db.dialect == "postgresql" else ""
        with self.db.transaction() as cur:
            row = cur.execute(
                "SELECT job_id, request_id, api_key_id, peer, control_id, message, tries, "
                f"give_up FROM hl7_deliveries WHERE {due} ORDER BY next_try LIMIT 1{lock}",
                (now, now),
            ).fetchone()
            if row is None:
                return None
            cur.execute(
                "UPDATE hl7_deliveries SET owner = %s, lease_until = %s WHERE job_id = %s",
                (self.owner, now + self.timeout + self.lease, row[0]),
            )
        job_id, request_id, key, peer, control_id, message, tries, give_up = row
        return Delivery(
            str(job_id), str(request_id), key, str(peer), str(control_id), str(message),
            int(tries), float(give_up),
        )  # fmt: skip

    def wait_before(self, tries: int) -> float:
        """Seconds between try ``tries`` and the next."""
        return min(self.backoff * 2 ** (tries - 1), MAX_WAIT)

    def record(self, delivery: Delivery, outcome: Attempt) -> str | None:
        """Store a try's outcome; the delivery's status after it, or None when the
        delivery was no longer this replica's (its lease ran out meanwhile)."""
        now = time.time()
        tries = delivery.tries + 1
        wait = self.wait_before(tries)
        if outcome.accepted:
            status = DELIVERED
        elif outcome.refused or tries > self.retries or now + wait > delivery.give_up:
            status = UNDELIVERED
        else:
            status = PENDING
        with self.db.transaction() as cur:
            n = cur.execute(
                "UPDATE hl7_deliveries SET status = %s, tries = %s, updated = %s, "
                "next_try = %s, ack = %s, error = %s, owner = NULL, lease_until = NULL "
                "WHERE job_id = %s AND owner = %s AND status = 'pending'",
                (status, tries, now, now + wait, outcome.ack, outcome.error,
                 delivery.job_id, self.owner),
            ).rowcount  # fmt: skip
        return status if n == 1 else None

    def state(self, job_id: str) -> dict[str, Any] | None:
        """A job's delivery as its poll shows it; None without one."""
        with self.db.transaction(write=False) as cur:
            row = cur.execute(
                "SELECT peer, control_id, status, tries, ack, error, updated, next_try "
                "FROM hl7_deliveries WHERE job_id = %s",
                (job_id,),
            ).fetchone()
        if row is None:
            return None
        peer, control_id, status, tries, ack, error, updated, next_try = row
        out: dict[str, Any] = {
            "peer": peer,
            "control_id": control_id,
            "status": status,
            "tries": int(tries),
            "ack": ack,
            "error": error,
            "updated": float(updated),
        }
        if status == PENDING:
            out["next_try"] = float(next_try)
        return out

    def requeue(self) -> int:
        """Give undelivered messages that were not refused a new round of tries (at
        start); how many."""
        now = time.time()
        codes = ", ".join(f"'{c}'" for c in REFUSED)
        with self.db.transaction() as cur:
            return cur.execute(
                "UPDATE hl7_deliveries SET status = 'pending', tries = 0, next_try = %s, "
                "give_up = %s, updated = %s WHERE status = 'undelivered' "
                f"AND (ack IS NULL OR ack NOT IN ({codes}))",
                (now, now + self.give_up, now),
            ).rowcount

    def release(self) -> int:
        """Hand this replica's claimed deliveries back (a clean stop)."""
        with self.db.transaction() as cur:
            return cur.execute(
                "UPDATE hl7_deliveries SET owner = NULL, lease_until = NULL "
                "WHERE owner = %s AND status = 'pending'",
                (self.owner,),
            ).rowcount

    def sweep(self) -> int:
        """Delete finished deliveries older than the ttl (their jobs are gone too)."""
        with self.db.transaction() as cur:
            return cur.execute(
                "DELETE FROM hl7_deliveries WHERE status <> 'pending' AND updated < %s",
                (time.time() - self.ttl,),
            ).rowcount

    # ------------------------------------------------------------------ the sender
    def wake(self) -> None:
        """Have the sender look for due deliveries now (call on the event loop)."""
        self._wake.set()

    def start(self) -> None:
        """Start this replica's sender on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._send())

    async def stop(self) -> None:
        """Stop the sender and hand its claim back."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._concluding is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._concluding
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.release)

    async def _send(self) -> None:
        swept = 0.0
        while True:
            try:
                delivery = await asyncio.to_thread(self.claim)
                if time.monotonic() - swept > min(self.ttl, 60.0):
                    swept = time.monotonic()
                    await asyncio.to_thread(self.sweep)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("cannot claim an HL7 delivery")
                delivery = None
            if delivery is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.poll)
                continue
            try:
                await self._try(delivery)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("HL7 delivery failed unexpectedly", extra={"job": delivery.job_id})

    async def _try(self, delivery: Delivery) -> None:
        """One try of a claimed delivery: send, then store and audit what came of it
        (a stop waits for that, not for the peer)."""
        host, port = parse_mllp_url(delivery.peer)
        outcome = await attempt(delivery.message, host, port, self.timeout)
        self._concluding = asyncio.ensure_future(self._conclude(delivery, outcome))
        await asyncio.shield(self._concluding)

    async def _conclude(self, delivery: Delivery, outcome: Attempt) -> None:
        status = await asyncio.to_thread(self.record, delivery, outcome)
        record = {
            "peer": delivery.peer,
            "control_id": delivery.control_id,
            "try": delivery.tries + 1,
            "ack": outcome.ack,
            "error": outcome.error,
            "status": status or "lost the claim",
        }
        level = logging.INFO if outcome.accepted else logging.WARNING
        log.log(level, "HL7 delivery try", extra={"job": delivery.job_id, **record})
        if self.audit is not None:
            try:
                await asyncio.shield(
                    self.audit.append_async(
                        request_id=delivery.request_id,
                        api_key_id=delivery.api_key_id,
                        route="hl7-forward",
                        job=delivery.job_id,
                        hl7=record,
                    )
                )
            except Exception:
                log.exception("cannot audit an HL7 delivery try", extra={"job": delivery.job_id})
