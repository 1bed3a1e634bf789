"""Liveness and readiness probes (open, no API key)."""

from __future__ import annotations

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
    summary="Readiness: models loaded and every worker alive",
    responses={503: {"description": "not ready (a worker is being replaced, or no model loaded)"}},
)
async def readyz(svc: ServicesDep) -> JSONResponse:
    """Ready when every worker is alive and at least one model is served."""
    registry = svc.registry
    pool = svc.pool
    workers = pool.status()
    models = [e.key for e in registry.all()]
    ready = pool.ready and bool(models)
    body = {
        "status": "ready" if ready else "not ready",
        "models": models,
        "model_failures": registry.failures,
        "workers": workers,
    }
    return JSONResponse(body, status_code=200 if ready else 503)
