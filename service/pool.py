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
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .pool_dispatch import Dispatch
from .pool_lifecycle import Lifecycle
from .pool_placement import Placement
from .wire import BufferPool
from .worker import model_id
from .worker_handle import WorkerHandle
from .worker_server import worker_context

if TYPE_CHECKING:
    from bagserve.core.artifacts import VerifiedArtifact

__all__ = ["WorkerPool", "model_id"]


class WorkerPool(Lifecycle, Placement, Dispatch):
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
        self._workers: dict[int, WorkerHandle] = {}
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
