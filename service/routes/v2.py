"""Open Inference Protocol v2 (KServe V2 / Triton / MLServer) over REST.

A bag is an ``[n, d]`` tensor named ``points`` (FP64 or FP32); several bags are their
points concatenated plus an INT64 ``bag_sizes`` tensor; marker names may be given as the
``markers`` parameter (of the request or of the ``points`` input). Outputs: ``prediction``
(one per bag; FP64 or BYTES), ``scores`` for classifiers, and for per-cell models
``labels`` (one per point) and ``out_of_range`` (BOOL, one per bag). The binary tensor
extension is supported both ways (``Inference-Header-Content-Length``). Errors carry
``{"error": ...}`` inside our problem details.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import numpy as np
import orjson
from bagserve.core.runtime import (
    CellPrediction,
    ClassificationPrediction,
    ModelKind,
    Prediction,
)
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from bagserve import __version__

from ..codecs import IncomingBag
from ..deps import CallerDep, LatestEntry, ServicesDep, VersionEntry, authenticate
from ..errors import Problem
from ..prediction import Caller, Outcome, PredictOptions, provenance_headers
from ..registry import ModelEntry
from ..uploads import read_limited

router = APIRouter(prefix="/v2", tags=["v2 (Open Inference Protocol)"])
#: Routes that need an API key (server metadata and health stay open, as in KServe).
models = APIRouter(dependencies=[Depends(authenticate)])

_NUMPY = {
    "FP64": np.float64, "FP32": np.float32, "FP16": np.float16,
    "INT64": np.int64, "INT32": np.int32, "INT16": np.int16, "INT8": np.int8,
    "UINT64": np.uint64, "UINT32": np.uint32, "UINT16": np.uint16, "UINT8": np.uint8,
    "BOOL": np.bool_,
}  # fmt: skip
HEADER_LENGTH = "inference-header-content-length"


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
    """Every worker alive and at least one model served."""
    ok = svc.pool.ready and bool(svc.registry.all())
    return Response(
        orjson.dumps({"ready": ok}), status_code=200 if ok else 503, media_type="application/json"
    )


#: Every model's applicability domain, one value per bag.
_DOMAIN_OUTPUTS = [
    {"name": "out_of_range", "datatype": "BOOL", "shape": [-1]},
    {"name": "domain_score", "datatype": "FP64", "shape": [-1]},
]
#: With the request parameter ``interval`` (a coverage): the interval of each bag.
_INTERVAL = {"name": "interval", "datatype": "FP64", "shape": [-1, 2]}
#: The outputs of each kind of model, with their datatype and shape.
_OUTPUTS: dict[ModelKind, list[dict[str, Any]]] = {
    ModelKind.REGRESSION: [
        {"name": "prediction", "datatype": "FP64", "shape": [-1]},
        *_DOMAIN_OUTPUTS,
        _INTERVAL,
    ],
    ModelKind.CONDITIONAL: [
        {"name": "prediction", "datatype": "FP64", "shape": [-1]},
        *_DOMAIN_OUTPUTS,
        _INTERVAL,
    ],
    ModelKind.CLASSIFICATION: [
        {"name": "prediction", "datatype": "BYTES", "shape": [-1]},
        {"name": "scores", "datatype": "FP64", "shape": [-1, -1]},
        {"name": "probabilities", "datatype": "FP64", "shape": [-1, -1]},
        *_DOMAIN_OUTPUTS,
        # With ``interval``: True where the class (a column) is in the bag's set.
        {"name": "prediction_set", "datatype": "BOOL", "shape": [-1, -1]},
    ],
    ModelKind.CELL: [
        {"name": "labels", "datatype": "BYTES", "shape": [-1]},
        # Classifiers: cells per (bag, class) and the classes' mean probabilities; with
        # the request parameter ``probabilities``: every cell's, columns as the classes.
        {"name": "population_counts", "datatype": "INT64", "shape": [-1, -1]},
        {"name": "population_mean_probability", "datatype": "FP64", "shape": [-1, -1]},
        {"name": "cell_probabilities", "datatype": "FP64", "shape": [-1, -1]},
        *_DOMAIN_OUTPUTS,
    ],
}


def _produced(result: Prediction) -> dict[str, np.ndarray]:
    """The output tensors of a typed result, by name (see :data:`_OUTPUTS`)."""
    if isinstance(result, CellPrediction):
        out = {"labels": result.estimate}
        optional = {
            "population_counts": result.counts,
            "population_mean_probability": result.mean_probabilities,
            "cell_probabilities": result.probabilities,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
    elif isinstance(result, ClassificationPrediction):
        out = {"prediction": result.labels, "scores": result.scores}
        if result.probabilities is not None:
            out["probabilities"] = result.probabilities
    else:
        out = {"prediction": result.estimate}
    if result.domain is not None:
        out.update(out_of_range=result.domain.out_of_range, domain_score=result.domain.score)
    if result.interval is not None:
        out["interval"] = result.interval
    if isinstance(result, ClassificationPrediction) and result.sets is not None:
        out["prediction_set"] = result.sets
    return out


def _trust(outcome: Outcome, entry: ModelEntry) -> dict[str, Any]:
    """The domain report of every bag, as request-level parameters (the tensors carry
    scores and flags; names of the nearest training bags only fit here), and the
    classes that name the columns of the per-class tensors."""
    out: dict[str, Any] = {}
    classes = getattr(outcome.result, "classes", None)
    if classes is not None:
        out["classes"] = [str(c) for c in classes.tolist()]
    domain = outcome.result.domain
    if domain is not None:
        out["domain"] = [entry.info.domain_of(domain, i) for i in range(outcome.result.n_bags)]
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
        "outputs": _OUTPUTS[entry.kind],
        "parameters": {"markers": list(panel.markers) if panel else None, "sha256": entry.sha256},
    }


@models.get("/models/{name}", summary="Model metadata")
async def model_metadata(svc: ServicesDep, entry: LatestEntry) -> dict[str, Any]:
    """Inputs, outputs, versions and panel of the model's latest version."""
    return _metadata(svc, entry)


