"""Reading one bag of cells, with its marker names, from the files labs have.

:func:`read_sample` reads FCS 2.0/3.0/3.1 through ``flowio`` (names from ``$PnS`` when
set, else ``$PnN``; both are kept for matching), CSV/TSV/TXT with a header row
(optionally gzip-compressed), NPY (a 2-D numeric array, names given separately),
Apache Parquet (pyarrow, the ``parquet`` extra) and AnnData ``.h5ad`` (anndata, the
``anndata`` extra). The format comes from the file name or, for raw bytes, from the
content's magic.

Every reading problem raises :class:`~core.errors.DataError` naming the file, and the
row or column when there is one. A caller that reads untrusted bytes (the service) passes
:class:`ReadLimits`: what a header declares (NPY shape, FCS ``$TOT``/``$PAR``, Parquet
and AnnData shapes, the rows of a CSV) and what a gzip stream inflates to are checked
against them before the memory is allocated, and
:class:`~core.errors.SizeLimitError` names the limit that was hit.
"""

from __future__ import annotations

import csv
import datetime
import io
import math
import os
import re
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError, SizeLimitError
from ..hashing import bytes_sha256
from .sample import NO_LIMITS, ReadLimits, Sample

__all__ = [
    "MAX_GZIP_MEMBERS",
    "SUPPORTED_SUFFIXES",
    "ReadLimits",
    "Sample",
    "format_of",
    "gunzip",
    "read_file",
    "read_sample",
]

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
GZIP_MAGIC = b"\x1f\x8b"
#: A gzip stream is fed to zlib in pieces of this many bytes and inflated in pieces of
#: ``_INFLATE_OUT`` bytes, so that neither the input nor the output is ever copied whole
#: and a bomb is stopped within one piece of its limit.
_INFLATE_IN = 1 << 16
_INFLATE_OUT = 1 << 20
#: A gzip stream may hold at most this many members. Tools that write many (bgzip:
#: one per 64 KiB of data) stay far below it within any decoded-size limit; each member
#: costs a new inflater, whatever it inflates to.
MAX_GZIP_MEMBERS = 65_536
#: NPY element kinds that are cells: real floats and integers. Complex values would
#: lose their imaginary part, booleans, strings, objects and records are no measurements.
_NPY_KINDS = "fiu"


def gunzip(data: bytes | bytearray | memoryview, source: str, limit: int | None = None) -> bytes:
    """Inflate a gzip stream (every member of it), stopping as soon as it passes ``limit``.

    The stream is inflated piece by piece: a small body that inflates to gigabytes
    (a "gzip bomb") costs at most ``limit`` bytes and the time to inflate them, never
    the whole. A stream whose trailer already declares more than ``limit`` (the size
    of its last member, modulo 2^32) is refused at once, and so is a stream of more
    than :data:`MAX_GZIP_MEMBERS` members (a body of empty members inflates to nothing
    but costs a new inflater each).

    Parameters
    ----------
    data : bytes-like
        The compressed bytes.
    source : str
        Named in errors.
    limit : int, optional
        Inflated bytes allowed.

    Raises
    ------
    SizeLimitError
        The stream inflates to more than ``limit`` bytes, or has too many members.
    DataError
        Not a gzip stream, or a broken or truncated one.
    """
    view = memoryview(data).cast("B")
    too_large = (
        f"{source}: the gzip stream inflates to more than {limit} bytes (the decoded-size limit)"
    )
    if limit is not None and len(view) >= 18 and int.from_bytes(view[-4:], "little") > limit:
        raise SizeLimitError(too_large)
    out = bytearray()
    # Where the next member starts: members are read in place, the rest of the stream
    # never copied (a copy per member made a stream of empty members quadratic).
    start = 0
    for _member in range(MAX_GZIP_MEMBERS):
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        pos = start
        try:
            while not inflater.eof and pos < len(view):
                piece: bytes | memoryview = view[pos : pos + _INFLATE_IN]
                pos += len(piece)
                while piece and not inflater.eof:
                    out += inflater.decompress(piece, _INFLATE_OUT)
                    if limit is not None and len(out) > limit:
                        raise SizeLimitError(too_large)
                    piece = inflater.unconsumed_tail
        except zlib.error as exc:
            raise DataError(f"{source}: broken gzip stream ({exc})") from exc
        if not inflater.eof:
            raise DataError(f"{source}: broken gzip stream (it ends before its last block)")
        start = pos - len(inflater.unused_data)
        # gzip(1) ignores zero bytes after the last member (tape padding); so do we.
        # (Copied once at most: a member cannot start with a zero byte.)
        if start >= len(view) or (view[start] == 0 and not bytes(view[start:]).strip(b"\0")):
            return bytes(out)
    raise SizeLimitError(
        f"{source}: the gzip stream has more than {MAX_GZIP_MEMBERS} members (the limit)"
    )


