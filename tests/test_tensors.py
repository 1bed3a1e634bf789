"""/v2 JSON tensors: the simdjson path gives exactly what the orjson path gives.

The orjson path (``orjson.loads``, then ``np.asarray`` of each tensor's list) is the
oracle: on every document, plain or hostile, decoding with the simdjson path enabled
must give the same bags (bit for bit), options and echo, or the same error (status,
detail, slug) as with it disabled.
"""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from bagserve.core import DistributionRidge, SlicedWasserstein, save
from bagserve.core.runtime import ModelRuntime
from bagserve.service import tensors
from bagserve.service.codecs import BodySpec, RequestLimits
from bagserve.service.errors import Problem
from bagserve.service.registry import ModelEntry
from hypothesis import given, settings
from hypothesis import strategies as st

LIMITS = RequestLimits(
    max_decoded_bytes=1 << 26,
    max_bags=100,
    max_points_per_bag=10**6,
    max_total_points=10**6,
    max_columns=64,
)
SPEC = BodySpec("application/json", protocol="v2")


@pytest.fixture(scope="module")
def entry(tmp_path_factory) -> ModelEntry:
    rng = np.random.default_rng(0)
    bags = [rng.normal(size=(20, 3)) + k for k in range(8)]
    rep = SlicedWasserstein(n_directions=5, n_levels=5, random_state=0)
    model = DistributionRidge(rep, gamma=1.0, alpha=0.1)
    model.fit(bags, np.arange(8.0))
    path = tmp_path_factory.mktemp("model") / "m"
    save(model, path, panel=["a", "b", "c"])
    return ModelEntry("m", "1", ModelRuntime.open(path).info)


def outcome(body: bytes, entry: ModelEntry, plain: bool) -> object:
    """What decoding ``body`` gives: the request's parts, or the problem raised."""
    with pytest.MonkeyPatch.context() as m:
        if not plain:
            m.setattr(tensors, "_plain_document", lambda head: None, raising=False)
        try:
            request = tensors.decode_inference(SPEC, body, LIMITS, entry)
        except Problem as exc:
            return ("problem", exc.status, exc.detail, exc.slug, exc.errors)
    return (
        [
            (b.id, b.names, b.input_sha256, b.points.dtype.str, b.points.shape, b.points.tobytes())
            for b in request.bags
        ],
        request.options.to_json(),
        request.echo,
    )


def same_on_both_paths(body: bytes, entry: ModelEntry) -> object:
    fast = outcome(body, entry, True)
    assert fast == outcome(body, entry, False)
    return fast


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
# Integers within and beyond int64 (uint64), and -0.0 among the floats.
number = st.one_of(finite, st.integers(-(2**63), 2**64 - 1), st.just(-0.0))
# No "[" in strings, so that every document takes the simdjson path (asserted below).
text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="["), max_size=6
)


@st.composite
def plain_requests(draw):
    n, d = draw(st.integers(0, 6)), 3
    values = draw(st.lists(number, min_size=n * d, max_size=n * d))
    dtype = draw(st.sampled_from(["FP64", "FP32", "FP16"]))
    if dtype != "FP64":  # what the simdjson path takes (no rounding twice)
        values = [v for v in values if abs(v) < 2**53][: n * d]
        n = len(values) // d
        values = values[: n * d]
    nested = draw(st.booleans()) and n > 0
    data = [values[i * d : (i + 1) * d] for i in range(n)] if nested else values
    points = {"name": "points", "datatype": dtype, "shape": [n, d], "data": data}
    if draw(st.booleans()):
        points["parameters"] = {"markers": draw(st.sampled_from([["a", "b", "c"], "a, b, c"]))}
    doc = {"inputs": [points]}
    if draw(st.booleans()) and n:
        split = draw(st.integers(0, n))
        doc["inputs"].append(
            {"name": "bag_sizes", "datatype": "INT64", "shape": [2], "data": [split, n - split]}
        )
    if draw(st.booleans()):
        doc["id"] = draw(text)
    if draw(st.booleans()):
        doc["outputs"] = [{"name": "prediction", "parameters": {"binary_data": False}}]
    if draw(st.booleans()):
        doc["parameters"] = {"binary_data_output": draw(st.booleans())}
    return orjson.dumps(doc)


@settings(max_examples=200, deadline=None)
@given(body=plain_requests())
def test_plain_requests_equal_the_orjson_path(body, entry):
    assert tensors._plain_document(body) is not None
    same_on_both_paths(body, entry)


def test_a_large_bag_is_read_exactly(entry):
    rng = np.random.default_rng(1)
    points = rng.normal(size=(30_000, 3))
    points[::7, 1] = np.round(points[::7, 1] * 1e3)  # integral values, written as 12.0
    points[0, 0] = -0.0
    points[1, 0] = 5e-324
    doc = {"inputs": [{"name": "points", "datatype": "FP64", "shape": [30_000, 3], "data": points}]}
    body = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    assert isinstance(tensors._plain_document(body)["inputs"][0]["data"], tensors._Numbers)
    (bag,), _, _ = same_on_both_paths(body, entry)
    assert bag[-1] == points.tobytes()


