"""Open Inference Protocol (``/v2``) requests to bags, decoded in a worker process.

A bag is an ``[n, d]`` tensor named ``points`` (FP64 or FP32); several bags are their
points concatenated plus an INT64 ``bag_sizes`` tensor; marker names may be given as the
``markers`` parameter (of the request or of the ``points`` input). The binary tensor
extension (``Inference-Header-Content-Length``) is read in place. The request's own
parameters (``interval``, ``compensated``, ``cells``, ``probabilities``) become
:class:`~.options.PredictOptions`, and what the answer needs of the request (its ``id``,
the outputs asked for and whether in binary) is handed back with the prediction.

Like :mod:`.codecs`, this runs in the workers, within :class:`~.codecs.RequestLimits`:
a tensor's declared shape is checked against the point and column limits, and its
float64 size against the decoded-size limit, before it is converted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from bagserve.core.hashing import points_sha256
from bagserve.core.runtime import ModelKind

from .codecs import BodySpec, IncomingBag, RequestLimits, check_json_values, inflate
from .errors import Problem
from .options import PredictOptions

if TYPE_CHECKING:
    from .registry import ModelEntry

__all__ = ["OUTPUTS", "InferenceRequest", "decode_inference"]

_NUMPY = {
    "FP64": np.float64, "FP32": np.float32, "FP16": np.float16,
    "INT64": np.int64, "INT32": np.int32, "INT16": np.int16, "INT8": np.int8,
    "UINT64": np.uint64, "UINT32": np.uint32, "UINT16": np.uint16, "UINT8": np.uint8,
    "BOOL": np.bool_,
}  # fmt: skip

#: Every model's applicability domain, one value per bag, and each bag's status under
#: the model's out-of-domain policy (final, preliminary, withheld).
_DOMAIN_OUTPUTS = [
    {"name": "out_of_range", "datatype": "BOOL", "shape": [-1]},
    {"name": "domain_score", "datatype": "FP64", "shape": [-1]},
    {"name": "status", "datatype": "BYTES", "shape": [-1]},
]
#: With the request parameter ``interval`` (a coverage): the interval of each bag.
_INTERVAL = {"name": "interval", "datatype": "FP64", "shape": [-1, 2]}
#: The outputs of each kind of model, with their datatype and shape.
OUTPUTS: dict[ModelKind, list[dict[str, Any]]] = {
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


@dataclass
class InferenceRequest:
    """A decoded inference request.

    Attributes
    ----------
    bags : list of IncomingBag
    options : PredictOptions
    echo : dict
        What the answer needs: ``id`` (the request's, if any), ``outputs`` (name to
        parameters, empty for all) and ``binary_data_output``.
    """

    bags: list[IncomingBag]
    options: PredictOptions
    echo: dict[str, Any] = field(default_factory=dict)


def _invalid(detail: str, slug: str = "invalid-tensor") -> Problem:
    return Problem(400, detail, slug=slug)


def _tensor(spec: dict[str, Any], binary: bytes | memoryview | None, limits: RequestLimits):
    name = spec.get("name", "?")
    dtype = spec.get("datatype")
    shape = spec.get("shape")
    if dtype not in _NUMPY:
        raise _invalid(f"input {name!r}: unsupported datatype {dtype!r} (numbers and BOOL only)")
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise _invalid(f"input {name!r}: shape must be a list of non-negative integers")
    # Python integers: a declared shape of 2^40 x 2^40 must not wrap around.
    expected = math.prod(shape)
    if expected * 8 > limits.max_decoded_bytes:
        raise Problem(
            413,
            f"input {name!r}: shape {shape} takes {expected * 8} bytes as float64, more than "
            f"the decoded-size limit of {limits.max_decoded_bytes} bytes",
            slug="decoded-too-large",
        )
    if binary is not None:
        array = np.frombuffer(binary, dtype=np.dtype(_NUMPY[dtype]).newbyteorder("<"))
    else:
        data = spec.get("data")
        if data is None:
            raise _invalid(f"input {name!r} has no data")
        try:
            array = np.asarray(data, dtype=_NUMPY[dtype]).reshape(-1)
        except (TypeError, ValueError, OverflowError):
            raise _invalid(f"input {name!r}: data are not {dtype} values") from None
    if array.size != expected:
        raise _invalid(f"input {name!r}: {array.size} value(s) for shape {shape}")
    return array.reshape(shape)


def _parse(
    body: bytes | memoryview, header_length: str | None, limits: RequestLimits
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise _invalid(
                "Inference-Header-Content-Length does not fit the body", slug="invalid-binary"
            )
        n = int(header_length)
        head, rest = body[:n], memoryview(body)[n:]
    else:
        head, rest = body, memoryview(b"")
    check_json_values(head, limits)
    try:
        doc = orjson.loads(head)
    except orjson.JSONDecodeError as exc:
        raise Problem(
            400, f"the inference request is not valid JSON ({exc})", slug="invalid-json"
        ) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise _invalid("the inference request needs a non-empty 'inputs' list", "invalid-request")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for spec in doc["inputs"]:
        if not isinstance(spec, dict):
            raise _invalid("every input must be an object", "invalid-request")
        params = spec.get("parameters") or {}
        if not isinstance(params, dict):
            raise _invalid(f"input {spec.get('name')!r}: parameters must be an object")
        binary = None
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise _invalid(
                    f"input {spec.get('name')!r}: binary_data_size must be a byte count",
                    "invalid-binary",
                )
            binary = rest[offset : offset + size]
            if len(binary) != size:
                raise _invalid(
                    f"input {spec.get('name')!r}: binary data shorter than its size",
                    "invalid-binary",
                )
            offset += size
        tensors[str(spec.get("name"))] = _tensor(spec, binary, limits)
    return doc, tensors


def _options(doc: dict[str, Any], entry: ModelEntry) -> tuple[PredictOptions, dict[str, Any]]:
    """The request's outputs must exist; its ``interval`` parameter is a coverage."""
    outputs = doc.get("outputs") or []
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise _invalid("'outputs' must be a list of objects", "invalid-request")
    wanted = {str(o.get("name")): (o.get("parameters") or {}) for o in outputs}
    available = [o["name"] for o in OUTPUTS[entry.kind]]
    unknown = set(wanted) - set(available)
    if unknown:
        raise _invalid(
            f"unknown output(s) {sorted(unknown)}; available: {sorted(available)}",
            "invalid-request",
        )
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise _invalid("'parameters' must be an object", "invalid-request")
    options = PredictOptions.parse(
        entry, {k: params.get(k) for k in ("interval", "compensated", "cells", "probabilities")}
    )
    request_id = doc.get("id")
    echo = {
        "id": request_id if isinstance(request_id, str) else None,
        "outputs": {
            name: {"binary_data": bool(p.get("binary_data"))} if isinstance(p, dict) else {}
            for name, p in wanted.items()
        },
        "binary_data_output": bool(params.get("binary_data_output")),
    }
    return options, echo


