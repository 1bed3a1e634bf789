"""The worker pool's first job: starting, watching, replacing and stopping its workers.

A worker is forked (:mod:`.worker_server`), greets on its control pipe, loads every
served model version before it takes a request (:mod:`.pool_placement`), and is
replaced when it dies or is killed; :meth:`Lifecycle.stop` ends them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from multiprocessing.connection import wait
from typing import Any

from .worker import worker_main
from .worker_handle import WorkerHandle

log = logging.getLogger("bagserve.workers")


class Lifecycle:
    """Start, watch, replace and stop the workers (a part of :class:`~.pool.WorkerPool`)."""

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
        """Start worker ``index``; it takes requests once it holds every served version,
        then loads those being loaded (:meth:`_converge`)."""
        loop = asyncio.get_running_loop()
        worker = await loop.run_in_executor(self._control, self._spawn, index)
        failed: dict[str, str] = {}
        try:
            # What became served while it started, until nothing is missing: checked and
            # registered with no await in between, so no version served meanwhile is
            # missing from it.
            while True:
                failed = {k: v for k, v in failed.items() if k in self._serving}
                if failed:
                    raise RuntimeError(
                        f"worker {index} could not load a served model: "
                        + "; ".join(f"{k}: {v}" for k, v in sorted(failed.items()))
                    )
                missing = sorted(self._serving - worker.held)
                if not missing:
                    break
                for mid in missing:
                    reason = await self._load_one(worker, mid)
                    if reason is not None:
                        failed[mid] = reason
        except BaseException:
            await loop.run_in_executor(self._control, worker.kill)
            raise
        if self._closed:
            worker.kill()
            return None
        self._workers[index] = worker
        self._release(index)
        self._refresh()
        self._converge(worker)
        return worker

    async def start(self) -> None:
        """Start the workers and the monitor that replaces dead ones, and return at once:
        :attr:`ready` says when every worker is up, :meth:`serves` which models they
        hold (see :meth:`load`)."""
        loop = asyncio.get_running_loop()
        self._idle = asyncio.Queue()
        for index in range(self.n):
            self._respawn_later(index)
        monitor = loop.create_task(self._monitor())
        self._tasks.add(monitor)

    def _release(self, index: int) -> None:
        """Make a worker available (once, however many paths release it)."""
        assert self._idle is not None
        self._in_use.discard(index)
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
        for waiter in self._waiters:
            waiter.cancel()
        for w in list(self._workers.values()):
            w.unwatch()
            w.kill()
        self._workers.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._control.shutdown(wait=False, cancel_futures=True)
        if self.buffers is not None:
            self.buffers.close()

    def _respawn_later(self, index: int) -> None:
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
                    self._refresh()
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

        self._track(loop.create_task(respawn()))

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