def points_doc(data: str, shape: str = "[2, 3]", dtype: str = '"FP64"', extra: str = "") -> bytes:
    return (
        f'{{"inputs": [{{"name": "points", "datatype": {dtype}, "shape": {shape}, '
        f'"data": {data}{extra}}}]}}'
    ).encode()


HOSTILE = {
    # Nesting: deeper than the parsers allow, deeper than two levels, hidden in a row.
    "deep nesting": points_doc("[" * 5000 + "]" * 5000),
    "three levels": points_doc("[[[1, 2, 3]], [[4, 5, 6]]]"),
    "a value nested in a row": points_doc("[[1, 2, 3], [4, 5, [6]]]"),
    "a singleton among values": points_doc("[[1], 2, 3, 4, 5, 6]"),
    "ragged rows": points_doc("[[1, 2], [3, 4, 5, 6]]"),
    "ragged rows, same count": points_doc("[[1, 2], [3], [4, 5, 6]]", "[3, 2]"),
    "rows and values mixed": points_doc("[[1, 2, 3], 4, 5, 6]"),
    "an empty row": points_doc("[[], [1, 2, 3]]", "[1, 3]"),
    "empty data": points_doc("[]", "[0, 3]"),
    "empty rows": points_doc("[[], []]", "[2, 0]"),
    # Numbers beyond float64 or int64, and the smallest.
    "a huge exponent": points_doc("[1e400, 2, 3, 4, 5, 6]"),
    "a negative huge exponent": points_doc("[1e-400, 2, 3, 4, 5, 6]"),
    "an integer beyond 64 bits": points_doc("[100000000000000000000000, 2, 3, 4, 5, 6]"),
    "an integer below int64": points_doc("[-9223372036854775809, 2, 3, 4, 5, 6]"),
    "uint64 and a negative": points_doc("[18446744073709551615, -1, 3, 4, 5, 6]"),
    "big integers to FP32": points_doc("[9007199254740993, 2, 3, 4, 5, 6]", dtype='"FP32"'),
    "big integers to FP16": points_doc("[[9007199254740993, 2, 3], [4, 5, 6]]", dtype='"FP16"'),
    "beyond FP16": points_doc("[70000, 2, 3, 4, 5, 6]", dtype='"FP16"'),
    "a subnormal": points_doc("[5e-324, -0, -0.0, 0, 1E+2, 0.1e1]"),
    # Wrong shapes.
    "too few values": points_doc("[1, 2, 3, 4, 5]"),
    "too many values": points_doc("[[1, 2, 3], [4, 5, 6], [7, 8, 9]]"),
    "a shape of one dimension": points_doc("[1, 2, 3, 4, 5, 6]", "[6]"),
    "a negative shape": points_doc("[1, 2, 3, 4, 5, 6]", "[-2, -3]"),
    "a shape of strings": points_doc("[1, 2, 3, 4, 5, 6]", '["2", "3"]'),
    "a shape beyond the limits": points_doc("[1]", "[1099511627776, 1099511627776]"),
    # Mixed types in the data.
    "a boolean": points_doc("[true, 2, 3, 4, 5, 6]"),
    "a boolean among fractions": points_doc("[[true, 2.5, 3], [4, 5, 6]]"),
    "a string": points_doc('[[1, 2, 3], [4, 5, "6"]]'),
    "a null": points_doc("[1, 2, 3, 4, 5, null]"),
    "an object": points_doc('[1, 2, 3, 4, 5, {"v": 6}]'),
    "rows of strings": points_doc('["abc", "def"]'),
    "rows of objects": points_doc('[{"a": 1}, {"b": 2}]'),
    "data not a list": points_doc('{"a": 1}'),
    "data a number": points_doc("1"),
    "data null": points_doc("null"),
    "fractions for INT64": points_doc("[1.5, 2, 3, 4, 5, 6]", dtype='"INT64"'),
    "INT8 out of range": points_doc("[1000, 2, 3, 4, 5, 6]", dtype='"INT8"'),
    "a datatype object": points_doc("[1, 2, 3, 4, 5, 6]", dtype="{}"),
    "a datatype list": points_doc("[1, 2, 3, 4, 5, 6]", dtype='["FP64"]'),
    "BOOL data": points_doc("[true, false, true, false, true, false]", dtype='"BOOL"'),
    # Repeated keys: orjson keeps the last, a lookup in simdjson finds the first.
    "two data": points_doc("[1, 2, 3, 4, 5, 6]", extra=', "data": [6, 5, 4, 3, 2, 1]'),
    "two datatypes": points_doc("[1.5, 2, 3, 4, 5, 6]", extra=', "datatype": "INT64"'),
    "two shapes": points_doc("[1, 2, 3, 4, 5, 6]", extra=', "shape": [3, 2]'),
    "two inputs keys": (
        b'{"inputs": [{"name": "points", "datatype": "FP64", "shape": [1, 3], '
        b'"data": [1, 2, 3]}], "inputs": [{"name": "points", "datatype": "FP64", '
        b'"shape": [1, 3], "data": [3, 2, 1]}]}'
    ),
    "two ids": points_doc("[1, 2, 3, 4, 5, 6]")[:-1] + b', "id": "a", "id": "b"}',
    "a repeated key in parameters": points_doc(
        "[1, 2, 3, 4, 5, 6]", extra=', "parameters": {"markers": ["x"], "markers": ["a", "b", "c"]}'
    ),
    # Not JSON: NaN and Infinity literals, a byte order mark, trailing content.
    "NaN": points_doc("[NaN, 2, 3, 4, 5, 6]"),
    "Infinity": points_doc("[Infinity, 2, 3, 4, 5, 6]"),
    "-Infinity": points_doc("[-Infinity, 2, 3, 4, 5, 6]"),
    "a quoted NaN": points_doc('["NaN", 2, 3, 4, 5, 6]'),
    "a byte order mark": b"\xef\xbb\xbf" + points_doc("[1, 2, 3, 4, 5, 6]"),
    "trailing content": points_doc("[1, 2, 3, 4, 5, 6]") + b" []",
    "a trailing comma": points_doc("[1, 2, 3, 4, 5, 6,]"),
    "a lone surrogate": points_doc("[1, 2, 3, 4, 5, 6]")[:-1] + b', "id": "\\ud800"}',
    "invalid UTF-8": points_doc("[1, 2, 3, 4, 5, 6]")[:-1] + b', "id": "\xff"}',
    "leading zeros": points_doc("[01, 2, 3, 4, 5, 6]"),
    # Valid, but a "[" in a string: counted, so taken by the orjson path.
    "a bracket in a string": points_doc("[1, 2, 3, 4, 5, 6]")[:-1] + b', "id": "a[b"}',
    "a bracket in a marker": points_doc(
        "[1, 2, 3, 4, 5, 6]", extra=', "parameters": {"markers": ["a[", "b", "c"]}'
    ),
    # Documents that are no inference requests.
    "a list": b"[1, 2, 3]",
    "no inputs": b'{"outputs": []}',
    "inputs not a list": b'{"inputs": {"name": "points"}}',
    "an input not an object": b'{"inputs": [[1, 2, 3]]}',
    "an input without a name": b'{"inputs": [{"datatype": "FP64", "shape": [1], "data": [1]}]}',
    "two inputs of one name": (
        b'{"inputs": [{"name": "points", "datatype": "FP64", "shape": [1, 1], "data": [1]},'
        b' {"name": "points", "datatype": "FP64", "shape": [1, 1], "data": [2]}]}'
    ),
    "bag sizes that do not add up": (
        b'{"inputs": [{"name": "points", "datatype": "FP64", "shape": [2, 1], "data": [1, 2]},'
        b' {"name": "bag_sizes", "datatype": "INT64", "shape": [2], "data": [1, 2]}]}'
    ),
    "bag sizes as floats": (
        b'{"inputs": [{"name": "points", "datatype": "FP64", "shape": [2, 1], "data": [1, 2]},'
        b' {"name": "bag_sizes", "datatype": "FP64", "shape": [2], "data": [1, 1]}]}'
    ),
    "an id not a string": points_doc("[1, 2, 3, 4, 5, 6]")[:-1] + b', "id": 7}',
    "an unknown output": points_doc("[1, 2, 3, 4, 5, 6]")[:-1]
    + b', "outputs": [{"name": "nothing"}]}',
    "markers of the wrong count": points_doc(
        "[1, 2, 3, 4, 5, 6]", extra=', "parameters": {"markers": ["a", "b"]}'
    ),
    "an empty body": b"",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_requests_fare_alike_on_both_paths(name, entry):
    same_on_both_paths(HOSTILE[name], entry)


@pytest.mark.parametrize(
    "name",
    [
        "three levels",
        "a value nested in a row",
        "a singleton among values",
        "ragged rows, same count",
        "rows and values mixed",
        "big integers to FP32",
        "two data",
        "two datatypes",
        "two inputs keys",
        "two ids",
        "a repeated key in parameters",
        "a byte order mark",
        "a bracket in a string",
    ],
)
def test_what_simdjson_would_misread_takes_the_orjson_path(name):
    """simdjson flattens any nesting, finds the first of a repeated key and skips a
    byte order mark: such documents must not be read by it (nor, for FP32 and FP16,
    integers that float64 rounds)."""
    assert tensors._plain_document(HOSTILE[name]) is None


@pytest.mark.parametrize(
    ("data", "dtype", "what"),
    [
        ("[true, 2, 3, 4, 5, 6]", "FP64", "numbers"),
        ("[[true, 2.5, 3], [4, 5, 6]]", "FP64", "numbers"),
        ("[[1, 2, 3], [4, 5, false]]", "FP32", "numbers"),
        ("[true, 2, 3, 4, 5, 6]", "INT64", "integers"),
    ],
)
def test_a_boolean_among_numbers_is_refused(data, dtype, what, entry):
    """numpy reads ``[true, 2.5]`` as ``[1.0, 2.5]``: a boolean must not become a value."""
    result = same_on_both_paths(points_doc(data, dtype=f'"{dtype}"'), entry)
    assert result[:2] == ("problem", 400)
    assert f"data must be {what} for {dtype}" in result[2]
