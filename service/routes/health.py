"""Liveness and readiness probes (open, no API key)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ..deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    """The process answers (no check of models or workers)."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness: models loaded, every worker alive, the state database reachable",
    responses={
        503: {
            "description": (
                "not ready (a worker is being replaced, no model loaded, or the database "
                "does not answer)"
            )
        }
    },
)
async def readyz(svc: ServicesDep) -> JSONResponse:
    """Ready when every worker is alive, at least one model is served and the database
    (jobs, idempotency, audit) answers: a replica that cannot record its audit trail
    must not take predictions."""
    registry = svc.registry
    pool = svc.pool
    workers = pool.status()
    models = [e.key for e in registry.all()]
    try:
        await asyncio.wait_for(asyncio.to_thread(svc.jobs.db.ping), 3.0)
        database = "ok"
    except Exception as exc:
        database = f"unreachable: {type(exc).__name__}: {exc}"[:300]
    ready = pool.ready and bool(models) and database == "ok"
    body = {
        "status": "ready" if ready else "not ready",
        "models": models,
        "model_failures": registry.failures,
        "workers": workers,
        "database": database,
    }
    return JSONResponse(body, status_code=200 if ready else 503)
