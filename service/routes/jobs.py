"""Asynchronous jobs: submit (202 + Location), poll, cancel."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from ..errors import Problem
from ..idempotency import fingerprint
from ..predict import (
    accepted_content_type,
    audit,
    compute,
    decode_job_body,
    distribution_options,
    encode_json,
    read_limited,
)
from .v1 import _PREDICT_DOC, _entry

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def _view(request: Request, meta: dict[str, Any]) -> dict[str, Any]:
    store = request.app.state.jobs
    view = {
        k: meta[k] for k in ("id", "status", "created", "updated", "model", "version") if k in meta
    }
    view["links"] = {"self": f"/v1/jobs/{meta['id']}"}
    if meta["status"] in ("succeeded", "failed"):
        view["result"] = store.result(meta["id"])
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
async def submit(request: Request) -> Response:
    request.state.key_id = request.app.state.auth.check(request)
    name = request.query_params.get("model")
    if not name:
        raise Problem(422, "the 'model' query parameter is required", slug="invalid-request")
    entry = _entry(request, name, request.query_params.get("version"))
    options = distribution_options(
        entry, request.query_params.get("quantiles"), request.query_params.get("exceed")
    )
    accepted_content_type(request)
    body = await read_limited(request, request.app.state.settings.max_body_bytes)

    async def accept() -> Response:
        meta = request.app.state.jobs.create(
            body,
            model=entry.name,
            version=entry.version,
            content_type=request.headers.get("content-type", ""),
            markers=request.query_params.get("markers"),
            options=options,
            request_id=request.state.request_id,
            api_key_id=request.state.key_id,
            input_sha256=hashlib.sha256(body).hexdigest(),
        )
        location = f"/v1/jobs/{meta['id']}"
        return Response(
            orjson.dumps(_view(request, meta)),
            status_code=202,
            media_type="application/json",
            headers={"Location": location},
        )

    key = request.headers.get("idempotency-key")
    if key is None:
        return await accept()
    return await request.app.state.idempotency.run(key, fingerprint(request, body), accept)


@router.get("/{job_id}", summary="Status and, when finished, the result")
async def status(request: Request, job_id: str) -> dict[str, Any]:
    request.app.state.auth.check(request)
    return _view(request, request.app.state.jobs.meta(job_id))


@router.delete("/{job_id}", summary="Cancel a queued or running job")
async def cancel(request: Request, job_id: str) -> dict[str, Any]:
    request.app.state.auth.check(request)
    return _view(request, request.app.state.jobs.cancel(job_id))


def job_runner(app: Any):
    """The coroutine that computes one stored job (used by the JobStore's consumers)."""

    async def run_one(job_id: str) -> None:
        store = app.state.jobs
        meta = store.meta(job_id)
        entry = app.state.registry.get(meta["model"], meta["version"])
        if entry is None:
            store.finish(
                job_id,
                "failed",
                {
                    "status": 404,
                    "detail": f"model {meta['model']}/{meta['version']} is no longer served",
                },
            )
            return
        timings: dict[str, float] = {}
        fake = _JobRequest(app, meta)
        try:
            t0 = time.perf_counter()
            bags, errors = await decode_job_body(
                meta["content_type"], store.body(job_id), meta.get("markers")
            )
            timings["parse"] = time.perf_counter() - t0
            outcome = await compute(app, entry, bags, errors, timings, meta.get("options"))
        except Problem as exc:
            store.finish(
                job_id, "failed", {"status": exc.status, "detail": exc.detail, "errors": exc.errors}
            )
            audit(fake, entry, meta["input_sha256"], exc.status, None)
            return
        result = encode_json(outcome, meta["request_id"], meta["input_sha256"])
        store.finish(job_id, "succeeded", {"status": 200, **result})
        audit(fake, entry, meta["input_sha256"], 200, outcome)

    return run_one


class _JobRequest:
    """What :func:`service.predict.audit` reads from a request, for a stored job."""

    def __init__(self, app: Any, meta: dict[str, Any]):
        self.app = app

        class _State:
            request_id = meta["request_id"]
            key_id = meta.get("api_key_id")

        class _URL:
            path = f"/v1/jobs/{meta['id']}"

        self.state = _State()
        self.url = _URL()
