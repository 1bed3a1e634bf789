"""A fixed pool of compute processes holding the models; the event loop never computes.

The asyncio side hands a request to an idle worker (:mod:`.worker`); when all are busy,
at most ``queue_size`` requests wait, and the next one is refused at once
(:class:`QueueFull`, answered 503 with ``Retry-After``). A worker that dies is noticed
through its process sentinel while a request is in flight: the request fails fast
(:class:`WorkerLost`), the worker is respawned, and readiness says so meanwhile. A
request that outlives ``request_timeout`` gets its worker killed and replaced
(:class:`WorkerTimeout`). A worker's own error arrives typed: :class:`InputRejected`
when the model refused the input, :class:`ComputeFailed` otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from .errors import Problem, ServiceError
from .wire import BufferPool, SharedBuffer, recv_message, send_message
from .worker import INPUT_ERROR, PROBLEM_ERROR, worker_main

__all__ = [
    "ComputeFailed",
    "InputRejected",
    "PoolError",
    "QueueFull",
    "WorkerLost",
    "WorkerPool",
    "WorkerTimeout",
]

log = logging.getLogger("bagserve.workers")


class PoolError(ServiceError):
    """A request could not be computed by the worker pool."""


class QueueFull(PoolError):
    """Every worker is busy and the waiting line is full."""


class WorkerLost(PoolError):
    """The worker computing this request died."""


class WorkerTimeout(PoolError):
    """The request took longer than the configured timeout."""


class InputRejected(PoolError):
    """The model refused the input (a validation error raised in the worker)."""


class ComputeFailed(PoolError):
    """The worker failed for another reason than the input; its message says why."""


@dataclass
class _Worker:
    index: int
    process: Any
    conn: Connection
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return bool(self.process.is_alive())

    def exchange(
        self,
        header: dict[str, Any],
        arrays: Mapping[str, np.ndarray],
        timeout: float,
        pool: BufferPool | None = None,
        lent: Sequence[SharedBuffer] = (),
        meanwhile: Callable[[], Any] | None = None,
    ):
        """Send a request, wait for the answer, the worker's death, or the timeout;
        returns the answer and what ``meanwhile()`` returned.

        ``meanwhile`` runs in this thread once the request is sent, while the worker
        computes (work that releases the GIL, such as hashing the input). Buffers taken
        from ``pool`` go back to it once the answer is in; if there is no answer, the
        worker may still read them, and they are never reused.
        """
        try:
            taken = send_message(self.conn, header, arrays, pool, lent)
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise WorkerLost(str(exc)) from exc
        try:
            aside = meanwhile() if meanwhile is not None else None
            answer = (*self._answer(timeout), aside)
        except BaseException:
            for buf in taken:
                buf.tainted = True
            raise
        finally:
            for buf in taken:
                pool.give_back(buf)  # type: ignore[union-attr]
        return answer

    def _answer(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout(f"no answer within {timeout:g} s")
            ready = wait([self.conn, self.process.sentinel], timeout=remaining)
            if self.conn in ready:
                try:
                    return recv_message(self.conn)
                except (EOFError, OSError) as exc:
                    raise WorkerLost(str(exc)) from exc
            if self.process.sentinel in ready:
                raise WorkerLost(f"worker {self.index} (pid {self.pid}) died")

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class WorkerPool:
    """``n`` worker processes serving ``models`` (key → artifact path).

    Parameters
    ----------
    models : dict of str to Path
        Model key (``name/version``) to its verified artifact.
    n : int
        Worker processes.
    queue_size : int
        Requests that may wait for a worker before :class:`QueueFull`.
    limits : dict
        The request limits the workers decode within (:class:`~.codecs.RequestLimits`
        as JSON).
    start_timeout : float, default=120
        Seconds a worker may take to load every model.
    """

    def __init__(
        self,
        models: dict[str, Path],
        n: int,
        queue_size: int,
        limits: dict[str, int],
        start_timeout: float = 120.0,
    ):
        self.models = {k: str(v) for k, v in models.items()}
        self.limits = dict(limits)
        self.n = n
        self.queue_size = queue_size
        self.start_timeout = start_timeout
        self._ctx = mp.get_context("spawn")
        self._workers: dict[int, _Worker] = {}
        self._idle: asyncio.Queue[int] | None = None
        self._waiting = 0
        self._busy = 0
        self._respawning: set[int] = set()
        self._executor = ThreadPoolExecutor(max_workers=n + 2, thread_name_prefix="bagserve-io")
        #: Shared buffers for large requests (Linux); request bodies can be read into
        #: one (:meth:`BufferPool.lease`) and reach the worker without a copy.
        self.buffers = (
            BufferPool(max_idle=n + 2, max_idle_bytes=512 << 20)
            if hasattr(os, "memfd_create")
            else None
        )
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._queued: set[int] = set()
        self._in_use: set[int] = set()
        #: Workers replaced by :meth:`reload` while computing: stopped once released.
        self._retired: dict[int, _Worker] = {}
        self._reloading = asyncio.Lock()

    # -- lifecycle
    def _spawn(self, index: int) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=worker_main,
            args=(child, self.models, self.limits),
            name=f"bagserve-worker-{index}",
            daemon=True,
        )
        proc.start()
        child.close()
        worker = _Worker(index, proc, parent)
        ready = wait([parent, proc.sentinel], timeout=self.start_timeout)
        if parent not in ready:
            worker.kill()
            raise RuntimeError(f"worker {index} did not start (exit code {proc.exitcode})")
        if parent.recv_bytes() != b"ready":
            worker.kill()
            raise RuntimeError(f"worker {index} sent an unexpected greeting")
        return worker

    async def start(self) -> None:
        """Start every worker (in parallel) and the monitor that replaces dead ones."""
        loop = asyncio.get_running_loop()
        self._idle = asyncio.Queue()
        workers = await asyncio.gather(
            *(loop.run_in_executor(self._executor, self._spawn, i) for i in range(self.n))
        )
        for w in workers:
            self._workers[w.index] = w
            self._release(w.index)
        monitor = loop.create_task(self._monitor())
        self._tasks.add(monitor)

    def _release(self, index: int) -> None:
        """Make a worker available (once, however many paths release it)."""
        assert self._idle is not None
        self._in_use.discard(index)
        retired = self._retired.pop(index, None)
        if retired is not None:
            self._executor.submit(retired.kill)
        if index not in self._queued:
            self._queued.add(index)
            self._idle.put_nowait(index)

    async def _monitor(self, period: float = 0.25) -> None:
        """Notice workers that die while idle (a request notices its own worker)."""
        while not self._closed:
            await asyncio.sleep(period)
            for index, worker in list(self._workers.items()):
                if index not in self._in_use and not worker.alive():
                    self._respawn_later(index)

    async def stop(self) -> None:
        """Stop the workers and release the shared buffers."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for w in list(self._workers.values()):
            w.kill()
        self._workers.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.buffers is not None:
            self.buffers.close()

    async def reload(self, models: dict[str, Path]) -> None:
        """Serve ``models`` from now on, without a moment of unavailability.

        Each worker in turn is replaced by a new one that has loaded ``models`` (one
        more process meanwhile); a worker computing a request finishes it and is
        stopped when released. Requests keep being served by the other workers, and
        by the old ones until they are replaced.

        Raises
        ------
        RuntimeError
            A new worker did not start (the old ones keep serving what they served).
        """
        loop = asyncio.get_running_loop()
        async with self._reloading:
            previous = self.models
            self.models = {k: str(v) for k, v in models.items()}
            try:
                for index in sorted(self._workers):
                    new = await loop.run_in_executor(self._executor, self._spawn, index)
                    old = self._workers.get(index)
                    self._workers[index] = new
                    if old is None:
                        continue
                    if index in self._in_use:
                        self._retired[index] = old
                    else:
                        await loop.run_in_executor(self._executor, old.kill)
            except Exception:
                self.models = previous
                raise
            log.info("workers reloaded", extra={"models": sorted(self.models)})

    def _respawn_later(self, index: int) -> None:
        """Replace a dead or killed worker in the background."""
        if self._closed or index in self._respawning:
            return
        self._respawning.add(index)
        loop = asyncio.get_running_loop()

        async def respawn() -> None:
            try:
                old = self._workers.pop(index, None)
                if old is not None:
                    await loop.run_in_executor(self._executor, old.kill)
                worker = await loop.run_in_executor(self._executor, self._spawn, index)
                if self._closed:
                    worker.kill()
                    return
                self._workers[index] = worker
                self._release(index)
                log.info("worker respawned", extra={"worker": index, "pid": worker.pid})
            except Exception:
                log.exception("respawning worker %d failed", index)
            finally:
                self._respawning.discard(index)

        task = loop.create_task(respawn())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- requests
    async def submit(
        self,
        header: dict[str, Any],
        arrays: Mapping[str, np.ndarray],
        timeout: float,
        lent: Sequence[SharedBuffer] = (),
        meanwhile: Callable[[], Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, np.ndarray], float, Any]:
        """Run one request on a worker; returns its answer, the seconds spent queued,
        and what ``meanwhile()`` returned (run while the worker computes; see
        :meth:`_Worker.exchange`).

        Arrays lying in one of the ``lent`` buffers (the caller's, from
        :attr:`buffers`) reach the worker without a copy. If the request fails, the
        worker may still be reading them: they are marked tainted, not to be reused.
        """
        assert self._idle is not None, "pool not started"
        if self.saturated:
            raise QueueFull()
        t0 = time.monotonic()
        while True:
            self._waiting += 1
            try:
                index = await self._idle.get()
            finally:
                self._waiting -= 1
            self._queued.discard(index)
            worker = self._workers.get(index)
            if worker is not None and worker.alive():
                break
            # Died while idle: replace it and take the next idle worker.
            self._respawn_later(index)
        queued = time.monotonic() - t0
        self._in_use.add(index)
        self._busy += 1
        loop = asyncio.get_running_loop()
        try:
            out_header, out_arrays, aside = await loop.run_in_executor(
                self._executor,
                worker.exchange,
                header,
                arrays,
                timeout,
                self.buffers,
                lent,
                meanwhile,
            )
        except (WorkerLost, WorkerTimeout):
            self._taint(lent)
            self._respawn_later(index)
            raise
        except BaseException:
            # Cancelled while computing: the worker's answer would come out of turn.
            self._taint(lent)
            self._respawn_later(index)
            raise
        finally:
            self._busy -= 1
        self._release(index)
        if not out_header.get("ok"):
            error = out_header.get("error") or {}
            if error.get("type") == PROBLEM_ERROR:
                raise Problem(
                    int(error["status"]),
                    str(error["detail"]),
                    errors=list(error.get("errors") or []),
                    slug=error.get("slug"),
                )
            cls = InputRejected if error.get("type") == INPUT_ERROR else ComputeFailed
            raise cls(str(error.get("message", "compute failed")))
        return out_header, out_arrays, queued, aside

    @property
    def saturated(self) -> bool:
        """Every worker is busy and the waiting line is full: the next request would be
        refused (checked before a request's body is read, too)."""
        return self._idle is not None and self._idle.empty() and self._waiting >= self.queue_size

    @staticmethod
    def _taint(buffers: Sequence[SharedBuffer]) -> None:
        for buf in buffers:
            buf.tainted = True

    def status(self) -> dict[str, Any]:
        """Configured, alive, busy and waiting counts, workers being replaced, pids."""
        alive = [w for w in self._workers.values() if w.alive()]
        return {
            "configured": self.n,
            "alive": len(alive),
            "busy": self._busy,
            "waiting": self._waiting,
            "respawning": sorted(self._respawning),
            "pids": [w.pid for w in alive],
        }

    @property
    def ready(self) -> bool:
        """Every configured worker is alive."""
        return not self._closed and len([w for w in self._workers.values() if w.alive()]) == self.n
