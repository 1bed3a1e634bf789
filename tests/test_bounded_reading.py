"""Reading untrusted bytes within limits: gzip, NPY, CSV, FCS, Parquet and AnnData.

Oracles: Python's own gzip module, numpy's ``np.load``, a plain ``csv``-module parser
(what the reader used before numpy's C parser), and the shapes written into the files.
"""

from __future__ import annotations

import csv
import gzip
import io
import tracemalloc
import zlib

import numpy as np
import pytest
from bagserve.core.errors import SizeLimitError
from bagserve.core.io import DataError, read_sample
from bagserve.core.io.readers import gunzip
from bagserve.core.io.sample import ReadLimits
from bagserve.core.io.spreadsheet import SafeWriter, safe_cell
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import SHARED_DATA

YEAST = SHARED_DATA / "cytoflow_yeast" / "dose_response"
MIB = 1 << 20


# ------------------------------------------------------------------ gzip
def test_gunzip_equals_gzip_for_one_and_several_members_and_padding():
    rng = np.random.default_rng(0)
    a, b = rng.bytes(300_000), b"CD4,CD8\n" * 50_000
    for data in (
        gzip.compress(a),
        gzip.compress(a) + gzip.compress(b),
        gzip.compress(b) + b"\0" * 7,
    ):
        assert gunzip(data, "x") == gzip.decompress(data)
    with pytest.raises(DataError, match="broken gzip stream"):
        gunzip(gzip.compress(a)[:-20], "x")
    with pytest.raises(DataError, match="broken gzip stream"):
        gunzip(gzip.compress(a) + b"garbage", "x")


