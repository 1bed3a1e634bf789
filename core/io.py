"""Reading the files labs have (FCS, CSV/TSV, NPY), marker panels and preprocessing.

* :func:`read_sample` reads one bag of cells with its marker names: FCS 2.0/3.0/3.1
  through ``flowio`` (names from ``$PnS`` when set, else ``$PnN``; both are matched),
  CSV/TSV with a header row (optionally gzip-compressed), NPY (a 2-D numeric array).
* :class:`Panel` lists the markers a model takes, in order, with accepted aliases;
  :meth:`Panel.select` matches a sample's columns by name, case and punctuation
  insensitively, reorders them, and names every missing or ambiguous marker.
* :class:`Preprocessing` is the chain stored with a model: a transform (``arcsinh``
  with a cofactor, ``log``), per-marker standard scaling learned on the training
  cells, and a seeded subsample of huge bags that does not depend on cell order.

Every reading problem raises :class:`DataError` naming the file, and the row or
column when there is one.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from .bags import Bags, subsample_bags

__all__ = [
    "BagMoments",
    "DataError",
    "Dataset",
    "Panel",
    "Preprocessing",
    "Sample",
    "dataset_fingerprint",
    "file_sha256",
    "labelled_files",
    "load_dataset",
    "normalise_marker",
    "read_file",
    "read_sample",
]

SUPPORTED_SUFFIXES = (".fcs", ".csv", ".tsv", ".txt", ".npy", ".csv.gz", ".tsv.gz", ".txt.gz")


class DataError(ValueError):
    """A file could not be read as a bag of cells, or does not fit the model's panel."""


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
    """

    points: NDArray[np.float64]
    names: list[str]
    alt_names: list[str]
    source: str


def normalise_marker(name: str) -> str:
    """Case- and punctuation-insensitive key: ``"CD4-PE"``, ``"cd4 pe"`` → ``"cd4pe"``."""
    return re.sub(r"[\s\-_./:()\[\]]+", "", name).casefold()


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _suffix(name: str) -> str:
    lower = name.lower()
    for s in sorted(SUPPORTED_SUFFIXES, key=len, reverse=True):
        if lower.endswith(s):
            return s
    return Path(lower).suffix


def _read_fcs(data: bytes, source: str) -> Sample:
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
    return Sample(arr, names, pnn, source)


def _read_text(data: bytes, source: str, delimiter: str | None) -> Sample:
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
    format : {"fcs", "csv", "tsv", "npy"}, optional
        Default: from the file name (``.fcs``, ``.csv[.gz]``, ``.tsv[.gz]``,
        ``.txt[.gz]``, ``.npy``).
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
    """:func:`read_sample` of a file, and the sha256 of its bytes, in one read."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    fmt = _suffix(path.name).lstrip(".") or None
    return read_sample(data, format=fmt, name=str(path)), hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Panel:
    """The markers a model takes, in input order, with accepted aliases.

    Parameters
    ----------
    markers : sequence of str
        Canonical names in the model's column order.
    aliases : mapping of str to sequence of str
        Other names accepted for a marker (e.g. ``{"FITC-A": ["GFP"]}``).
    """

    markers: tuple[str, ...]
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "markers", tuple(self.markers))
        object.__setattr__(self, "aliases", {k: tuple(v) for k, v in dict(self.aliases).items()})
        unknown = set(self.aliases) - set(self.markers)
        if unknown:
            raise ValueError(f"aliases for markers not in the panel: {sorted(unknown)}")
        keys = [normalise_marker(m) for m in self.markers]
        if len(set(keys)) != len(keys):
            raise ValueError(
                f"panel markers collide when case and punctuation are ignored: {self.markers}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "markers": list(self.markers),
            "aliases": {k: list(v) for k, v in self.aliases.items()},
        }

    @classmethod
    def from_json(cls, spec: Mapping[str, Any]) -> Panel:
        return cls(tuple(spec["markers"]), dict(spec.get("aliases", {})))

    def columns(
        self, names: Sequence[str], alt_names: Sequence[str] | None = None, *, source: str = "input"
    ) -> NDArray[np.int64]:
        """Column index of each panel marker among ``names`` (and ``alt_names``).

        Raises
        ------
        DataError
            Listing every missing marker (with the names that were available) and every
            marker matched by more than one column.
        """
        alt = list(alt_names) if alt_names is not None else list(names)
        keys = [{normalise_marker(a), normalise_marker(b)} for a, b in zip(names, alt, strict=True)]
        out, missing, ambiguous = [], [], []
        for m in self.markers:
            wanted = {normalise_marker(m)} | {normalise_marker(a) for a in self.aliases.get(m, ())}
            hits = [j for j, k in enumerate(keys) if k & wanted]
            if not hits:
                missing.append(m)
            elif len(hits) > 1:
                ambiguous.append(f"{m!r} matches columns {[names[j] for j in hits]}")
            else:
                out.append(hits[0])
        problems = []
        if missing:
            problems.append(f"missing marker(s) {missing} (available: {list(names)})")
        problems += [f"ambiguous marker {a}" for a in ambiguous]
        if problems:
            raise DataError(f"{source}: " + "; ".join(problems))
        return np.asarray(out, dtype=np.int64)

    def extra(self, names: Sequence[str], alt_names: Sequence[str] | None = None) -> list[str]:
        """Columns of a sample that the panel does not use."""
        used = set(self.columns(names, alt_names).tolist())
        return [n for j, n in enumerate(names) if j not in used]

    def select(self, sample: Sample) -> NDArray[np.float64]:
        """The sample's columns for this panel, in panel order."""
        cols = self.columns(sample.names, sample.alt_names, source=sample.source)
        return np.ascontiguousarray(sample.points[:, cols])


