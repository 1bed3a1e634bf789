"""Model repository operations: serve new, changed or fewer models without a restart.

:class:`Repository` keeps the registry (what the routes answer for) and the worker pool
(what computes) in step. A load rescans the models directory (all of it, or one
model), has the workers replaced one by one by workers that loaded the new set (the
pool keeps serving meanwhile, :meth:`WorkerPool.reload`), and only then makes the new
set visible to requests. An unload takes a model out of the registry at once; its
arrays stay mapped in the workers until the next reload. Triton's repository
extension (``/v2/repository/...``) and ``SIGHUP`` call these.
"""

from __future__ import annotations

import asyncio
import logging

from .errors import Problem
from .pool import WorkerPool
from .registry import Registry

__all__ = ["Repository"]

log = logging.getLogger("bagserve.repository")


class Repository:
    """Load, reload and unload the served models (see the module docstring)."""

    def __init__(self, registry: Registry, pool: WorkerPool) -> None:
        self.registry = registry
        self.pool = pool
        self._lock = asyncio.Lock()

    async def load(self, name: str | None = None) -> list[str]:
        """(Re)load model ``name`` from disk, or every model (``None``); returns the
        model versions served afterwards.

        Raises
        ------
        Problem
            404 when ``name`` has no valid artifact on disk (the reasons listed); the
            models served before are still served.
        """
        async with self._lock:
            nxt = self.registry.plan(name)
            if name is not None and name not in nxt.entries:
                reasons = [f"{k}: {v}" for k, v in nxt.failures.items() if k.startswith(f"{name}/")]
                raise Problem(
                    404,
                    f"no servable version of model {name!r} in the repository",
                    errors=reasons,
                    slug="unknown-model",
                )
            current = {e.key: e.info.path for e in self.registry.all()}
            wanted = {e.key: e.info.path for e in nxt.all()}
            # Workers keep what is served now, so that requests routed before the
            # switch still find their model.
            await self.pool.reload({**current, **wanted})
            self.registry.adopt(nxt)
            served = sorted(e.key for e in self.registry.all())
            log.info(
                "models loaded",
                extra={"model": name or "*", "served": served, "failures": nxt.failures},
            )
            return served

    async def unload(self, name: str) -> None:
        """Stop serving model ``name`` (404 if it is not served)."""
        async with self._lock:
            if name not in self.registry.entries:
                raise Problem(404, f"model {name!r} is not loaded", slug="unknown-model")
            self.registry.adopt(self.registry.without(name))
            log.info("model unloaded", extra={"model": name})
