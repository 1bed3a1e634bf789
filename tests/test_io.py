"""Readers (FCS, CSV, NPY) on real and broken files; panels; preprocessing."""

from __future__ import annotations

import gzip
import io

import numpy as np
import pytest
from bagserve.core import Bags
from bagserve.core.io import DataError, Panel, Preprocessing, normalise_marker, read_sample

from .conftest import SHARED_DATA

YEAST = SHARED_DATA / "cytoflow_yeast" / "dose_response"
FLOWSOM = SHARED_DATA / "flowsom_example"
GVHD = SHARED_DATA / "flowcap1_gvhd"


def test_reads_real_fcs_with_channel_names():
    s = read_sample(YEAST / "Yeast_B1_B01.fcs")
    assert s.points.shape == (1000, 9)
    assert s.names[:3] == ["FSC-A", "FSC-H", "FSC-W"] and s.names[-1] == "Time"
    # Values are the linear-scale floats the README describes.
    assert 1000 < np.median(s.points[:, s.names.index("FITC-A")]) < 5000


def test_fcs_display_names_come_from_pns_and_both_names_match():
    s = read_sample(FLOWSOM / "not_preprocessed.fcs")
    assert s.points.shape == (19225, 18)
    assert "CD4" in s.names and "PE-Cy5-A" in s.alt_names
    cols = Panel(("cd4", "PE-Cy5-A", "fsc_a")).columns(s.names, s.alt_names)
    assert [s.names[c] for c in cols] == ["CD4", "CD19", "FSC-A"]


def test_reads_gzipped_csv_with_header():
    s = read_sample(GVHD / "sample3.csv.gz")
    assert s.names == ["FSC.H", "SSC.H", "FL1.H", "FL2.H", "FL3.H", "FL4.H"]
    assert s.points.shape[1] == 6 and s.points.shape[0] > 10_000


def test_csv_tsv_and_npy_round_trip(tmp_path):
    x = np.random.default_rng(0).normal(size=(5, 3))
    (tmp_path / "a.csv").write_text(
        "CD3,CD4,CD8\n" + "\n".join(",".join(repr(float(v)) for v in r) for r in x)
    )
    (tmp_path / "a.tsv").write_text(
        "CD3\tCD4\tCD8\n" + "\n".join("\t".join(repr(float(v)) for v in r) for r in x)
    )
    np.save(tmp_path / "a.npy", x)
    for name in ("a.csv", "a.tsv"):
        s = read_sample(tmp_path / name)
        np.testing.assert_array_equal(s.points, x)
        assert s.names == ["CD3", "CD4", "CD8"]
    s = read_sample(tmp_path / "a.npy", markers=["CD3", "CD4", "CD8"])
    np.testing.assert_array_equal(s.points, x)
    raw = (tmp_path / "a.csv").read_bytes()
    np.testing.assert_array_equal(read_sample(raw, format="csv").points, x)
    np.testing.assert_array_equal(read_sample(gzip.compress(raw), format="csv").points, x)
    buf = io.BytesIO()
    np.save(buf, x)
    np.testing.assert_array_equal(read_sample(buf.getvalue()).points, x)


@pytest.fixture
def fcs_bytes() -> bytes:
    return (YEAST / "Yeast_B2_B02.fcs").read_bytes()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[: len(b) // 2], "unreadable FCS file"),
        (lambda b: b[:200], "unreadable FCS file"),
        # DATA segment offsets pointing past the end of the file.
        (lambda b: b[:26] + b"  99999999" + b[36:], "unreadable FCS file"),
        (lambda b: b"this is a plain text note, not cytometry data\n" * 3, "not an FCS file"),
    ],
)
def test_broken_fcs_files_give_a_clear_error(tmp_path, fcs_bytes, mutate, message):
    path = tmp_path / "broken.fcs"
    path.write_bytes(mutate(fcs_bytes))
    with pytest.raises(DataError, match=message) as info:
        read_sample(path)
    assert "broken.fcs" in str(info.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty file"),
        ("1,2,3\n4,5,6\n", "first row must hold marker names"),
        ("a,b\n1,2\n3\n", "row 3 has 1 field"),
        ("a,b\n1,2\n3,x\n", r"row 3, column 'b': 'x' is not a number"),
        ("a,b\n1,nan\n", "non-finite value"),
        ("a,b\n", "no cells"),
    ],
)
def test_bad_csv_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "cells.csv"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        read_sample(path)