_MONTHS = {m: i for i, m in enumerate(
    ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"), 1
)}  # fmt: skip


def fcs_acquired(text: dict[str, Any]) -> str | None:
    """When an FCS file was acquired, from its TEXT keywords (flowio's: lower case,
    no ``$``): ``$BEGINDATETIME`` (FCS 3.2, ISO 8601) as written, else ``$DATE``
    (``dd-mmm-yyyy``) with ``$BTIM`` (``hh:mm:ss``, fractions dropped) as local time.
    ``None`` when absent or unreadable: the time is a courtesy, not a reason to refuse
    the sample."""
    begin = str(text.get("begindatetime", "")).strip()
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})?", begin):
        return begin
    m = re.fullmatch(r"(\d{1,2})-([A-Za-z]{3})-(\d{4})", str(text.get("date", "")).strip())
    if not m or m.group(2).upper() not in _MONTHS:
        return None
    day, month, year = int(m.group(1)), _MONTHS[m.group(2).upper()], int(m.group(3))
    try:
        date = datetime.date(year, month, day)
    except ValueError:
        return None
    t = re.match(r"(\d{1,2}):(\d{2}):(\d{2})", str(text.get("btim", "")).strip())
    if not t or int(t.group(1)) > 23 or int(t.group(2)) > 59 or int(t.group(3)) > 59:
        return date.isoformat()
    return f"{date.isoformat()}T{int(t.group(1)):02d}:{t.group(2)}:{t.group(3)}"


def format_of(name: str) -> str | None:
    """The ``format`` :func:`read_sample` reads a file of this name as (``csv.gz``
    for ``x.csv.gz``), or None when the name does not say (the content's magic will)."""
    return _suffix(name).lstrip(".") or None


def _suffix(name: str) -> str:
    """The format suffix of a file name; ``.csv.gz`` counts as one suffix."""
    lower = name.lower()
    for s in sorted(SUPPORTED_SUFFIXES, key=len, reverse=True):
        if lower.endswith(s):
            return s
    return Path(lower).suffix


def _check_fcs_size(text: dict[str, str], source: str, limits: ReadLimits) -> None:
    """The sizes an FCS TEXT segment declares, against the limits, before the DATA
    segment is read: ``$TOT`` x ``$PAR`` cells, and what the DATA segment's bytes
    become as float64 (integers of 8 bits grow eightfold)."""
    try:
        rows, columns = int(text["tot"]), int(text["par"])
        start, stop = int(text.get("begindata", 0)), int(text.get("enddata", 0))
        if text.get("datatype", "").lower() == "i":
            bits = min(int(text[f"p{i}b"]) for i in range(1, columns + 1))
        else:
            bits = {"f": 32, "d": 64}.get(text.get("datatype", "").lower(), 32)
    except (KeyError, ValueError):
        return  # flowio names what is missing or malformed
    limits.check_shape(rows, columns, source, "its $TOT and $PAR keywords")
    values = max(stop - start + 1, 0) * 8 // max(bits, 1)
    if limits.max_decoded_bytes is not None and values * 8 > limits.max_decoded_bytes:
        raise SizeLimitError(
            f"{source}: its DATA segment decodes to {values * 8} bytes, more than the "
            f"decoded-size limit of {limits.max_decoded_bytes} bytes"
        )


