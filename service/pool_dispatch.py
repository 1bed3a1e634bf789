"""The worker pool's third job: handing each request to an idle worker.

At most ``queue_size`` requests wait for a worker; the next is refused at once
(:class:`~.worker_handle.QueueFull`). A worker's error comes back typed; one that
dies or overruns its request's time is replaced (:mod:`.pool_lifecycle`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .errors import Problem
from .wire import BufferPool, SharedBuffer, fits_one_write
from .worker import INPUT_ERROR, PROBLEM_ERROR
from .worker_handle import (
    LOOP_EXCHANGE,
    ComputeFailed,
    InputRejected,
    QueueFull,
    WorkerHandle,
    WorkerLost,
    WorkerTimeout,
)


class Dispatch:
    """Queue requests for idle workers (a part of :class:`~.pool.WorkerPool`).

    Parameters
    ----------
    workers : mapping of int to WorkerHandle
        The running workers by index (kept by :class:`~.pool_lifecycle.Lifecycle`).
    queue_size : int
        Requests that may wait for a worker before :class:`QueueFull`.
    threads : int
        Threads that carry requests to the workers.
    buffers : BufferPool or None
        Where large requests are written for the worker (None: through the pipe).
    routable : callable
        ``routable(key, sha256)``: requests for that model may go to any worker.
    replace : callable
        ``replace(index)``: worker ``index`` died or overran; have it replaced.
    """

    def __init__(
        self,
        workers: Mapping[int, WorkerHandle],
        queue_size: int,
        threads: int,
        buffers: BufferPool | None,
        routable: Callable[[str, str | None], bool],
        replace: Callable[[int], None],
    ):
        self._workers = workers
        self.queue_size = queue_size
        self.buffers = buffers
        self._routable = routable
        self._replace = replace
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bagserve-io")
        self._idle: asyncio.Queue[int] | None = None
        #: Idle workers in ``_idle``, and workers with a request.
        self._queued: set[int] = set()
        self._in_use: set[int] = set()
        self._waiting = 0
        self._busy = 0

    def start(self) -> None:
        """Open the line of idle workers (:meth:`release` puts them in)."""
        self._idle = asyncio.Queue()

    def close(self) -> None:
        """Stop carrying requests (what is waiting for a thread is cancelled)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def release(self, index: int) -> None:
        """Make a worker available (once, however many paths release it)."""
        assert self._idle is not None
        self._in_use.discard(index)
        if index not in self._queued:
            self._queued.add(index)
            self._idle.put_nowait(index)

    @property
    def waiting(self) -> int:
        """Requests waiting for an idle worker."""
        return self._waiting

    @property
    def busy(self) -> int:
        """Requests on a worker."""
        return self._busy

    def in_use(self, index: int) -> bool:
        """Worker ``index`` has a request (its death is noticed by that request)."""
        return index in self._in_use

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
        :meth:`WorkerHandle.exchange`).

        Arrays lying in one of the ``lent`` buffers (the caller's, from
        :attr:`buffers`) reach the worker without a copy. If the request fails, the
        worker may still be reading them: they are marked tainted, not to be reused.
        """
        assert self._idle is not None, "pool not started"
        key, sha256 = header.get("model"), header.get("sha256")
        if key is not None and not self._routable(key, sha256):
            raise Problem(
                503,
                f"model {key} is being loaded into the workers; retry shortly",
                headers={"Retry-After": "1"},
                slug="model-loading",
            )
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
            self._replace(index)
        queued = time.monotonic() - t0
        self._in_use.add(index)
        self._busy += 1
        loop = asyncio.get_running_loop()
        try:
            if LOOP_EXCHANGE and not lent and fits_one_write(arrays):
                out_header, out_arrays, aside = await worker.exchange_in_loop(
                    header, arrays, timeout, self._executor, meanwhile
                )
            else:
                worker.unwatch()  # the thread reads the pipe itself
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
            self._replace(index)
            raise
        except BaseException:
            # Cancelled while computing: the worker's answer would come out of turn.
            self._taint(lent)
            self._replace(index)
            raise
        finally:
            self._busy -= 1
        self.release(index)
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
