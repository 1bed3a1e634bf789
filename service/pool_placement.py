"""The worker pool's second job: which model versions every worker holds.

Models are loaded into the running workers, all at once, on their control pipes
(:meth:`Placement.load`); a version is served from the moment every running worker
holds it (:meth:`Placement.serves`), and one a worker cannot load is dropped from all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from .worker import model_id
from .worker_handle import PoolError, WorkerHandle

if TYPE_CHECKING:
    from bagserve.core.artifacts import VerifiedArtifact

log = logging.getLogger("bagserve.workers")


class Placement:
    """Load and drop model versions in every worker (a part of :class:`~.pool.WorkerPool`).

    Parameters
    ----------
    workers : mapping of int to WorkerHandle
        The running workers by index (kept by :class:`~.pool_lifecycle.Lifecycle`).
    control : Executor
        The threads that wait on the workers' control pipes.
    start_timeout : float
        Seconds a worker may take to load one model version.
    replace : callable
        ``replace(index)``: worker ``index`` stopped answering; have it replaced.
    """

    def __init__(
        self,
        workers: Mapping[int, WorkerHandle],
        control: Executor,
        start_timeout: float,
        replace: Callable[[int], None],
    ):
        self._workers = workers
        self._control = control
        self.start_timeout = start_timeout
        self._replace = replace
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
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

    def close(self) -> None:
        """Stop loading: the background loads end, whoever waits for one is cancelled."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for waiter in self._waiters:
            waiter.cancel()

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
            self.refresh()  # what every worker holds already (a reload of the same)
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

    async def catch_up(self, worker: WorkerHandle) -> None:
        """Have a started ``worker`` hold every served version, before it takes a request.

        Raises :class:`RuntimeError` if it cannot load one of them (still served), or
        :class:`WorkerLost` or :class:`WorkerTimeout`.
        """
        failed: dict[str, str] = {}
        # What became served while it started, until nothing is missing: checked here,
        # and the worker registered by the caller, with no await in between, so no
        # version served meanwhile is missing from it.
        while True:
            failed = {k: v for k, v in failed.items() if k in self._serving}
            if failed:
                raise RuntimeError(
                    f"worker {worker.index} could not load a served model: "
                    + "; ".join(f"{k}: {v}" for k, v in sorted(failed.items()))
                )
            missing = sorted(self._serving - worker.held)
            if not missing:
                return
            for mid in missing:
                reason = await self._load_one(worker, mid)
                if reason is not None:
                    failed[mid] = reason

    def joined(self, worker: WorkerHandle) -> None:
        """A worker now runs (it caught up): serve what every worker holds, and have it
        load the versions being loaded (:meth:`_converge`)."""
        self.refresh()
        self._converge(worker)

    async def _command(
        self, worker: WorkerHandle, message: dict[str, Any], fds: Sequence[int] = ()
    ) -> dict[str, Any]:
        """One control exchange with ``worker`` (the caller holds its ``control_lock``)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._control, worker.command, message, self.start_timeout, fds
        )

    async def _load_one(self, worker: WorkerHandle, mid: str) -> str | None:
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

    def _converge(self, worker: WorkerHandle) -> None:
        """Have ``worker`` load the wanted versions it lacks, in the background (one task
        per worker, reading what is wanted at each turn)."""
        if self._closed or (worker.converging is not None and not worker.converging.done()):
            return
        loop = asyncio.get_running_loop()
        worker.converging = loop.create_task(self._converge_loop(worker))
        self._track(worker.converging)

    async def _converge_loop(self, worker: WorkerHandle) -> None:
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
                self._replace(worker.index)
                return
            if reason is not None:
                failed.add(mid)
                self._fail(mid, reason)
            self.refresh()

    def refresh(self) -> None:
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

        async def drop(worker: WorkerHandle) -> None:
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

    # -- routing
    def routable(self, key: str, sha256: str | None) -> bool:
        """Requests for ``key`` (at ``sha256``) may go to any worker."""
        if sha256 is not None:
            return model_id(key, sha256) in self._serving
        return any(mid.rsplit("@", 1)[0] == key for mid in self._serving)
