"""Asynchronous jobs: submit (202 + Location), poll, cancel.

The computation itself is :class:`~bagserve.service.job_runner.JobRunner`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from bagserve.core.hashing import bytes_sha256
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from ..deps import ServicesDep, authenticate, lookup
from ..errors import Problem
from ..idempotency import fingerprint
from ..prediction import PredictOptions
from ..uploads import accepted_content_type, read_limited
from .v1 import _PREDICT_DOC

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(authenticate)])


def _view(meta: dict[str, Any], result: dict[str, Any] | None = None) -> dict[str, Any]:
    view = {
        k: meta[k]
        for k in ("id", "status", "created", "updated", "model", "version", "attempts")
        if k in meta
    }
    view["links"] = {"self": f"/v1/jobs/{meta['id']}"}
    if meta["status"] in ("succeeded", "failed"):
        view["result"] = result
    return view


_JOB_DOC = {
    **_PREDICT_DOC,
    "parameters": [
        {"name": "model", "in": "query", "required": True, "schema": {"type": "string"}},
        {"name": "version", "in": "query", "required": False, "schema": {"type": "string"}},
        *_PREDICT_DOC["parameters"],
    ],
}


@router.post(
    "",
    status_code=202,
    summary="Submit a prediction job (same bodies as predict)",
    openapi_extra=_JOB_DOC,
    responses={
        202: {"description": "accepted; poll the Location"},
        404: {"description": "unknown model"},
    },
)
async def submit(request: Request, svc: ServicesDep) -> Response:
    """Store the request and queue it; answer 202 with the job's ``Location``."""
    qp = request.query_params
    name = qp.get("model")
    if not name:
        raise Problem(422, "the 'model' query parameter is required", slug="invalid-request")
    entry = lookup(svc.registry, name, qp.get("version"))
    options = PredictOptions.parse(entry, qp)
    accepted_content_type(request)
    body = await read_limited(request, svc.settings.max_body_bytes)

    async def accept() -> Response:
        meta = await asyncio.to_thread(
            svc.jobs.create,
            body,
            model=entry.name,
            version=entry.version,
            content_type=request.headers.get("content-type", ""),
            markers=qp.get("markers"),
            options=options.to_json(),
            request_id=request.state.request_id,
            api_key_id=request.state.key_id,
            input_sha256=bytes_sha256(body),
        )
        svc.jobs.wake()
        return Response(
            orjson.dumps(_view(meta)),
            status_code=202,
            media_type="application/json",
            headers={"Location": f"/v1/jobs/{meta['id']}"},
        )

    key = request.headers.get("idempotency-key")
    if key is None:
        return await accept()
    return await svc.idempotency.run(key, fingerprint(request, body), accept)


@router.get("/{job_id}", summary="Status and, when finished, the result")
async def status(svc: ServicesDep, job_id: str) -> dict[str, Any]:
    """The job's status, and its result (or problem) once finished."""
    return _view(*await asyncio.to_thread(svc.jobs.view, job_id))


@router.delete("/{job_id}", summary="Cancel a queued or running job")
async def cancel(svc: ServicesDep, job_id: str) -> dict[str, Any]:
    """Cancel a queued or running job (a finished one is left as it is)."""
    meta = await asyncio.to_thread(svc.jobs.cancel, job_id)
    svc.jobs.abandon(job_id)
    return _view(*await asyncio.to_thread(svc.jobs.view, meta["id"]))
