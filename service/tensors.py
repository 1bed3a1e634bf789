"""Open Inference Protocol (``/v2``) requests to bags, decoded in a worker process.

A bag is an ``[n, d]`` tensor named ``points`` (FP64 or FP32); several bags are their
points concatenated plus an INT64 ``bag_sizes`` tensor; marker names may be given as the
``markers`` parameter (of the request or of the ``points`` input). The binary tensor
extension (``Inference-Header-Content-Length``) is read in place. The request's own
parameters (``interval``, ``compensated``, ``cells``, ``probabilities``, ``explain``) become
:class:`~.options.PredictOptions`, and what the answer needs of the request (its ``id``,
the outputs asked for and whether in binary) is handed back with the prediction.

A plain JSON document (float tensors' data flat or as rows of one length, no
repeated key, no ``[`` inside a string) is read by simdjson, its float data straight
into float64 buffers without a Python object per number (a 10^5 x 3 bag: about 15 ms
instead of about 70 ms for ``orjson.loads`` and ``np.asarray``); any other document,
including every invalid one, goes through orjson, whose path writes the error
messages. Both give the same arrays, bit for bit, and the same checks follow.

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
import simdjson
from bagserve.core.hashing import points_sha256
from bagserve.core.results import ModelKind

from .codecs import (
    BodySpec,
    IncomingBag,
    RequestLimits,
    check_json_values,
    inflate,
    simdjson_document,
)
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


def _json_type(value: Any) -> str:
    """What a JSON value is, in words, for a message."""
    if value is None or isinstance(value, bool):
        return orjson.dumps(value).decode()
    if isinstance(value, int | float):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), "a value")


def _optional_object(value: Any, where: str) -> dict[str, Any]:
    """An optional object (``parameters``): absent or null is empty, anything else but
    an object is refused (an empty list or ``false`` is not "no parameters")."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _invalid(f"{where} must be an object, got {_json_type(value)}", "invalid-request")
    return value


def _optional_flag(params: dict[str, Any], key: str, where: str) -> bool:
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise _invalid(
            f"{where}{key} must be true or false, got {_json_type(value)}", "invalid-request"
        )
    return bool(value)


#: The kinds of values (as numpy reads the JSON) each kind of datatype takes: no
#: integers from fractions (numpy would truncate them), no numbers from strings or
#: booleans (it would convert them).
_DATA_KINDS = {"f": "iuf", "i": "iu", "u": "iu", "b": "b"}


def _values(data: Any, dtype: str, where: str) -> np.ndarray:
    """The JSON ``data`` of a tensor as a flat array of ``dtype``."""
    if isinstance(data, _Numbers):
        return data.values.astype(_NUMPY[dtype], copy=False)
    if not isinstance(data, list):
        raise _invalid(f"{where}: data must be a list of {dtype} values, got {_json_type(data)}")
    target = np.dtype(_NUMPY[dtype])
    what = "booleans" if target.kind == "b" else "integers" if target.kind in "iu" else "numbers"
    problem = _invalid(
        f"{where}: data must be {what} for {dtype} (a list, possibly nested, of one shape)"
    )
    try:
        # Read as the JSON gives them first, so that strings and objects show as such.
        raw = np.asarray(data).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise problem from None
    if not raw.size:
        return raw.astype(target)
    if raw.dtype.kind not in _DATA_KINDS[target.kind]:
        raise problem
    # Among numbers numpy reads true as 1: a boolean in numeric data is refused too.
    if target.kind != "b" and bool in set(map(type, np.asarray(data, dtype=object).flat)):
        raise problem
    if target.kind in "iu":
        info = np.iinfo(target)
        if raw.min() < info.min or raw.max() > info.max:
            raise _invalid(f"{where}: data out of the range of {dtype}")
    return raw.astype(target)


#: Datatypes whose JSON data the plain path reads straight into float64: any JSON
#: number is one of their values (for integer datatypes a fraction is refused, which
#: needs the numbers as the JSON wrote them).
_FLOATS = ("FP64", "FP32", "FP16")
#: Integers beyond this magnitude are not exact in float64: converted to FP32 or FP16
#: through float64 they could round twice, where numpy rounds an integer list once.
_EXACT = float(2**53)


@dataclass(frozen=True)
class _Numbers:
    """The data of a float tensor, read by simdjson: its numbers, flat, as float64
    (what ``np.asarray`` of the same list gives), and how many arrays held them."""

    values: np.ndarray
    arrays: int


