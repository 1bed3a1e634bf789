"""Reading one bag of cells, with its marker names, from the files labs have.

:func:`read_sample` reads FCS 2.0/3.0/3.1 through ``flowio`` (names from ``$PnS`` when
set, else ``$PnN``; both are kept for matching), CSV/TSV/TXT with a header row
(optionally gzip-compressed), NPY (a 2-D numeric array, names given separately),
Apache Parquet (pyarrow, the ``parquet`` extra) and AnnData ``.h5ad`` (anndata, the
``anndata`` extra). The format comes from the file name or, for raw bytes, from the
content's magic.

Every reading problem raises :class:`~core.errors.DataError` naming the file, and the
row or column when there is one.
"""

from __future__ import annotations

import csv
import gzip
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import DataError
from ..hashing import bytes_sha256

__all__ = ["SUPPORTED_SUFFIXES", "Sample", "read_file", "read_sample"]

SUPPORTED_SUFFIXES = (
    ".fcs",
    ".csv",
    ".tsv",
    ".txt",
    ".npy",
    ".csv.gz",
    ".tsv.gz",
    ".txt.gz",
    ".parquet",
    ".pq",
    ".h5ad",
)
PARQUET_MAGIC = b"PAR1"
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
#: Columns of an AnnData ``var`` table that hold a second name per marker (the
#: instrument's channel, as FCS-to-AnnData converters keep it), first found wins.
ANNDATA_ALT_COLUMNS = ("channel", "pnn", "marker", "antigen")


@dataclass(frozen=True)
class Sample:
    """One bag of cells read from a file.

    Attributes
    ----------
    points : ndarray of shape (n_cells, n_columns)
    names : list of str
        Display name of each column (``$PnS`` if set, else ``$PnN``, or the CSV header).
    alt_names : list of str
        A second name per column (``$PnN`` for FCS), also accepted when matching.
    source : str
        Where it came from (file name).
    spillover : str, optional
        The FCS file's spillover keyword as written (``$SPILLOVER``, else ``SPILL``,
        else ``$COMP``), parsed only when a model compensates with it (a broken keyword
        then fails only the models that need it).
    """

    points: NDArray[np.float64]
    names: list[str]
    alt_names: list[str]
    source: str
    spillover: str | None = None


def _suffix(name: str) -> str:
    """The format suffix of a file name; ``.csv.gz`` counts as one suffix."""
    lower = name.lower()
    for s in sorted(SUPPORTED_SUFFIXES, key=len, reverse=True):
        if lower.endswith(s):
            return s
    return Path(lower).suffix


def _read_fcs(data: bytes, source: str) -> Sample:
    """An FCS file's events; names from ``$PnS`` when set, ``$PnN`` kept as alternates."""
    import flowio

    if len(data) < 58 or not data[:3] == b"FCS":
        raise DataError(f"{source}: not an FCS file (no 'FCS' header)")
    try:
        fd = flowio.FlowData(io.BytesIO(data))
        arr = np.asarray(fd.as_array(preprocess=True), dtype=np.float64)
    except (DataError, MemoryError):
        raise
    except Exception as exc:  # flowio raises several exception types for broken files
        raise DataError(f"{source}: unreadable FCS file ({type(exc).__name__}: {exc})") from exc
    pnn = [str(v).strip() for v in fd.pnn_labels]
    pns = [str(v).strip() for v in fd.pns_labels]
    if arr.ndim != 2 or arr.shape[1] != len(pnn):
        raise DataError(f"{source}: FCS data do not match its {len(pnn)} channel(s)")
    names = [s if s else n for s, n in zip(pns, pnn, strict=True)]
    # flowio gives the keywords lower case, without their "$".
    spill = next((fd.text[k] for k in ("spillover", "spill", "comp") if fd.text.get(k)), None)
    return Sample(arr, names, pnn, source, spill)


