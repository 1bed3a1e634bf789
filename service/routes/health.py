"""Liveness and readiness probes (open: no API key needed).

Probes are open because orchestrators and load balancers call them without keys; so
their answer says only what an outsider may know: ready or not, and why in words. The
detail (model names and refusals, worker counts and process ids, the database) is
given to a caller presenting a valid API key, or to everyone when the service runs
without keys.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..database_errors import DatabaseTimeout
from ..deps import ServicesDep
from ..exposure import anonymous_exposure

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    """The process answers (no check of models or workers)."""
    return {"status": "ok"}


def _reasons(
    models: list[str], loading: list[str], workers: dict[str, Any], database_ok: bool
) -> list[str]:
    """Why the replica is not ready, in words an outsider may read."""
    reasons = []
    if not models:
        reasons.append("no model is served")
    if loading:
        reasons.append(f"{len(loading)} of {len(models)} model version(s) are loading")
    missing = workers["configured"] - workers["alive"]
    if missing:
        reasons.append(
            f"{missing} of {workers['configured']} worker process(es) are starting or "
            "being replaced"
        )
    if not database_ok:
        reasons.append("the state database (jobs, audit trail) does not answer")
    return reasons


@router.get(
    "/readyz",
    summary="Readiness: every model loaded, every worker alive, the state database reachable",
    responses={
        401: {"description": "an API key was presented and is not valid"},
        503: {
            "description": (
                "not ready (a worker is starting or being replaced, a model is loading, "
                "no model is served, or the database does not answer)"
            )
        },
    },
)
async def readyz(request: Request, svc: ServicesDep) -> JSONResponse:
    """Ready when every worker is alive, every model found (at start-up, or served
    since) is loaded in every worker, at least one is served, and the database (jobs,
    idempotency, audit) answers: a replica that cannot record its audit trail must not
    take predictions. The server answers while it starts (not ready, and why);
    ``/v2/models/{name}/ready`` says when each model is served. Without a key: the
    status and the reasons; with a valid key (or no keys configured): the models,
    refused artifacts, workers and database, and whether anyone may call it anonymously
    on a non-loopback address (``anonymous_public``, explained in ``warnings``):
    reported, not a reason to be unready, since the image's health check reads this
    probe."""
    # A presented key must be valid (401 otherwise); none at all is an outsider.
    detailed = not svc.auth.enabled or (
        svc.auth.presented(request) is not None and svc.auth.check(request) is not None
    )
    pool = svc.pool
    workers = pool.status()
    models = [e.key for e in svc.registry.all()]
    loading = svc.repository.loading()
    limit = svc.settings.database_timeout
    try:
        await asyncio.wait_for(asyncio.to_thread(svc.jobs.db.ping), limit)
        database = "ok"
    except (TimeoutError, DatabaseTimeout) as exc:
        # Frozen, or every connection held by calls that wait for it.
        database = f"unresponsive: {str(exc) or f'no answer within {limit:g} s'}"[:300]
    except Exception as exc:
        database = f"unreachable: {type(exc).__name__}: {exc}"[:300]
    reasons = _reasons(models, loading, workers, database == "ok")
    ready = pool.ready and not reasons
    body: dict[str, Any] = {"status": "ready" if ready else "not ready", "reasons": reasons}
    if detailed:
        # Keys configured means no anonymous exposure: warnings are empty for insiders.
        exposure = anonymous_exposure(svc.settings)
        body.update(
            models=models,
            model_failures=svc.registry.failures,
            workers=workers,
            database=database,
            anonymous_public=exposure is not None,
            warnings=[exposure] if exposure else [],
        )
    return JSONResponse(body, status_code=200 if ready else 503)