def _numbers(data: simdjson.Array, dtype: Any) -> _Numbers | None:
    """The numbers of a flat or two-level (rows of equal length) array, or None.

    simdjson flattens nested arrays without checking their shape and refuses anything
    but numbers in them; the rows' lengths are checked here, and the caller checks that
    no array is nested deeper (its count of ``[``).
    """
    values = np.frombuffer(data.as_buffer(of_type="d"), dtype=np.float64)
    if len(data) and isinstance(data[0], simdjson.Array):
        # len() of every row, without a Python test per row: a number has none
        # (TypeError); strings and objects in the data failed as_buffer already.
        rows = list(map(len, data))
        if rows.count(rows[0]) != len(rows) or values.size != rows[0] * len(rows):
            return None
        arrays = 1 + len(rows)
    elif values.size == len(data):
        arrays = 1
    else:
        return None
    if dtype != "FP64" and values.size and float(np.abs(values).max()) >= _EXACT:
        return None
    return _Numbers(values, arrays)


def _arrays_in(value: Any) -> int:
    """The JSON arrays in a parsed value (its ``[``), float data counted as read."""
    if isinstance(value, _Numbers):
        return value.arrays
    if isinstance(value, list):
        return 1 + sum(map(_arrays_in, value))
    if isinstance(value, dict):
        return sum(map(_arrays_in, value.values()))
    return 0


def _plain_document(head: bytes | memoryview) -> dict[str, Any] | None:
    """The request document with each float tensor's data as :class:`_Numbers`, read
    by simdjson without a Python object per number; None to take orjson's path.

    Everything but the float data becomes the Python objects orjson would give, so
    the checks that follow are the same on either path. The float data become what
    ``np.asarray`` makes of the same lists; a document is taken here only if its ``[``
    count is exactly its arrays (so no data array hides a deeper nesting, and no
    string holds a ``[``) and no object repeats a key. Anything else, including every
    invalid document, goes to orjson, whose path writes the errors.
    """
    try:
        out = _plain_objects(simdjson_document(head))
    except (ValueError, TypeError, RuntimeError, KeyError, IndexError):
        return None
    if out is None:
        return None
    brackets = int(np.count_nonzero(np.frombuffer(head, np.uint8) == ord("[")))
    return out if brackets == _arrays_in(out) else None


def _plain_objects(doc: Any) -> dict[str, Any] | None:
    """:func:`_plain_document`'s conversion; no simdjson proxy outlives it (the
    thread's parser is reused)."""
    if not isinstance(doc, simdjson.Object) or not isinstance(doc.get("inputs"), simdjson.Array):
        return None
    out = _fields(doc, "inputs")
    if out is None:
        return None
    inputs = []
    for item in doc["inputs"]:
        if not isinstance(item, simdjson.Object):
            inputs.append(_python(item))
            continue
        spec = _fields(item, "data")
        if spec is None:
            return None
        if "data" in spec:
            data, dtype = item["data"], spec.get("datatype")
            if isinstance(data, simdjson.Array) and isinstance(dtype, str) and dtype in _FLOATS:
                numbers = _numbers(data, dtype)
                if numbers is None:
                    return None
                spec["data"] = numbers
            else:
                spec["data"] = _python(data)
        inputs.append(spec)
    out["inputs"] = inputs
    return out


def _fields(obj: simdjson.Object, lazy: str) -> dict[str, Any] | None:
    """An object's fields as Python objects, but for ``lazy`` (None in its place);
    None for an object with a repeated key (where simdjson's lookup finds the first,
    orjson keeps the last: the general path takes those)."""
    keys = list(obj.keys())
    if len(set(keys)) != len(keys):
        return None
    return {k: None if k == lazy else _python(obj[k]) for k in keys}


