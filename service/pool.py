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

import os
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .pool_dispatch import Dispatch
from .pool_lifecycle import Lifecycle
from .pool_placement import Placement
from .wire import BufferPool
from .worker import model_id
from .worker_handle import WorkerHandle

if TYPE_CHECKING:
    import numpy as np
    from bagserve.core.artifacts import VerifiedArtifact

    from .wire import SharedBuffer

__all__ = ["WorkerPool", "model_id"]


class WorkerPool:
    """``n`` worker processes and the model versions they hold (see the module docstring).

    Made of its three jobs, each an object of its own that gets what it needs from
    here: :attr:`lifecycle` (start, watch, replace and stop the workers),
    :attr:`placement` (the model versions every worker holds) and :attr:`dispatch` (a
    request to an idle worker). They share the running workers by index, which only
    the lifecycle changes.

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
        self._workers: dict[int, WorkerHandle] = {}
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
        self.placement = Placement(self._workers, self._control, start_timeout, self._replace)
        self.dispatch = Dispatch(
            self._workers,
            queue_size,
            n + 2,
            self.buffers,
            routable=self.placement.routable,
            replace=self._replace,
        )
        self.lifecycle = Lifecycle(
            n,
            self.limits,
            start_timeout,
            self._workers,
            self._control,
            catch_up=self.placement.catch_up,
            joined=self.placement.joined,
            left=self.placement.refresh,
            available=self.dispatch.release,
            in_use=self.dispatch.in_use,
        )

    def _replace(self, index: int) -> None:
        """Have worker ``index`` replaced (the placement and the dispatch notice dead
        workers; the lifecycle, made after them, replaces them)."""
        self.lifecycle.replace(index)

    async def start(self) -> None:
        """Start the workers and the monitor that replaces dead ones, and return at once:
        :attr:`ready` says when every worker is up, :meth:`serves` which models they
        hold (see :meth:`load`)."""
        self.dispatch.start()
        self.lifecycle.start()

    async def stop(self) -> None:
        """Stop the workers and release the shared buffers."""
        self.placement.close()
        self.lifecycle.close()
        self.dispatch.close()
        self._control.shutdown(wait=False, cancel_futures=True)
        if self.buffers is not None:
            self.buffers.close()

    async def load(
        self,
        models: Mapping[str, VerifiedArtifact],
        keep: Collection[str] = (),
        timeout: float | None = None,
    ) -> dict[str, str]:
        """Have every worker hold ``models`` besides ``keep``; returns the ids that could
        not be loaded, with the reasons (see :meth:`.Placement.load`)."""
        return await self.placement.load(models, keep, timeout)

    def serves(self, mid: str) -> bool:
        """Every running worker holds model version ``mid``: requests for it are served."""
        return self.placement.serves(mid)

    @property
    def loading(self) -> list[str]:
        """Model ids being loaded (wanted, not yet held by every running worker)."""
        return self.placement.loading

    async def submit(
        self,
        header: dict[str, Any],
        arrays: Mapping[str, np.ndarray],
        timeout: float,
        lent: Sequence[SharedBuffer] = (),
        meanwhile: Callable[[], Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, np.ndarray], float, Any]:
        """Run one request on a worker; returns its answer, the seconds spent queued,
        and what ``meanwhile()`` returned (see :meth:`.Dispatch.submit`)."""
        return await self.dispatch.submit(header, arrays, timeout, lent, meanwhile)

    @property
    def saturated(self) -> bool:
        """Every worker is busy and the waiting line is full: the next request would be
        refused (checked before a request's body is read, too)."""
        return self.dispatch.saturated

    def status(self) -> dict[str, Any]:
        """Configured, alive, busy and waiting counts, workers starting or being
        replaced, pids, and the model versions being loaded."""
        alive = self.lifecycle.alive
        return {
            "configured": self.n,
            "alive": len(alive),
            "busy": self.dispatch.busy,
            "waiting": self.dispatch.waiting,
            "respawning": self.lifecycle.respawning,
            "pids": [w.pid for w in alive],
            "loading": sorted({mid.rsplit("@", 1)[0] for mid in self.loading}),
        }

    @property
    def ready(self) -> bool:
        """Every configured worker is alive."""
        return self.lifecycle.ready