def _read_fcs(data: bytes, source: str, limits: ReadLimits = NO_LIMITS) -> Sample:
    """An FCS file's events; names from ``$PnS`` when set, ``$PnN`` kept as alternates."""
    import flowio

    if len(data) < 58 or not data[:3] == b"FCS":
        raise DataError(f"{source}: not an FCS file (no 'FCS' header)")
    try:
        if limits != NO_LIMITS:
            head = flowio.FlowData(io.BytesIO(data), only_text=True)
            _check_fcs_size(head.text, source, limits)
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
    fil = str(fd.text.get("fil", "")).strip() or None
    return Sample(arr, names, pnn, source, spill, fil, fcs_acquired(fd.text))


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


def _read_parquet(data: bytes | memoryview, source: str, limits: ReadLimits = NO_LIMITS) -> Sample:
    """A Parquet table: its numeric columns are the markers.

    Lab exports often carry text columns beside the measurements (a sample id, a gate
    name); those are skipped, as a CSV reader cannot, and the panel then picks its
    markers by name. A null in a numeric column is an error naming it. Only the numeric
    columns are decompressed, after the footer's row count passed the limits.
    """
    pq = _extra("pyarrow.parquet", "parquet", source)
    pa = _extra("pyarrow", "parquet", source)
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        schema = parquet.schema_arrow
        numeric = [
            f.name for f in schema if pa.types.is_integer(f.type) or pa.types.is_floating(f.type)
        ]
        if not numeric:
            raise DataError(
                f"{source}: no numeric column among {schema.names} (markers must be numbers)"
            )
        limits.check_shape(parquet.metadata.num_rows, len(numeric), source, "its footer")
        table = parquet.read(columns=numeric)
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for broken files
        raise DataError(f"{source}: unreadable Parquet file ({type(exc).__name__}: {exc})") from exc
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


def _h5ad_shape(h5: Any, source: str) -> tuple[int, int]:
    """The cells x markers shape of an AnnData file's ``X``, from its metadata only."""
    x = h5.get("X")
    if x is None:
        raise DataError(f"{source}: the AnnData file has no X matrix")
    shape = x.attrs.get("shape") if not hasattr(x, "shape") else x.shape
    if shape is None or len(shape) != 2:
        raise DataError(f"{source}: X must be a cells x markers matrix")
    return int(shape[0]), int(shape[1])


def _read_h5ad(data: bytes | memoryview, source: str, limits: ReadLimits = NO_LIMITS) -> Sample:
    """An AnnData file: cells are ``obs``, markers ``var`` (names: ``var_names``).

    Only ``X`` and ``var`` are read (AnnData's own element reader), after ``X``'s
    declared shape passed the limits; ``obs``, ``uns`` and layers are never decoded.
    """
    _extra("anndata", "anndata", source)
    import h5py
    from anndata.io import read_elem

    try:
        with h5py.File(io.BytesIO(bytes(data)), "r") as h5:
            limits.check_shape(*_h5ad_shape(h5, source), source, "the shape of its X")
            x = read_elem(h5["X"])
            var = read_elem(h5["var"]) if "var" in h5 else None
    except DataError:
        raise
    except Exception as exc:  # h5py and anndata raise many types for broken files
        raise DataError(f"{source}: unreadable AnnData file ({type(exc).__name__}: {exc})") from exc
    if hasattr(x, "toarray"):  # scipy sparse
        x = x.toarray()
    points = np.asarray(x)
    if points.ndim != 2 or not np.issubdtype(points.dtype, np.number):
        raise DataError(f"{source}: X must be a numeric cells x markers matrix, got {points.dtype}")
    if var is None or len(var.index) != points.shape[1]:
        raise DataError(f"{source}: var does not name the {points.shape[1]} columns of X")
    names = [str(v) for v in var.index]
    alt = next(
        ([str(v) for v in var[c]] for c in ANNDATA_ALT_COLUMNS if c in var),
        names,
    )
    return Sample(np.ascontiguousarray(points, dtype=np.float64), names, alt, source)


#: numpy's loadtxt errors, turned into messages naming the row (as the file counts
#: them, header included, blank lines skipped) and the column by its name.
_NOT_A_NUMBER = re.compile(r"could not convert string (.*) to float64 at row (\d+), column (\d+)")
_FIELDS_CHANGED = re.compile(r"number of columns changed from (\d+) to (\d+) at row (\d+)")


