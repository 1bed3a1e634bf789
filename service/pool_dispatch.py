"""The worker pool's third job: handing each request to an idle worker.

At most ``queue_size`` requests wait for a worker; the next is refused at once
(:class:`~.worker_handle.QueueFull`). A worker's error comes back typed; one that
dies or overruns its request's time is replaced (:mod:`.pool_lifecycle`).

A small request (one write, :func:`~.wire.fits_one_write`) is sent on the event loop
and its answer read in the loop's reader callback (:meth:`.WorkerHandle.send_in_loop`);
the same callback hands the worker to the next request in line and sends it. A worker
is thus busy for its computation and the pipe, not for as long as the answered
request's task takes to resume: under 8 clients that wait was most of the ``queue``
stage, about a millisecond per request (``bench/README.md``). Larger requests are
exchanged in a thread, which takes the worker out of the line and hands it back when
done.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
)


@dataclass(eq=False)
class _Request:
    """A request waiting in line for a worker, then on one.

    ``future`` gets the worker's index (exchanged in a thread), or, sent on the loop,
    the answer itself.
    """

    header: dict[str, Any]
    arrays: Mapping[str, np.ndarray]
    timeout: float
    in_loop: bool
    future: asyncio.Future[Any]
    arrived: float = field(default_factory=time.monotonic)
    #: The worker it was given to, and the seconds it waited for one.
    index: int | None = None
    queued: float = 0.0


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
        self._started = False
        #: Idle workers, in the order they became idle (each at most once).
        self._idle: deque[int] = deque()
        #: Requests waiting for a worker, in the order they came.
        self._line: deque[_Request] = deque()
        #: Workers with a request.
        self._in_use: set[int] = set()

    def start(self) -> None:
        """Open the line (:meth:`release` makes workers available)."""
        self._started = True

    def close(self) -> None:
        """Stop carrying requests (what is waiting for a thread is cancelled)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def release(self, index: int) -> None:
        """Make a worker available (once, however many paths release it): the next
        request in line gets it at once, else it waits idle."""
        self._in_use.discard(index)
        if index in self._idle:
            return
        self._idle.append(index)
        self._serve_line()

    @property
    def waiting(self) -> int:
        """Requests waiting for an idle worker."""
        return len(self._line)

    @property
    def busy(self) -> int:
        """Requests on a worker."""
        return len(self._in_use)

    def in_use(self, index: int) -> bool:
        """Worker ``index`` has a request (its death is noticed by that request)."""
        return index in self._in_use

    def _serve_line(self) -> None:
        """Give idle workers to the requests in line, first come first served; a
        request sent on the loop is sent here, in the caller's callback."""
        while self._line and self._idle:
            request = self._line.popleft()
            if request.future.done():
                continue  # its caller stopped waiting
            index = self._idle.popleft()
            worker = self._workers.get(index)
            if worker is None or not worker.alive():
                # Died while idle: replace it; the request takes the next idle worker.
                self._replace(index)
                self._line.appendleft(request)
                continue
            request.index = index
            request.queued = time.monotonic() - request.arrived
            self._in_use.add(index)
            if not request.in_loop:
                request.future.set_result(index)
                continue
            try:
                worker.send_in_loop(
                    request.header,
                    request.arrays,
                    request.timeout,
                    self._executor,
                    lambda answered, index=index: self._settled(index, answered),
                    request.future,
                )
            except WorkerLost as exc:
                self._settled(index, False)
                request.future.set_exception(exc)

    def _settled(self, index: int, answered: bool) -> None:
        """Worker ``index`` answered (hand it on) or died or overran (replace it)."""
        if answered:
            self.release(index)
        else:
            self._in_use.discard(index)
            self._replace(index)

    async def submit(
        self,
        header: dict[str, Any],
        arrays: Mapping[str, np.ndarray],
        timeout: float,
        lent: Sequence[SharedBuffer] = (),
        meanwhile: Callable[[], Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, np.ndarray], float, Any]:
        """Run one request on a worker; returns its answer, the seconds spent queued,
        and what ``meanwhile()`` returned (run once the request is in line or on its
        worker: on the loop for a request sent on it, else in the thread that
        exchanges it, see :meth:`WorkerHandle.exchange`).

        Arrays lying in one of the ``lent`` buffers (the caller's, from
        :attr:`buffers`) reach the worker without a copy. If the request fails, the
        worker may still be reading them: they are marked tainted, not to be reused.
        """
        assert self._started, "pool not started"
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
        in_loop = LOOP_EXCHANGE and not lent and fits_one_write(arrays)
        loop = asyncio.get_running_loop()
        request = _Request(header, arrays, timeout, in_loop, loop.create_future())
        self._line.append(request)
        self._serve_line()
        try:
            aside = meanwhile() if in_loop and meanwhile is not None else None
            given = await request.future
        except BaseException:
            self._give_up(request)
            raise
        if in_loop:
            out_header, out_arrays = given
        else:
            out_header, out_arrays, aside = await self._in_thread(given, request, lent, meanwhile)
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
        return out_header, out_arrays, request.queued, aside

    async def _in_thread(
        self,
        index: int,
        request: _Request,
        lent: Sequence[SharedBuffer],
        meanwhile: Callable[[], Any] | None,
    ) -> tuple[dict[str, Any], dict[str, np.ndarray], Any]:
        """Exchange ``request`` with worker ``index`` in a thread, then hand it on."""
        worker = self._workers[index]
        worker.unwatch()  # the thread reads the pipe itself
        try:
            answer = await asyncio.get_running_loop().run_in_executor(
                self._executor,
                worker.exchange,
                request.header,
                request.arrays,
                request.timeout,
                self.buffers,
                lent,
                meanwhile,
            )
        except BaseException:
            # Lost, overran, or cancelled while computing (its answer would come out
            # of turn): the worker is replaced, and may still read what was lent.
            self._taint(lent)
            self._settled(index, False)
            raise
        self.release(index)
        return answer

    def _give_up(self, request: _Request) -> None:
        """The request's caller stopped waiting (cancelled): leave the line, or give
        back the worker it held."""
        future, index = request.future, request.index
        if index is None:
            if request in self._line:
                self._line.remove(request)
        elif not future.done() or future.cancelled():
            # Cancelled while its worker computes: the answer would come out of turn.
            worker = self._workers.get(index)
            if worker is not None:
                worker.forget()
            self._settled(index, False)
        elif not request.in_loop and future.exception() is None:
            # Given a worker for a thread's exchange, and cancelled before using it.
            self.release(index)
        # Otherwise its answer or failure came in, and the worker was handed on.

    @property
    def saturated(self) -> bool:
        """Every worker is busy and the waiting line is full: the next request would be
        refused (checked before a request's body is read, too)."""
        return self._started and not self._idle and len(self._line) >= self.queue_size

    @staticmethod
    def _taint(buffers: Sequence[SharedBuffer]) -> None:
        for buf in buffers:
            buf.tainted = True
