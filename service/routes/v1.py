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
    FORBIDDEN,
    CallerDep,
    LatestEntry,
    ModelName,
    ServicesDep,
    VersionEntry,
    authenticate,
    lookup,
    require,
)
from ..encoders import CSV_OUT, encode, encode_off_loop, negotiate, server_timing
from ..errors import Problem
from ..hl7 import HL7_V2, ID_PATTERN, Parties, hl7_references
from ..idempotency import fingerprint
from ..options import PredictOptions
from ..prediction import Caller, provenance_headers
from ..registry import ModelEntry
from ..security import Role
from ..uploads import accepted_content_type, body_spec

router = APIRouter(prefix="/v1", tags=["v1"], dependencies=[Depends(authenticate)])

_EXAMPLE_BAG = {
    "bags": [
        {
            "id": "patient-17",
            "markers": ["FSC-A", "SSC-A", "GFP"],
            "points": [[2.1, 1.0, 0.3], [1.7, 0.8, 1.9], [2.4, 1.3, 0.1]],
        }
    ]
}
_PREDICT_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": (
            "One bag or many. JSON (`bags`: id, points, optional markers and weights), "
            "or one file as the body (NPY with `?markers=`, CSV/TSV with a header, FCS, "
            "Parquet or AnnData .h5ad with the optional extras), "
            "or multipart/form-data with several files (one bag each)."
        ),
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["bags"],
                    "properties": {
                        "bags": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["points"],
                                "properties": {
                                    "id": {"type": "string"},
                                    "points": {
                                        "type": "array",
                                        "items": {"type": "array", "items": {"type": "number"}},
                                    },
                                    "markers": {"type": "array", "items": {"type": "string"}},
                                    "weights": {"type": "array", "items": {"type": "number"}},
                                },
                            },
                        }
                    },
                },
                "example": _EXAMPLE_BAG,
            },
            "text/csv": {
                "schema": {"type": "string"},
                "example": "FSC-A,SSC-A,GFP\n2.1,1.0,0.3\n1.7,0.8,1.9\n",
            },
            "application/x-npy": {"schema": {"type": "string", "format": "binary"}},
            "application/vnd.isac.fcs": {"schema": {"type": "string", "format": "binary"}},
            "application/vnd.apache.parquet": {"schema": {"type": "string", "format": "binary"}},
            "application/x-hdf5": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "files": {"type": "array", "items": {"type": "string", "format": "binary"}}
                    },
                }
            },
        },
    },
    "parameters": [
        {
            "name": "markers",
            "in": "query",
            "required": False,
            "schema": {"type": "string"},
            "description": "Comma-separated marker names of an NPY body's columns.",
        },
        {
            "name": "quantiles",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "pattern": r"^[0-9.eE+-]+(,[0-9.eE+-]+)*$"},
            "description": (
                "Conditional models (ConditionalMeanEmbedding) only: comma-separated levels "
                "in [0, 1], e.g. `0.05,0.5,0.95`; each prediction gains `quantiles` "
                "{level: value} of the outcome's predicted distribution (CSV: columns "
                "q_<level>; NPY: columns after the mean)."
            ),
        },
        {
            "name": "exceed",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "pattern": r"^[0-9.eE+-]+(,[0-9.eE+-]+)*$"},
            "description": (
                "Conditional models only: comma-separated thresholds t, e.g. `2.5`; each "
                "prediction gains `exceedance` {t: P(outcome > t)} (CSV: columns p_gt_<t>; "
                "NPY: last columns)."
            ),
        },
        {
            "name": "interval",
            "in": "query",
            "required": False,
            "schema": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "example": 0.9,
            "description": (
                "A coverage such as 0.9. Regressors: each prediction gains `interval` [lo, hi] "
                "(conformal jackknife+ on the leave-one-bag-out residuals; conditional "
                "models: the conditional quantiles); classifiers: `set`, the conformal "
                "prediction set (CSV: columns interval_lo, interval_hi or set). Every "
                "prediction carries `domain` {score, out_of_range, nearest} whatever is asked."
            ),
        },
        {
            "name": "compensated",
            "in": "query",
            "required": False,
            "schema": {"type": "boolean", "default": False},
            "description": (
                "For models that compensate (see the model's preprocessing): `true` "
                "declares the cells compensated already, so the model's compensation is "
                "skipped (recorded in the audit trail). Without it, a model that uses each "
                "file's own spillover matrix needs FCS uploads."
            ),
        },
        {
            "name": "cells",
            "in": "query",
            "required": False,
            "schema": {"type": "boolean", "default": True},
            "description": (
                "Per-cell models: `false` leaves out the label of every cell; the "
                "`population` summary (count, percent and mean probability per class) "
                "stays (CSV: one row per bag and class; NPY: counts, bags x classes)."
            ),
        },
        {
            "name": "plot",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 0, "maximum": 20000, "default": 0},
            "description": (
                "Per-cell models (JSON): up to this many cells per bag, drawn with a fixed "
                "seed, as the model sees them (compensated, transformed, scaled), with "
                "their labels: `plot` {markers, cells (row numbers), points, labels}. "
                "Bag-level models with `explain=true`: the cells with their contributions."
            ),
        },
        {
            "name": "explain",
            "in": "query",
            "required": False,
            "schema": {"type": "boolean", "default": False},
            "description": (
                "Bag-level models (JSON; FHIR and HL7: one line of text): each prediction "
                "gains `explanation` {method, outputs, n_cells, prediction, baseline, "
                "total, by_marker, top_cells}, which cells moved it: `exact` per-cell "
                "contributions summing to prediction - baseline where the model is linear "
                "in the sample, else each cell's first-order `influence`. With `plot=N`, "
                "`plot` {markers, cells, points, output, contributions} of up to N cells. "
                "With `Accept: application/vnd.isac.fcs` and one bag: that sample's cells "
                "as sent plus a `contribution` channel, as FCS. "
                "The audit trail keeps only its sha256."
            ),
        },
        {
            "name": "probabilities",
            "in": "query",
            "required": False,
            "schema": {"type": "boolean", "default": False},
            "description": (
                "Per-cell classifiers: every cell's calibrated class probabilities (JSON: "
                "`probabilities` {classes, cells}; CSV: columns p_<class>; NPY: cells x "
                "classes). Column order of CSV and NPY: the `Bagserve-Classes` header."
            ),
        },
        {
            "name": "unassigned",
            "in": "query",
            "required": False,
            # No example: the document's examples are sent to every model, and this
            # one applies to per-cell classifiers only.
            "schema": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "description": (
                "Per-cell classifiers: every cell farther from the population it was given "
                "than this chi-square level of Mahalanobis distance (under that "
                "population's training covariance) is answered `unassigned`, a row of its "
                "own in the `population` summary. Not with `probabilities`."
            ),
        },
        {
            "name": "control",
            "in": "query",
            "required": False,
            # No example: it names a bag of the request, and applies to per-cell models
            # trained with a reference control only.
            "schema": {"type": "string", "maxLength": 256},
            "description": (
                "Per-cell models trained with a reference control (`[data] control`): the "
                "id of the request's bag that is this batch's control. Its map (per "
                "marker, its quantiles onto the training control's) is applied to every "
                "other bag before the model answers; each bag's `report.calibration` says "
                "how far it moved each marker and which markers it made worse. The "
                "control gets no answer of its own; a note names it with its sha256."
            ),
        },
        *(
            {
                "name": name,
                "in": "query",
                "required": False,
                "schema": {"type": "string"},
                "example": example,
                "description": (
                    f"FHIR answers (`Accept: application/fhir+json`): the {what} of every "
                    f"Observation, as a reference relative to the FHIR server the bundle is "
                    f"filed on: `{example.split('/')[0]}/<id>` (another type, an absolute URL "
                    "or a `urn:uuid:` is refused)."
                ),
            }
            for name, example, what in (
                ("subject", "Patient/123", "subject (the patient)"),
                ("specimen", "Specimen/9", "specimen (the sample)"),
            )
        ),
        {
            "name": "patient",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "pattern": ID_PATTERN},
            "example": "p-17",
            "description": (
                "HL7 v2 answers (`Accept: application/hl7-v2`) and forwarded jobs: the "
                "patient identifier (PID-3)."
            ),
        },
        {
            "name": "order",
            "in": "query",
            "required": False,
            "schema": {
                "type": "array",
                "items": {"type": "string", "pattern": ID_PATTERN},
                "uniqueItems": True,
            },
            "style": "form",
            "explode": True,
            "example": ["ord-4711"],
            "description": (
                "HL7 v2 answers and forwarded jobs: the placer order number of each bag "
                "(ORC-2, OBR-2), repeated in the bags' order (`order=A&order=B`): a placer "
                "order number names one order, so there are as many as bags, or none "
                "(422 otherwise)."
            ),
        },
        {
            "name": "effective",
            "in": "query",
            "required": False,
            "schema": {"type": "string"},
            "example": "2026-11-25T09:30:00+01:00",
            "description": (
                "FHIR answers: when the sample was taken or measured, a FHIR dateTime (a "
                "date, or a date and time with its zone); every Observation's and the "
                "report's `effectiveDateTime`. Default: the FCS file's acquisition time."
            ),
        },
    ],
}
_IDEMPOTENCY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "maxLength": 255},
    "description": "A retried request with the same key and body gets the stored answer.",
}
_PREDICT_DOC["parameters"].append(_IDEMPOTENCY)
_PREDICT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": (
            "Predictions with provenance (model name, version, sha256; request id; input sha256)."
        ),
        "content": {
            "application/json": {
                "example": {
                    "model": {"name": "demo-dose", "version": "1", "sha256": "3f1c…"},
                    "request_id": "9b2e…",
                    "request_sha256": "a41d…",
                    "warnings": [],
                    "notes": [],
                    "predictions": [
                        {
                            "id": "patient-17",
                            "input_sha256": "5c0e…",
                            "status": "final",
                            "prediction": 1.27,
                            "quantiles": {"0.05": 0.81, "0.95": 1.74},
                            "exceedance": {"1.5": 0.22},
                        }
                    ],
                }
            },
            "text/csv": {
                "schema": {
                    "type": "string",
                    "description": (
                        "The results table every CSV door writes (bagserve predict "
                        "--format csv, bagserve batch): id, the values by the model's kind, "
                        "then status, out_of_range, domain_score, withheld_reason, "
                        "input_sha256, model_sha256, warnings, error. The columns follow "
                        "from the model and the query alone; a withheld bag's value cells "
                        "are empty (docs: lab-integration, the results table)."
                    ),
                },
                "example": (
                    "id,prediction,interval_lo,interval_hi,status,out_of_range,domain_score,"
                    "withheld_reason,input_sha256,model_sha256,warnings,error\n"
                    "patient-1,0.322,0.23,0.40,final,0,0.865,,9f86d0…,a489f9…,,\n"
                ),
            },
            "application/x-npy": {},
            "application/fhir+json": {},
            "application/hl7-v2": {
                "schema": {
                    "type": "string",
                    "description": "one HL7 v2.5.1 ORU^R01 message, segments ended by CR",
                }
            },
            "application/vnd.isac.fcs": {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": (
                        "With explain=true and one bag (bag-level models): an FCS 3.1 file "
                        "of that bag's cells as sent (every column in its order, before "
                        "compensation and transforms, 32-bit floats) plus the channel "
                        "`contribution`, each cell's contribution to the last output, for "
                        "gating in FlowJo or FlowKit; the file `bagserve predict --explain "
                        "--fcs-dir` writes. 406 without explain=true, 422 for several bags."
                    ),
                }
            },
        },
    },
    400: {"description": "a body that cannot be parsed (JSON, multipart, Content-Length)"},
    401: {"description": "missing or invalid API key"},
    **FORBIDDEN,
    404: {"description": "unknown model or version"},
    406: {"description": "unsupported Accept (FCS without explain=true)"},
    413: {
        "description": (
            "the body is over the size limit, or decodes (inflates, or holds cells) beyond "
            "the decoded-size, cell or column limits"
        )
    },
    415: {"description": "unsupported content type or Content-Encoding"},
    422: {"description": "invalid bags or options (every problem listed)"},
    503: {
        "description": (
            "queue full, request bodies waiting over their limit, worker lost, or the "
            "state database unreachable; see Retry-After"
        )
    },
    504: {"description": "prediction timed out"},
}


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
    request: Request, svc: ServicesDep, caller: Caller, entry: ModelEntry
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
                    outcome.result,
                    outcome.ids,
                    fmt,
                    outcome.provenance(caller.request_id),
                    entry.info,
                    options,
                    inputs=outcome.inputs,
                    plots=outcome.plots,
                    explanations=outcome.explanations,
                    refs=refs,
                    acquired=outcome.acquired,
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


@router.post(
    "/models/{name}/predict",
    dependencies=[Depends(require(Role.PREDICT))],
    summary="Predict with the latest version",
    openapi_extra=_PREDICT_DOC,
    responses=_PREDICT_RESPONSES,
)
async def predict_latest(
    request: Request, svc: ServicesDep, caller: CallerDep, entry: LatestEntry
) -> Response:
    """Predict with the model's latest version."""
    return await _predict(request, svc, caller, entry)


@router.post(
    "/models/{name}/versions/{version}/predict",
    dependencies=[Depends(require(Role.PREDICT))],
    summary="Predict with one version",
    openapi_extra=_PREDICT_DOC,
    responses=_PREDICT_RESPONSES,
)
async def predict_version(
    request: Request, svc: ServicesDep, caller: CallerDep, entry: VersionEntry
) -> Response:
    """Predict with one version of the model."""
    return await _predict(request, svc, caller, entry)
