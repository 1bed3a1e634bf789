"""Model repository operations: serve new, changed or fewer models without a restart.

:class:`Repository` keeps the registry (what the routes answer for) and the worker pool
(what computes) in step. A load rescans the models directory (all of it, or one
model), has every worker load the new versions at the same time, beside what they
serve (:meth:`WorkerPool.load`), and only then makes the new set visible to requests:
until the switch the previous versions answer, after it the new ones, and a version
some worker could not load is never served (it is reported, and what was served
before still is). An unload takes a model out of the registry at once; its arrays stay
mapped in the workers until the next load.

A load runs in the background (:meth:`Repository.begin`): the HTTP route answers as
soon as it is done or after a short wait, with its :class:`LoadStatus` to poll.
Triton's repository extension (``/v2/repository/...``) and ``SIGHUP`` call these. The
models found at start-up are loaded the same way (:meth:`Repository.start`), each
served as soon as every worker holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import Problem
from .pool import WorkerPool, model_id
from .registry import _NAME, ModelEntry, Registry

if TYPE_CHECKING:
    from bagserve.core.artifacts import VerifiedArtifact

__all__ = ["LOADING", "READY", "UNAVAILABLE", "LoadStatus", "Repository"]

log = logging.getLogger("bagserve.repository")

#: The states of Triton's repository index (KServe's model repository extension).
READY, LOADING, UNAVAILABLE = "READY", "LOADING", "UNAVAILABLE"


def _ids(entries: list[ModelEntry]) -> dict[str, VerifiedArtifact]:
    """Model id (name/version@sha256) to its verified bytes, as the pool loads them."""
    out = {}
    for e in entries:
        # Every served entry carries them (Registry scans with load=True).
        assert e.verified is not None, f"{e.key} was not read for serving"
        out[model_id(e.key, e.sha256)] = e.verified
    return out


@dataclass
class LoadStatus:
    """One load of a model (or of the whole repository), as its status route shows it.

    Attributes
    ----------
    name : str or None
        The model; None for the whole repository (``SIGHUP``).
    state : str
        ``LOADING`` until done, then ``READY`` (every version on disk is served) or
        ``UNAVAILABLE`` (``reason`` says why; what was served before still is).
    reason : str
    versions : list of str
        ``name/version`` of what this load brings in (new or changed), once known.
    served : list of str
        ``name/version`` served afterwards (of ``name``, or all).
    problem : Problem, optional
        The failure as the route answers it when it is done within the wait.
    """

    name: str | None
    state: str = LOADING
    reason: str = ""
    versions: list[str] = field(default_factory=list)
    served: list[str] = field(default_factory=list)
    problem: Problem | None = None
    started: float = field(default_factory=time.time)
    finished: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def finish(self, state: str, reason: str = "", problem: Problem | None = None) -> None:
        self.state, self.reason, self.problem = state, reason, problem
        self.finished = time.time()
        self.done.set()

    def to_json(self) -> dict[str, Any]:
        """The status as ``GET /v2/repository/models/{name}/load/status`` answers it."""
        return {
            "name": self.name,
            "state": self.state,
            "reason": self.reason,
            "versions": self.versions,
            "served": self.served,
            "started": self.started,
            "finished": self.finished,
            "seconds": None if self.finished is None else round(self.finished - self.started, 6),
        }


class Repository:
    """Load, reload and unload the served models (see the module docstring)."""

    def __init__(self, registry: Registry, pool: WorkerPool) -> None:
        self.registry = registry
        self.pool = pool
        self._lock = asyncio.Lock()
        #: The latest load of each model ("" for the whole repository).
        self._loads: dict[str, LoadStatus] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: Set once the models found at start-up are served (or refused).
        self.started = asyncio.Event()

    # -- start-up
    def start(self) -> None:
        """Load the registry's models into the workers, in the background."""
        self._track(asyncio.get_running_loop().create_task(self._start_up()))

    async def _start_up(self) -> None:
        t0 = time.perf_counter()
        try:
            async with self._lock:
                entries = self.registry.all()
                failed = await self.pool.load(_ids(entries))
                if failed:
                    by_key = {mid.rsplit("@", 1)[0]: why for mid, why in failed.items()}
                    self.registry.adopt(self.registry.refusing(by_key))
            log.info(
                "models loaded",
                extra={
                    "models": sorted(e.key for e in self.registry.all()),
                    "failures": failed,
                    "seconds": round(time.perf_counter() - t0, 3),
                },
            )
        finally:
            self.started.set()

    def loading(self) -> list[str]:
        """Served model versions (in the registry) that the workers do not hold yet."""
        return [e.key for e in self.registry.all() if not self.pool.serves(self.id_of(e))]

    @staticmethod
    def id_of(entry: ModelEntry) -> str:
        """How the pool knows ``entry`` (:func:`~.worker.model_id`)."""
        return model_id(entry.key, entry.sha256)

    # -- loads
    def begin(self, name: str | None = None) -> LoadStatus:
        """Start loading model ``name`` (``None``: the whole models directory) in the
        background; its status at once.

        Raises
        ------
        Problem
            404 at once when ``name`` has no directory in the repository and is not
            served; a directory without a servable version fails the load itself.
        """
        if (
            name is not None
            and name not in self.registry.entries
            and not (_NAME.match(name) and (self.registry.models_dir / name).is_dir())
        ):
            raise Problem(
                404,
                f"no servable version of model {name!r} in the repository",
                slug="unknown-model",
            )
        status = LoadStatus(name)
        self._loads[name or ""] = status
        self._track(asyncio.get_running_loop().create_task(self._run(status)))
        return status

    async def load(self, name: str | None = None) -> list[str]:
        """(Re)load model ``name`` from disk, or every model (``None``), and wait;
        returns the model versions served afterwards (of ``name``, or all).

        Raises
        ------
        Problem
            404 when ``name`` has no valid artifact on disk (the reasons listed), 500
            when the workers could not load it; the models served before are still
            served.
        """
        status = self.begin(name)
        await status.done.wait()
        if status.problem is not None:
            raise status.problem
        return status.served

    def status(self, name: str) -> LoadStatus:
        """The latest load of model ``name``; for a model served without one (found
        at start-up), its state now.

        Raises
        ------
        Problem
            404 when no load of ``name`` was asked for and it is not served.
        """
        found = self._loads.get(name)
        if found is not None:
            return found
        versions = self.registry.versions(name)
        if not versions:
            raise Problem(
                404,
                f"no load of model {name!r} was asked for, and it is not served",
                slug="unknown-model",
            )
        keys = [e.key for e in versions]
        pending = [k for k in self.loading() if k in keys]
        now = LoadStatus(name, versions=keys, served=keys)
        if pending:
            now.reason = "loading at start-up"
        else:
            now.finish(READY)
        return now

    async def _run(self, status: LoadStatus) -> None:
        try:
            async with self._lock:
                await self._load(status)
        except Problem as exc:
            status.finish(UNAVAILABLE, exc.detail, exc)
        except Exception as exc:
            log.exception("model load failed", extra={"model": status.name or "*"})
            detail = (
                f"the load failed ({type(exc).__name__}: {exc}); the models served "
                "before are still served"
            )
            status.finish(UNAVAILABLE, detail, Problem(500, detail, slug="load-failed"))

    async def _load(self, status: LoadStatus) -> None:
        name = status.name
        t0 = time.perf_counter()
        # Reading the manifests and hashing every file takes a while for large models.
        nxt = await asyncio.to_thread(self.registry.plan, name)
        if name is not None and name not in nxt.entries:
            reasons = [f"{k}: {v}" for k, v in nxt.failures.items() if k.startswith(f"{name}/")]
            raise Problem(
                404,
                f"no servable version of model {name!r} in the repository",
                errors=reasons,
                slug="unknown-model",
            )
        current = _ids(self.registry.all())
        wanted = _ids(nxt.all())
        status.versions = sorted(
            e.key
            for e in nxt.all()
            if self.id_of(e) not in current and (name is None or e.name == name)
        )
        # Workers keep what is served now, so that requests routed before the switch
        # still find their version; what neither set names is dropped.
        failed = await self.pool.load(wanted, keep=current)
        if failed:
            by_key = {
                mid.rsplit("@", 1)[0]: f"the workers could not load it: {why}"
                for mid, why in failed.items()
            }
            nxt = nxt.refusing(by_key, fallback=self.registry)
        self.registry.adopt(nxt)
        mine = [e for e in self.registry.all() if name is None or e.name == name]
        status.served = sorted(e.key for e in mine)
        log.info(
            "models loaded",
            extra={
                "model": name or "*",
                "served": sorted(e.key for e in self.registry.all()),
                "failures": failed,
                "seconds": round(time.perf_counter() - t0, 3),
            },
        )
        refused = {
            mid.rsplit("@", 1)[0]: why
            for mid, why in failed.items()
            if name is None or mid.startswith(f"{name}/")
        }
        if refused:
            detail = "; ".join(f"{k}: {v}" for k, v in sorted(refused.items()))
            raise Problem(
                500,
                f"the workers could not load {', '.join(sorted(refused))}; what was served "
                "before still is",
                errors=[detail],
                slug="load-failed",
            )
        status.finish(READY)

    async def unload(self, name: str) -> None:
        """Stop serving model ``name`` (404 if it is not served); waits for a load
        under way to finish first."""
        async with self._lock:
            if name not in self.registry.entries:
                raise Problem(404, f"model {name!r} is not loaded", slug="unknown-model")
            self.registry.adopt(self.registry.without(name))
            log.info("model unloaded", extra={"model": name})

    # -- the index
    async def index(self) -> list[dict[str, str]]:
        """Every model version on disk with its state (Triton's repository index):
        READY, LOADING (being loaded into the workers) or UNAVAILABLE with the reason."""
        rows = await asyncio.to_thread(self.registry.on_disk)
        loading = set(self.loading())
        for status in self._loads.values():
            if status.state == LOADING:
                loading.update(status.versions)
        for row in rows:
            if f"{row['name']}/{row['version']}" in loading:
                row["state"], row["reason"] = LOADING, "being loaded into the workers"
        return rows

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Cancel the loads under way (at shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