@models.get("/models/{name}/versions/{version}", summary="Model version metadata")
async def model_version_metadata(svc: ServicesDep, entry: VersionEntry) -> dict[str, Any]:
    """Inputs, outputs, versions and panel of one version."""
    return _metadata(svc, entry)


def _model_ready(svc: ServicesDep, entry: ModelEntry) -> Response:
    ok = svc.pool.ready
    return Response(
        orjson.dumps({"name": entry.name, "ready": ok}),
        status_code=200 if ok else 503,
        media_type="application/json",
    )


@models.get("/models/{name}/ready", summary="Model ready")
async def model_ready(svc: ServicesDep, entry: LatestEntry) -> Response:
    """The model is served and every worker is alive."""
    return _model_ready(svc, entry)


@models.get("/models/{name}/versions/{version}/ready", summary="Model version ready")
async def model_version_ready(svc: ServicesDep, entry: VersionEntry) -> Response:
    """The version is served and every worker is alive."""
    return _model_ready(svc, entry)


def _tensor(spec: dict[str, Any], binary: bytes | None) -> np.ndarray:
    name = spec.get("name", "?")
    dtype = spec.get("datatype")
    shape = spec.get("shape")
    if dtype not in _NUMPY:
        raise Problem(
            400,
            f"input {name!r}: unsupported datatype {dtype!r} (numbers and BOOL only)",
            slug="invalid-tensor",
        )
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise Problem(
            400,
            f"input {name!r}: shape must be a list of non-negative integers",
            slug="invalid-tensor",
        )
    if binary is not None:
        array = np.frombuffer(binary, dtype=np.dtype(_NUMPY[dtype]).newbyteorder("<"))
    else:
        data = spec.get("data")
        if data is None:
            raise Problem(400, f"input {name!r} has no data", slug="invalid-tensor")
        try:
            array = np.asarray(data, dtype=_NUMPY[dtype]).reshape(-1)
        except (TypeError, ValueError):
            raise Problem(
                400, f"input {name!r}: data are not {dtype} values", slug="invalid-tensor"
            ) from None
    expected = int(np.prod(shape)) if shape else 1
    if array.size != expected:
        raise Problem(
            400, f"input {name!r}: {array.size} value(s) for shape {shape}", slug="invalid-tensor"
        )
    return array.reshape(shape)


