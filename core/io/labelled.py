"""Labelled data sets: many sample files, their labels, and a fingerprint of both.

:func:`load_dataset` reads files into one :class:`Dataset` (bags in panel order) with
one label per bag, from a CSV table, or one per cell, from a column of each file or a
label file per sample. :func:`labelled_files` is its first step alone, for training
that streams the files instead of holding them. :func:`dataset_fingerprint` is the
sha256 recorded in a model's manifest as ``training_data_sha256``.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from ..bags import Bags
from ..errors import DataError
from ..hashing import chunks_sha256
from .compensation import Compensation
from .panel import Panel, normalise_marker
from .readers import read_file
from .sample import Sample

__all__ = ["Dataset", "dataset_fingerprint", "labelled_files", "load_dataset", "read_file_table"]


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


def read_file_table(path: Path, key: str, value: str) -> dict[str, str]:
    """A per-file CSV table (labels, batches) as file name → text of ``value``; a file
    listed twice is an error."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise DataError(f"{path}: cannot read the table ({exc.strerror or exc})") from exc
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise DataError(f"{path}: the table is empty")
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
    compensation: Compensation | None = None,
) -> Dataset:
    """Read many files into one :class:`Dataset`.

    Bag-level labels come from ``labels_table`` (a CSV with ``file_column`` and
    ``label_column``; files without a label are skipped, labels without a file are an
    error). Cell-level labels come from a column of each CSV (``cell_label_column``,
    removed from the markers) or from one label file per sample (``cell_label_files``,
    sample path → label file with one label per line).

    Files are read in parallel with joblib (``n_jobs``); the panel defaults to the
    first file's columns, and every file must provide all of its markers.

    Parameters
    ----------
    files : sequence of path-like
        The sample files (any format :func:`~core.io.read_sample` reads).
    panel : Panel, optional
        The markers to keep, in order; default: the first file's columns.
    labels_table : path-like, optional
        CSV of one label per bag.
    file_column, label_column : str
        Columns of ``labels_table`` holding the file name and its label.
    cell_label_column : str, optional
        Column of each file holding one label per cell.
    cell_label_files : mapping of str to path-like, optional
        Sample path (or file name) → file of its cells' labels, one per line.
    n_jobs : int, optional
        Files read at once (threads).
    compensation : Compensation, optional
        Applied to every sample before the panel's columns are picked.
    progress : bool, default=False
        Show a progress bar.

    Returns
    -------
    Dataset

    Raises
    ------
    DataError
        A file is unreadable or lacks a marker, a label is missing or left over.
    """
    from joblib import Parallel, delayed

    paths, y_bag = labelled_files(files, labels_table, file_column, label_column)
    iterator: Iterable[Path] = paths
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(paths, desc="reading", unit="file")
    read = Parallel(n_jobs=n_jobs, prefer="threads")(delayed(read_file)(p) for p in iterator)
    samples = [sample for sample, _ in read]
    if compensation is not None and compensation.active:
        samples = [compensation.apply(s) for s in samples]
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
                    s.spillover,
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

    Parameters
    ----------
    files : sequence of path-like
    labels_table : path-like, optional
        CSV of one label per bag, matched to ``files`` by file name.
    file_column, label_column : str
        Columns of ``labels_table`` holding the file name and its label.

    Returns
    -------
    paths : list of Path
        The labelled files, in the order of ``files``.
    labels : ndarray or None
        Their labels (integers, floats or strings), or None without a table.

    Raises
    ------
    DataError
        No files, an unreadable table, or labels for files that were not given.
    """
    paths = [Path(f) for f in files]
    if not paths:
        raise DataError("no data files matched")
    if labels_table is None:
        return paths, None
    table = read_file_table(Path(labels_table), file_column, label_column)
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
    """sha256 over the name and sha256 of every file, then the labels.

    Parameters
    ----------
    paths : sequence of Path
        The files, in data set order (only their names count).
    sha256s : sequence of str
        The sha256 of each file's bytes (:func:`~core.io.read_file`).
    y : ndarray, optional
        The labels.

    Returns
    -------
    str
        The ``training_data_sha256`` recorded in a model's manifest.
    """
    # File names, not paths: the same data copied elsewhere keep their fingerprint.
    # The separators keep one file's name and digest from running into the next.
    parts = [
        p.name.encode() + b"\0" + digest.encode() + b"\n"
        for p, digest in zip(paths, sha256s, strict=True)
    ]
    if y is not None:
        parts.append(repr(y.tolist()).encode())
    return chunks_sha256(parts)