def test_bad_npy_and_unknown_types(tmp_path):
    np.save(tmp_path / "v.npy", np.zeros(4))
    with pytest.raises(DataError, match="2-D numeric array"):
        read_sample(tmp_path / "v.npy")
    (tmp_path / "x.xlsx").write_bytes(b"PK\x03\x04")
    with pytest.raises(DataError, match=r"unsupported file type '\.xlsx'"):
        read_sample(tmp_path / "x.xlsx")
    with pytest.raises(DataError, match="cannot read"):
        read_sample(tmp_path / "nope.csv")


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12.0).reshape(4, 3),  # the zero-copy path
        np.asfortranarray(np.arange(12.0).reshape(4, 3)),
        np.arange(12.0).reshape(4, 3).astype(">f8"),
        np.arange(12, dtype=np.int32).reshape(4, 3),
    ],
)
def test_npy_bytes_in_any_layout_read_the_same(array):
    buf = io.BytesIO()
    np.save(buf, array)
    data = buf.getvalue()
    s = read_sample(data, format="npy", markers=["a", "b", "c"])
    assert s.points.dtype == np.float64
    np.testing.assert_array_equal(s.points, np.arange(12.0).reshape(4, 3))
    with pytest.raises(DataError, match="not a readable NPY array"):
        read_sample(data[:-5], format="npy", markers=["a", "b", "c"])


def test_panel_matching_is_case_and_alias_tolerant_and_reorders():
    panel = Panel(("FSC-A", "FITC-A", "CD4"), {"FITC-A": ("GFP",)})
    names = ["cd4 ", "gfp", "SSC-A", "fsc_a"]
    np.testing.assert_array_equal(panel.columns(names), [3, 1, 0])
    assert panel.extra(names) == ["SSC-A"]
    with pytest.raises(DataError, match=r"missing marker\(s\) \['FITC-A', 'CD4'\]"):
        panel.columns(["FSC-A", "SSC-A"], source="s1.csv")
    with pytest.raises(DataError, match="ambiguous marker 'CD4'"):
        panel.columns(["FSC-A", "GFP", "CD4", "cd-4"])
    assert Panel.from_json(panel.to_json()) == panel
    assert normalise_marker("PE-Cy5.5 (A)") == "pecy55a"
    with pytest.raises(ValueError, match="collide"):
        Panel(("CD4", "cd-4"))


def test_preprocessing_transforms_scales_and_subsamples():
    rng = np.random.default_rng(0)
    bags = Bags.from_arrays(
        [rng.exponential(100, size=(500, 2)), rng.exponential(50, size=(40, 2))]
    )
    pre = Preprocessing(
        transform="arcsinh",
        cofactor={"CD3": 5.0},
        default_cofactor=150.0,
        scale="standard",
        max_points=100,
        seed=3,
    )
    pre.fit(bags, ["CD3", "CD4"])
    out = pre.apply(bags, ["CD3", "CD4"])
    np.testing.assert_array_equal(out.sizes, [100, 40])
    t = np.column_stack(
        [np.arcsinh(bags.points[:, 0] / 5.0), np.arcsinh(bags.points[:, 1] / 150.0)]
    )
    np.testing.assert_allclose(pre.mean_, t.mean(0))
    np.testing.assert_allclose(out[1], (t[500:] - t.mean(0)) / t.std(0))
    # The subsample does not depend on cell order, and is reproducible.
    perm = Bags.from_arrays([bags[0][rng.permutation(500)], bags[1]])
    a = np.sort(pre.apply(bags, ["CD3", "CD4"])[0], axis=0)
    b = np.sort(pre.apply(perm, ["CD3", "CD4"])[0], axis=0)
    np.testing.assert_array_equal(a, b)
    again = Preprocessing.from_json(pre.to_json())
    np.testing.assert_array_equal(again.apply(bags, ["CD3", "CD4"]).points, out.points)
    log = Preprocessing(transform="log").apply(bags, ["CD3", "CD4"])
    np.testing.assert_allclose(log.points, np.log10(np.maximum(bags.points, 1.0)))
    with pytest.raises(ValueError, match="not fitted"):
        Preprocessing(scale="standard").apply(bags, ["a", "b"])


# ----------------------------------------------------------------- Parquet and AnnData
def _parquet_bytes(columns: dict) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf)
    return buf.getvalue()