def _read_text(
    data: bytes | bytearray | memoryview,
    source: str,
    delimiter: str | None,
    limits: ReadLimits = NO_LIMITS,
) -> Sample:
    """A delimited table with a header row; the delimiter is sniffed unless given.

    The header is read with :mod:`csv`; the cells with numpy's C parser
    (:func:`numpy.loadtxt`), which allocates only the float64 array. The rows the text
    can hold (its line count) are checked against the limits first.
    """
    try:
        text = str(data, "utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{source}: not UTF-8 text ({exc})") from exc
    first, _, rest = text.partition("\n")
    first = first.rstrip("\r")
    if not first.strip():
        raise DataError(f"{source}: empty file (a header row with marker names is required)")
    if delimiter is None:
        try:
            delimiter = csv.Sniffer().sniff(first, delimiters=",\t;").delimiter
        except csv.Error:
            delimiter = ","
    header = [h.strip() for h in next(csv.reader([first], delimiter=delimiter))]
    if any(_is_number(h) for h in header):
        raise DataError(
            f"{source}: the first row must hold marker names, found a number "
            f"({next(h for h in header if _is_number(h))!r})"
        )
    limits.check_shape(rest.count("\n") + 1, len(header), source, "its lines")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data"
            arr = np.loadtxt(
                io.StringIO(rest),
                delimiter=delimiter,
                dtype=np.float64,
                ndmin=2,
                comments=None,
                quotechar='"',
            )
    except ValueError as exc:
        raise DataError(_text_problem(str(exc), source, header)) from None
    if arr.size == 0:
        arr = np.empty((0, len(header)))
    if arr.shape[1] != len(header):
        raise DataError(
            f"{source}: row 2 has {arr.shape[1]} field(s), the header has {len(header)}"
        )
    return Sample(arr, header, list(header), source)


