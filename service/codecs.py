"""Request bodies to bags: JSON, NPY, CSV/TSV, FCS, Parquet, AnnData and multipart.

These decoders run in the worker processes (:mod:`.worker`), never on the server's event
loop: a body crosses to a worker as bytes (through shared memory when large) and is
decoded there, so that a slow or hostile body stalls one worker, not every request, and
the memory it takes is the worker's. Every decoder is bounded by
:class:`RequestLimits`, checked before the memory is allocated (a compressed body's
inflated size, an NPY or FCS header's shape, the rows of a CSV, the values of a JSON
document); a body beyond them is refused with 413, an undecodable one with 400, 415 or
422, each naming the problem.

Accepted bodies (``Content-Type``), each optionally ``Content-Encoding: gzip``:

* ``application/json``: ``{"bags": [{"id", "points", "markers"?, "weights"?}]}``. Plain
  documents of this shape are parsed by simdjson straight into float64 buffers (no
  Python object per number, about 4x faster than orjson + numpy on large bags); anything
  else, including every malformed body, goes through orjson, whose path writes the
  error messages. Both paths give the same arrays, bit for bit;
* ``application/x-npy``: one bag, a 2-D array; marker names in the ``markers`` query
  parameter (comma-separated), or columns in the model's panel order;
* ``text/csv`` / ``text/tab-separated-values``: one bag with a header row of markers;
* ``application/vnd.isac.fcs`` (or ``application/octet-stream`` holding FCS): one bag;
* ``application/vnd.apache.parquet`` (numeric columns are markers) and
  ``application/x-hdf5`` (an AnnData ``.h5ad`` file): one bag each, with the optional
  extras ``bagserve[parquet]`` / ``bagserve[anndata]`` installed;
* ``multipart/form-data``: several files of the above kinds, one bag each (the file
  name is the bag id and tells the format; ``.gz`` files are inflated).
"""

from __future__ import annotations

import io
import threading
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import orjson
import simdjson
from bagserve.core.errors import SizeLimitError
from bagserve.core.hashing import bytes_sha256, points_sha256
from bagserve.core.io import DataError, read_sample
from bagserve.core.io.readers import GZIP_MAGIC, gunzip
from bagserve.core.io.sample import ReadLimits

from .errors import Problem

__all__ = [
    "ACCEPTED",
    "ENCODINGS",
    "BodySpec",
    "IncomingBag",
    "RequestLimits",
    "decode_body",
    "decode_file",
    "inflate",
    "media_type",
    "npy_bytes",
    "simdjson_document",
]

JSON = "application/json"
NPY = "application/x-npy"
CSV = "text/csv"
TSV = "text/tab-separated-values"
FCS = "application/vnd.isac.fcs"
OCTET = "application/octet-stream"
PARQUET = "application/vnd.apache.parquet"
HDF5 = "application/x-hdf5"
MULTIPART = "multipart/form-data"
ACCEPTED = (JSON, NPY, CSV, TSV, FCS, PARQUET, HDF5, OCTET, MULTIPART)
#: ``Content-Encoding`` values a body may carry (``identity`` or none: as it is).
ENCODINGS = ("gzip", "x-gzip", "deflate")
#: File kinds by name suffix (multipart parts) and by magic bytes (octet-stream).
FILE_KINDS = ("fcs", "csv", "tsv", "npy", "parquet", "pq", "h5ad")
MAGIC = (
    (b"FCS", "fcs"),
    (b"\x93NUMPY", "npy"),
    (b"PAR1", "parquet"),
    (b"\x89HDF\r\n\x1a\n", "h5ad"),
)
BAG_KEYS = {"id", "points", "markers", "weights"}


