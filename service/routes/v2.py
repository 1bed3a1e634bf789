"""Open Inference Protocol v2 (KServe V2 / Triton / MLServer) over REST.

A bag is an ``[n, d]`` tensor named ``points`` (FP64 or FP32); several bags are their
points concatenated plus an INT64 ``bag_sizes`` tensor; marker names may be given as the
``markers`` parameter (of the request or of the ``points`` input). Outputs: ``prediction``
(one per bag; FP64 or BYTES), ``scores`` for classifiers, and for per-cell models
``labels`` (one per point) and ``out_of_range`` (BOOL, one per bag). The binary tensor
extension is supported both ways (``Inference-Header-Content-Length``). Errors carry
``{"error": ...}`` inside our problem details. The request document is decoded in a
worker process (:mod:`..tensors`), like every other body.
"""

from __future__ import annotations

import functools
import struct
import time
from typing import Any

import numpy as np
import orjson
from bagserve.core.results import CellPrediction, ClassificationPrediction, Prediction
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from bagserve import __version__

from ..deps import (
    FORBIDDEN,
    CallerDep,
    ServicesDep,
    authenticate,
    require,
)
from ..encoders import encode_off_loop, server_timing
from ..prediction import Caller, Outcome, provenance_headers
from ..registry import ModelEntry
from ..security import Role
from ..tensors import OUTPUTS
from ..uploads import body_spec, check_encoding
from .twins import Twin, add_twins

router = APIRouter(prefix="/v2", tags=["v2 (Open Inference Protocol)"])
#: Routes that need an API key (server metadata and health stay open, as in KServe).
models = APIRouter(dependencies=[Depends(authenticate)])


@router.get("", summary="Server metadata")
async def server_metadata() -> dict[str, Any]:
    """Name, version and extensions of the server."""
    return {"name": "bagserve", "version": __version__, "extensions": ["binary_tensor_data"]}


@router.get("/health/live", summary="Server live")
async def live() -> dict[str, bool]:
    """The process answers."""
    return {"live": True}


@router.get("/health/ready", summary="Server ready", responses={503: {"description": "not ready"}})
async def ready(svc: ServicesDep) -> Response:
    """Every worker alive, every model loaded in each, and at least one served."""
    ok = svc.pool.ready and bool(svc.registry.all()) and not svc.repository.loading()
    return Response(
        orjson.dumps({"ready": ok}), status_code=200 if ok else 503, media_type="application/json"
    )


def _produced(result: Prediction) -> dict[str, np.ndarray]:
    """The output tensors of a typed result, by name (see :data:`OUTPUTS`). A bag
    withheld by the model's out-of-domain policy has NaN values (empty labels, false
    set memberships, zero counts) in every per-bag and per-cell tensor; its ``status``
    says why there is nothing."""
    withheld = np.array([not result.released(i) for i in range(result.n_bags)], dtype=bool)
    return _tensors(result, withheld)


def _masked(values: np.ndarray | None, rows: np.ndarray) -> np.ndarray | None:
    """``values`` with ``rows`` (a withheld bag's, or its cells') emptied."""
    if values is None or not rows.any():
        return values
    values = np.array(values, copy=True)
    kind = values.dtype.kind
    values[rows] = "" if kind in "US" else False if kind == "b" else 0 if kind in "iu" else np.nan
    return values


def _trust_tensors(result: Prediction, withheld: np.ndarray) -> dict[str, np.ndarray]:
    """Every kind's status, domain and interval tensors."""
    out = {"status": np.array([result.status_of(i) for i in range(result.n_bags)])}
    if result.domain is not None:
        out.update(out_of_range=result.domain.out_of_range, domain_score=result.domain.score)
    if result.interval is not None:
        out["interval"] = _masked(result.interval, withheld)  # type: ignore[assignment]
    return out


@functools.singledispatch
def _tensors(result: Prediction, withheld: np.ndarray) -> dict[str, np.ndarray]:
    """The output tensors by the kind of the result, in the order they are answered:
    here the estimate, then the trust tensors."""
    out = {"prediction": _masked(result.estimate, withheld)}
    return {**out, **_trust_tensors(result, withheld)}  # type: ignore[dict-item]


