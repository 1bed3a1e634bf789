"""Native API: list models, describe one, predict."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..errors import Problem
from ..idempotency import fingerprint
from ..predict import predict, predict_body, read_body
from ..registry import ModelEntry

router = APIRouter(prefix="/v1", tags=["v1"])

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
            "or one file as the body (NPY with `?markers=`, CSV/TSV with a header, FCS), "
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
            "example": "0.05,0.5,0.95",
            "description": (
                "Conditional models (ConditionalMeanEmbedding) only: comma-separated levels "
                "in [0, 1]; each prediction gains `quantiles` {level: value} of the outcome's "
                "predicted distribution (CSV: columns q_<level>; NPY: columns after the mean)."
            ),
        },
        {
            "name": "exceed",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "pattern": r"^[0-9.eE+-]+(,[0-9.eE+-]+)*$"},
            "example": "2.5",
            "description": (
                "Conditional models only: comma-separated thresholds t; each prediction gains "
                "`exceedance` {t: P(outcome > t)} (CSV: columns p_gt_<t>; NPY: last columns)."
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
                    "input_sha256": "a41d…",
                    "warnings": [],
                    "predictions": [
                        {
                            "id": "patient-17",
                            "prediction": 1.27,
                            "quantiles": {"0.05": 0.81, "0.95": 1.74},
                            "exceedance": {"1.5": 0.22},
                        }
                    ],
                }
            },
            "text/csv": {},
            "application/x-npy": {},
        },
    },
    401: {"description": "missing or invalid API key"},
    404: {"description": "unknown model or version"},
    406: {"description": "unsupported Accept"},
    413: {"description": "body over the limit"},
    415: {"description": "unsupported content type"},
    422: {"description": "invalid bags (every problem listed)"},
    503: {"description": "queue full or worker lost; see Retry-After"},
    504: {"description": "prediction timed out"},
}


def _entry(request: Request, name: str, version: str | None) -> ModelEntry:
    registry = request.app.state.registry
    entry = registry.get(name, version)
    if entry is None:
        known = sorted(registry.entries)
        if name in registry.entries:
            versions = [e.version for e in registry.versions(name)]
            raise Problem(
                404,
                f"model {name!r} has no version {version!r} (versions: {versions})",
                slug="unknown-version",
            )
        raise Problem(404, f"unknown model {name!r} (models: {known})", slug="unknown-model")
    return entry


@router.get("/models", summary="Every served model with its versions")
async def list_models(request: Request) -> dict[str, Any]:
    request.app.state.auth.check(request)
    registry = request.app.state.registry
    return {
        "models": [
            {"name": name, "versions": [e.describe() for e in registry.versions(name)]}
            for name in sorted(registry.entries)
        ],
        "failures": registry.failures,
    }


@router.get("/models/{name}", summary="One model: versions, estimator, panel, metrics, sha256")
async def get_model(request: Request, name: str) -> dict[str, Any]:
    request.app.state.auth.check(request)
    entry = _entry(request, name, None)
    registry = request.app.state.registry
    return {
        "name": entry.name,
        "latest": entry.version,
        "versions": [e.describe() for e in registry.versions(name)],
    }


async def _predict(request: Request, name: str, version: str | None) -> Response:
    request.state.key_id = request.app.state.auth.check(request)
    entry = _entry(request, name, version)
    key = request.headers.get("idempotency-key")
    if key is None:
        return await predict(request, entry)
    body, lent = await read_body(request, request.app.state.settings.max_body_bytes)
    try:
        return await request.app.state.idempotency.run(
            key, fingerprint(request, body), lambda: predict_body(request, entry, body, lent)
        )
    finally:
        if lent is not None:
            request.app.state.pool.buffers.give_back(lent)


@router.post(
    "/models/{name}/predict",
    summary="Predict with the latest version",
    openapi_extra=_PREDICT_DOC,
    responses=_PREDICT_RESPONSES,
)
async def predict_latest(request: Request, name: str) -> Response:
    return await _predict(request, name, None)


@router.post(
    "/models/{name}/versions/{version}/predict",
    summary="Predict with one version",
    openapi_extra=_PREDICT_DOC,
    responses=_PREDICT_RESPONSES,
)
async def predict_version(request: Request, name: str, version: str) -> Response:
    return await _predict(request, name, version)
