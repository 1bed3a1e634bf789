"""JSON bodies: the simdjson fast path gives exactly what the general orjson path gives."""

from __future__ import annotations

import gzip
import zlib

import numpy as np
import orjson
import pytest
from bagserve.service.codecs import (
    BodySpec,
    RequestLimits,
    _general_json_bags,
    _json_bags,
    _plain_json_bags,
    decode_body,
    inflate,
)
from bagserve.service.errors import Problem
from hypothesis import given, settings
from hypothesis import strategies as st

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
number = st.one_of(finite, st.integers(-(2**63), 2**63 - 1))
# No "[" in strings here, so that every document takes the fast path (asserted below).
text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="["), max_size=6
)


def same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.id, x.names, x.alt_names) == (y.id, y.names, y.alt_names)
        assert x.points.shape == y.points.shape
        # Bit for bit, signed zeros included.
        assert x.points.tobytes() == y.points.tobytes()
        if x.weights is None or y.weights is None:
            assert x.weights is None and y.weights is None
        else:
            assert x.weights.tobytes() == y.weights.tobytes()


@st.composite
def plain_documents(draw):
    bags = []
    for _ in range(draw(st.integers(1, 3))):
        width = draw(st.integers(1, 4))
        rows = draw(st.lists(st.lists(number, min_size=width, max_size=width), min_size=1))
        bag = {"points": rows}
        if draw(st.booleans()):
            bag["id"] = draw(st.one_of(text, st.integers(0, 10**6)))
        if draw(st.booleans()):
            bag["markers"] = draw(st.lists(text, min_size=width, max_size=width))
        if draw(st.booleans()):
            bag["weights"] = draw(st.lists(finite, min_size=len(rows), max_size=len(rows)))
        bags.append(bag)
    return {"bags": bags} if len(bags) > 1 or draw(st.booleans()) else bags[0]


@settings(max_examples=300, deadline=None)
@given(plain_documents())
def test_fast_path_equals_the_general_path(doc):
    body = orjson.dumps(doc)
    assert _plain_json_bags(body) is not None
    fast = _json_bags(body)
    general = _general_json_bags(body)
    assert fast[1] == general[1] == []
    same(fast[0], general[0])


@pytest.mark.parametrize(
    "body",
    [
        b'{"bags": [{"points": [[1, 2], [3, [4]]]}]}',  # nested single value: shape hidden
        b'{"bags": [{"points": [[1, 2], [3]]}]}',  # ragged
        b'{"bags": [{"points": [[1, 2], [3], [4, 5, 6]]}]}',  # ragged, 2 x 3 values
        b'{"bags": [{"points": ["ab", "cd"]}]}',  # rows with a len() that are no arrays
        b'{"bags": [{"points": [{"a": 1}, {"b": 2}]}]}',
        b'{"bags": [{"points": [[1, 2], [3, "x"]]}]}',
        b'{"bags": [{"points": [[1, 2], [3, null]]}]}',
        b'{"bags": [{"points": [[1e400, 2]]}]}',
        b'{"bags": [{"points": []}]}',
        b'{"bags": [{"points": [[1, 2]], "weights": [[1]]}]}',
        b'{"bags": [{"points": [[1, 2]], "markers": ["a"]}]}',
        b'{"bags": [{"points": [[1, 2]], "extra": [1]}]}',
        b'{"bags": []}',
        b"[[1, 2]]",
        b'{"bags": [{"id": "a[b", "points": [[1, 2]]}]}',  # valid, but sent to the general path
        # simdjson skips a byte order mark; JSON (and orjson) refuse it.
        b'\xef\xbb\xbf{"bags": [{"points": [[1, 2]]}]}',
    ],
)
def test_anything_unusual_takes_the_general_path(body):
    assert _plain_json_bags(body) is None


def test_large_bag_round_trips_exactly(rng):
    points = rng.normal(size=(20_000, 7))
    points[::5, 2] = np.round(points[::5, 2] * 1e3)
    points[0, 0] = -0.0
    body = orjson.dumps(
        {"bags": [{"id": "p", "points": points}]}, option=orjson.OPT_SERIALIZE_NUMPY
    )
    bags = _plain_json_bags(body)
    assert bags is not None and bags[0].points.tobytes() == points.tobytes()
    assert bags[0].points.flags.writeable