def _bags(doc: dict[str, Any], tensors: dict[str, np.ndarray]) -> list[IncomingBag]:
    if "points" not in tensors:
        raise _invalid(f"no input named 'points' (got {sorted(tensors)})", "invalid-request")
    points = tensors["points"]
    if points.ndim != 2:
        raise _invalid(f"'points' must have shape [n, d], got {list(points.shape)}")
    points = np.ascontiguousarray(points, dtype=np.float64)
    sizes = tensors.get("bag_sizes")
    if sizes is None:
        sizes = np.array([points.shape[0]])
    sizes = np.asarray(sizes).reshape(-1)
    if sizes.dtype.kind not in "iu" or (sizes < 0).any() or int(sizes.sum()) != points.shape[0]:
        raise _invalid(f"'bag_sizes' must be non-negative integers summing to {points.shape[0]}")
    spec = next(s for s in doc["inputs"] if s.get("name") == "points")
    markers = (spec.get("parameters") or {}).get("markers") or (doc.get("parameters") or {}).get(
        "markers"
    )
    if isinstance(markers, str):
        markers = [m.strip() for m in markers.split(",")]
    if markers is not None and (
        not isinstance(markers, list)
        or len(markers) != points.shape[1]
        or not all(isinstance(m, str) for m in markers)
    ):
        raise _invalid(
            f"'markers' must name the {points.shape[1]} columns of 'points'", "invalid-request"
        )
    starts = np.concatenate([[0], np.cumsum(sizes)])
    bags = []
    for i in range(sizes.size):
        cells = points[starts[i] : starts[i + 1]]
        bag = IncomingBag(f"bag-{i}", cells, markers, markers)
        bag.input_sha256 = points_sha256(cells)  # cells sent as numbers: their hash
        bags.append(bag)
    return bags


def decode_inference(
    spec: BodySpec, body: bytes | memoryview, limits: RequestLimits, entry: ModelEntry
) -> InferenceRequest:
    """The bags, options and answer needs of an inference request.

    Raises
    ------
    Problem
        400 for a malformed request (JSON, tensors, unknown outputs), 413 beyond the
        limits, 422 for options the model cannot answer.
    """
    body = inflate(body, spec.content_encoding, limits)
    doc, tensors = _parse(body, spec.header_length, limits)
    options, echo = _options(doc, entry)
    return InferenceRequest(_bags(doc, tensors), options, echo)