def test_gunzip_stops_at_the_limit_within_one_piece():
    data = gzip.compress(b"\0" * (64 * MIB))
    # The honest trailer refuses at once; a forged one while inflating.
    with pytest.raises(SizeLimitError, match="decoded-size limit"):
        gunzip(data, "x", 8 * MIB)
    forged = data[:-4] + (100).to_bytes(4, "little")
    tracemalloc.start()
    try:
        with pytest.raises(SizeLimitError, match="more than 8388608 bytes"):
            gunzip(forged, "x", 8 * MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MIB + 4 * MIB
    # At the limit exactly: allowed.
    assert len(gunzip(gzip.compress(b"1" * 1000), "x", 1000)) == 1000


def test_read_sample_inflates_gzip_by_magic_within_the_limit():
    text = b"a,b\n" + b"1.5,2\n" * 1000
    s = read_sample(gzip.compress(text), format="csv")
    assert s.points.shape == (1000, 2)
    with pytest.raises(SizeLimitError):
        read_sample(gzip.compress(text), limits=ReadLimits(max_decoded_bytes=len(text) - 1))
    assert not isinstance(zlib.error(), DataError)  # zlib errors are wrapped, not leaked


# ------------------------------------------------------------------ NPY
def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


@pytest.mark.parametrize(
    "dtype", [np.float64, np.float32, np.float16, np.int8, np.int64, np.uint16, ">f4", ">i8"]
)
def test_npy_real_dtypes_read_as_np_load_does(dtype):
    array = (np.arange(24).reshape(8, 3) - 5).astype(dtype)
    s = read_sample(_npy(array), format="npy")
    np.testing.assert_array_equal(s.points, np.load(io.BytesIO(_npy(array))).astype(np.float64))
    fortran = read_sample(_npy(np.asfortranarray(array)), format="npy")
    np.testing.assert_array_equal(fortran.points, s.points)


@pytest.mark.parametrize(
    ("array", "name"),
    [
        (np.ones((3, 2), dtype=np.complex128), "<c16"),
        (np.ones((3, 2), dtype=np.complex64), "<c8"),
        (np.ones((3, 2), dtype=bool), "|b1"),
        (np.array([["a", "b"]]), "<U1"),
        (np.zeros((3, 2), dtype="datetime64[s]"), "<M8[s]"),
        (np.zeros(3, dtype=[("x", "f8"), ("y", "f8")]), "('x', '<f8')"),
    ],
)
def test_npy_dtypes_that_are_no_cells_are_refused_by_name(array, name):
    with pytest.raises(DataError, match="not supported") as info:
        read_sample(_npy(array), format="npy")
    assert name in str(info.value)


def test_npy_object_arrays_are_refused_without_unpickling():
    header = np.lib.format.header_data_from_array_1_0(np.zeros((2, 2)))
    header["descr"] = "|O"
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    with pytest.raises(DataError, match=r"dtype '\|O' is not supported"):
        read_sample(buf.getvalue() + b"\x80\x04K\x01." * 4, format="npy")


def test_npy_shape_is_checked_against_the_limits_before_allocating():
    header = np.lib.format.header_data_from_array_1_0(np.zeros((2, 3)))
    header["shape"] = (10**11, 3)
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    limits = ReadLimits(max_decoded_bytes=MIB, max_cells=1000, max_columns=50)
    tracemalloc.start()
    try:
        with pytest.raises(SizeLimitError, match="100000000000 cells"):
            read_sample(buf.getvalue() + b"\0" * 48, format="npy", limits=limits)
        # Without limits the data's length still has to match the header's shape.
        with pytest.raises(DataError, match="declares"):
            read_sample(buf.getvalue() + b"\0" * 48, format="npy")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MIB
    with pytest.raises(SizeLimitError, match="60 columns"):
        read_sample(_npy(np.zeros((2, 60))), format="npy", limits=limits)
    # int8 grows eightfold as float64: the decoded size counts, not the body's.
    body = _npy(np.zeros((5000, 40), np.int8))  # 200 kB, 1.6 MB as float64
    assert len(body) < MIB
    with pytest.raises(SizeLimitError, match="decoded-size limit"):
        read_sample(body, format="npy", limits=ReadLimits(max_decoded_bytes=MIB))


# ------------------------------------------------------------------ CSV
def _naive_csv(text: str) -> tuple[list[str], np.ndarray]:
    """The oracle: the csv module and float(), row by row."""
    lines = text.splitlines()
    try:
        delimiter = csv.Sniffer().sniff(lines[0], delimiters=",\t;").delimiter
    except csv.Error:
        delimiter = ","
    rows = [r for r in csv.reader(lines, delimiter=delimiter) if any(c.strip() for c in r)]
    header = [h.strip() for h in rows[0]]
    return header, np.array([[float(c) for c in r] for r in rows[1:]], dtype=np.float64)


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 5).flatmap(
        lambda d: st.tuples(
            st.just(d),
            st.lists(st.lists(finite, min_size=d, max_size=d), min_size=1, max_size=30),
            st.sampled_from([",", "\t", ";"]),
            st.booleans(),
            st.booleans(),
        )
    )
)
def test_csv_reader_equals_the_csv_module_bit_for_bit(case):
    d, rows, delimiter, crlf, blank_lines = case
    newline = "\r\n" if crlf else "\n"
    names = [f"m{j}" for j in range(d)]
    lines = [delimiter.join(names)]
    for r in rows:
        lines.append(delimiter.join(repr(v) for v in r))
        if blank_lines:
            lines.append("")
    text = newline.join(lines) + newline
    header, expected = _naive_csv(text)
    s = read_sample(text.encode(), format="csv")
    assert s.names == header
    assert s.points.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("a,b\n1,2\n3,4,5\n", "row 3 has 3 field"),
        ("a,b\n1,2,3\n", "row 2 has 3 field"),
        ("a,b\n1,2\n\n3,x\n", r"row 3, column 'b': 'x' is not a number"),
        ("a,b,c\n1,,3\n", r"row 2, column 'b': '' is not a number"),
        ('a,b\n"1",2\n', None),
    ],
)
def test_csv_problems_name_the_row_and_column(content, message):
    if message is None:
        assert read_sample(content.encode(), format="csv").points.tolist() == [[1.0, 2.0]]
        return
    with pytest.raises(DataError, match=message):
        read_sample(content.encode(), format="csv")


