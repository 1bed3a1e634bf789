"""Asynchronous prediction jobs, shared by every replica through the database.

``POST /v1/jobs?model=NAME[&version=V]`` takes the same bodies as predict, stores the
request in the database (:mod:`.database`) and answers 202 with ``Location``; any
replica accepts, any replica answers the poll. Each replica runs ``concurrency``
consumers that *claim* queued jobs: one transaction picks the oldest queued job (or a
running one whose lease expired) under a row lock (``FOR UPDATE SKIP LOCKED`` on
PostgreSQL, the write lock on SQLite) and marks it running, owned by this replica
until ``lease`` seconds from now. While the job runs its owner renews the lease; if
the replica dies (SIGKILL, lost host) the lease runs out and another replica takes the
job over and runs it again (a prediction has no side effect but its audit record). A
replica that stops cleanly hands its running jobs back at once.

The answer (or problem) is stored only by the job's current owner, and never over a
cancellation: ``DELETE`` marks a job cancelled, and the replica running it notices at
its next renewal (within a second) and abandons the computation. Finished jobs are
deleted ``jobs_ttl`` seconds after they finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from .database import Cursor, Database
from .errors import Problem

__all__ = ["FINAL", "JobStore", "replica_id"]

log = logging.getLogger("bagserve.jobs")
FINAL = ("succeeded", "failed", "cancelled")
#: Columns of a job besides its metadata document.
_COLUMNS = "id, status, created, updated, meta, attempts"


def replica_id() -> str:
    """This process's name as an owner of jobs and keys: host, pid and a random part
    (a restarted replica with a reused pid is another owner)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _check_id(job_id: str) -> str:
    if len(job_id) != 32 or not all(c in "0123456789abcdef" for c in job_id):
        raise Problem(404, f"unknown job {job_id!r}", slug="unknown-job")
    return job_id


def _meta(row: tuple[Any, ...]) -> dict[str, Any]:
    job_id, status, created, updated, meta, attempts = row
    return {
        **json.loads(meta),
        "id": job_id,
        "status": status,
        "created": float(created),
        "updated": float(updated),
        "attempts": int(attempts),
    }