def _text_problem(message: str, source: str, header: list[str]) -> str:
    """numpy's message about a bad cell, in the file's own terms."""
    bad = _NOT_A_NUMBER.search(message)
    if bad is not None:
        value, row, column = bad.group(1), int(bad.group(2)), int(bad.group(3))
        if column > len(header):
            return f"{source}: row {row + 2} has more than {len(header)} field(s) (the header's)"
        return f"{source}: row {row + 2}, column {header[column - 1]!r}: {value} is not a number"
    changed = _FIELDS_CHANGED.search(message)
    if changed is not None:
        first, now, row = (int(g) for g in changed.groups())
        if first != len(header):
            return f"{source}: row 2 has {first} field(s), the header has {len(header)}"
        return f"{source}: row {row + 1} has {now} field(s), the header has {len(header)}"
    return f"{source}: unreadable table ({message})"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _npy_header(view: memoryview, source: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """Shape, Fortran order, dtype and data offset of an NPY file, from its header only."""
    try:
        prefix = bytes(view[:12])
        version = np.lib.format.read_magic(io.BytesIO(prefix))
        # Version 3.0 only allows UTF-8 in the header, which a numeric array never has.
        read = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise ValueError(f"unknown NPY format version {version}")
        width = 2 if version == (1, 0) else 4
        start = 8 + width + int.from_bytes(prefix[8 : 8 + width], "little")
        head = io.BytesIO(bytes(view[:start]))
        np.lib.format.read_magic(head)
        shape, fortran, dtype = read(head)
    except ValueError as exc:
        raise DataError(f"{source}: not a readable NPY array ({exc})") from exc
    return tuple(int(n) for n in shape), bool(fortran), np.dtype(dtype), start


def _read_npy(
    data: bytes | bytearray | memoryview,
    source: str,
    names: Sequence[str] | None,
    limits: ReadLimits = NO_LIMITS,
) -> Sample:
    """A 2-D real-valued NPY array, read from its header and bytes (never ``np.load``).

    The header's dtype, shape and data length are checked before anything is
    allocated: complex, boolean, text, object and structured arrays are refused naming
    their dtype, a shape beyond the limits or unlike the data's length is refused. A
    little-endian float64 C-order array then views ``data`` (read-only, no copy: an
    upload in shared memory reaches the model as it is); other real dtypes are
    converted once.
    """
    view = memoryview(data).cast("B")
    shape, fortran, dtype, start = _npy_header(view, source)
    if dtype.kind not in _NPY_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise DataError(
            f"{source}: NPY dtype {dtype.str if dtype.fields is None else dtype.descr!r} is "
            "not supported: cells must be real numbers (a float or integer dtype)"
        )
    if len(shape) != 2:
        raise DataError(
            f"{source}: NPY must hold a 2-D numeric array (cells x markers), "
            f"got {dtype} of shape {shape}"
        )
    limits.check_shape(shape[0], shape[1], source, "its NPY header")
    expected = math.prod(shape) * dtype.itemsize
    if len(view) - start != expected:
        raise DataError(
            f"{source}: not a readable NPY array (its header declares {shape} {dtype}, "
            f"{expected} bytes of data; the file holds {len(view) - start})"
        )
    flat = np.frombuffer(view, dtype=dtype, count=math.prod(shape), offset=start)
    arr = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    # A writable upload buffer still gives a read-only array, as bytes would.
    arr.flags.writeable = False
    if names is None:
        names = [str(i) for i in range(arr.shape[1])]
    if len(names) != arr.shape[1]:
        raise DataError(f"{source}: {len(names)} marker name(s) for {arr.shape[1]} column(s)")
    if dtype != np.dtype("<f8") or fortran:
        arr = np.ascontiguousarray(arr, dtype=np.float64)
    return Sample(arr, list(names), list(names), source)


def read_sample(
    source: str | os.PathLike[str] | bytes | bytearray | memoryview,
    *,
    format: str | None = None,
    name: str | None = None,
    markers: Sequence[str] | None = None,
    limits: ReadLimits | None = None,
) -> Sample:
    """Read one bag of cells from a file path or raw bytes.

    Parameters
    ----------
    source : path, bytes or memoryview
        A file, or its contents (an NPY memoryview is read without a copy).
    format : {"fcs", "csv", "tsv", "npy", "parquet", "h5ad"}, optional
        Default: from the file name (``.fcs``, ``.csv[.gz]``, ``.tsv[.gz]``,
        ``.txt[.gz]``, ``.npy``, ``.parquet`` / ``.pq``, ``.h5ad``), else from the
        content's magic bytes. gzip is recognised by its magic bytes whatever the name.
    name : str, optional
        Name used in error messages (default: the path).
    markers : sequence of str, optional
        Column names for NPY input, which has none.
    limits : ReadLimits, optional
        Bounds for untrusted input, checked before allocating (default: none).

    Raises
    ------
    SizeLimitError
        The sample is larger than ``limits`` allow (naming the limit).
    DataError
        Unreadable, truncated or wrongly typed file, naming it (and the row/column).
    """
    limits = limits or NO_LIMITS
    if isinstance(source, bytes | bytearray | memoryview):
        # A memoryview (an upload in shared memory) is kept as it is for NPY, which
        # reads it without a copy; the other formats take bytes.
        data = source
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
    if suffix.endswith(".gz") or bytes(data[:2]) == GZIP_MAGIC:
        data = gunzip(data, label, limits.max_decoded_bytes)
        suffix = suffix.removesuffix(".gz")
    head = bytes(data[:8])
    if suffix == ".fcs" or (not suffix and head[:3] == b"FCS"):
        sample = _read_fcs(bytes(data), label, limits)
    elif suffix == ".npy" or (not suffix and head[:6] == b"\x93NUMPY"):
        sample = _read_npy(data, label, markers, limits)
    elif suffix in (".parquet", ".pq") or (not suffix and head[:4] == PARQUET_MAGIC):
        sample = _read_parquet(data, label, limits)
    elif suffix == ".h5ad" or (not suffix and head == HDF5_MAGIC):
        sample = _read_h5ad(data, label, limits)
    elif suffix in (".csv", ".tsv", ".txt", ""):
        sample = _read_text(data, label, "\t" if suffix == ".tsv" else None, limits)
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
    return read_sample(data, format=format_of(path.name), name=str(path)), bytes_sha256(data)