def _python(value: Any) -> Any:
    """A simdjson value as the Python objects orjson gives."""
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def _tensor(
    spec: dict[str, Any], where: str, binary: bytes | memoryview | None, limits: RequestLimits
) -> np.ndarray:
    dtype = spec.get("datatype")
    shape = spec.get("shape")
    if not isinstance(dtype, str) or dtype not in _NUMPY:
        shown = repr(dtype) if isinstance(dtype, str) else _json_type(dtype)
        raise _invalid(
            f"{where}: datatype must name a tensor type of numbers or booleans "
            f"({', '.join(_NUMPY)}), got {shown}"
        )
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise _invalid(f"{where}: shape must be a list of non-negative integers")
    # Python integers: a declared shape of 2^40 x 2^40 must not wrap around.
    expected = math.prod(shape)
    if expected * 8 > limits.max_decoded_bytes:
        raise Problem(
            413,
            f"{where}: shape {shape} takes {expected * 8} bytes as float64, more than "
            f"the decoded-size limit of {limits.max_decoded_bytes} bytes",
            slug="decoded-too-large",
        )
    if binary is not None:
        array = np.frombuffer(binary, dtype=np.dtype(_NUMPY[dtype]).newbyteorder("<"))
    else:
        if spec.get("data") is None:
            raise _invalid(f"{where} has no data")
        array = _values(spec["data"], dtype, where)
    if array.size != expected:
        raise _invalid(f"{where}: {array.size} value(s) of data for shape {shape}")
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
    doc = _plain_document(head)
    if doc is None:
        try:
            doc = orjson.loads(head)
        except orjson.JSONDecodeError as exc:
            raise Problem(
                400, f"the inference request is not valid JSON ({exc})", slug="invalid-json"
            ) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise _invalid("the inference request needs a non-empty 'inputs' list", "invalid-request")
    if doc.get("id") is not None and not isinstance(doc["id"], str):
        raise _invalid(f"id must be a string, got {_json_type(doc['id'])}", "invalid-request")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for i, spec in enumerate(doc["inputs"]):
        if not isinstance(spec, dict):
            raise _invalid(
                f"inputs[{i}] must be an object, got {_json_type(spec)}", "invalid-request"
            )
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid(
                f"inputs[{i}]: name must be a non-empty string, got {_json_type(name)}",
                "invalid-request",
            )
        where = f"inputs[{i}] ({name!r})"
        if name in tensors:
            raise _invalid(f"{where}: a second input of that name", "invalid-request")
        params = _optional_object(spec.get("parameters"), f"{where}: parameters")
        binary = None
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise _invalid(f"{where}: binary_data_size must be a byte count", "invalid-binary")
            binary = rest[offset : offset + size]
            if len(binary) != size:
                raise _invalid(
                    f"{where}: binary data shorter than its binary_data_size", "invalid-binary"
                )
            offset += size
        tensors[name] = _tensor(spec, where, binary, limits)
    return doc, tensors


def _options(doc: dict[str, Any], entry: ModelEntry) -> tuple[PredictOptions, dict[str, Any]]:
    """The request's outputs must exist; its ``interval`` parameter is a coverage."""
    outputs = doc.get("outputs")
    if outputs is None:
        outputs = []
    if not isinstance(outputs, list):
        raise _invalid(f"outputs must be a list, got {_json_type(outputs)}", "invalid-request")
    available = [o["name"] for o in OUTPUTS[entry.kind]]
    wanted: dict[str, dict[str, Any]] = {}
    for i, output in enumerate(outputs):
        if not isinstance(output, dict):
            raise _invalid(
                f"outputs[{i}] must be an object, got {_json_type(output)}", "invalid-request"
            )
        name = output.get("name")
        if not isinstance(name, str) or name not in available:
            shown = repr(name) if isinstance(name, str) else _json_type(name)
            raise _invalid(
                f"outputs[{i}]: name must be one of {sorted(available)}, got {shown}",
                "invalid-request",
            )
        params = _optional_object(output.get("parameters"), f"outputs[{i}] ({name!r}): parameters")
        binary = _optional_flag(params, "binary_data", f"outputs[{i}] ({name!r}): parameters.")
        wanted[name] = {"binary_data": binary}
    params = _optional_object(doc.get("parameters"), "parameters")
    options = PredictOptions.parse(
        entry,
        {
            k: params.get(k)
            for k in ("interval", "compensated", "cells", "probabilities", "control", "explain")
        },
    )
    echo = {
        "id": doc.get("id"),
        "outputs": wanted,
        "binary_data_output": _optional_flag(params, "binary_data_output", "parameters."),
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
    i = next(i for i, s in enumerate(doc["inputs"]) if s["name"] == "points")
    # Parsed as objects already (_parse, _options); the input's own markers first.
    markers = (doc["inputs"][i].get("parameters") or {}).get("markers")
    where = f"inputs[{i}] ('points'): parameters.markers"
    if markers is None:
        markers = (doc.get("parameters") or {}).get("markers")
        where = "parameters.markers"
    if isinstance(markers, str):
        markers = [m.strip() for m in markers.split(",")]
    if markers is not None and (
        not isinstance(markers, list)
        or len(markers) != points.shape[1]
        or not all(isinstance(m, str) for m in markers)
    ):
        raise _invalid(
            f"{where} must name the {points.shape[1]} columns of 'points' (a list of "
            f"strings, or one string of comma-separated names), got {_json_type(markers)}",
            "invalid-request",
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
