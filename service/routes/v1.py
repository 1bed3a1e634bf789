"""Native API: list models, describe one, predict.

Predict is an adapter: the body is read and decoded into bags, the prediction use-case
(:class:`~bagserve.service.prediction.Predictor`) runs, and the typed result is encoded
as the caller asked (JSON, CSV or NPY; :mod:`..encoders`).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse
from starlette.responses import Response

from .. import fhir
from ..codecs import FCS, NPY
from ..deps import (
    CallerDep,
    LatestEntry,
    ModelName,
    ServicesDep,
    authenticate,
    lookup,
    require,
)
from ..encoders import CSV_OUT, encode, encode_off_loop, negotiate, server_timing
from ..errors import Problem
from ..hl7 import HL7_V2, Parties, hl7_references
from ..idempotency import fingerprint
from ..options import PredictOptions
from ..prediction import provenance_headers
from ..registry import ModelEntry
from ..security import Role
from ..uploads import accepted_content_type, body_spec
from .twins import Twin, add_twins
from .v1_openapi import PREDICT_DOC, PREDICT_RESPONSES

router = APIRouter(prefix="/v1", tags=["v1"], dependencies=[Depends(authenticate)])


@router.get("/models", summary="Every served model with its versions")
async def list_models(svc: ServicesDep) -> dict[str, Any]:
    """Every served model with its versions, and the artifacts refused at start-up."""
    registry = svc.registry
    return {
        "models": [
            {"name": name, "versions": [e.describe() for e in registry.versions(name)]}
            for name in sorted(registry.entries)
        ],
        "failures": registry.failures,
    }


@router.get("/models/{name}", summary="One model: versions, estimator, panel, metrics, sha256")
async def get_model(svc: ServicesDep, entry: LatestEntry) -> dict[str, Any]:
    """One model: its latest version and every version's description."""
    return {
        "name": entry.name,
        "latest": entry.version,
        "versions": [e.describe() for e in svc.registry.versions(entry.name)],
    }


@router.get(
    "/models/{name}/card",
    summary="The model card (Markdown)",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/markdown": {"schema": {"type": "string"}}}}},
)
async def model_card(
    name: ModelName,
    svc: ServicesDep,
    version: Annotated[str | None, Query(examples=["1"])] = None,
) -> PlainTextResponse:
    """Intended use, training data, evaluation, panel, preprocessing and provenance of
    the latest version (or ``?version=``), as ``bagserve train`` writes it."""
    entry = lookup(svc.registry, name, version)
    return PlainTextResponse(entry.card(), media_type="text/markdown; charset=utf-8")


@router.get("/audit", summary="Recent audit-trail entries")
async def recent_audit(
    svc: ServicesDep, caller: CallerDep, limit: int = Query(50, ge=1, le=1000)
) -> dict[str, Any]:
    """The newest entries of the audit trail, newest first: with API keys, only the
    caller's own (matched by key id); without keys, everyone's. No patient values
    are in the trail (sizes, hashes, summaries of the answers)."""
    if svc.audit is None:
        return {"entries": [], "key_id": caller.key_id}
    entries = await asyncio.to_thread(svc.audit.recent, limit, caller.key_id)
    return {"entries": entries, "key_id": caller.key_id}


async def _predict(
    request: Request, svc: ServicesDep, caller: CallerDep, entry: ModelEntry
) -> Response:
    """Read the body, predict on a worker (which decodes it), encode, behind
    ``Idempotency-Key`` when the caller sent one."""
    fmt = negotiate(request.headers.get("accept"))
    accepted_content_type(request)
    qp = request.query_params
    # Bad query parameters are refused before the body is read.
    options = PredictOptions.parse(entry, qp)
    if fmt == FCS and not options.explain:
        raise Problem(
            406,
            "an FCS answer is a sample's cells with their contributions: add ?explain=true "
            "(and send one bag), or accept application/json",
        )
    refs = (
        fhir.references(qp)
        if fmt == fhir.FHIR_JSON
        else hl7_references(qp)
        if fmt == HL7_V2
        else None
    )
    spec = body_spec(request)
    async with svc.intake.body(request) as received:
        body = received.data

        async def answer() -> Response:
            outcome = await svc.predictor.run(
                caller,
                entry,
                body,
                spec,
                options,
                lent=received.lent,
                timings={"read": received.seconds},
                fcs=fmt == FCS,
            )
            t1 = time.perf_counter()
            if outcome.fcs is not None:  # written by the worker, where the cells are
                content = outcome.fcs
            else:
                content = await encode_off_loop(
                    outcome.result,
                    encode,
                    outcome.answer(caller.request_id),
                    fmt,
                    options,
                    refs=refs,
                    performer=svc.settings.fhir_performer,
                    timezone=svc.settings.fhir_timezone,
                    parties=Parties.from_settings(svc.settings),
                )
            timings = {**outcome.timings, "encode": time.perf_counter() - t1}
            svc.metrics.observe_stages({"encode": timings["encode"]})
            headers = provenance_headers(entry, outcome)
            headers["Server-Timing"] = server_timing(timings)
            if fmt == NPY:
                # An NPY table carries numbers only: each bag's status rides beside it.
                headers["Bagserve-Status"] = json.dumps(
                    [outcome.result.status_of(i) for i in range(outcome.result.n_bags)]
                )
            classes = getattr(outcome.result, "classes", None)
            if fmt in (CSV_OUT, NPY) and classes is not None:
                # The column order of CSV probability columns and NPY tables.
                headers["Bagserve-Classes"] = json.dumps([str(c) for c in classes.tolist()])
            warning = outcome.warning_header()
            if warning is not None:
                headers["Warning"] = warning
            media = (
                f"{fmt}; fhirVersion=4.0"
                if fmt == fhir.FHIR_JSON
                else f"{fmt}; charset=utf-8"
                if fmt == HL7_V2
                else fmt
            )
            return Response(content, media_type=media, headers=headers)

        key = request.headers.get("idempotency-key")
        if key is None:
            return await answer()
        return await svc.idempotency.run(
            key, await fingerprint(request, body), answer, owner=caller.key_id
        )


add_twins(
    router,
    "POST",
    "/models/{name}/predict",
    _predict,
    latest=Twin(
        "predict_latest",
        "Predict with the latest version",
        "Predict with the model's latest version.",
    ),
    version=Twin(
        "predict_version", "Predict with one version", "Predict with one version of the model."
    ),
    dependencies=[Depends(require(Role.PREDICT))],
    openapi_extra=PREDICT_DOC,
    responses=PREDICT_RESPONSES,
)