def test_parquet_bags_keep_numeric_columns_by_name(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 3))
    data = _parquet_bytes(
        {
            "sample_id": ["p1"] * 300,  # text beside the measurements: skipped
            "CD4-PE": x[:, 0],
            "CD8": x[:, 1].astype(np.float32),
            "events": np.arange(300, dtype=np.int64),
            "cd3": x[:, 2],
        }
    )
    path = tmp_path / "patient.parquet"
    path.write_bytes(data)
    for sample in (read_sample(path), read_sample(data), read_sample(memoryview(data))):
        assert sample.names == ["CD4-PE", "CD8", "events", "cd3"]
        np.testing.assert_array_equal(sample.points[:, 0], x[:, 0])
        np.testing.assert_array_equal(sample.points[:, 1], x[:, 1].astype(np.float32))
        np.testing.assert_array_equal(sample.points[:, 2], np.arange(300.0))
    # The panel matches as for every other format (case and punctuation ignored).
    picked = Panel(("CD3", "CD4 PE")).select(read_sample(path))
    np.testing.assert_array_equal(picked, x[:, [2, 0]])


def test_parquet_problems_name_the_file_and_column(tmp_path):
    nulls = tmp_path / "nulls.pq"
    nulls.write_bytes(_parquet_bytes({"CD4": [1.0, None, 3.0], "CD8": [1.0, 2.0, 3.0]}))
    with pytest.raises(
        DataError, match=r"nulls.pq: column 'CD4' has 1 missing value\(s\), first at row 2"
    ):
        read_sample(nulls)
    text = tmp_path / "text.parquet"
    text.write_bytes(_parquet_bytes({"gate": ["a", "b"]}))
    with pytest.raises(DataError, match=r"text.parquet: no numeric column among \['gate'\]"):
        read_sample(text)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1" + b"\0" * 40 + b"PAR1")
    with pytest.raises(DataError, match=r"broken\.parquet: unreadable Parquet file"):
        read_sample(broken)
    inf = tmp_path / "inf.parquet"
    inf.write_bytes(_parquet_bytes({"CD4": [1.0, np.inf]}))
    with pytest.raises(DataError, match=r"inf.parquet: 1 non-finite value\(s\), first at cell 2"):
        read_sample(inf)


@pytest.mark.parametrize("sparse", [False, True])
def test_h5ad_bags_read_x_and_var_names(tmp_path, sparse):
    import anndata
    import pandas as pd
    import scipy.sparse

    rng = np.random.default_rng(1)
    x = rng.gamma(2.0, 100.0, size=(200, 3)) * (rng.random((200, 3)) < 0.7)
    var = pd.DataFrame({"channel": ["FL1-A", "FL2-A", "FL3-A"]}, index=["CD4", "CD8", "CD3"])
    adata = anndata.AnnData(X=scipy.sparse.csr_matrix(x) if sparse else x, var=var)
    path = tmp_path / "cells.h5ad"
    adata.write_h5ad(path)
    for sample in (read_sample(path), read_sample(path.read_bytes())):
        assert sample.names == ["CD4", "CD8", "CD3"]
        assert sample.alt_names == ["FL1-A", "FL2-A", "FL3-A"]
        np.testing.assert_array_equal(sample.points, x)
    # Either name matches a panel marker.
    np.testing.assert_array_equal(Panel(("FL3-A", "CD4")).select(read_sample(path)), x[:, [2, 0]])
    broken = tmp_path / "broken.h5ad"
    broken.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    with pytest.raises(DataError, match=r"broken\.h5ad: unreadable AnnData file"):
        read_sample(broken)


def test_fcs_acquisition_time_from_its_keywords():
    from bagserve.core.io.readers import fcs_acquired

    assert fcs_acquired({"date": "02-DEC-2012", "btim": "09:45:26"}) == "2012-12-02T09:45:26"
    assert fcs_acquired({"date": "2-jul-2013", "btim": "00:29:01.25"}) == "2013-07-02T00:29:01"
    # FCS 3.2's $BEGINDATETIME (ISO 8601, with its zone) wins over $DATE/$BTIM.
    begin = {"begindatetime": "2024-03-01T10:00:00+01:00", "date": "01-MAR-2024"}
    assert fcs_acquired(begin) == "2024-03-01T10:00:00+01:00"
    assert fcs_acquired({"date": "01-MAR-2024", "btim": "25:00:00"}) == "2024-03-01"
    for broken in ({}, {"date": "31-FEB-2020"}, {"date": "2020-02-01"}, {"date": "01-XYZ-2020"}):
        assert fcs_acquired(broken) is None
