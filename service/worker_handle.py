"""The pool's side of one worker process: its pipes, its exchanges, and their errors.

A :class:`WorkerHandle` sends a request on the worker's request pipe and reads the
answer, in a thread (:meth:`WorkerHandle.exchange`) or, for small requests, on the
event loop (:meth:`WorkerHandle.send_in_loop`: the answer is read in the loop's reader
callback), watching the process sentinel meanwhile: a worker that dies fails its
request at once (:class:`WorkerLost`). Model loads and drops go over a control pipe of
their own (:meth:`WorkerHandle.command`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from .errors import ServiceError
from .wire import (
    BufferPool,
    SharedBuffer,
    head_is_whole,
    recv_head,
    recv_message,
    recv_rest,
    send_message,
    send_with_descriptors,
)

__all__ = [
    "LOOP_EXCHANGE",
    "ComputeFailed",
    "InputRejected",
    "PoolError",
    "QueueFull",
    "WorkerHandle",
    "WorkerLost",
    "WorkerTimeout",
]

#: Small requests are exchanged on the event loop (:meth:`WorkerHandle.send_in_loop`)
#: where it can watch the worker's pipe and sentinel as descriptors: not on Windows,
#: whose pipes and process handles are no sockets.
LOOP_EXCHANGE = os.name == "posix"


#: What woke the loop's reader callback: the answer is readable, or the worker died.
_ANSWER, _DIED = "answer", "died"


@dataclass(eq=False)
class _Flight:
    """A request sent on the event loop (:meth:`WorkerHandle.send_in_loop`), until
    its answer or failure settles ``future``."""

    future: asyncio.Future[tuple[dict[str, Any], dict[str, np.ndarray]]]
    loop: asyncio.AbstractEventLoop
    rest: ThreadPoolExecutor
    timeout: float
    settled: Callable[[bool], None] | None
    timer: asyncio.TimerHandle


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


@dataclass(eq=False)
class WorkerHandle:
    index: int
    process: Any
    conn: Connection
    #: The control pipe: model loads and drops, answered by a thread of the worker's.
    control: Connection
    started: float = field(default_factory=time.monotonic)
    #: Model ids the worker holds (changed on the event loop's thread only).
    held: set[str] = field(default_factory=set)
    #: The task loading what the worker lacks (:meth:`WorkerPool._converge`).
    converging: asyncio.Task[None] | None = None
    #: One control exchange at a time, decided and booked (``held``) under it, in the
    #: order the event loop asked for them.
    control_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    _command: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: The event loop watching the request pipe and the sentinel (:meth:`watch`).
    _watcher: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    #: The request sent on the event loop that the worker computes, if any.
    _flight: _Flight | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return bool(self.process.is_alive())

    def command(
        self, message: dict[str, Any], timeout: float, fds: Sequence[int] = ()
    ) -> dict[str, Any]:
        """One exchange on the control pipe (in a thread), passing descriptors ``fds``
        with the message; the worker's answer.

        Raises :class:`WorkerLost` or :class:`WorkerTimeout`; after a timeout the pipe
        is out of step, and the worker must be replaced.
        """
        with self._command:
            try:
                send_with_descriptors(self.control, message, fds)
            except (BrokenPipeError, EOFError, OSError) as exc:
                raise WorkerLost(str(exc)) from exc
            ready = wait([self.control, self.process.sentinel], timeout=timeout)
            if self.control in ready:
                try:
                    return dict(self.control.recv())
                except (EOFError, OSError) as exc:
                    raise WorkerLost(str(exc)) from exc
            if self.process.sentinel in ready:
                raise WorkerLost(self._died())
            raise WorkerTimeout(f"no answer within {timeout:g} s")

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

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have ``loop`` watch the request pipe and the sentinel from now on, for
        :meth:`send_in_loop` (on the loop's thread; once, not per request).

        Registering and unregistering both descriptors, and restoring the pipe's
        blocking mode, for every request cost about 20 system calls of the event
        loop's per small request (``bench/README.md``).
        """
        if self._watcher is loop:
            return
        fd, sentinel = self.conn.fileno(), self.process.sentinel
        loop.add_reader(fd, self._wake, _ANSWER)
        loop.add_reader(sentinel, self._wake, _DIED)
        # uvloop leaves a watched descriptor non-blocking; the reads of an answer, and
        # the thread's exchanges, expect a blocking socket (readiness is epoll's).
        os.set_blocking(fd, True)
        self._watcher = loop

    def unwatch(self) -> None:
        """Stop the loop's watch (on the loop's thread): before an exchange in a thread
        (which reads the pipe itself), and before the worker's descriptors close."""
        loop, self._watcher = self._watcher, None
        if loop is None:
            return
        loop.remove_reader(self.conn.fileno())
        loop.remove_reader(self.process.sentinel)
        os.set_blocking(self.conn.fileno(), True)

    def _wake(self, what: str) -> None:
        """The loop's reader callback: the answer is readable, or the worker died.

        The answer is read here, in the callback, and the request's future settled,
        and ``settled`` then hands the worker on (:meth:`send_in_loop`): the worker is
        free before the request's task resumes, one loop turn later or, on a busy
        loop, several.
        """
        flight = self._flight
        if flight is None:
            # Readable with no request in flight: the worker died idle (its sentinel
            # stays readable), wrote out of turn, or answered a request that was given
            # up. Not watched until its next request, so that the loop does not spin
            # on it; the monitor replaces a dead one, the pool one given up.
            self.unwatch()
            return
        # An answer written before the worker died is still the answer.
        if what == _DIED and not self.conn.poll(0):
            self._land(WorkerLost(self._died()))
            return
        flight.timer.cancel()
        try:
            head = recv_head(self.conn)
            if head_is_whole(head):
                self._land(recv_rest(self.conn, head))
                return
        except EOFError:
            self._land(WorkerLost(self._died()))
            return
        except OSError as exc:
            self._land(WorkerLost(str(exc)))
            return
        # More follows (arrays past the first write, memory files to map): read on in a
        # thread, so that the loop never waits on a large answer; the pipe stays
        # readable meanwhile, so the loop stops watching it.
        self.unwatch()
        rest = flight.loop.run_in_executor(flight.rest, recv_rest, self.conn, head)
        rest.add_done_callback(self._rest_read)

    def _rest_read(self, rest: asyncio.Future[Any]) -> None:
        exc = rest.exception()
        if exc is None:
            self._land(rest.result())
        elif isinstance(exc, EOFError):
            self._land(WorkerLost(self._died()))
        else:
            self._land(WorkerLost(str(exc)))

    def _expire(self, future: asyncio.Future[Any]) -> None:
        flight = self._flight
        if flight is not None and flight.future is future:
            self._land(WorkerTimeout(f"no answer within {flight.timeout:g} s"))

    def _land(self, outcome: tuple[dict[str, Any], dict[str, np.ndarray]] | PoolError) -> None:
        """Settle the request in flight with its answer or its failure, then tell its
        sender (``settled``) whether the worker answered."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        flight.timer.cancel()
        answered = not isinstance(outcome, PoolError)
        if not flight.future.done():
            if answered:
                flight.future.set_result(outcome)
            else:
                flight.future.set_exception(outcome)
        if flight.settled is not None:
            flight.settled(answered)

    def send_in_loop(
        self,
        header: dict[str, Any],
        arrays: Mapping[str, np.ndarray],
        timeout: float,
        rest: ThreadPoolExecutor,
        settled: Callable[[bool], None] | None = None,
        future: asyncio.Future[Any] | None = None,
    ) -> asyncio.Future[tuple[dict[str, Any], dict[str, np.ndarray]]]:
        """Send a request that is one write (:func:`~.wire.fits_one_write`, nothing
        lent) on the event loop's thread; the future gets the answer, or
        :class:`WorkerLost` or :class:`WorkerTimeout`.

        An idle worker has read everything sent to it, so the write fits its socket's
        buffer and does not block. The loop watches the worker's pipe and sentinel as
        it watches any socket (:meth:`watch`) and reads the answer in its reader
        callback; an answer whose head says more follows is read on in ``rest``, a
        thread. Once the future is settled, ``settled(answered)`` is called in the
        same callback: ``answered`` is False when the worker died or overran, and must
        be replaced. :meth:`forget` gives the request up. ``future``: the one to
        settle (its caller's, awaited already), else a new one.

        Raises
        ------
        WorkerLost
            The request could not be written (the worker is gone).
        """
        loop = asyncio.get_running_loop()
        self.watch(loop)
        if future is None:
            future = loop.create_future()
        try:
            send_message(self.conn, header, arrays)
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise WorkerLost(str(exc)) from exc
        timer = loop.call_later(timeout, self._expire, future)
        self._flight = _Flight(future, loop, rest, timeout, settled, timer)
        return future

    def forget(self) -> None:
        """Give up the request in flight (its sender stopped waiting): no answer is
        read for it, and ``settled`` is not called; the worker must be replaced, since
        its answer would come out of turn."""
        flight, self._flight = self._flight, None
        if flight is not None:
            flight.timer.cancel()

    def _died(self) -> str:
        return f"worker {self.index} (pid {self.pid}) died"

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
                except EOFError:
                    raise WorkerLost(self._died()) from None
                except OSError as exc:
                    raise WorkerLost(str(exc)) from exc
            if self.process.sentinel in ready:
                raise WorkerLost(self._died())

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()
        self.control.close()