Transform = Literal["none", "arcsinh", "log"]


@dataclass(frozen=True)
class BagMoments:
    """Sufficient statistics of one bag for standard scaling (see :meth:`Preprocessing.fit`)."""

    count: int
    total: NDArray[np.float64]
    centred_squares: NDArray[np.float64]


@dataclass
class Preprocessing:
    """Per-cell preprocessing stored with a model (and re-applied at prediction).

    Parameters
    ----------
    transform : {"none", "arcsinh", "log"}
        ``arcsinh(x / cofactor)``, or ``log10(max(x, log_floor))``.
    cofactor : float or mapping of marker to float
        One cofactor, or one per marker (panel names; others use ``default_cofactor``).
    scale : {"none", "standard"}
        ``"standard"``: subtract the training cells' mean and divide by their standard
        deviation, per marker (learned by :meth:`fit`).
    max_points : int or None
        Keep at most this many cells per bag (seeded draw, independent of cell order).
    seed : int
    """

    transform: Transform = "none"
    cofactor: float | Mapping[str, float] = 5.0
    default_cofactor: float = 5.0
    log_floor: float = 1.0
    scale: Literal["none", "standard"] = "none"
    max_points: int | None = None
    seed: int = 0
    mean_: list[float] | None = None
    std_: list[float] | None = None

    def __post_init__(self) -> None:
        if self.transform not in ("none", "arcsinh", "log"):
            raise ValueError(
                f"transform must be 'none', 'arcsinh' or 'log', got {self.transform!r}"
            )
        if self.scale not in ("none", "standard"):
            raise ValueError(f"scale must be 'none' or 'standard', got {self.scale!r}")
        if self.max_points is not None and self.max_points < 2:
            raise ValueError(f"max_points must be >= 2 or None, got {self.max_points}")

    def _cofactors(self, markers: Sequence[str]) -> NDArray[np.float64]:
        if isinstance(self.cofactor, Mapping):
            return np.array([float(self.cofactor.get(m, self.default_cofactor)) for m in markers])
        return np.full(len(markers), float(self.cofactor))

    def _transform(self, x: NDArray[np.float64], markers: Sequence[str]) -> NDArray[np.float64]:
        if self.transform == "arcsinh":
            return np.arcsinh(x / self._cofactors(markers))
        if self.transform == "log":
            return np.log10(np.maximum(x, self.log_floor))
        return x

    def fit(self, bags: Bags, markers: Sequence[str]) -> Preprocessing:
        """Learn the per-marker scaling from the (transformed) training cells.

        The moments are taken bag by bag and then combined (:meth:`fit_moments`), so
        that training which streams bags from files, locally or on a cluster, learns
        bit for bit the same scaling as training on bags held in memory.
        """
        if self.scale == "standard":
            stats = [
                self.bag_moments(bags.points[lo:hi], markers)
                for lo, hi in zip(bags.offsets[:-1], bags.offsets[1:], strict=True)
            ]
            self.fit_moments(stats)
        return self

    def bag_moments(self, points: NDArray[np.float64], markers: Sequence[str]) -> BagMoments:
        """Count, sum and centred sum of squares of one bag's transformed cells."""
        t = self._transform(points, markers)
        total = t.sum(axis=0)
        centred = t - total / t.shape[0]
        return BagMoments(int(t.shape[0]), total, np.einsum("ij,ij->j", centred, centred))

    def fit_moments(self, moments: Sequence[BagMoments]) -> Preprocessing:
        """Learn the scaling from per-bag moments (the pooled mean and standard deviation).

        Pooled centred sums of squares, ``M2 = Σ_b M2_b + Σ_b n_b (m_b - m)²``, are
        stable where the raw sums of squares would cancel (Chan, Golub, LeVeque 1983).
        """
        if self.scale != "standard":
            return self
        if not moments:
            raise ValueError("standard scaling needs at least one training bag")
        counts = np.array([m.count for m in moments], dtype=np.float64)
        sums = np.stack([m.total for m in moments])
        n = counts.sum()
        mean = sums.sum(axis=0) / n
        between = counts[:, None] * (sums / counts[:, None] - mean) ** 2
        m2 = np.stack([m.centred_squares for m in moments]).sum(axis=0) + between.sum(axis=0)
        std = np.sqrt(m2 / n)
        self.mean_ = mean.tolist()
        self.std_ = np.where(std > 0, std, 1.0).tolist()
        return self

    def apply(self, bags: Bags, markers: Sequence[str]) -> Bags:
        """Subsample, transform and scale bags whose columns follow ``markers``."""
        bags = self.subsample(bags)
        x = self.scale_points(self._transform(bags.points, markers))
        return Bags(x, bags.offsets, bags.weights, validate=False)

    def subsample(self, bags: Bags) -> Bags:
        """The first step of :meth:`apply`: at most ``max_points`` cells per bag."""
        if self.max_points is None:
            return bags
        return subsample_bags(bags, self.max_points, self.seed)

    def transform_points(
        self, points: NDArray[np.float64], markers: Sequence[str]
    ) -> NDArray[np.float64]:
        """The second step of :meth:`apply`: the per-cell transform, without scaling."""
        return self._transform(points, markers)

    def scale_points(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """The last step of :meth:`apply`: the learned scaling of transformed cells."""
        if self.scale != "standard":
            return x
        if self.mean_ is None or self.std_ is None:
            raise ValueError("standard scaling is not fitted: call fit() on the training bags")
        return (x - np.asarray(self.mean_)) / np.asarray(self.std_)

    def to_json(self) -> dict[str, Any]:
        cof = dict(self.cofactor) if isinstance(self.cofactor, Mapping) else self.cofactor
        return {
            "transform": self.transform,
            "cofactor": cof,
            "default_cofactor": self.default_cofactor,
            "log_floor": self.log_floor,
            "scale": self.scale,
            "max_points": self.max_points,
            "seed": self.seed,
            "mean_": self.mean_,
            "std_": self.std_,
        }

    @classmethod
    def from_json(cls, spec: Mapping[str, Any]) -> Preprocessing:
        return cls(**dict(spec))


@dataclass
class Dataset:
    """Bags read from files, in panel order, with their labels.

    Attributes
    ----------
    bags : Bags
        Raw (not yet preprocessed) cells, columns in ``panel`` order.
    y : ndarray or None
        One label per bag (``level="bag"``) or per cell (``level="cell"``).
    files : list of str
        File of each bag.
    panel : Panel
    level : {"bag", "cell"}
    sha256 : str
        Fingerprint of the data: the name and sha256 of every file, and the labels.
    """

    bags: Bags
    y: NDArray[Any] | None
    files: list[str]
    panel: Panel
    level: Literal["bag", "cell"]
    sha256: str


def _read_table(path: Path, key: str, value: str) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise DataError(f"{path}: cannot read the labels table ({exc.strerror or exc})") from exc
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise DataError(f"{path}: the labels table is empty")
    for col in (key, value):
        if col not in rows[0]:
            raise DataError(f"{path}: no column {col!r} (columns: {list(rows[0])})")
    out: dict[str, str] = {}
    for i, r in enumerate(rows):
        name = (r[key] or "").strip()
        if name in out:
            raise DataError(f"{path}: file {name!r} is listed twice (row {i + 2})")
        out[name] = (r[value] or "").strip()
    return out


def _parse_label(text: str) -> int | float | str:
    """Integers stay integers (class IDs), other numbers become floats, the rest text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def load_dataset(
    files: Sequence[str | os.PathLike[str]],
    *,
    panel: Panel | None = None,
    labels_table: str | os.PathLike[str] | None = None,
    file_column: str = "file",
    label_column: str = "label",
    cell_label_column: str | None = None,
    cell_label_files: Mapping[str, str | os.PathLike[str]] | None = None,
    n_jobs: int | None = None,
    progress: bool = False,
) -> Dataset:
    """Read many files into one :class:`Dataset`.

    Bag-level labels come from ``labels_table`` (a CSV with ``file_column`` and
    ``label_column``; files without a label are skipped, labels without a file are an
    error). Cell-level labels come from a column of each CSV (``cell_label_column``,
    removed from the markers) or from one label file per sample (``cell_label_files``,
    sample path → label file with one label per line).

    Files are read in parallel with joblib (``n_jobs``); the panel defaults to the
    first file's columns, and every file must provide all of its markers.
    """
    from joblib import Parallel, delayed

    paths, y_bag = labelled_files(files, labels_table, file_column, label_column)
    iterator: Iterable[Path] = paths
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(paths, desc="reading", unit="file")
    read = Parallel(n_jobs=n_jobs, prefer="threads")(delayed(read_file)(p) for p in iterator)
    samples = [sample for sample, _ in read]
    cell_labels: list[NDArray[Any]] | None = None
    if cell_label_column is not None:
        cell_labels, stripped = [], []
        for s in samples:
            keys = [normalise_marker(n) for n in s.names]
            if normalise_marker(cell_label_column) not in keys:
                raise DataError(f"{s.source}: no cell label column {cell_label_column!r}")
            j = keys.index(normalise_marker(cell_label_column))
            cell_labels.append(s.points[:, j].copy())
            keep = [k for k in range(len(s.names)) if k != j]
            stripped.append(
                Sample(
                    s.points[:, keep],
                    [s.names[k] for k in keep],
                    [s.alt_names[k] for k in keep],
                    s.source,
                )
            )
        samples = stripped
    elif cell_label_files is not None:
        cell_labels = []
        for p, s in zip(paths, samples, strict=True):
            lab_path = cell_label_files.get(str(p)) or cell_label_files.get(p.name)
            if lab_path is None:
                raise DataError(f"{p}: no cell label file")
            lab = np.loadtxt(lab_path, dtype=str, ndmin=1)
            if lab.shape[0] != s.points.shape[0]:
                raise DataError(
                    f"{lab_path}: {lab.shape[0]} label(s) for {s.points.shape[0]} cell(s) "
                    f"of {p.name}"
                )
            cell_labels.append(np.array([_parse_label(v) for v in lab]))
    if panel is None:
        panel = Panel(tuple(samples[0].names))
    arrays = [panel.select(s) for s in samples]
    bags = Bags.from_arrays(arrays)
    level: Literal["bag", "cell"] = "bag"
    y = y_bag
    if y is None and cell_labels is not None:
        y = np.concatenate(cell_labels)
        level = "cell"
    sha = dataset_fingerprint(paths, [digest for _, digest in read], y)
    return Dataset(bags, y, [str(p) for p in paths], panel, level, sha)


def labelled_files(
    files: Sequence[str | os.PathLike[str]],
    labels_table: str | os.PathLike[str] | None = None,
    file_column: str = "file",
    label_column: str = "label",
) -> tuple[list[Path], NDArray[Any] | None]:
    """The files that have a bag-level label, and their labels (all files if no table).

    Files without a label are skipped; labels without a file are an error.
    """
    paths = [Path(f) for f in files]
    if not paths:
        raise DataError("no data files matched")
    if labels_table is None:
        return paths, None
    table = _read_table(Path(labels_table), file_column, label_column)
    names = {p.name for p in paths}
    unknown = sorted(set(table) - names)
    if unknown:
        raise DataError(f"{labels_table}: labels for files that were not found: {unknown}")
    paths = [p for p in paths if p.name in table and table[p.name] != ""]
    if not paths:
        raise DataError(f"{labels_table}: no data file has a label")
    return paths, np.array([_parse_label(table[p.name]) for p in paths])


def dataset_fingerprint(
    paths: Sequence[Path], sha256s: Sequence[str], y: NDArray[Any] | None
) -> str:
    """sha256 over the name and sha256 of every file, then the labels."""
    h = hashlib.sha256()
    for p, digest in zip(paths, sha256s, strict=True):
        h.update(p.name.encode() + b"\0" + digest.encode() + b"\n")
    if y is not None:
        h.update(repr(y.tolist()).encode())
    return h.hexdigest()