def _extra(module: str, extra: str, source: str) -> Any:
    """An optional dependency, or a DataError saying which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(
            f"{source}: reading this format needs {module.split('.')[0]}: "
            f"pip install 'bagserve[{extra}]'"
        ) from None


def _read_parquet(data: bytes | memoryview, source: str) -> Sample:
    """A Parquet table: its numeric columns are the markers.

    Lab exports often carry text columns beside the measurements (a sample id, a gate
    name); those are skipped, as a CSV reader cannot, and the panel then picks its
    markers by name. A null in a numeric column is an error naming it.
    """
    pq = _extra("pyarrow.parquet", "parquet", source)
    pa = _extra("pyarrow", "parquet", source)
    try:
        table = pq.read_table(pa.BufferReader(data))
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for broken files
        raise DataError(f"{source}: unreadable Parquet file ({type(exc).__name__}: {exc})") from exc
    numeric = [
        f.name for f in table.schema if pa.types.is_integer(f.type) or pa.types.is_floating(f.type)
    ]
    if not numeric:
        raise DataError(
            f"{source}: no numeric column among {table.schema.names} (markers must be numbers)"
        )
    columns = []
    for name in numeric:
        col = table.column(name)
        if col.null_count:
            first = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(
                f"{source}: column {name!r} has {col.null_count} missing value(s), "
                f"first at row {first + 1}"
            )
        columns.append(col.to_numpy().astype(np.float64, copy=False))
    points = np.column_stack(columns) if columns[0].size else np.empty((0, len(numeric)))
    return Sample(np.ascontiguousarray(points), numeric, list(numeric), source)


def _read_h5ad(data: bytes | memoryview, source: str) -> Sample:
    """An AnnData file: cells are ``obs``, markers ``var`` (names: ``var_names``)."""
    anndata = _extra("anndata", "anndata", source)
    try:
        adata = anndata.read_h5ad(io.BytesIO(bytes(data)))
    except Exception as exc:  # h5py and anndata raise many types for broken files
        raise DataError(f"{source}: unreadable AnnData file ({type(exc).__name__}: {exc})") from exc
    x = adata.X
    if x is None:
        raise DataError(f"{source}: the AnnData file has no X matrix")
    if hasattr(x, "toarray"):  # scipy sparse
        x = x.toarray()
    points = np.asarray(x)
    if points.ndim != 2 or not np.issubdtype(points.dtype, np.number):
        raise DataError(f"{source}: X must be a numeric cells x markers matrix, got {points.dtype}")
    names = [str(v) for v in adata.var_names]
    alt = next(
        ([str(v) for v in adata.var[c]] for c in ANNDATA_ALT_COLUMNS if c in adata.var),
        names,
    )
    return Sample(np.ascontiguousarray(points, dtype=np.float64), names, alt, source)


def _read_text(data: bytes, source: str, delimiter: str | None) -> Sample:
    """A delimited table with a header row; the delimiter is sniffed unless given."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{source}: not UTF-8 text ({exc})") from exc
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise DataError(f"{source}: empty file (a header row with marker names is required)")
    if delimiter is None:
        try:
            delimiter = csv.Sniffer().sniff(lines[0], delimiters=",\t;").delimiter
        except csv.Error:
            delimiter = ","
    reader = csv.reader(lines, delimiter=delimiter)
    header = [h.strip() for h in next(reader)]
    if any(_is_number(h) for h in header):
        raise DataError(
            f"{source}: the first row must hold marker names, found a number "
            f"({next(h for h in header if _is_number(h))!r})"
        )
    rows = list(reader)
    rows = [r for r in rows if any(c.strip() for c in r)]
    for i, r in enumerate(rows):
        if len(r) != len(header):
            raise DataError(
                f"{source}: row {i + 2} has {len(r)} field(s), the header has {len(header)}"
            )
    try:
        arr = np.array(rows, dtype=np.float64).reshape(len(rows), len(header))
    except ValueError:
        for i, r in enumerate(rows):
            for j, c in enumerate(r):
                if not _is_number(c):
                    raise DataError(
                        f"{source}: row {i + 2}, column {header[j]!r}: {c!r} is not a number"
                    ) from None
        raise
    return Sample(arr, header, list(header), source)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _read_npy(data: bytes | memoryview, source: str, names: Sequence[str] | None) -> Sample:
    """A 2-D numeric NPY array; little-endian float64 C-order data is not copied.

    The array then views ``data`` (read-only), which saves a copy of every upload; only
    the header is copied out to be parsed.
    """
    view = memoryview(data).cast("B")
    try:
        prefix = bytes(view[:12])
        version = np.lib.format.read_magic(io.BytesIO(prefix))
        read_header = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }.get(version)
        if read_header is not None:
            # Magic and version (8 bytes), the header's length (2 or 4), the header.
            width = 2 if version == (1, 0) else 4
            start = 8 + width + int.from_bytes(prefix[8 : 8 + width], "little")
            head = io.BytesIO(bytes(view[:start]))
            np.lib.format.read_magic(head)
            shape, fortran, dtype = read_header(head)
        if (
            read_header is not None
            and dtype == np.dtype("<f8")
            and not fortran
            and len(view) - start == int(np.prod(shape, dtype=np.int64)) * 8
        ):
            arr = np.frombuffer(view, dtype=dtype, offset=start).reshape(shape)
            # A writable upload buffer still gives a read-only array, as bytes would.
            arr.flags.writeable = False
        else:
            arr = np.load(io.BytesIO(view), allow_pickle=False)
    except ValueError as exc:
        raise DataError(f"{source}: not a readable NPY array ({exc})") from exc
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.number):
        raise DataError(
            f"{source}: NPY must hold a 2-D numeric array (cells x markers), "
            f"got {arr.dtype} of shape {arr.shape}"
        )
    if names is None:
        names = [str(i) for i in range(arr.shape[1])]
    if len(names) != arr.shape[1]:
        raise DataError(f"{source}: {len(names)} marker name(s) for {arr.shape[1]} column(s)")
    return Sample(arr.astype(np.float64, copy=False), list(names), list(names), source)


