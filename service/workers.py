"""A fixed pool of compute processes holding the models; the event loop never computes.

Each worker process loads every served model once (arrays memory-mapped read-only, so
the pages are shared between workers) and answers requests on its own pipe. Arrays
never get pickled: small ones cross the pipe as raw bytes (``send_bytes`` of the
buffer, ``frombuffer`` on the other side); from 1 MiB on, on Linux, they go through an
anonymous memory file (``memfd``) whose descriptor is passed over the socket, and the
receiver maps it (no stream of socket chunks, and no ``/dev/shm`` size limit to hit in
a container). Requests use a pool of such files that are reused (:class:`BufferPool`),
which the workers keep mapped; a request body read straight into one (large NPY
uploads) reaches the worker with no copy at all.

The asyncio side hands a request to an idle worker; when all are busy, at most
``queue_size`` requests wait, and the next one is refused at once (:class:`QueueFull`,
answered 503 with ``Retry-After``). A worker that dies is noticed through its process
sentinel while a request is in flight: the request fails fast (:class:`WorkerLost`),
the worker is respawned, and readiness says so meanwhile. A request that outlives
``request_timeout`` gets its worker killed and replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import mmap
import multiprocessing as mp
import os
import pickle
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ComputeError", "QueueFull", "WorkerLost", "WorkerPool", "WorkerTimeout"]

log = logging.getLogger("bagserve.workers")

# Bags are predicted in chunks of at most this many points (bounds worker memory).
CHUNK_POINTS = 2_000_000


class QueueFull(Exception):
    """Every worker is busy and the waiting line is full."""


class WorkerLost(Exception):
    """The worker computing this request died."""


class WorkerTimeout(Exception):
    """The request took longer than the configured timeout."""


class ComputeError(Exception):
    """The model refused the input (e.g. a validation error raised in the worker)."""


# ----------------------------------------------------------------------- wire format
#: Messages with at least this many bytes of arrays go through a memory file.
MEMFD_MIN_BYTES = 1 << 20
#: Shared buffers are sized in whole steps of this many bytes, so that bodies of
#: similar sizes reuse one another's buffers.
BUFFER_STEP = 1 << 20
#: Mappings of the server's shared buffers a worker keeps between requests.
WORKER_MAPPINGS = 4


def _raw(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1)).cast("B")


def _address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, np.uint8).__array_interface__["data"][0])


class SharedBuffer:
    """An anonymous memory file mapped read-write here, lent to one request at a time.

    Allocating and faulting in the pages of a fresh memory file costs more than
    copying the data (about 4 ms for 8 MB, against under 1 ms to copy into pages
    that exist): buffers are therefore reused, and a worker keeps its own mapping of
    each (keyed by ``id``), so that sending a buffer costs neither.

    Parameters
    ----------
    capacity : int
        Size in bytes; the pages are allocated at once.
    """

    _ids = itertools.count()

    def __init__(self, capacity: int) -> None:
        self.id = f"{os.getpid()}-{next(self._ids)}"
        self.capacity = capacity
        self.fd = os.memfd_create("bagserve-buffer", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, capacity)
            self.map = mmap.mmap(self.fd, capacity, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.address = _address(self.map)
        #: Set when a worker may still read the buffer (its request failed): never reused.
        self.tainted = False

    def offset_of(self, a: np.ndarray) -> int | None:
        """Where the contiguous array ``a`` lies in this buffer, or None if elsewhere."""
        start = int(a.__array_interface__["data"][0]) - self.address
        return start if start >= 0 and start + a.nbytes <= self.capacity else None

    def close(self) -> None:
        # The mapping itself goes when the last view of it does.
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BufferPool:
    """Shared buffers for requests to the workers, reused once their request is over.

    Parameters
    ----------
    max_idle : int
        Idle buffers kept for reuse; more are closed.
    max_idle_bytes : int
        Total size of the idle buffers kept.
    """

    def __init__(self, max_idle: int, max_idle_bytes: int) -> None:
        self.max_idle = max_idle
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[SharedBuffer] = []
        self._lock = threading.Lock()

    def lease(self, size: int) -> SharedBuffer:
        """A buffer of at least ``size`` bytes for the caller's sole use until returned."""
        with self._lock:
            fits = [b for b in self._idle if b.capacity >= size]
            if fits:
                best = min(fits, key=lambda b: b.capacity)
                self._idle.remove(best)
                return best
        return SharedBuffer(max(BUFFER_STEP, -(-size // BUFFER_STEP) * BUFFER_STEP))

    def give_back(self, buffer: SharedBuffer) -> None:
        """Return a leased buffer; a tainted one, or one too many, is closed."""
        if buffer.tainted or buffer.fd < 0 or buffer.capacity > self.max_idle_bytes:
            buffer.close()
            return
        with self._lock:
            self._idle.append(buffer)
            # The oldest go first: the most recently used are mapped by the workers.
            while self._idle and (
                len(self._idle) > self.max_idle
                or sum(b.capacity for b in self._idle) > self.max_idle_bytes
            ):
                self._idle.pop(0).close()

    def close(self) -> None:
        with self._lock:
            for b in self._idle:
                b.close()
            self._idle.clear()


def send_message(
    conn: Connection,
    header: dict[str, Any],
    arrays: list[np.ndarray],
    pool: BufferPool | None = None,
    lent: Sequence[SharedBuffer] = (),
) -> list[SharedBuffer]:
    """A small header, then the arrays' raw buffers (no pickling of the data).

    Arrays that already lie in one of the ``lent`` shared buffers are sent by
    reference (the buffer's descriptor and their offset), without a copy. The others
    cross the pipe when small; from ``MEMFD_MIN_BYTES`` on they are copied into a
    buffer of ``pool`` (or, without one, into a fresh memory file).

    Returns
    -------
    list of SharedBuffer
        The buffers taken from ``pool``: the caller returns them once the receiver
        is done with the message.
    """
    arrays = [np.ascontiguousarray(a) for a in arrays]
    places: list[tuple[int, int] | None] = []
    for a in arrays:
        place = None
        for k, buf in enumerate(lent):
            offset = buf.offset_of(a) if a.size else None
            if offset is not None:
                place = (k, offset)
                break
        places.append(place)
    buffers: list[tuple[str | None, int]] = [(b.id, b.capacity) for b in lent]
    fds = [b.fd for b in lent]
    taken: list[SharedBuffer] = []
    rest = [i for i, p in enumerate(places) if p is None]
    total = sum(arrays[i].nbytes for i in rest)
    fresh = -1
    try:
        if total >= MEMFD_MIN_BYTES and hasattr(os, "memfd_create"):
            if pool is not None:
                scratch = pool.lease(total)
                taken.append(scratch)
                target, fd, name = scratch.map, scratch.fd, scratch.id
            else:
                fresh = os.memfd_create("bagserve-arrays", os.MFD_CLOEXEC)
                target, fd, name = None, fresh, None
            k, offset = len(buffers), 0
            for i in rest:
                view = _raw(arrays[i])
                if target is not None:
                    target[offset : offset + len(view)] = view
                else:
                    while view:
                        view = view[os.write(fresh, view) :]
                places[i] = (k, offset)
                offset += arrays[i].nbytes
            buffers.append((name, offset if name is None else taken[-1].capacity))
            fds.append(fd)
        meta = [(a.dtype.str, a.shape, p) for a, p in zip(arrays, places, strict=True)]
        conn.send_bytes(pickle.dumps((header, meta, buffers), protocol=pickle.HIGHEST_PROTOCOL))
        for fd in fds:
            reduction.send_handle(conn, fd, 0)  # the pid is only used on Windows
        for a, p in zip(arrays, places, strict=True):
            if p is None:
                conn.send_bytes(_raw(a) if a.size else b"")
    except BaseException:
        for buf in taken:
            buf.tainted = True
            pool.give_back(buf)  # type: ignore[union-attr]
        raise
    finally:
        if fresh >= 0:
            os.close(fresh)
    return taken


def recv_message(
    conn: Connection, mappings: OrderedDict[str, mmap.mmap] | None = None
) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The arrays of :func:`send_message`, read-only, viewing the shared buffers.

    ``mappings`` keeps this side's mapping of each reusable buffer by its id, so that
    a buffer sent again is not mapped again (at most ``WORKER_MAPPINGS`` of them).
    """
    # Only ever exchanged between this process and its own workers.
    header, meta, buffers = pickle.loads(conn.recv_bytes())
    mapped = []
    for name, size in buffers:
        fd = reduction.recv_handle(conn)
        try:
            known = mappings.get(name) if mappings is not None and name is not None else None
            if known is not None and len(known) == size:
                mappings.move_to_end(name)  # type: ignore[union-attr]
                mapped.append(known)
                continue
            # Read-only and populated up front; the arrays keep the mapping alive.
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if mappings is not None and name is not None:
            mappings[name] = m
            while len(mappings) > WORKER_MAPPINGS:
                mappings.popitem(last=False)
        mapped.append(m)
    arrays = []
    for dt, shape, place in meta:
        dtype = np.dtype(dt)
        if place is None:
            arrays.append(np.frombuffer(conn.recv_bytes(), dtype=dtype).reshape(shape))
            continue
        k, offset = place
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(mapped[k], dtype, count, offset).reshape(shape))
    return header, arrays


# ----------------------------------------------------------------------- worker side
def _predict(entry: dict[str, Any], header: dict[str, Any], arrays: list[np.ndarray]):
    from bagserve.core.bags import Bags
    from bagserve.core.io import Preprocessing

    model = entry["model"]
    points, offsets = arrays[0], arrays[1]
    weights = arrays[2] if header.get("weighted") else None
    bags = Bags(points, offsets, weights, validate=False)
    pre: Preprocessing = entry["preprocessing"]
    bags = pre.apply(bags, entry["markers"])
    kind = entry["kind"]
    if kind == "cell":
        results = model.predict_tasks(bags)
        labels = np.concatenate([r.predictions for r in results])
        reports = [r.report for r in results]
        return {"kind": kind}, [
            labels,
            np.array([r.out_of_range for r in reports]),
            np.array([r.distance for r in reports]),
            np.array(
                [
                    np.pad(r.nearest_tasks, (0, 3 - r.nearest_tasks.size), constant_values=-1)
                    for r in reports
                ]
            ),
            np.array([np.pad(r.similarities, (0, 3 - r.similarities.size)) for r in reports]),
        ]
    outs, scores, extra = [], [], []
    levels = np.asarray(header.get("quantiles") or [], dtype=np.float64)
    thresholds = np.asarray(header.get("exceed") or [], dtype=np.float64)
    start = 0
    sizes = bags.sizes
    while start < len(bags):
        stop = start + 1
        total = int(sizes[start])
        while stop < len(bags) and total + sizes[stop] <= CHUNK_POINTS:
            total += int(sizes[stop])
            stop += 1
        chunk = bags[start:stop]
        if kind == "conditional":
            # One embedding and one kernel evaluation for the mean and every quantity.
            mean, q, e = model.summary(chunk, levels, thresholds)
            outs.append(mean)
            extra.append(np.hstack([q, e]))
        else:
            outs.append(np.asarray(model.predict(chunk)))
        if kind == "classification":
            s = np.asarray(model.decision_function(chunk))
            scores.append(s[:, None] if s.ndim == 1 else s)
        start = stop
    values = np.concatenate(outs)
    header = {"kind": kind}
    # Representations with a bounded domain (density features) clip new points into the
    # training range: the caller is told how many, per bag.
    rep = getattr(model, "representation_", None)
    if hasattr(rep, "clipped_counts"):
        header["clipped"] = rep.clipped_counts(bags).tolist()
    if kind == "classification":
        return header, [values, np.concatenate(scores), np.asarray(model.classes_)]
    if kind == "conditional":
        return header, [values, np.concatenate(extra)]
    return header, [values]


def worker_main(conn: Connection, models: dict[str, str]) -> None:
    """Entry point of a worker process: load every model, then serve requests."""
    import os

    # One BLAS thread per worker: the pool, not BLAS, uses the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bagserve.core.artifacts import load, read_manifest
    from bagserve.core.io import Panel, Preprocessing
    from threadpoolctl import threadpool_limits

    from .registry import kind_of

    threadpool_limits(1)
    loaded: dict[str, dict[str, Any]] = {}
    for key, path in models.items():
        manifest = read_manifest(path, verify=False)  # verified by the registry at start-up
        meta = manifest["metadata"]
        panel = Panel.from_json(meta["panel"]) if meta.get("panel") else None
        kind = kind_of(manifest["estimator"]["class"])
        loaded[key] = {
            "model": load(path, mmap=True),
            "preprocessing": Preprocessing.from_json(meta["preprocessing"])
            if meta.get("preprocessing")
            else Preprocessing(),
            "markers": list(panel.markers) if panel else [],
            "kind": kind,
        }
    conn.send_bytes(b"ready")
    mappings: OrderedDict[str, mmap.mmap] = OrderedDict()
    while True:
        try:
            header, arrays = recv_message(conn, mappings)
        except (EOFError, OSError):
            return
        try:
            t0 = time.perf_counter()
            out_header, out_arrays = _predict(loaded[header["model"]], header, arrays)
            out_header["seconds"] = time.perf_counter() - t0
            send_message(conn, {"ok": True, **out_header}, out_arrays)
        except Exception as exc:  # report, keep serving
            send_message(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, [])


# ----------------------------------------------------------------------- pool side
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
        arrays: list[np.ndarray],
        timeout: float,
        pool: BufferPool | None = None,
        lent: Sequence[SharedBuffer] = (),
    ):
        """Send a request, wait for the answer, the worker's death, or the timeout.

        Buffers taken from ``pool`` go back to it once the answer is in; if there is
        no answer, the worker may still read them, and they are never reused.
        """
        try:
            taken = send_message(self.conn, header, arrays, pool, lent)
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise WorkerLost(str(exc)) from exc
        try:
            answer = self._answer(timeout)
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
    """``n`` worker processes serving ``models`` (key → artifact path)."""

    def __init__(
        self, models: dict[str, Path], n: int, queue_size: int, start_timeout: float = 120.0
    ):
        self.models = {k: str(v) for k, v in models.items()}
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

    # -- lifecycle
    def _spawn(self, index: int) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=worker_main,
            args=(child, self.models),
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
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for w in list(self._workers.values()):
            w.kill()
        self._workers.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.buffers is not None:
            self.buffers.close()

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
        arrays: list[np.ndarray],
        timeout: float,
        lent: Sequence[SharedBuffer] = (),
    ) -> tuple[dict[str, Any], list[np.ndarray], float]:
        """Run one request on a worker; returns its answer and the seconds spent queued.

        Arrays lying in one of the ``lent`` buffers (the caller's, from
        :attr:`buffers`) reach the worker without a copy. If the request fails, the
        worker may still be reading them: they are marked tainted, not to be reused.
        """
        assert self._idle is not None, "pool not started"
        if self._idle.empty() and self._waiting >= self.queue_size:
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
            out_header, out_arrays = await loop.run_in_executor(
                self._executor, worker.exchange, header, arrays, timeout, self.buffers, lent
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
            raise ComputeError(out_header.get("error", "compute failed"))
        return out_header, out_arrays, queued

    @staticmethod
    def _taint(buffers: Sequence[SharedBuffer]) -> None:
        for buf in buffers:
            buf.tainted = True

    def status(self) -> dict[str, Any]:
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
        return not self._closed and len([w for w in self._workers.values() if w.alive()]) == self.n
