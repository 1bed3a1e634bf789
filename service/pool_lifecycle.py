"""The worker pool's first job: starting, watching, replacing and stopping its workers.

A worker is forked (:mod:`.worker_server`), greets on its control pipe, catches up with
the served model versions before it takes a request (:mod:`.pool_placement`), and is
replaced when it dies or is killed; :meth:`Lifecycle.close` ends them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from multiprocessing.connection import wait
from typing import Any

from .worker import worker_main
from .worker_handle import WorkerHandle
from .worker_server import worker_context

log = logging.getLogger("bagserve.workers")


class Lifecycle:
    """Start, watch, replace and stop the workers (a part of :class:`~.pool.WorkerPool`).

    Parameters
    ----------
    n : int
        Worker processes.
    limits : dict
        The request limits the workers decode within.
    start_timeout : float
        Seconds a worker may take to start.
    workers : dict of int to WorkerHandle
        The running workers by index, kept up to date here (the other parts read it).
    control : Executor
        The threads that wait on the workers while they start and stop.
    catch_up : callable
        ``await catch_up(worker)``: a started worker loads what is served; raises if it
        cannot.
    joined, left : callable
        ``joined(worker)`` once a worker runs, ``left()`` once one is gone.
    available : callable
        ``available(index)``: worker ``index`` may take a request.
    in_use : callable
        ``in_use(index)``: worker ``index`` has a request (its death is noticed there).
    """

    def __init__(
        self,
        n: int,
        limits: dict[str, int],
        start_timeout: float,
        workers: dict[int, WorkerHandle],
        control: Executor,
        *,
        catch_up: Callable[[WorkerHandle], Awaitable[None]],
        joined: Callable[[WorkerHandle], None],
        left: Callable[[], None],
        available: Callable[[int], None],
        in_use: Callable[[int], bool],
    ):
        self.n = n
        self.limits = limits
        self.start_timeout = start_timeout
        self._ctx = worker_context()
        self._workers = workers
        self._control = control
        self._catch_up = catch_up
        self._joined = joined
        self._left = left
        self._available = available
        self._in_use = in_use
        self._respawning: set[int] = set()
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def alive(self) -> list[WorkerHandle]:
        """The running workers whose process is alive."""
        return [w for w in self._workers.values() if w.alive()]

    @property
    def respawning(self) -> list[int]:
        """Indexes of the workers being started or replaced."""
        return sorted(self._respawning)

    @property
    def ready(self) -> bool:
        """Every configured worker is alive."""
        return not self._closed and len(self.alive) == self.n

    def _spawn(self, index: int) -> WorkerHandle:
        """Start worker ``index``, in a thread: it waits for the worker's greeting."""
        parent, child = self._ctx.Pipe(duplex=True)
        control, control_child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=worker_main,
            args=(child, control_child, self.limits),
            name=f"bagserve-worker-{index}",
            daemon=True,
        )
        proc.start()
        child.close()
        control_child.close()
        worker = WorkerHandle(index, proc, parent, control)
        ready = wait([control, proc.sentinel], timeout=self.start_timeout)
        greeting: Any = None
        if control in ready:
            with contextlib.suppress(EOFError, OSError):
                greeting = control.recv()
        if not isinstance(greeting, dict):
            worker.kill()
            raise RuntimeError(f"worker {index} did not start (exit code {proc.exitcode})")
        return worker

    async def _bring_up(self, index: int) -> WorkerHandle | None:
        """Start worker ``index``; it takes requests once it has caught up (it holds
        every served version), and is then announced (``joined``)."""
        loop = asyncio.get_running_loop()
        worker = await loop.run_in_executor(self._control, self._spawn, index)
        try:
            await self._catch_up(worker)
        except BaseException:
            await loop.run_in_executor(self._control, worker.kill)
            raise
        if self._closed:
            worker.kill()
            return None
        self._workers[index] = worker
        self._available(index)
        self._joined(worker)
        return worker

    def start(self) -> None:
        """Start the workers and the monitor that replaces dead ones, and return at once
        (:attr:`ready` says when every worker is up)."""
        loop = asyncio.get_running_loop()
        for index in range(self.n):
            self.replace(index)
        monitor = loop.create_task(self._monitor())
        self._tasks.add(monitor)

    async def _monitor(self, period: float = 0.25) -> None:
        """Notice workers that die while idle (a request notices its own worker)."""
        while not self._closed:
            await asyncio.sleep(period)
            for index, worker in list(self._workers.items()):
                if not self._in_use(index) and not worker.alive():
                    self.replace(index)

    def close(self) -> None:
        """Stop the workers and what starts or watches them."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for w in list(self._workers.values()):
            w.unwatch()
            w.kill()
        self._workers.clear()

    def replace(self, index: int) -> None:
        """Start worker ``index``, or replace a dead or killed one, in the background."""
        if self._closed or index in self._respawning:
            return
        self._respawning.add(index)
        loop = asyncio.get_running_loop()

        async def respawn() -> None:
            try:
                old = self._workers.pop(index, None)
                if old is not None:
                    # The others may now be every running worker holding a version.
                    self._left()
                    old.unwatch()  # on the loop's thread, before its descriptors close
                    await loop.run_in_executor(self._control, old.kill)
                pause = 1.0
                while not self._closed:
                    try:
                        worker = await self._bring_up(index)
                    except Exception:
                        # Tried again (readiness says a worker is missing meanwhile):
                        # what failed may pass later (memory, a process limit).
                        log.exception("starting worker %d failed; retrying in %g s", index, pause)
                        await asyncio.sleep(pause)
                        pause = min(2 * pause, 30.0)
                        continue
                    if worker is not None:
                        log.info("worker started", extra={"worker": index, "pid": worker.pid})
                    return
            finally:
                self._respawning.discard(index)

        task = loop.create_task(respawn())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
