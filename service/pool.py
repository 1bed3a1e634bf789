"""A fixed pool of compute processes holding the models; the event loop never computes.

The asyncio side hands a request to an idle worker (:mod:`.worker`); when all are busy,
at most ``queue_size`` requests wait, and the next one is refused at once
(:class:`QueueFull`, answered 503 with ``Retry-After``). A worker that dies is noticed
through its process sentinel while a request is in flight: the request fails fast
(:class:`WorkerLost`), the worker is respawned, and readiness says so meanwhile. A
request that outlives ``request_timeout`` gets its worker killed and replaced
(:class:`WorkerTimeout`). A worker's own error arrives typed: :class:`InputRejected`
when the model refused the input, :class:`ComputeFailed` otherwise.

Models are loaded into the running workers, all workers at once, on a control pipe of
their own (:meth:`WorkerPool.load`): each model version is handed over as the sealed
memory its verified bytes were read into
(:class:`~bagserve.core.artifacts.VerifiedArtifact`), which every worker maps read-only
(one copy in memory whatever the number of workers; no worker reads a model's files).
A load takes about one model's load time, whatever the number of workers, and no
worker stops taking requests for it. A
model version is served (:meth:`WorkerPool.serves`) from the moment every running
worker holds it; a request for one that is not yet served is answered 503
``model-loading`` instead of reaching a worker without it, and a worker that starts
later (a replacement) takes requests only once it holds every served version.

Workers are forked from a server process that imported what they need once
(:mod:`.worker_server`, multiprocessing's ``forkserver``): a worker starts in
milliseconds instead of importing numpy, scipy and the estimators again. Where there
is no fork server (Windows), they are spawned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import Problem, ServiceError
from .wire import (
    BufferPool,
    SharedBuffer,
    fits_one_write,
    head_is_whole,
    recv_head,
    recv_message,
    recv_rest,
    send_message,
    send_with_descriptors,
)
from .worker import INPUT_ERROR, PROBLEM_ERROR, model_id, worker_main
from .worker_server import worker_context

if TYPE_CHECKING:
    from bagserve.core.artifacts import VerifiedArtifact

__all__ = [
    "ComputeFailed",
    "InputRejected",
    "PoolError",
    "QueueFull",
    "WorkerLost",
    "WorkerPool",
    "WorkerTimeout",
    "model_id",
]

log = logging.getLogger("bagserve.workers")

#: Small requests are exchanged on the event loop (:meth:`_Worker.exchange_in_loop`)
#: where it can watch the worker's pipe and sentinel as descriptors: not on Windows,
#: whose pipes and process handles are no sockets.
_LOOP_EXCHANGE = os.name == "posix"


#: Why an in-loop exchange woke: the answer is readable, the worker died, or time ran out.
_ANSWER, _DIED, _EXPIRED = "answer", "died", "expired"


def _expire(woken: asyncio.Future[str]) -> None:
    if not woken.done():
        woken.set_result(_EXPIRED)


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
class _Worker:
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
    #: What the in-loop exchange waits for: the answer, or the worker's death.
    _woken: asyncio.Future[str] | None = field(default=None, repr=False)

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
        :meth:`exchange_in_loop` (on the loop's thread; once, not per request).

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
        woken = self._woken
        if woken is None:
            # Readable with no request in flight: the worker died idle (its sentinel
            # stays readable) or wrote out of turn. Not watched until its next request,
            # so that the loop does not spin on it; the monitor replaces a dead one.
            self.unwatch()
        elif not woken.done():
            woken.set_result(what)

    async def exchange_in_loop(
        self,
        header: dict[str, Any],
        arrays: Mapping[str, np.ndarray],
        timeout: float,
        rest: ThreadPoolExecutor,
        meanwhile: Callable[[], Any] | None = None,
    ):
        """:meth:`exchange` on the event loop's thread, for a request that is one write
        (:func:`~.wire.fits_one_write`, nothing lent): no thread hand-off either way.

        An idle worker has read everything sent to it, so the write fits its socket's
        buffer and does not block. The loop waits for the answer or the worker's death
        as it waits for any socket (it watches both while the worker lives,
        :meth:`watch`); an answer whose head says more follows (arrays past the first
        write, memory files to map) is read on in ``rest``, a thread, so that the loop
        never waits on a large answer. For a small request the two hand-offs cost about
        a sixth of the server's CPU (``bench/README.md``).
        """
        loop = asyncio.get_running_loop()
        self.watch(loop)
        woken: asyncio.Future[str] = loop.create_future()
        self._woken = woken
        try:
            send_message(self.conn, header, arrays)
        except (BrokenPipeError, EOFError, OSError) as exc:
            self._woken = None
            raise WorkerLost(str(exc)) from exc
        timer = loop.call_later(timeout, _expire, woken)
        try:
            aside = meanwhile() if meanwhile is not None else None
            what = await woken
        finally:
            timer.cancel()
            self._woken = None
        if what == _EXPIRED:
            raise WorkerTimeout(f"no answer within {timeout:g} s")
        # An answer written before the worker died is still the answer.
        if what == _DIED and not self.conn.poll(0):
            raise WorkerLost(self._died())
        try:
            head = recv_head(self.conn)
            if head_is_whole(head):
                return (*recv_rest(self.conn, head), aside)
            self.unwatch()  # the thread reads on: the pipe stays readable meanwhile
            return (*await loop.run_in_executor(rest, recv_rest, self.conn, head), aside)
        except EOFError:
            raise WorkerLost(self._died()) from None
        except OSError as exc:
            raise WorkerLost(str(exc)) from exc

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


class WorkerPool:
    """``n`` worker processes and the model versions they hold (see the module docstring).

    Parameters
    ----------
    n : int
        Worker processes.
    queue_size : int
        Requests that may wait for a worker before :class:`QueueFull`.
    limits : dict
        The request limits the workers decode within (:class:`~.codecs.RequestLimits`
        as JSON).
    start_timeout : float, default=120
        Seconds a worker may take to start, and to load one model version.
    """

    def __init__(
        self,
        n: int,
        queue_size: int,
        limits: dict[str, int],
        start_timeout: float = 120.0,
    ):
        self.limits = dict(limits)
        self.n = n
        self.queue_size = queue_size
        self.start_timeout = start_timeout
        self._ctx = worker_context()
        self._workers: dict[int, _Worker] = {}
        self._idle: asyncio.Queue[int] | None = None
        self._waiting = 0
        self._busy = 0
        self._respawning: set[int] = set()
        self._executor = ThreadPoolExecutor(max_workers=n + 2, thread_name_prefix="bagserve-io")
        # Starting workers and loading models wait on the workers for a while: threads
        # of their own, so that no request waits for a thread behind them.
        self._control = ThreadPoolExecutor(max_workers=n + 2, thread_name_prefix="bagserve-control")
        #: Shared buffers for large requests (Linux); request bodies can be read into
        #: one (:meth:`BufferPool.lease`) and reach the worker without a copy.
        self.buffers = (
            BufferPool(max_idle=n + 2, max_idle_bytes=512 << 20)
            if hasattr(os, "memfd_create")
            else None
        )
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._queued: set[int] = set()
        self._in_use: set[int] = set()
        #: Model id to its verified bytes: what every worker should hold (served, or
        #: loading), kept for the workers that start later. Replaced, never changed in
        #: place: threads read it as it was.
        self._wanted: dict[str, VerifiedArtifact] = {}
        #: The ids every running worker holds: the only ones requests may ask for.
        self._serving: set[str] = set()
        #: Ids whose last load failed, with the reason.
        self._failed: dict[str, str] = {}
        #: Who waits for ids to be served or failed (:meth:`_settle`).
        self._waiters: list[asyncio.Future[None]] = []
        self._loading = asyncio.Lock()

    # -- lifecycle
    def _spawn(self, index: int) -> _Worker:
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
        worker = _Worker(index, proc, parent, control)
        ready = wait([control, proc.sentinel], timeout=self.start_timeout)
        greeting: Any = None
        if control in ready:
            with contextlib.suppress(EOFError, OSError):
                greeting = control.recv()
        if not isinstance(greeting, dict):
            worker.kill()
            raise RuntimeError(f"worker {index} did not start (exit code {proc.exitcode})")
        return worker

    async def _bring_up(self, index: int) -> _Worker | None:
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

    # -- models
    async def load(
        self,
        models: Mapping[str, VerifiedArtifact],
        keep: Collection[str] = (),
        timeout: float | None = None,
    ) -> dict[str, str]:
        """Have every worker hold ``models`` (model id, see :func:`model_id`, to its
        verified bytes) besides ``keep``; what is in neither is dropped. Returns the ids
        that could not be loaded, with the reasons (``{}``: all served).

        Every running worker loads the versions it lacks at the same time as the others,
        one version after another, without stopping to take requests. A version is
        served from the moment every running worker holds it, each as it comes
        (:meth:`serves`); one that a worker cannot load is dropped from all and reported,
        and what was served before is still served. Loads run one at a time.

        Parameters
        ----------
        models : mapping of str to VerifiedArtifact
            Read with ``shared=True``: the workers map its sealed memory.
        keep : collection of str
            Ids held before to go on holding (what is served until the caller switches).
        timeout : float, optional
            Seconds until a version not held by every worker is given up (default:
            twice ``start_timeout``: a worker may have to start first).
        """
        async with self._loading:
            new = dict(models)
            stale = set(self._wanted) - set(keep) - set(new)
            if stale:
                self._serving -= stale
                self._wanted = {k: v for k, v in self._wanted.items() if k not in stale}
                await self._drop_unwanted()
            for mid in new:
                self._failed.pop(mid, None)
            self._wanted = {**new, **self._wanted}
            self._refresh()  # what every worker holds already (a reload of the same)
            for worker in list(self._workers.values()):
                self._converge(worker)
            limit = 2 * self.start_timeout if timeout is None else timeout
            try:
                await asyncio.wait_for(self._settle(new), limit)
            except TimeoutError:
                for mid in new:
                    self._fail(mid, f"not held by every worker after {limit:g} s")
            return {mid: self._failed[mid] for mid in new if mid in self._failed}

    def serves(self, mid: str) -> bool:
        """Every running worker holds model version ``mid``: requests for it are served."""
        return mid in self._serving

    @property
    def loading(self) -> list[str]:
        """Model ids being loaded (wanted, not yet held by every running worker)."""
        return sorted(set(self._wanted) - self._serving)

    async def _command(
        self, worker: _Worker, message: dict[str, Any], fds: Sequence[int] = ()
    ) -> dict[str, Any]:
        """One control exchange with ``worker`` (the caller holds its ``control_lock``)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._control, worker.command, message, self.start_timeout, fds
        )

    async def _load_one(self, worker: _Worker, mid: str) -> str | None:
        """Load one wanted version into ``worker``; why not, or None. Raises
        :class:`WorkerLost` or :class:`WorkerTimeout`."""
        async with worker.control_lock:
            artifact = self._wanted.get(mid)
            if artifact is None or mid in worker.held:  # dropped, or loaded, meanwhile
                return None
            spec, fds = artifact.handle()
            answer = await self._command(worker, {"op": "load", "id": mid, "artifact": spec}, fds)
            if answer.get("ok"):
                worker.held.add(mid)
                return None
            return str(answer.get("reason") or "the worker could not load it")

    def _converge(self, worker: _Worker) -> None:
        """Have ``worker`` load the wanted versions it lacks, in the background (one task
        per worker, reading what is wanted at each turn)."""
        if self._closed or (worker.converging is not None and not worker.converging.done()):
            return
        loop = asyncio.get_running_loop()
        worker.converging = loop.create_task(self._converge_loop(worker))
        self._track(worker.converging)

    async def _converge_loop(self, worker: _Worker) -> None:
        failed: set[str] = set()  # never tried twice by this task: a failure is final
        while not self._closed and self._workers.get(worker.index) is worker:
            todo = [mid for mid in self._wanted if mid not in worker.held and mid not in failed]
            if not todo:
                return
            mid = todo[0]
            try:
                reason = await self._load_one(worker, mid)
            except PoolError as exc:
                self._fail(mid, f"worker {worker.index} stopped while loading it ({exc})")
                self._respawn_later(worker.index)
                return
            if reason is not None:
                failed.add(mid)
                self._fail(mid, reason)
            self._refresh()

    def _refresh(self) -> None:
        """Serve every wanted version that every running worker holds."""
        running = list(self._workers.values())
        if not running:
            return
        held = {
            mid
            for mid in self._wanted
            if mid not in self._serving and all(mid in w.held for w in running)
        }
        if held:
            self._serving |= held
            self._notify()

    def _fail(self, mid: str, reason: str) -> None:
        """Give up version ``mid`` (not served yet): dropped from every worker, reported."""
        if mid not in self._wanted or mid in self._serving:
            return
        log.error("model not loaded", extra={"model": mid, "reason": reason})
        self._failed[mid] = reason
        self._wanted = {k: v for k, v in self._wanted.items() if k != mid}
        self._track(asyncio.get_running_loop().create_task(self._drop_unwanted()))
        self._notify()

    async def _drop_unwanted(self) -> None:
        """Have every worker drop what is not wanted (its memory maps go)."""

        async def drop(worker: _Worker) -> None:
            async with worker.control_lock:
                # Decided under the lock: a version wanted again meanwhile stays.
                dropped = worker.held - set(self._wanted)
                if not dropped:
                    return
                with contextlib.suppress(PoolError):  # a dead worker is replaced anyway
                    await self._command(worker, {"op": "drop", "ids": sorted(dropped)})
                    worker.held -= dropped

        await asyncio.gather(*(drop(w) for w in list(self._workers.values())))

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _settle(self, ids: Collection[str]) -> None:
        """Until each of ``ids`` is served or failed."""
        loop = asyncio.get_running_loop()
        while not all(mid in self._serving or mid in self._failed for mid in ids):
            waiter = loop.create_future()
            self._waiters.append(waiter)
            await waiter

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
            self._respawn_later(index)
        queued = time.monotonic() - t0
        self._in_use.add(index)
        self._busy += 1
        loop = asyncio.get_running_loop()
        try:
            if _LOOP_EXCHANGE and not lent and fits_one_write(arrays):
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

    def _routable(self, key: str, sha256: str | None) -> bool:
        """Requests for ``key`` (at ``sha256``) may go to any worker."""
        if sha256 is not None:
            return model_id(key, sha256) in self._serving
        return any(mid.rsplit("@", 1)[0] == key for mid in self._serving)

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
        """Configured, alive, busy and waiting counts, workers starting or being
        replaced, pids, and the model versions being loaded."""
        alive = [w for w in self._workers.values() if w.alive()]
        return {
            "configured": self.n,
            "alive": len(alive),
            "busy": self._busy,
            "waiting": self._waiting,
            "respawning": sorted(self._respawning),
            "pids": [w.pid for w in alive],
            "loading": sorted({mid.rsplit("@", 1)[0] for mid in self.loading}),
        }

    @property
    def ready(self) -> bool:
        """Every configured worker is alive."""
        return not self._closed and len([w for w in self._workers.values() if w.alive()]) == self.n