def test_a_reused_parser_leaves_earlier_results_alone(rng):
    """The thread's simdjson parser is reused: what an earlier parse returned must not
    change with the next document, and a parser still holding a document (here a live
    proxy) must not make the fast path fail."""
    import simdjson
    from bagserve.service import codecs

    first = rng.normal(size=(3000, 4))
    body = orjson.dumps(
        {"bags": [{"id": "a", "points": first, "weights": np.ones(3000)}]},
        option=orjson.OPT_SERIALIZE_NUMPY,
    )
    bags = _plain_json_bags(body)
    again = _plain_json_bags(orjson.dumps({"bags": [{"id": "b", "points": [[7.0] * 4] * 5000}]}))
    assert again is not None and again[0].points.shape == (5000, 4)
    assert bags[0].id == "a" and bags[0].points.tobytes() == first.tobytes()
    assert bags[0].weights.tobytes() == np.ones(3000).tobytes()
    held = codecs._parser(10).parse(b'{"keep": [1]}')["keep"]  # a live proxy
    with pytest.raises(RuntimeError):
        codecs._parser(10).parse(b"[1]")
    third = _plain_json_bags(body)
    assert third is not None and third[0].points.tobytes() == first.tobytes()
    assert isinstance(held, simdjson.Array)


# ------------------------------------------------------------------ bounded bodies
LIMITS = RequestLimits(
    max_decoded_bytes=4000, max_bags=3, max_points_per_bag=100, max_total_points=300, max_columns=8
)


def test_json_numbers_are_bounded_before_parsing():
    small = b'{"points": [' + b",".join([b"[0,0]"] * 40) + b"]}"
    assert len(decode_body(BodySpec("application/json"), small, LIMITS)[0]) == 1
    # 400 values of one digit: 3200 bytes as float64, over the 4000-byte limit.
    large = b'{"points": [' + b",".join([b"[0,0,0,0,0,0,0,0]"] * 100) + b"]}"
    with pytest.raises(Problem) as info:
        decode_body(BodySpec("application/json"), large, LIMITS)
    assert info.value.status == 413 and "decoded-size limit of 4000" in info.value.detail


def test_content_encodings_are_undone_within_the_limit():
    text = b"a,b\n" + b"1,2\n" * 50
    for coding, data in (
        ("gzip", gzip.compress(text)),
        ("deflate", zlib.compress(text)),
        ("deflate", zlib.compress(text)[2:-4]),  # raw deflate, as some clients send it
    ):
        assert bytes(inflate(data, coding, LIMITS)) == text
    with pytest.raises(Problem) as info:
        inflate(zlib.compress(b"0" * 5000), "deflate", LIMITS)
    assert info.value.status == 413
    with pytest.raises(Problem) as info:
        inflate(b"not gzip at all", "gzip", LIMITS)
    assert info.value.status == 400


def test_multipart_files_are_named_and_form_fields_skipped():
    boundary = "b0undary"
    parts = [
        ('form-data; name="note"', b"a field, not a file"),
        ('form-data; name="files"; filename="p1.csv"', b"a,b\n1,2\n3,4\n"),
        ('form-data; name="files"; filename="p2.csv.gz"', gzip.compress(b"a,b\n5,6\n7,8\n")),
    ]
    body = (
        b"".join(
            f"--{boundary}\r\nContent-Disposition: {d}\r\n\r\n".encode() + data + b"\r\n"
            for d, data in parts
        )
        + f"--{boundary}--\r\n".encode()
    )
    spec = BodySpec(f"multipart/form-data; boundary={boundary}")
    bags, errors = decode_body(spec, body, LIMITS)
    assert errors == [] and [b.id for b in bags] == ["p1.csv", "p2.csv.gz"]
    assert bags[1].points.tolist() == [[5.0, 6.0], [7.0, 8.0]]
    with pytest.raises(Problem) as info:
        decode_body(BodySpec("multipart/form-data"), body, LIMITS)
    assert info.value.status == 400 and "boundary" in info.value.detail