def _parse(body: bytes, header_length: str | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise Problem(
                400, "Inference-Header-Content-Length does not fit the body", slug="invalid-binary"
            )
        n = int(header_length)
        head, rest = body[:n], body[n:]
    else:
        head, rest = body, b""
    try:
        doc = orjson.loads(head)
    except orjson.JSONDecodeError as exc:
        raise Problem(
            400, f"the inference request is not valid JSON ({exc})", slug="invalid-json"
        ) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise Problem(
            400, "the inference request needs a non-empty 'inputs' list", slug="invalid-request"
        )
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for spec in doc["inputs"]:
        if not isinstance(spec, dict):
            raise Problem(400, "every input must be an object", slug="invalid-request")
        params = spec.get("parameters") or {}
        binary = None
        if "binary_data_size" in params:
            size = int(params["binary_data_size"])
            binary = rest[offset : offset + size]
            if len(binary) != size:
                raise Problem(
                    400,
                    f"input {spec.get('name')!r}: binary data shorter than its size",
                    slug="invalid-binary",
                )
            offset += size
        tensors[str(spec.get("name"))] = _tensor(spec, binary)
    return doc, tensors


def _options(doc: dict[str, Any], entry: ModelEntry) -> PredictOptions:
    """The request's outputs must exist; its ``interval`` parameter is a coverage."""
    wanted = {o.get("name") for o in doc.get("outputs") or []}
    available = [o["name"] for o in _OUTPUTS[entry.kind]]
    unknown = wanted - set(available)
    if unknown:
        raise Problem(
            400,
            f"unknown output(s) {sorted(unknown)}; available: {sorted(available)}",
            slug="invalid-request",
        )
    params = doc.get("parameters") or {}
    return PredictOptions.parse(
        entry, {k: params.get(k) for k in ("interval", "compensated", "cells", "probabilities")}
    )


def _bags(doc: dict[str, Any], tensors: dict[str, np.ndarray]) -> list[IncomingBag]:
    if "points" not in tensors:
        raise Problem(
            400, f"no input named 'points' (got {sorted(tensors)})", slug="invalid-request"
        )
    points = tensors["points"]
    if points.ndim != 2:
        raise Problem(
            400, f"'points' must have shape [n, d], got {list(points.shape)}", slug="invalid-tensor"
        )
    points = np.ascontiguousarray(points, dtype=np.float64)
    sizes = tensors.get("bag_sizes")
    if sizes is None:
        sizes = np.array([points.shape[0]])
    sizes = np.asarray(sizes).reshape(-1)
    if sizes.dtype.kind not in "iu" or (sizes < 0).any() or int(sizes.sum()) != points.shape[0]:
        raise Problem(
            400,
            f"'bag_sizes' must be non-negative integers summing to {points.shape[0]}",
            slug="invalid-tensor",
        )
    spec = next(s for s in doc["inputs"] if s.get("name") == "points")
    markers = (spec.get("parameters") or {}).get("markers") or (doc.get("parameters") or {}).get(
        "markers"
    )
    if isinstance(markers, str):
        markers = [m.strip() for m in markers.split(",")]
    if markers is not None and (not isinstance(markers, list) or len(markers) != points.shape[1]):
        raise Problem(
            400,
            f"'markers' must name the {points.shape[1]} columns of 'points'",
            slug="invalid-request",
        )
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [
        IncomingBag(f"bag-{i}", points[starts[i] : starts[i + 1]], markers, markers)
        for i in range(sizes.size)
    ]


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


async def _infer(request: Request, svc: ServicesDep, caller: Caller, entry: ModelEntry) -> Response:
    """Decode tensors → predict → encode tensors."""
    t0 = time.perf_counter()
    body = await read_limited(request, svc.settings.max_body_bytes)
    timings = {"read": time.perf_counter() - t0}
    # The document is parsed here, before the use-case, because it also carries the
    # options (``interval``); a problem in it is raised inside the use-case, so that
    # it is audited like any other.
    t1 = time.perf_counter()
    try:
        doc, tensors = _parse(body, request.headers.get(HEADER_LENGTH))
        options = _options(doc, entry)
        problem = None
    except Problem as exc:
        problem = exc
    timings["parse"] = time.perf_counter() - t1

    async def decode() -> tuple[list[IncomingBag], list[str]]:
        if problem is not None:
            raise problem
        return _bags(doc, tensors), []

    outcome = await svc.predictor.run(
        caller, entry, body, decode, PredictOptions() if problem else options, timings=timings
    )
    wanted = {o.get("name"): (o.get("parameters") or {}) for o in doc.get("outputs") or []}
    binary_all = bool((doc.get("parameters") or {}).get("binary_data_output"))
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
        "id": doc.get("id", caller.request_id),
        "parameters": {
            "request_id": caller.request_id,
            "input_sha256": outcome.input_sha256,
            "model_sha256": entry.sha256,
            "bag_sizes": outcome.sizes,
            "warnings": outcome.warnings,
            **_trust(outcome, entry),
        },
        "outputs": outputs,
    }
    head = orjson.dumps(answer)
    headers = provenance_headers(entry, outcome.input_sha256)
    warning = outcome.warning_header()
    if warning is not None:
        headers["Warning"] = warning
    if blobs:
        headers["Inference-Header-Content-Length"] = str(len(head))
        return Response(
            head + b"".join(blobs), media_type="application/octet-stream", headers=headers
        )
    return Response(head, media_type="application/json", headers=headers)


@models.post("/models/{name}/infer", summary="Inference")
async def infer(
    request: Request, svc: ServicesDep, caller: CallerDep, entry: LatestEntry
) -> Response:
    """Predict with the model's latest version (Open Inference Protocol)."""
    return await _infer(request, svc, caller, entry)


@models.post("/models/{name}/versions/{version}/infer", summary="Inference with one version")
async def infer_version(
    request: Request, svc: ServicesDep, caller: CallerDep, entry: VersionEntry
) -> Response:
    """Predict with one version of the model (Open Inference Protocol)."""
    return await _infer(request, svc, caller, entry)


router.include_router(models)