class JobStore:
    """Jobs in the database and this replica's consumers.

    Parameters
    ----------
    db : Database
    ttl : float
        Seconds a finished job is kept.
    lease : float
        Seconds a replica holds a running job without renewing it.
    poll : float
        Seconds between looks for queued jobs when idle (a job submitted to this
        replica wakes its consumers at once).
    owner : str, optional
        This replica's name (:func:`replica_id` by default).
    max_attempts : int
        Runs of one job whose replica stopped answering before it is failed.
    """

    def __init__(
        self,
        db: Database,
        ttl: float,
        *,
        lease: float = 30.0,
        poll: float = 0.5,
        owner: str | None = None,
        max_attempts: int = 3,
    ) -> None:
        self.db = db
        self.max_attempts = max_attempts
        self.ttl = ttl
        self.lease = lease
        self.poll = poll
        self.owner = owner or replica_id()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ storage
    def create(self, body: bytes, **meta: Any) -> dict[str, Any]:
        """Store a request body with its metadata as a queued job; its metadata."""
        job_id = uuid.uuid4().hex
        now = time.time()
        with self.db.transaction(timeout=self.db.write_timeout(len(body))) as cur:
            cur.execute(
                "INSERT INTO jobs (id, status, created, updated, meta, body) "
                "VALUES (%s, 'queued', %s, %s, %s, %s)",
                (job_id, now, now, json.dumps(meta), bytes(body)),
            )
        return self.meta(job_id)

    def wake(self) -> None:
        """Have an idle consumer look for queued jobs now (call on the event loop)."""
        self._wake.set()

    def _row(self, columns: str, job_id: str) -> tuple[Any, ...]:
        """One job's ``columns``; 404 for an unknown (or malformed) id."""
        with self.db.transaction(write=False) as cur:
            row = cur.execute(
                f"SELECT {columns} FROM jobs WHERE id = %s", (_check_id(job_id),)
            ).fetchone()
        if row is None:
            raise Problem(404, f"unknown job {job_id!r}", slug="unknown-job")
        return tuple(row)

    def meta(self, job_id: str) -> dict[str, Any]:
        """The job's metadata (status, model, times, ...); 404 for an unknown id."""
        return _meta(self._row(_COLUMNS, job_id))

    def body(self, job_id: str) -> bytes:
        """The stored request body (given the time a large one takes to read)."""
        with self.db.transaction(write=False, timeout=self.db.write_timeout(1 << 28)) as cur:
            row = cur.execute(
                "SELECT body FROM jobs WHERE id = %s", (_check_id(job_id),)
            ).fetchone()
        if row is None:
            raise Problem(404, f"unknown job {job_id!r}", slug="unknown-job")
        return bytes(row[0])

    def view(self, job_id: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Metadata and result in one read (what a poll answers)."""
        row = self._row(f"{_COLUMNS}, result", job_id)
        return _meta(row[:-1]), (json.loads(row[-1]) if row[-1] is not None else None)

    def claim(self) -> str | None:
        """Take the oldest queued job, or a running one whose owner's lease ran out;
        None when there is none. The job is then running, owned by this replica.

        A job whose lease ran out ``max_attempts`` times (it kills every replica that
        runs it, say) is failed instead of taken again."""
        now = time.time()
        due = "status = 'queued' OR (status = 'running' AND lease_until < %s)"
        # A read first: idle replicas look often, and a look must not take the write lock.
        with self.db.transaction(write=False) as cur:
            if cur.execute(f"SELECT 1 FROM jobs WHERE {due} LIMIT 1", (now,)).fetchone() is None:
                return None
        lock = " FOR UPDATE SKIP LOCKED" if self.db.dialect == "postgresql" else ""
        while True:
            with self.db.transaction() as cur:
                row = cur.execute(
                    f"SELECT id, status, owner, attempts FROM jobs WHERE {due} "
                    "ORDER BY created LIMIT 1" + lock,
                    (now,),
                ).fetchone()
                if row is None:
                    return None
                job_id, status, previous, attempts = row
                if status == "running" and int(attempts) >= self.max_attempts:
                    problem = {
                        "status": 500,
                        "detail": (
                            f"abandoned: the replicas running this job stopped answering "
                            f"{attempts} times ({previous} last)"
                        ),
                    }
                    cur.execute(
                        "UPDATE jobs SET status = 'failed', result = %s, updated = %s, "
                        "owner = NULL, lease_until = NULL WHERE id = %s",
                        (json.dumps(problem), now, job_id),
                    )
                    log.error("job abandoned", extra={"job": job_id, "attempts": attempts})
                    continue
                cur.execute(
                    "UPDATE jobs SET status = 'running', owner = %s, lease_until = %s, "
                    "updated = %s, attempts = attempts + 1 WHERE id = %s",
                    (self.owner, now + self.lease, now, job_id),
                )
            if status == "running":
                log.warning(
                    "job taken over", extra={"job": job_id, "from": previous, "to": self.owner}
                )
            return str(job_id)

    def renew(self, job_id: str) -> bool:
        """Extend this replica's lease on a running job; False when the job is no
        longer this replica's to run (cancelled, or taken over)."""
        now = time.time()
        with self.db.transaction() as cur:
            n = cur.execute(
                "UPDATE jobs SET lease_until = %s WHERE id = %s AND owner = %s "
                "AND status = 'running'",
                (now + self.lease, job_id, self.owner),
            ).rowcount
        return n == 1

    def finish(
        self,
        job_id: str,
        status: str,
        result: dict[str, Any],
        also: Callable[[Cursor], None] | None = None,
    ) -> bool:
        """Store a finished job's answer if the job is still this replica's (not
        cancelled, not taken over); whether it was stored. ``also(cursor)`` writes
        what goes with the answer (its HL7 delivery) in the same transaction, only
        when the answer is stored."""
        with self.db.transaction() as cur:
            n = cur.execute(
                "UPDATE jobs SET status = %s, result = %s, updated = %s, owner = NULL, "
                "lease_until = NULL WHERE id = %s AND owner = %s AND status = 'running'",
                (status, json.dumps(result), time.time(), job_id, self.owner),
            ).rowcount
            if n == 1 and also is not None:
                also(cur)
        return n == 1

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a queued or running job; a finished one is returned as it is."""
        with self.db.transaction() as cur:
            cur.execute(
                "UPDATE jobs SET status = 'cancelled', updated = %s, owner = NULL, "
                "lease_until = NULL WHERE id = %s AND status IN ('queued', 'running')",
                (time.time(), _check_id(job_id)),
            )
        return self.meta(job_id)

    def abandon(self, job_id: str) -> None:
        """Stop computing a job this replica runs (call on the event loop, after
        :meth:`cancel`); a job run by another replica stops at its next renewal."""
        task = self._running.get(job_id)
        if task is not None:
            task.cancel()

    def release(self) -> int:
        """Hand this replica's running jobs back to the queue (a clean stop)."""
        with self.db.transaction() as cur:
            return cur.execute(
                "UPDATE jobs SET status = 'queued', owner = NULL, lease_until = NULL, "
                "updated = %s WHERE owner = %s AND status = 'running'",
                (time.time(), self.owner),
            ).rowcount

    def sweep(self) -> int:
        """Delete finished jobs older than the ttl; how many."""
        with self.db.transaction() as cur:
            return cur.execute(
                "DELETE FROM jobs WHERE status IN ('succeeded', 'failed', 'cancelled') "
                "AND updated < %s",
                (time.time() - self.ttl,),
            ).rowcount

    def counts(self) -> dict[str, int]:
        """Jobs by status."""
        with self.db.transaction(write=False) as cur:
            rows = cur.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall()
        return {str(s): int(n) for s, n in rows}

    # ------------------------------------------------------------------ consumers
    def start(self, run_one: Callable[[str], Awaitable[None]], concurrency: int) -> None:
        """Start ``concurrency`` consumers running ``run_one(job_id)`` on claimed jobs,
        and the sweep that deletes expired finished jobs."""
        loop = asyncio.get_running_loop()
        for _ in range(concurrency):
            self._tasks.add(loop.create_task(self._consume(run_one)))
        self._tasks.add(loop.create_task(self._sweep()))

    async def _consume(self, run_one: Callable[[str], Awaitable[None]]) -> None:
        while True:
            try:
                job_id = await asyncio.to_thread(self.claim)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("cannot claim a job")
                job_id = None
            if job_id is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.poll)
                continue
            await self._run(job_id, run_one)

    async def _run(self, job_id: str, run_one: Callable[[str], Awaitable[None]]) -> None:
        inner = asyncio.ensure_future(run_one(job_id))
        self._running[job_id] = inner
        keeper = asyncio.ensure_future(self._keep(job_id, inner))
        try:
            await inner
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise  # the consumer itself is stopping
        except Exception as exc:
            # Not left running: its lease would run out and another replica would try
            # the same failure again.
            log.exception("job failed unexpectedly", extra={"job": job_id})
            problem = {"status": 500, "detail": f"internal error: {type(exc).__name__}"}
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.finish, job_id, "failed", problem)
        finally:
            keeper.cancel()
            self._running.pop(job_id, None)

    async def _keep(self, job_id: str, inner: asyncio.Future[None]) -> None:
        """Renew the lease while the job runs; abandon it once it is not ours."""
        every = min(self.lease / 3, 1.0)
        while not inner.done():
            await asyncio.sleep(every)
            try:
                mine = await asyncio.to_thread(self.renew, job_id)
            except Exception:
                log.exception("cannot renew a job's lease", extra={"job": job_id})
                continue
            if not mine:
                inner.cancel()
                return

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(self.ttl, 60.0))
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.sweep)

    async def stop(self) -> None:
        """Stop the consumers and hand the running jobs back to the queue."""
        for t in list(self._tasks) + list(self._running.values()):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.release)
