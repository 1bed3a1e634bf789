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

import hashlib
import struct
import time
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from bagserve import __version__

from ..codecs import IncomingBag
from ..errors import Problem
from ..predict import audit, compute, provenance_headers, read_limited
from .v1 import _entry

router = APIRouter(prefix="/v2", tags=["v2 (Open Inference Protocol)"])

_NUMPY = {
    "FP64": np.float64, "FP32": np.float32, "FP16": np.float16,
    "INT64": np.int64, "INT32": np.int32, "INT16": np.int16, "INT8": np.int8,
    "UINT64": np.uint64, "UINT32": np.uint32, "UINT16": np.uint16, "UINT8": np.uint8,
    "BOOL": np.bool_,
}  # fmt: skip
HEADER_LENGTH = "inference-header-content-length"


@router.get("", summary="Server metadata")
async def server_metadata() -> dict[str, Any]:
    return {"name": "bagserve", "version": __version__, "extensions": ["binary_tensor_data"]}


@router.get("/health/live", summary="Server live")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready", summary="Server ready", responses={503: {"description": "not ready"}})
async def ready(request: Request) -> Response:
    ok = request.app.state.pool.ready and bool(request.app.state.registry.all())
    return Response(
        orjson.dumps({"ready": ok}), status_code=200 if ok else 503, media_type="application/json"
    )


def _metadata(request: Request, name: str, version: str | None) -> dict[str, Any]:
    request.app.state.auth.check(request)
    entry = _entry(request, name, version)
    panel = entry.panel
    outputs = [
        {
            "name": "prediction",
            "datatype": "BYTES" if entry.kind == "classification" else "FP64",
            "shape": [-1],
        }
    ]
    if entry.kind == "classification":
        outputs.append({"name": "scores", "datatype": "FP64", "shape": [-1, -1]})
    if entry.kind == "cell":
        outputs = [
            {"name": "labels", "datatype": "BYTES", "shape": [-1]},
            {"name": "out_of_range", "datatype": "BOOL", "shape": [-1]},
        ]
    return {
        "name": entry.name,
        "versions": [e.version for e in request.app.state.registry.versions(entry.name)],
        "platform": "bagserve",
        "inputs": [
            {"name": "points", "datatype": "FP64", "shape": [-1, entry.n_features]},
            {"name": "bag_sizes", "datatype": "INT64", "shape": [-1]},
        ],
        "outputs": outputs,
        "parameters": {"markers": list(panel.markers) if panel else None, "sha256": entry.sha256},
    }


@router.get("/models/{name}", summary="Model metadata")
async def model_metadata(request: Request, name: str) -> dict[str, Any]:
    return _metadata(request, name, None)


@router.get("/models/{name}/versions/{version}", summary="Model version metadata")
async def model_version_metadata(request: Request, name: str, version: str) -> dict[str, Any]:
    return _metadata(request, name, version)


async def _model_ready(request: Request, name: str, version: str | None) -> Response:
    request.app.state.auth.check(request)
    _entry(request, name, version)
    ok = request.app.state.pool.ready
    return Response(
        orjson.dumps({"name": name, "ready": ok}),
        status_code=200 if ok else 503,
        media_type="application/json",
    )


@router.get("/models/{name}/ready", summary="Model ready")
async def model_ready(request: Request, name: str) -> Response:
    return await _model_ready(request, name, None)


@router.get("/models/{name}/versions/{version}/ready", summary="Model version ready")
async def model_version_ready(request: Request, name: str, version: str) -> Response:
    return await _model_ready(request, name, version)


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


async def _infer(request: Request, name: str, version: str | None) -> Response:
    request.state.key_id = request.app.state.auth.check(request)
    entry = _entry(request, name, version)
    t0 = time.perf_counter()
    body = await read_limited(request, request.app.state.settings.max_body_bytes)
    timings = {"read": time.perf_counter() - t0}
    input_sha = hashlib.sha256(body).hexdigest()
    status, outcome = 500, None
    try:
        t1 = time.perf_counter()
        doc, tensors = _parse(body, request.headers.get(HEADER_LENGTH))
        bags = _bags(doc, tensors)
        timings["parse"] = time.perf_counter() - t1
        outcome = await compute(request.app, entry, bags, [], timings)
        wanted = {o.get("name"): (o.get("parameters") or {}) for o in doc.get("outputs") or []}
        binary_all = bool((doc.get("parameters") or {}).get("binary_data_output"))
        if entry.kind == "cell":
            produced = {"labels": outcome.arrays[0], "out_of_range": outcome.arrays[1]}
        elif entry.kind == "classification":
            produced = {"prediction": outcome.arrays[0], "scores": outcome.arrays[1]}
        else:
            produced = {"prediction": outcome.arrays[0]}
        names = [n for n in produced if not wanted or n in wanted]
        unknown = set(wanted) - set(produced)
        if unknown:
            raise Problem(
                400,
                f"unknown output(s) {sorted(unknown)}; available: {sorted(produced)}",
                slug="invalid-request",
            )
        outputs, blobs = [], []
        for n in names:
            spec, raw = _output(
                n, produced[n], binary_all or bool(wanted.get(n, {}).get("binary_data"))
            )
            outputs.append(spec)
            if raw is not None:
                blobs.append(raw)
        answer = {
            "model_name": entry.name,
            "model_version": entry.version,
            "id": doc.get("id", request.state.request_id),
            "parameters": {
                "request_id": request.state.request_id,
                "input_sha256": input_sha,
                "model_sha256": entry.sha256,
                "bag_sizes": outcome.sizes,
                "warnings": outcome.warnings,
            },
            "outputs": outputs,
        }
        head = orjson.dumps(answer)
        headers = provenance_headers(entry, input_sha)
        status = 200
        if blobs:
            headers["Inference-Header-Content-Length"] = str(len(head))
            return Response(
                head + b"".join(blobs), media_type="application/octet-stream", headers=headers
            )
        return Response(head, media_type="application/json", headers=headers)
    except Problem as exc:
        status = exc.status
        raise
    finally:
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.observe_stages(timings)
        audit(request, entry, input_sha, status, outcome if status == 200 else None)


@router.post("/models/{name}/infer", summary="Inference")
async def infer(request: Request, name: str) -> Response:
    return await _infer(request, name, None)


@router.post("/models/{name}/versions/{version}/infer", summary="Inference with one version")
async def infer_version(request: Request, name: str, version: str) -> Response:
    return await _infer(request, name, version)
