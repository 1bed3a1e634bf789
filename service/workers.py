"""A fixed pool of compute processes holding the models; the event loop never computes.

Each worker process loads every served model once (arrays memory-mapped read-only, so
the pages are shared between workers) and answers requests on its own pipe. Arrays
never get pickled: small ones cross the pipe as raw bytes (``send_bytes`` of the
buffer, ``frombuffer`` on the other side); from 1 MiB on, on Linux, they are written
once into an anonymous memory file (``memfd``) whose descriptor is passed over the
socket, and the receiver maps it (one kernel copy instead of a stream of socket
chunks, and no ``/dev/shm`` size limit to hit in a container).

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
import logging
import mmap
import multiprocessing as mp
import os
import pickle
import time
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


def _raw(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1)).cast("B")


def send_message(conn: Connection, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """A small header, then the arrays' raw buffers (no pickling of the data)."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    meta = [(a.dtype.str, a.shape) for a in arrays]
    total = sum(a.nbytes for a in arrays)
    via_fd = total >= MEMFD_MIN_BYTES and hasattr(os, "memfd_create")
    conn.send_bytes(pickle.dumps((header, meta, via_fd), protocol=pickle.HIGHEST_PROTOCOL))
    if not via_fd:
        for a in arrays:
            conn.send_bytes(_raw(a) if a.size else b"")
        return
    fd = os.memfd_create("bagserve-arrays", os.MFD_CLOEXEC)
    try:
        for a in arrays:
            view = _raw(a)
            while view:
                view = view[os.write(fd, view) :]
        reduction.send_handle(conn, fd, 0)  # the pid is only used on Windows
    finally:
        os.close(fd)


def recv_message(conn: Connection) -> tuple[dict[str, Any], list[np.ndarray]]:
    # Only ever exchanged between this process and its own workers.
    header, meta, via_fd = pickle.loads(conn.recv_bytes())
    if not via_fd:
        arrays = [
            np.frombuffer(conn.recv_bytes(), dtype=np.dtype(dt)).reshape(shape)
            for dt, shape in meta
        ]
        return header, arrays
    fd = reduction.recv_handle(conn)
    try:
        # Read-only and populated up front; the arrays keep the mapping alive.
        mapped = mmap.mmap(
            fd,
            os.fstat(fd).st_size,
            flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
            prot=mmap.PROT_READ,
        )
    finally:
        os.close(fd)
    arrays, offset = [], 0
    for dt, shape in meta:
        dtype = np.dtype(dt)
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(mapped, dtype, count, offset).reshape(shape))
        offset += count * dtype.itemsize
    return header, arrays


# ----------------------------------------------------------------------- worker side
def _predict(entry: dict[str, Any], header: dict[str, Any], arrays: list[np.ndarray]):
    from core.bags import Bags
    from core.io import Preprocessing

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
    from threadpoolctl import threadpool_limits

    from core.artifacts import load, read_manifest
    from core.io import Panel, Preprocessing

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
    while True:
        try:
            header, arrays = recv_message(conn)
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

    def exchange(self, header: dict[str, Any], arrays: list[np.ndarray], timeout: float):
        """Send a request, wait for the answer, the worker's death, or the timeout."""
        try:
            send_message(self.conn, header, arrays)
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise WorkerLost(str(exc)) from exc
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
        self, header: dict[str, Any], arrays: list[np.ndarray], timeout: float
    ) -> tuple[dict[str, Any], list[np.ndarray], float]:
        """Run one request on a worker; returns its answer and the seconds spent queued."""
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
                self._executor, worker.exchange, header, arrays, timeout
            )
        except (WorkerLost, WorkerTimeout):
            self._respawn_later(index)
            raise
        except BaseException:
            # Cancelled while computing: the worker's answer would come out of turn.
            self._respawn_later(index)
            raise
        finally:
            self._busy -= 1
        self._release(index)
        if not out_header.get("ok"):
            raise ComputeError(out_header.get("error", "compute failed"))
        return out_header, out_arrays, queued

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
