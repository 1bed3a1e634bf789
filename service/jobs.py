"""Asynchronous prediction jobs that survive restarts.

``POST /v1/jobs?model=NAME[&version=V]`` takes the same bodies as predict, writes the
request to ``DATA_DIR/jobs/<id>/`` and answers 202 with ``Location``. A runner hands
queued jobs to the worker pool; their results (or problems) are written next to the
request, atomically. At start-up every job that was accepted but not finished is queued
again, so a restart loses nothing accepted. Finished jobs are deleted after
``jobs_ttl`` seconds; ``DELETE`` cancels a queued or running job (a running job's
answer is then discarded).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from bagserve.core.atomic import atomic_directory, atomic_write_json

from .errors import Problem

__all__ = ["JobStore"]

log = logging.getLogger("bagserve.jobs")
FINAL = ("succeeded", "failed", "cancelled")


class JobStore:
    """Jobs on disk, ``DIRECTORY/<id>/`` (request body, ``meta.json``, ``result.json``),
    and the consumers that run them.

    Parameters
    ----------
    directory : Path
    ttl : float
        Seconds a finished job is kept.
    """

    def __init__(self, directory: Path, ttl: float):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ttl = ttl
        self.queue: asyncio.Queue[str] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: dict[str, asyncio.Task[None]] = {}

    # -- storage
    def _dir(self, job_id: str) -> Path:
        if not all(c in "0123456789abcdef" for c in job_id) or len(job_id) != 32:
            raise Problem(404, f"unknown job {job_id!r}", slug="unknown-job")
        return self.directory / job_id

    def meta(self, job_id: str) -> dict[str, Any]:
        """The job's metadata (status, model, times, ...); 404 for an unknown id."""
        path = self._dir(job_id) / "meta.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            raise Problem(404, f"unknown job {job_id!r}", slug="unknown-job") from None

    def _update(self, job_id: str, **fields: Any) -> dict[str, Any]:
        meta = {**self.meta(job_id), **fields, "updated": time.time()}
        atomic_write_json(self._dir(job_id) / "meta.json", meta)
        return meta

    def create(self, body: bytes, **meta: Any) -> dict[str, Any]:
        """Store a request body with its metadata, queue it, and return the metadata."""
        job_id = uuid.uuid4().hex
        now = time.time()
        # Published whole or not at all: recover() drops the hidden build directories.
        with atomic_directory(self.directory / job_id) as tmp:
            (tmp / "request.bin").write_bytes(body)
            first = {"id": job_id, "status": "queued", "created": now, "updated": now, **meta}
            (tmp / "meta.json").write_text(json.dumps(first))
        self.queue.put_nowait(job_id)
        return self.meta(job_id)

    def body(self, job_id: str) -> bytes:
        """The stored request body."""
        return (self._dir(job_id) / "request.bin").read_bytes()

    def result(self, job_id: str) -> dict[str, Any] | None:
        """The job's answer or problem, once finished (else ``None``)."""
        path = self._dir(job_id) / "result.json"
        return json.loads(path.read_text()) if path.exists() else None

    def finish(self, job_id: str, status: str, result: dict[str, Any]) -> None:
        """Store a finished job's answer, unless it was cancelled meanwhile."""
        if self.meta(job_id)["status"] == "cancelled":
            return  # cancelled while running: the answer is discarded
        atomic_write_json(self._dir(job_id) / "result.json", result)
        self._update(job_id, status=status)

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a queued or running job; a finished one is returned as it is."""
        meta = self.meta(job_id)
        if meta["status"] in FINAL:
            return meta
        task = self._running.get(job_id)
        if task is not None:
            task.cancel()
        return self._update(job_id, status="cancelled")

    # -- lifecycle
    def recover(self) -> int:
        """Queue every accepted but unfinished job; drop expired and half-written ones."""
        n = 0
        now = time.time()
        for path in sorted(self.directory.iterdir(), key=lambda p: p.name):
            if path.name.startswith("."):
                shutil.rmtree(path, ignore_errors=True)  # never fully created
                continue
            try:
                meta = json.loads((path / "meta.json").read_text())
            except (OSError, ValueError):
                shutil.rmtree(path, ignore_errors=True)
                continue
            if meta["status"] in FINAL:
                if now - meta["updated"] > self.ttl:
                    shutil.rmtree(path, ignore_errors=True)
                continue
            if meta["status"] == "running":
                self._update(meta["id"], status="queued")
            self.queue.put_nowait(meta["id"])
            n += 1
        return n

    def start(self, run_one: Any, concurrency: int) -> None:
        """Start ``concurrency`` consumers running ``run_one(job_id)``, and the sweep
        that deletes expired finished jobs.
        """

        async def consume() -> None:
            while True:
                job_id = await self.queue.get()
                try:
                    if self.meta(job_id)["status"] != "queued":
                        continue
                    self._update(job_id, status="running")
                    task = asyncio.current_task()
                    assert task is not None
                    inner = asyncio.ensure_future(run_one(job_id))
                    self._running[job_id] = inner
                    try:
                        await inner
                    except asyncio.CancelledError:
                        if task.cancelled() or (
                            task.cancelling() if hasattr(task, "cancelling") else 0
                        ):
                            raise
                finally:
                    self._running.pop(job_id, None)

        async def sweep() -> None:
            while True:
                await asyncio.sleep(min(self.ttl, 60.0))
                now = time.time()
                for path in list(self.directory.iterdir()):
                    with contextlib.suppress(OSError, ValueError, KeyError):
                        meta = json.loads((path / "meta.json").read_text())
                        if meta["status"] in FINAL and now - meta["updated"] > self.ttl:
                            shutil.rmtree(path, ignore_errors=True)

        for _ in range(concurrency):
            t = asyncio.get_running_loop().create_task(consume())
            self._tasks.add(t)
        self._tasks.add(asyncio.get_running_loop().create_task(sweep()))

    async def stop(self) -> None:
        """Cancel the consumers, the sweep and the running jobs."""
        for t in list(self._tasks) + list(self._running.values()):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