def test_csv_rows_and_columns_are_checked_before_parsing():
    text = b"a,b,c\n" + b"1,2,3\n" * 5000
    with pytest.raises(SizeLimitError, match=r"cells \(its lines\), more than the limit of 100"):
        read_sample(text, format="csv", limits=ReadLimits(max_cells=100))
    with pytest.raises(SizeLimitError, match="3 columns"):
        read_sample(text, format="csv", limits=ReadLimits(max_columns=2))
    with pytest.raises(SizeLimitError, match="decoded-size limit"):
        read_sample(text, format="csv", limits=ReadLimits(max_decoded_bytes=50_000))
    assert read_sample(text, format="csv", limits=ReadLimits(max_cells=5001)).points.shape == (
        5000,
        3,
    )


# ------------------------------------------------------------------ FCS, Parquet, AnnData
def test_fcs_header_sizes_are_checked_before_the_data_segment():
    data = (YEAST / "Yeast_B1_B01.fcs").read_bytes()  # 1000 events x 9 channels, float32
    assert read_sample(data, limits=ReadLimits(max_cells=1000, max_columns=9)).points.shape == (
        1000,
        9,
    )
    with pytest.raises(SizeLimitError, match=r"1000 cells \(its \$TOT and \$PAR"):
        read_sample(data, limits=ReadLimits(max_cells=999))
    with pytest.raises(SizeLimitError, match="9 columns"):
        read_sample(data, limits=ReadLimits(max_columns=8))
    with pytest.raises(SizeLimitError, match="decoded-size limit"):
        read_sample(data, limits=ReadLimits(max_decoded_bytes=9 * 1000 * 8 - 1))


def test_parquet_and_anndata_shapes_are_checked_before_decoding(tmp_path):
    import anndata
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"CD4": np.arange(500.0), "gate": ["x"] * 500}), buf)
    data = buf.getvalue()
    assert read_sample(data, limits=ReadLimits(max_cells=500)).names == ["CD4"]
    with pytest.raises(SizeLimitError, match="its footer"):
        read_sample(data, limits=ReadLimits(max_cells=499))
    adata = anndata.AnnData(np.ones((300, 4), dtype=np.float32))
    adata.var_names = ["CD3", "CD4", "CD8", "CD19"]
    adata.write_h5ad(tmp_path / "cells.h5ad")
    h5 = (tmp_path / "cells.h5ad").read_bytes()
    s = read_sample(h5, limits=ReadLimits(max_cells=300))
    assert s.names == ["CD3", "CD4", "CD8", "CD19"] and s.points.shape == (300, 4)
    with pytest.raises(SizeLimitError, match="the shape of its X"):
        read_sample(h5, limits=ReadLimits(max_columns=3))


# ------------------------------------------------------------------ spreadsheets
def test_safe_cells_follow_owasp_and_keep_numbers():
    assert [safe_cell(v) for v in ("=1+1", "+A1", "-A1", "@SUM(A1)", "\tx", "\rx")] == [
        "'=1+1",
        "'+A1",
        "'-A1",
        "'@SUM(A1)",
        "'\tx",
        "'\rx",
    ]
    assert [safe_cell(v) for v in ("-1", "+2.5e-3", ".5", "CD4+", "a=b", -3, 2.5, None)] == [
        "-1",
        "+2.5e-3",
        ".5",
        "CD4+",
        "a=b",
        -3,
        2.5,
        None,
    ]
    buf = io.StringIO()
    SafeWriter(buf, lineterminator="\n").writerow(["=HYPERLINK(x)", -1.5, "T cells"])
    assert buf.getvalue() == "'=HYPERLINK(x),-1.5,T cells\n"