@_tensors.register
def _(result: CellPrediction, withheld: np.ndarray) -> dict[str, np.ndarray]:
    cells = np.repeat(withheld, result.sizes)
    out = {"labels": _masked(result.estimate, cells)}
    optional = {
        "population_counts": _masked(result.counts, withheld),
        "population_mean_probability": _masked(result.mean_probabilities, withheld),
        "cell_probabilities": _masked(result.probabilities, cells),
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return {**out, **_trust_tensors(result, withheld)}  # type: ignore[dict-item]


@_tensors.register
def _(result: ClassificationPrediction, withheld: np.ndarray) -> dict[str, np.ndarray]:
    out = {
        "prediction": _masked(result.labels, withheld),
        "scores": _masked(result.scores, withheld),
    }
    if result.probabilities is not None:
        out["probabilities"] = _masked(result.probabilities, withheld)
    out.update(_trust_tensors(result, withheld))
    if result.sets is not None:
        out["prediction_set"] = _masked(result.sets, withheld)
    return out  # type: ignore[return-value]


def _trust(outcome: Outcome, entry: ModelEntry) -> dict[str, Any]:
    """The domain report of every bag, as request-level parameters (the tensors carry
    scores and flags; names of the nearest training bags only fit here), the classes
    that name the columns of the per-class tensors, and with the request parameter
    ``explain`` each bag's explanation."""
    out: dict[str, Any] = {}
    classes = getattr(outcome.result, "classes", None)
    if classes is not None:
        out["classes"] = [str(c) for c in classes.tolist()]
    domain = outcome.result.domain
    if domain is not None:
        out["domain"] = [entry.info.domain_of(domain, i) for i in range(outcome.result.n_bags)]
    if outcome.explanations is not None:
        # With the parameter explain: each bag's explanation (none for a withheld bag).
        released = outcome.result.released
        out["explanations"] = [
            e if released(i) else None for i, e in enumerate(outcome.explanations)
        ]
    return out


def _metadata(svc: ServicesDep, entry: ModelEntry) -> dict[str, Any]:
    panel = entry.panel
    return {
        "name": entry.name,
        "versions": [e.version for e in svc.registry.versions(entry.name)],
        "platform": "bagserve",
        "inputs": [
            {"name": "points", "datatype": "FP64", "shape": [-1, entry.n_features]},
            {"name": "bag_sizes", "datatype": "INT64", "shape": [-1]},
        ],
        "outputs": OUTPUTS[entry.kind],
        "parameters": {"markers": list(panel.markers) if panel else None, "sha256": entry.sha256},
    }


add_twins(
    models,
    "GET",
    "/models/{name}",
    _metadata,
    latest=Twin(
        "model_metadata",
        "Model metadata",
        "Inputs, outputs, versions and panel of the model's latest version.",
    ),
    version=Twin(
        "model_version_metadata",
        "Model version metadata",
        "Inputs, outputs, versions and panel of one version.",
    ),
)


def _model_ready(svc: ServicesDep, entry: ModelEntry) -> Response:
    # Loaded in every running worker: its requests are computed (not 503 model-loading).
    ok = svc.pool.serves(svc.repository.id_of(entry))
    return Response(
        orjson.dumps({"name": entry.name, "ready": ok}),
        status_code=200 if ok else 503,
        media_type="application/json",
    )


add_twins(
    models,
    "GET",
    "/models/{name}/ready",
    _model_ready,
    latest=Twin(
        "model_ready",
        "Model ready",
        "The model's latest version is loaded in every running worker (while the server\n"
        "starts, each model is ready as soon as it is loaded).",
    ),
    version=Twin(
        "model_version_ready",
        "Model version ready",
        "The version is loaded in every running worker.",
    ),
)


def _output(name: str, array: np.ndarray, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    array = np.asarray(array)
    if array.dtype.kind in "US":
        values = [str(v) for v in array.reshape(-1)]
        if binary:
            raw = b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)
            return {
                "name": name,
                "datatype": "BYTES",
                "shape": list(array.shape),
                "parameters": {"binary_data_size": len(raw)},
            }, raw
        return {"name": name, "datatype": "BYTES", "shape": list(array.shape), "data": values}, None
    dtype = {"b": "BOOL", "i": "INT64", "u": "UINT64"}.get(array.dtype.kind, "FP64")
    array = array.astype(
        {"BOOL": np.bool_, "INT64": np.int64, "UINT64": np.uint64, "FP64": np.float64}[dtype]
    )
    if binary:
        raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
        return {
            "name": name,
            "datatype": dtype,
            "shape": list(array.shape),
            "parameters": {"binary_data_size": len(raw)},
        }, raw
    return {
        "name": name,
        "datatype": dtype,
        "shape": list(array.shape),
        "data": array.reshape(-1).tolist(),
    }, None


async def _infer(
    request: Request, svc: ServicesDep, caller: CallerDep, entry: ModelEntry
) -> Response:
    """Read the body, predict on a worker (which decodes the tensors), encode tensors."""
    check_encoding(request)
    spec = body_spec(request, protocol="v2")
    async with svc.intake.body(request) as received:
        outcome = await svc.predictor.run(
            caller,
            entry,
            received.data,
            spec,
            lent=received.lent,
            timings={"read": received.seconds},
        )
    t1 = time.perf_counter()
    echo = outcome.echo or {}
    head, blobs = await encode_off_loop(outcome.result, _answer, outcome, entry, caller, echo)
    timings = {**outcome.timings, "encode": time.perf_counter() - t1}
    svc.metrics.observe_stages({"encode": timings["encode"]})
    headers = provenance_headers(entry, outcome)
    headers["Server-Timing"] = server_timing(timings)
    warning = outcome.warning_header()
    if warning is not None:
        headers["Warning"] = warning
    if blobs:
        headers["Inference-Header-Content-Length"] = str(len(head))
        return Response(
            head + b"".join(blobs), media_type="application/octet-stream", headers=headers
        )
    return Response(head, media_type="application/json", headers=headers)


def _answer(
    outcome: Outcome, entry: ModelEntry, caller: Caller, echo: dict[str, Any]
) -> tuple[bytes, list[bytes]]:
    """The inference answer's JSON head and its binary tensors, if any."""
    wanted = echo.get("outputs") or {}
    binary_all = bool(echo.get("binary_data_output"))
    produced = _produced(outcome.result)
    outputs, blobs = [], []
    for n in produced:
        if wanted and n not in wanted:
            continue
        spec, raw = _output(
            n, produced[n], binary_all or bool(wanted.get(n, {}).get("binary_data"))
        )
        outputs.append(spec)
        if raw is not None:
            blobs.append(raw)
    answer = {
        "model_name": entry.name,
        "model_version": entry.version,
        "id": echo.get("id") or caller.request_id,
        "parameters": {
            "request_id": caller.request_id,
            "request_sha256": outcome.request_sha256,
            "input_sha256": outcome.inputs,
            "model_sha256": entry.sha256,
            "bag_sizes": outcome.sizes,
            "status": [outcome.result.status_of(i) for i in range(outcome.result.n_bags)],
            "warnings": outcome.warnings,
            "notes": outcome.notes,
            **_trust(outcome, entry),
        },
        "outputs": outputs,
    }
    return orjson.dumps(answer), blobs


_TENSOR_IN: dict[str, Any] = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": {"type": "string", "description": "`points` ([n, d]) or `bag_sizes` ([bags])"},
        "datatype": {"type": "string", "enum": ["FP64", "FP32", "INT64", "INT32"]},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "parameters": {
            "type": "object",
            "properties": {
                "markers": {"type": "array", "items": {"type": "string"}},
                "binary_data_size": {"type": "integer", "minimum": 0},
            },
        },
        "data": {"type": "array", "items": {}},
    },
}
_INFER_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": (
            "An Open Inference Protocol request: the tensor `points` ([n, d], the bags' "
            "cells one after another) and, for several bags, `bag_sizes`; marker names in "
            "the `markers` parameter. With the binary tensor extension the body is "
            "`application/octet-stream`: the JSON header (Inference-Header-Content-Length "
            "bytes) and then the tensors' bytes. `Content-Encoding: gzip` is accepted."
        ),
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["inputs"],
                    "properties": {
                        "id": {"type": "string"},
                        "inputs": {"type": "array", "minItems": 1, "items": _TENSOR_IN},
                        "outputs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "parameters": {"type": "object"},
                                },
                            },
                        },
                        "parameters": {"type": "object"},
                    },
                },
                "example": {
                    "id": "patient-17",
                    "inputs": [
                        {
                            "name": "points",
                            "datatype": "FP64",
                            "shape": [3, 3],
                            "parameters": {"markers": ["FSC-A", "SSC-A", "GFP"]},
                            "data": [2.1, 1.0, 0.3, 1.7, 0.8, 1.9, 2.4, 1.3, 0.1],
                        }
                    ],
                },
            },
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    },
}
_INFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the output tensors, with the domain report among the parameters",
        "content": {"application/json": {}, "application/octet-stream": {}},
    },
    400: {"description": "a malformed inference request (JSON, tensors, unknown outputs)"},
    **FORBIDDEN,
    404: {"description": "unknown model or version"},
    413: {"description": "over the body, decoded-size, cell or column limits"},
    415: {"description": "unsupported Content-Encoding"},
    422: {"description": "invalid bags or parameters (every problem listed)"},
    503: {"description": "queue full, worker lost or database unreachable; see Retry-After"},
    504: {"description": "prediction timed out"},
}


add_twins(
    models,
    "POST",
    "/models/{name}/infer",
    _infer,
    latest=Twin(
        "infer", "Inference", "Predict with the model's latest version (Open Inference Protocol)."
    ),
    version=Twin(
        "infer_version",
        "Inference with one version",
        "Predict with one version of the model (Open Inference Protocol).",
    ),
    dependencies=[Depends(require(Role.PREDICT))],
    openapi_extra=_INFER_DOC,
    responses=_INFER_RESPONSES,
)


router.include_router(models)