def read_sample(
    source: str | os.PathLike[str] | bytes | memoryview,
    *,
    format: str | None = None,
    name: str | None = None,
    markers: Sequence[str] | None = None,
) -> Sample:
    """Read one bag of cells from a file path or raw bytes.

    Parameters
    ----------
    source : path, bytes or memoryview
        A file, or its contents (an NPY memoryview is read without a copy).
    format : {"fcs", "csv", "tsv", "npy", "parquet", "h5ad"}, optional
        Default: from the file name (``.fcs``, ``.csv[.gz]``, ``.tsv[.gz]``,
        ``.txt[.gz]``, ``.npy``, ``.parquet`` / ``.pq``, ``.h5ad``), else from the
        content's magic bytes.
    name : str, optional
        Name used in error messages (default: the path).
    markers : sequence of str, optional
        Column names for NPY input, which has none.

    Raises
    ------
    DataError
        Unreadable, truncated or wrongly typed file, naming it (and the row/column).
    """
    if isinstance(source, bytes | bytearray | memoryview):
        # A memoryview (an upload in shared memory) is kept as it is for NPY, which
        # reads it without a copy; the other formats take bytes.
        data = source if isinstance(source, memoryview) else bytes(source)
        label = name or "<upload>"
        suffix = f".{format}" if format else ""
    else:
        path = Path(source)
        label = name or str(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise DataError(f"{label}: cannot read ({exc.strerror or exc})") from exc
        suffix = f".{format}" if format else _suffix(path.name)
    if suffix.endswith(".gz") or data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise DataError(f"{label}: broken gzip stream ({exc})") from exc
        suffix = suffix.removesuffix(".gz")
    if suffix == ".fcs" or (not suffix and data[:3] == b"FCS"):
        sample = _read_fcs(bytes(data), label)
    elif suffix == ".npy" or (not suffix and data[:6] == b"\x93NUMPY"):
        sample = _read_npy(data, label, markers)
    elif suffix in (".parquet", ".pq") or (not suffix and bytes(data[:4]) == PARQUET_MAGIC):
        sample = _read_parquet(data, label)
    elif suffix == ".h5ad" or (not suffix and bytes(data[:8]) == HDF5_MAGIC):
        sample = _read_h5ad(data, label)
    elif suffix in (".csv", ".tsv", ".txt", ""):
        sample = _read_text(bytes(data), label, "\t" if suffix == ".tsv" else None)
    else:
        raise DataError(
            f"{label}: unsupported file type {suffix!r}; expected one of {SUPPORTED_SUFFIXES}"
        )
    if sample.points.shape[0] == 0:
        raise DataError(f"{label}: no cells")
    if not np.isfinite(sample.points).all():
        bad = ~np.isfinite(sample.points)
        row, col = np.argwhere(bad)[0]
        raise DataError(
            f"{label}: {int(bad.sum())} non-finite value(s), first at cell {row + 1}, "
            f"marker {sample.names[col]!r}"
        )
    return sample


def read_file(path: str | os.PathLike[str]) -> tuple[Sample, str]:
    """:func:`read_sample` of a file, and the sha256 of its bytes, in one read.

    Parameters
    ----------
    path : path-like
        The file; its format comes from its name.

    Returns
    -------
    sample : Sample
    sha256 : str
        Of the file's bytes as stored (before any gzip decompression).

    Raises
    ------
    DataError
        The file cannot be read or parsed.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    fmt = _suffix(path.name).lstrip(".") or None
    return read_sample(data, format=fmt, name=str(path)), bytes_sha256(data)