@dataclass
class IncomingBag:
    """One bag as received: raw columns, their names if the format carries them."""

    id: str
    points: np.ndarray
    names: list[str] | None
    alt_names: list[str] | None = None
    weights: np.ndarray | None = None
    #: Every value is already known to be finite (files: read_sample checks them).
    finite: bool = False
    #: An FCS file's spillover keyword, for models that compensate with it.
    spillover: str | None = None
    #: sha256 of the sample as it came: its file's bytes (undone from the request's
    #: Content-Encoding, as uploaded otherwise), or its cells as float64 when they came
    #: as numbers; ``None``: the request body itself is the file (its hash is the
    #: request's, computed beside the worker).
    input_sha256: str | None = None
    #: When the instrument acquired the sample (FCS keywords), for FHIR's
    #: ``effectiveDateTime`` (:attr:`bagserve.core.io.Sample.acquired`).
    acquired: str | None = None


@dataclass(frozen=True)
class RequestLimits:
    """What one request may hold and what decoding it may allocate.

    Attributes
    ----------
    max_decoded_bytes : int
        A compressed body (or each of its files, together) may inflate to at most this
        many bytes, and its cells may take at most this many bytes as float64.
    max_bags, max_points_per_bag, max_total_points, max_columns : int
        The service's limits on bags, cells per bag, cells in all, and columns.
    """

    max_decoded_bytes: int
    max_bags: int
    max_points_per_bag: int
    max_total_points: int
    max_columns: int

    def reading(self, decoded_budget: int | None = None) -> ReadLimits:
        """The core readers' limits for one file, with ``decoded_budget`` bytes left."""
        budget = self.max_decoded_bytes if decoded_budget is None else decoded_budget
        return ReadLimits(
            max_decoded_bytes=budget,
            max_cells=self.max_points_per_bag,
            max_columns=self.max_columns,
        )

    def to_json(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class BodySpec:
    """How to decode a request body: what the request's headers and query said of it.

    Attributes
    ----------
    content_type : str
        The whole ``Content-Type`` header (a multipart body needs its boundary).
    content_encoding : str
        The ``Content-Encoding`` header (``gzip``, ``deflate``; empty: none).
    markers : list of str, optional
        Column names of an NPY body (the ``markers`` query parameter).
    default_id : str, optional
        The id of a single bag that names none (the ``id`` query parameter); without
        one, a file body is known by the name it gives itself (FCS ``$FIL``), else as
        ``bag-0``.
    protocol : {"v1", "v2"}
        A native body, or an Open Inference Protocol document (:mod:`.tensors`).
    header_length : str, optional
        ``/v2``: the ``Inference-Header-Content-Length`` header (binary tensors).
    """

    content_type: str
    content_encoding: str = ""
    markers: list[str] | None = None
    default_id: str | None = None
    protocol: str = "v1"
    header_length: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def media_type(header: str | None) -> str:
    """The media type of a ``Content-Type`` or ``Accept`` entry, lower case, no parameters."""
    return (header or "").split(";")[0].strip().lower()


def encoding_problem(header: str | None) -> str | None:
    """Why a ``Content-Encoding`` cannot be decoded (None when it can)."""
    coding = (header or "").strip().lower()
    if coding in ("", "identity", *ENCODINGS):
        return None
    return f"unsupported Content-Encoding {header!r}; expected one of {list(ENCODINGS)}"


def inflate(body: bytes | memoryview, encoding: str, limits: RequestLimits) -> bytes | memoryview:
    """The body with its ``Content-Encoding`` undone, within the decoded-size limit (413)."""
    coding = encoding.strip().lower()
    if coding in ("", "identity"):
        return body
    try:
        if coding in ("gzip", "x-gzip"):
            return gunzip(body, "the body", limits.max_decoded_bytes)
        if coding == "deflate":
            return _inflate_zlib(body, limits.max_decoded_bytes)
    except SizeLimitError as exc:
        raise Problem(413, str(exc), slug="decoded-too-large") from None
    except DataError as exc:
        raise Problem(400, str(exc), slug="invalid-encoding") from None
    raise Problem(415, encoding_problem(encoding) or coding, slug="unsupported-encoding")


def _inflate_zlib(body: bytes | memoryview, limit: int) -> bytes:
    """A ``deflate`` body (zlib-wrapped, or raw as some clients send it), bounded."""
    view = memoryview(body).cast("B")
    raw = len(view) < 2 or (view[0] & 0x0F) != 8 or (view[0] << 8 | view[1]) % 31 != 0
    inflater = zlib.decompressobj(-zlib.MAX_WBITS if raw else zlib.MAX_WBITS)
    out = bytearray()
    try:
        for start in range(0, len(view), 1 << 16):
            piece: bytes | memoryview = view[start : start + (1 << 16)]
            while piece and not inflater.eof:
                out += inflater.decompress(piece, 1 << 20)
                if len(out) > limit:
                    raise SizeLimitError(
                        f"the body inflates to more than {limit} bytes (the decoded-size limit)"
                    )
                piece = inflater.unconsumed_tail
    except zlib.error as exc:
        raise DataError(f"the body: broken deflate stream ({exc})") from exc
    if not inflater.eof:
        raise DataError("the body: broken deflate stream (it ends before its last block)")
    return bytes(out)


#: JSON bodies up to this size reuse their thread's parser (larger ones get their own).
PARSER_REUSE_BYTES = 32 << 20
_local = threading.local()


def _parser(size: int) -> simdjson.Parser:
    """A simdjson parser, reused for bodies up to ``PARSER_REUSE_BYTES``.

    A new parser allocates and faults in its buffers (about 2.3 times the document)
    on every parse: 13 of 52 ms for a 19 MB body. A reused one keeps them, which
    bounds the memory kept to about 75 MB per thread. Nothing the fast path returns
    refers to the parser (points and weights are copied out, ids and markers are
    Python strings), so the next parse cannot change an earlier result; a parser
    still holding a live document refuses to parse (RuntimeError), and a fresh one
    takes over.
    """
    if size > PARSER_REUSE_BYTES:
        return simdjson.Parser()
    parser = getattr(_local, "parser", None)
    if parser is None:
        parser = _local.parser = simdjson.Parser()
    return parser


def simdjson_document(body: bytes | memoryview) -> Any:
    """``body`` parsed by simdjson, with the thread's parser when it is free.

    Raises what simdjson raises for an invalid document, and ValueError for a body
    that starts with a UTF-8 byte order mark, which simdjson skips but JSON (RFC 8259)
    and orjson, whose path writes the error messages, do not allow.
    """
    if bytes(body[:3]) == b"\xef\xbb\xbf":
        raise ValueError("a byte order mark")
    try:
        return _parser(len(body)).parse(body)
    except RuntimeError:  # the thread's parser still holds a live document
        return simdjson.Parser().parse(body)


def check_json_values(body: bytes | memoryview, limits: RequestLimits) -> None:
    """Refuse a JSON body whose numbers would take more than the decoded-size limit.

    A document of one-digit numbers holds one value per two bytes, and every parser
    spends 8 bytes or more on each: a 256 MiB body could ask for gigabytes. Each value
    but the last of an array is followed by a comma, so commas and brackets bound the
    count from the bytes alone (about 12 ms for 19 MB, needed only for bodies larger
    than a quarter of the limit).
    """
    # A value takes two bytes at least (a digit and a separator): most bodies pass on
    # their length alone, without a pass over their bytes.
    if (len(body) // 2 + 1) * 8 <= limits.max_decoded_bytes:
        return
    raw = np.frombuffer(body, np.uint8)
    values = int(np.count_nonzero(raw == ord(","))) + int(np.count_nonzero(raw == ord("[")))
    if values * 8 > limits.max_decoded_bytes:
        raise Problem(
            413,
            f"the JSON body holds up to {values} values, {values * 8} bytes decoded: more than "
            f"the decoded-size limit of {limits.max_decoded_bytes} bytes",
            slug="decoded-too-large",
        )


def _plain_json_bags(body: bytes | memoryview) -> list[IncomingBag] | None:
    """The bags of a plain, valid document, or None to take the general path.

    simdjson flattens nested arrays into one buffer without checking their shape, so a
    document is accepted here only if every row has the same length and the document
    holds no array besides the expected ones: ``[`` occurs in the body exactly once per
    expected array (a ``[`` inside a string only adds to the count and sends the body
    to the general path, which is always correct).
    """
    try:
        doc = simdjson_document(body)
        if isinstance(doc, simdjson.Object) and "points" in doc and "bags" not in doc:
            items = [doc]
            arrays = 0
        elif isinstance(doc, simdjson.Object) and isinstance(doc.get("bags"), simdjson.Array):
            items = list(doc["bags"])
            arrays = 1
        else:
            return None
        if not items:
            return None
        bags = []
        for i, item in enumerate(items):
            if not isinstance(item, simdjson.Object) or set(item.keys()) - BAG_KEYS:
                return None
            pts = item.get("points")
            if not isinstance(pts, simdjson.Array) or len(pts) == 0:
                return None
            # len() of every row, without a Python test per row: a number has no len
            # (TypeError); a string or object row has one but is no array, which the
            # count of "[" below catches.
            rows = list(map(len, pts))
            width = rows[0]
            if width < 1 or rows.count(width) != len(rows):
                return None
            values = np.frombuffer(pts.as_buffer(of_type="d"), dtype=np.float64)
            if values.size != width * len(rows):
                return None
            arrays += 1 + len(rows)
            markers = item.get("markers")
            if markers is not None:
                if not isinstance(markers, simdjson.Array):
                    return None
                markers = list(markers)
                if not all(isinstance(m, str) for m in markers) or len(markers) != width:
                    return None
                arrays += 1
            weights = item.get("weights")
            if weights is not None:
                if not isinstance(weights, simdjson.Array):
                    return None
                weights = np.frombuffer(weights.as_buffer(of_type="d"), dtype=np.float64).copy()
                arrays += 1
            bag_id = item.get("id", f"bag-{i}")
            if not isinstance(bag_id, str | int) or isinstance(bag_id, bool):
                return None
            points = values.reshape(len(rows), width).copy()
            bags.append(IncomingBag(str(bag_id), points, markers, markers, weights))
    except (ValueError, TypeError, RuntimeError, KeyError):
        return None
    # numpy counts the bytes about twice as fast as bytes.count (6 against 12 ms on 19 MB).
    brackets = int(np.count_nonzero(np.frombuffer(body, np.uint8) == ord("[")))
    return bags if brackets == arrays else None


def _json_bags(body: bytes | memoryview) -> tuple[list[IncomingBag], list[str]]:
    """Bags and the problems found while decoding them (reported with the others)."""
    plain = _plain_json_bags(body)
    return (plain, []) if plain is not None else _general_json_bags(body)


def _general_json_bags(body: bytes | memoryview) -> tuple[list[IncomingBag], list[str]]:
    """Any JSON body, with an error message for each problem (orjson, then numpy)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise Problem(400, f"the body is not valid JSON ({exc})", slug="invalid-json") from exc
    if isinstance(doc, dict) and "points" in doc and "bags" not in doc:
        doc = {"bags": [doc]}
    if not isinstance(doc, dict) or not isinstance(doc.get("bags"), list):
        raise Problem(
            422, 'expected an object {"bags": [{"id", "points", ...}]}', slug="invalid-request"
        )
    if not doc["bags"]:
        raise Problem(422, "no bags in the request", slug="invalid-request")
    bags, errors = [], []
    for i, item in enumerate(doc["bags"]):
        if not isinstance(item, dict):
            errors.append(f"bags[{i}]: expected an object with 'points'")
            continue
        bag_id = str(item.get("id", f"bag-{i}"))
        where = f"bag {bag_id!r}"
        try:
            pts = np.asarray(item.get("points"), dtype=np.float64)
        except (TypeError, ValueError):
            errors.append(f"{where}: points must be a rectangular list of lists of numbers")
            continue
        if pts.ndim == 1 and pts.size == 0:
            pts = pts.reshape(0, 0)
        if pts.ndim != 2:
            errors.append(f"{where}: points must be 2-D (cells x markers), got shape {pts.shape}")
            continue
        markers = item.get("markers")
        if markers is not None and (
            not isinstance(markers, list) or not all(isinstance(m, str) for m in markers)
        ):
            errors.append(f"{where}: markers must be a list of strings")
            continue
        if markers is not None and pts.shape[0] and len(markers) != pts.shape[1]:
            errors.append(f"{where}: {len(markers)} marker name(s) for {pts.shape[1]} column(s)")
            continue
        weights = None
        if item.get("weights") is not None:
            try:
                weights = np.asarray(item["weights"], dtype=np.float64)
            except (TypeError, ValueError):
                errors.append(f"{where}: weights must be a list of numbers")
                continue
        bags.append(IncomingBag(bag_id, pts, markers, markers, weights))
    return bags, errors


def decode_file(
    data: bytes | memoryview,
    name: str | None,
    kind: str | None,
    markers: list[str] | None,
    limits: ReadLimits | None = None,
    *,
    digest: bool = True,
) -> IncomingBag:
    """One bag from a file's bytes (``kind``: one of :data:`FILE_KINDS`, or None to
    infer it); 413 beyond ``limits``, 422 for an unreadable file.

    ``name`` is the bag's id; without one the file's own name (FCS ``$FIL``) or
    ``bag-0``. ``digest``: hash the bytes (a file of a multipart body, or a body whose
    Content-Encoding was undone); otherwise the request's hash stands for the file's.
    """
    try:
        sample = read_sample(
            data, format=kind, name=name or "the body", markers=markers, limits=limits
        )
    except SizeLimitError as exc:
        raise Problem(413, str(exc), errors=[str(exc)], slug="too-large") from exc
    except DataError as exc:
        raise Problem(422, str(exc), errors=[str(exc)], slug="invalid-file") from exc
    has_names = kind != "npy" or markers is not None
    return IncomingBag(
        name or sample.file_name or "bag-0",
        sample.points,
        sample.names if has_names else None,
        sample.alt_names if has_names else None,
        finite=True,
        spillover=sample.spillover,
        input_sha256=bytes_sha256(data) if digest else None,
        acquired=sample.acquired,
    )


def decode_body(
    spec: BodySpec, body: bytes | memoryview, limits: RequestLimits
) -> tuple[list[IncomingBag], list[str]]:
    """Bags from a native (``/v1``, job) body, and the problems already found in them.

    Raises
    ------
    Problem
        413 beyond the limits, 400/415/422 for a body that cannot be decoded.
    """
    ctype = media_type(spec.content_type)
    encoded = spec.content_encoding.strip().lower() not in ("", "identity")
    body = inflate(body, spec.content_encoding, limits)
    reading = limits.reading()
    if ctype == MULTIPART:
        return _multipart_bags(spec, body, limits)
    if ctype == JSON:
        check_json_values(body, limits)
        bags, problems = _json_bags(body)
        for bag in bags:  # cells sent as numbers are known by their cells
            bag.input_sha256 = points_sha256(bag.points)
        return bags, problems
    name = spec.default_id
    kinds = {NPY: "npy", CSV: "csv", TSV: "tsv", PARQUET: "parquet", HDF5: "h5ad"}
    if ctype in kinds:
        return [decode_file(body, name, kinds[ctype], spec.markers, reading, digest=encoded)], []
    if ctype in (FCS, OCTET):
        head = bytes(body[:8])
        if head.startswith(GZIP_MAGIC):
            return [decode_file(body, name, None, spec.markers, reading, digest=encoded)], []
        kind = next((k for magic, k in MAGIC if head.startswith(magic)), None)
        if kind is None:
            raise Problem(
                415,
                "application/octet-stream bodies must be FCS, NPY, Parquet or AnnData files",
                slug="unsupported-media-type",
            )
        return [decode_file(body, name, kind, spec.markers, reading, digest=encoded)], []
    raise Problem(
        415,
        f"unsupported content type {ctype or '(none)'!r}; expected one of {list(ACCEPTED)}",
        slug="unsupported-media-type",
    )


def _multipart_bags(
    spec: BodySpec, body: bytes | memoryview, limits: RequestLimits
) -> tuple[list[IncomingBag], list[str]]:
    """One bag per file part (the file name is its id and tells its format).

    The files share the decoded-size budget: what each inflates to, or decodes into,
    is taken from what is left. At most ``max_bags`` files are decoded; the count of the
    rest is reported with the other problems.
    """
    files = _multipart_files(spec.content_type, body, limits.max_bags + 1)
    if not files:
        raise Problem(422, "the multipart body holds no files", slug="invalid-request")
    bags, errors = [], []
    budget = limits.max_decoded_bytes
    for name, data in files[: limits.max_bags]:
        suffix = name.lower().removesuffix(".gz").rsplit(".", 1)[-1]
        kind = suffix if suffix in FILE_KINDS else None
        try:
            bag = decode_file(data, name, kind, spec.markers, limits.reading(budget))
        except Problem as exc:
            if exc.status == 413:
                raise
            errors += exc.errors or [exc.detail]
            continue
        # The cells decoded so far stay; what a file inflates to is freed once parsed.
        budget -= bag.points.nbytes
        bags.append(bag)
    if len(files) > limits.max_bags:
        errors.append(f"more than {limits.max_bags} files, the limit of bags per request")
    return bags, errors


def _multipart_files(
    content_type: str, body: bytes | memoryview, max_files: int
) -> list[tuple[str, bytes]]:
    """The (file name, bytes) of each file part of a multipart body, in order; at most
    ``max_files`` are kept (form fields without a file name are skipped)."""
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header

    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise Problem(400, "malformed multipart body: no boundary", slug="invalid-request")
    files: list[tuple[str, bytes]] = []
    part: dict[str, Any] = {}

    def begin() -> None:
        part.clear()
        part.update(headers={}, field=b"", value=b"", chunks=[])

    def header_field(data: bytes, start: int, end: int) -> None:
        part["field"] += data[start:end]

    def header_value(data: bytes, start: int, end: int) -> None:
        part["value"] += data[start:end]

    def header_end() -> None:
        part["headers"][part["field"].lower()] = part["value"]
        part["field"] = part["value"] = b""

    def data(chunk: bytes, start: int, end: int) -> None:
        if len(files) < max_files:
            part["chunks"].append(chunk[start:end])

    def end() -> None:
        _, disposition = parse_options_header(part["headers"].get(b"content-disposition"))
        if b"filename" not in disposition:
            return  # a form field, not a file
        index = len(files)
        name = disposition[b"filename"].decode("utf-8", "replace") or (
            f"{disposition.get(b'name', b'file').decode('utf-8', 'replace')}-{index}"
        )
        files.append((name, b"".join(part["chunks"]) if index < max_files else b""))

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": begin,
            "on_header_field": header_field,
            "on_header_value": header_value,
            "on_header_end": header_end,
            "on_part_data": data,
            "on_part_end": end,
        },
    )
    try:
        parser.write(bytes(body))
        parser.finalize()
    except (FormParserError, ValueError) as exc:
        raise Problem(400, f"malformed multipart body: {exc}", slug="invalid-request") from None
    return files


def npy_bytes(array: np.ndarray) -> bytes:
    """An array as the bytes of an ``.npy`` file (no pickle)."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()
