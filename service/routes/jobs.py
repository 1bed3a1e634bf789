"""Asynchronous jobs: submit (202 + Location), poll, cancel.

A job belongs to the API key that submitted it: another key polling or cancelling it
gets 404, as for a job that does not exist (an admin key sees every job). The
computation itself is :class:`~bagserve.service.job_runner.JobRunner`'s. With HL7
forwarding, a finished job's poll also says where its message is (``hl7``: pending,
delivered or undelivered, :mod:`~bagserve.service.hl7_delivery`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from bagserve.core.hashing import bytes_sha256
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from ..deps import FORBIDDEN, PrincipalDep, ServicesDep, authenticate, lookup, require
from ..errors import Problem
from ..hl7 import hl7_references
from ..idempotency import fingerprint
from ..options import PredictOptions
from ..security import Role
from ..uploads import accepted_content_type, body_spec
from .v1_openapi import PREDICT_DOC, PREDICT_RESPONSES

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(authenticate)])


def _view(
    meta: dict[str, Any],
    result: dict[str, Any] | None = None,
    delivery: dict[str, Any] | None = None,
) -> dict[str, Any]:
    view = {
        k: meta[k]
        for k in ("id", "status", "created", "updated", "model", "version", "attempts")
        if k in meta
    }
    view["links"] = {"self": f"/v1/jobs/{meta['id']}"}
    if meta["status"] in ("succeeded", "failed"):
        view["result"] = result
    if delivery is not None:
        view["hl7"] = delivery
    return view


_JOB_DOC = {
    **PREDICT_DOC,
    "parameters": [
        {
            "name": "model",
            "in": "query",
            "required": True,
            "schema": {"type": "string"},
            "example": "demo-dose",
        },
        {"name": "version", "in": "query", "required": False, "schema": {"type": "string"}},
        *PREDICT_DOC["parameters"],
    ],
}
#: What submitting answers besides 202: as predict, but nothing computed yet.
_SUBMIT_RESPONSES = {
    code: PREDICT_RESPONSES[code] for code in (400, 401, 403, 404, 413, 415, 422, 503)
}


@router.post(
    "",
    status_code=202,
    dependencies=[Depends(require(Role.PREDICT))],
    summary="Submit a prediction job (same bodies as predict)",
    openapi_extra=_JOB_DOC,
    responses={202: {"description": "accepted; poll the Location"}, **_SUBMIT_RESPONSES},
)
async def submit(request: Request, svc: ServicesDep, principal: PrincipalDep) -> Response:
    """Store the request and queue it; answer 202 with the job's ``Location``. The job
    is the submitting API key's: other keys get 404 for it."""
    qp = request.query_params
    name = qp.get("model")
    if not name:
        raise Problem(422, "the 'model' query parameter is required", slug="invalid-request")
    entry = lookup(svc.registry, name, qp.get("version"))
    options = PredictOptions.parse(entry, qp)
    # The patient and placer order numbers of a forwarded HL7 message, checked now.
    refs = hl7_references(qp)
    accepted_content_type(request)
    spec = body_spec(request)
    async with svc.intake.body(request, compute=False) as received:
        body = received.data

        async def accept() -> Response:
            meta = await asyncio.to_thread(
                svc.jobs.create,
                body,
                model=entry.name,
                version=entry.version,
                content_type=spec.content_type,
                content_encoding=spec.content_encoding,
                markers=qp.get("markers"),
                bag_id=spec.default_id,
                options=options.to_json(),
                hl7=refs or None,
                request_id=request.state.request_id,
                api_key_id=principal.key_id,
                input_sha256=await asyncio.to_thread(bytes_sha256, body),
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
        return await svc.idempotency.run(
            key, await fingerprint(request, body), accept, owner=principal.key_id
        )


async def _owned(
    svc: ServicesDep, principal: PrincipalDep, job_id: str
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The job and its result if the caller may see it; 404 otherwise, as for a job
    that does not exist (another key's job is not confirmed to exist)."""
    meta, result = await asyncio.to_thread(svc.jobs.view, job_id)
    if not principal.owns(meta.get("api_key_id")):
        raise Problem(404, f"unknown job {job_id!r}", slug="unknown-job")
    return meta, result


async def _delivery(svc: ServicesDep, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The job's HL7 delivery, if its answer was forwarded."""
    if meta["status"] != "succeeded":
        return None
    return await asyncio.to_thread(svc.deliveries.state, meta["id"])


async def _audit(svc: ServicesDep, request: Request, meta: dict[str, Any], action: str) -> None:
    """Record who read or cancelled a job's result (its prediction is audited apart)."""
    if svc.audit is None:
        return
    await asyncio.to_thread(
        svc.audit.append,
        request_id=request.state.request_id,
        api_key_id=request.state.key_id,
        route=request.url.path,
        action=action,
        job={"id": meta["id"], "status": meta["status"], "request_id": meta.get("request_id")},
        model={"name": meta.get("model"), "version": meta.get("version")},
        status=200,
    )


@router.get(
    "/{job_id}",
    response_model=None,  # the Job schema of the document (openapi_doc)
    summary="Status and, when finished, the result",
    responses={404: {"description": "unknown job (or another API key's)"}},
)
async def status(
    request: Request, svc: ServicesDep, principal: PrincipalDep, job_id: str
) -> dict[str, Any]:
    """The job's status, and its result (or problem) once finished; reading a finished
    job's result is recorded in the audit trail."""
    meta, result = await _owned(svc, principal, job_id)
    if meta["status"] in ("succeeded", "failed"):
        await _audit(svc, request, meta, "job-result")
    return _view(meta, result, await _delivery(svc, meta))


@router.delete(
    "/{job_id}",
    response_model=None,
    dependencies=[Depends(require(Role.PREDICT))],
    summary="Cancel a queued or running job",
    responses={**FORBIDDEN, 404: {"description": "unknown job (or another API key's)"}},
)
async def cancel(
    request: Request, svc: ServicesDep, principal: PrincipalDep, job_id: str
) -> dict[str, Any]:
    """Cancel a queued or running job (a finished one is left as it is); recorded in the
    audit trail."""
    await _owned(svc, principal, job_id)
    meta = await asyncio.to_thread(svc.jobs.cancel, job_id)
    svc.jobs.abandon(job_id)
    meta, result = await asyncio.to_thread(svc.jobs.view, meta["id"])
    await _audit(svc, request, meta, "job-cancel")
    return _view(meta, result, await _delivery(svc, meta))
