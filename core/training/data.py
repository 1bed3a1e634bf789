"""The training data: the configured files read into labelled bags, and their names and
fingerprints.

:func:`read_data` reads ``[data]`` (files, labels per bag or per cell, ``label_map``)
into a :class:`~core.io.Dataset`, compensated and aligned to the panel as the
configuration says. Every training bag gets a stable name (:func:`bag_names`: a sample
id or the file's name, never a path) and a fingerprint (:func:`bag_fingerprints`: the
sha256 of its file and of its cells) that the manifest records, so that evaluation
(:mod:`core.training.evaluation`) recognises a training bag whichever file it comes back
in (:func:`training_overlap`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..bags import Bags
from ..errors import ConfigError, DataError
from ..estimators.transfer.open_set import UNASSIGNED
from ..hashing import file_sha256
from ..io import Compensation, Dataset, Panel, load_dataset, read_file_table
from ..streaming import points_sha256
from .config import config_compensation, config_panel, config_rest_label, resolve_path


def read_data(
    config: Mapping[str, Any],
    panel: Panel | None = None,
    progress: bool = False,
    compensation: Compensation | None = None,
) -> Dataset:
    """The labelled bags of ``[data]``, compensated as ``compensation`` (default: as
    ``[preprocessing]`` says) and aligned to ``panel`` (default: ``[panel]``)."""
    base = Path(config["_base"])
    if compensation is None:
        compensation = config_compensation(config)
    data = dict(config["data"])
    files = resolve_path(base, data.pop("files"))
    labels = data.pop("labels", None)
    cell_files = data.pop("cell_label_files", None)
    cell_map = None
    if cell_files is not None:
        # A template naming each sample's label file: {name} (file name), {stem} (name
        # without extensions), {digits} (the digits in the name), e.g.
        # "labels{digits}.csv.gz" for "sample12.csv.gz".
        cell_map = {}
        for f in files:
            stem = f.name.split(".")[0]
            digits = "".join(ch for ch in stem if ch.isdigit())
            rel = cell_files.format(stem=stem, name=f.name, digits=digits)
            cell_map[str(f)] = str(base / rel)
    label_map = data.pop("label_map", None)
    # Batches, groups and sample ids are read by training (config_batches,
    # config_groups, bag_names), not here.
    for key in ("batches", "batch_column", "groups", "group_column", "sample_column", "control"):
        data.pop(key, None)
    known = {"file_column", "label_column", "cell_label_column", "n_jobs"}
    if set(data) - known:
        raise ConfigError(f"[data] unknown key(s) {sorted(set(data) - known)}")
    if panel is None:
        panel = config_panel(config)
    dataset = load_dataset(
        files,
        panel=panel,
        labels_table=None if labels is None else base / labels,
        file_column=data.get("file_column", "file"),
        label_column=data.get("label_column", "label"),
        cell_label_column=data.get("cell_label_column"),
        cell_label_files=cell_map,
        n_jobs=data.get("n_jobs"),
        progress=progress,
        compensation=compensation,
    )
    if dataset.y is not None:
        dataset.y = _mark_unassigned(config, apply_label_map(label_map, dataset.y))
    return dataset


def read_control(config: Mapping[str, Any], panel: Panel) -> tuple[Bags, dict[str, str]] | None:
    """``[data] control``: the training batch's reference control (one file, relative
    to the configuration), compensated as ``[preprocessing]`` says and aligned to
    ``panel``, as one bag, with its file name and sha256 (the model's provenance);
    ``None`` without one."""
    name = (config.get("data") or {}).get("control")
    if name is None:
        return None
    if not isinstance(name, str):
        raise ConfigError(f"[data] control must be one file name, got {name!r}")
    path = Path(config["_base"]) / name
    if not path.is_file():
        raise ConfigError(f"[data] control: no file {path.name!r} beside the configuration")
    dataset = load_dataset([path], panel=panel, compensation=config_compensation(config))
    return dataset.bags, {"file": name, "sha256": file_sha256(path)}


def _mark_unassigned(config: Mapping[str, Any], y: np.ndarray) -> np.ndarray:
    """The rest label of ``[labels] unassigned`` renamed :data:`UNASSIGNED`, so that
    every answer, summary and report shows those cells as their own row."""
    rest = config_rest_label(config)
    if rest is None:
        return y
    keys = np.array([label_key(v) for v in y.tolist()])
    if not np.any(keys == rest):
        present = sorted(set(keys.tolist()))
        raise ConfigError(
            f"[labels] unassigned = {rest!r} names no label of the data (after "
            f"[data] label_map); the labels are {present[:20]}"
        )
    if UNASSIGNED in keys.tolist() and rest != UNASSIGNED:
        raise ConfigError(
            f"[labels] unassigned = {rest!r}: the data already has a label "
            f"{UNASSIGNED!r}; map one of them to another name in [data] label_map"
        )
    return np.where(keys == rest, UNASSIGNED, keys.astype(object)).astype(str)


def apply_label_map(label_map: Mapping[str, Any] | None, y: np.ndarray) -> np.ndarray:
    """Relabel (e.g. merge gates that are not aligned across samples); keys are the labels
    as written in the data, unlisted labels stay as they are."""
    if label_map is None:
        return y
    mapping = {str(k): v for k, v in label_map.items()}
    return np.array([mapping.get(label_key(v), v) for v in y.tolist()])


def label_key(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def file_column(
    config: Mapping[str, Any], files: Sequence[str], key: str, column_key: str, default: str
) -> np.ndarray | None:
    """The value of every data file in the CSV named by ``[data] <key>`` (the file name in
    ``file_column``, the value in the column ``[data] <column_key>``, default
    ``default``), or ``None`` without one.

    Raises
    ------
    ConfigError
        The table cannot be read, or a data file has no value in it.
    """
    data = config.get("data", {})
    if data.get(key) is None:
        return None
    path = Path(config["_base"]) / data[key]
    column = data.get(column_key, default)
    try:
        table = read_file_table(path, data.get("file_column", "file"), column)
    except DataError as exc:
        raise ConfigError(f"[data] {key}: {exc}") from exc
    missing = [Path(f).name for f in files if table.get(Path(f).name, "") == ""]
    if missing:
        raise ConfigError(
            f"[data] {key}: {path.name} gives no {column!r} for {len(missing)} data "
            f"file(s): {missing[:5]}"
        )
    return np.array([table[Path(f).name] for f in files])


def bag_names(config: Mapping[str, Any], files: Sequence[str]) -> list[str]:
    """A stable name per training bag, as answers name the nearest training samples:
    the ``[data] sample_column`` of the labels table when given (a sample id), else the
    file's name. Never a path: where the files lay on the training machine says nothing
    to a lab reading an answer (and is nobody's business)."""
    ids = None
    if config.get("data", {}).get("sample_column") and config["data"].get("labels"):
        ids = file_column(config, files, "labels", "sample_column", "sample")
    return [str(v) for v in ids] if ids is not None else [Path(f).name for f in files]


def bag_fingerprints(
    names: Sequence[str], file_digests: Sequence[str | None], points: Sequence[np.ndarray]
) -> list[dict[str, Any]]:
    """One record per bag: its name, the sha256 of its file and of its cells.

    Two digests, so that the same bag is recognised whether it comes back as the same
    file (renamed or moved: the file digest) or as the same cells in another file (a
    CSV export of an FCS file, a header rewritten: the points digest).

    Parameters
    ----------
    names : sequence of str
        How the bags are named in reports (file paths relative to the configuration).
    file_digests : sequence of str or None
        sha256 of each bag's file (:func:`core.hashing.file_sha256`), ``None`` for a bag
        that has no file.
    points : sequence of ndarray of shape (n_cells, n_markers)
        Each bag's raw cells in panel order, before preprocessing.

    Returns
    -------
    list of dict
        ``{"name", "sha256", "points_sha256"}`` per bag; ``points_sha256`` is the
        sha256 of the cells as C-ordered float64 bytes.
    """
    return [
        {"name": str(n), "sha256": d, "points_sha256": points_sha256(x)}
        for n, d, x in zip(names, file_digests, points, strict=True)
    ]


def training_overlap(
    metadata: Mapping[str, Any], bags: Sequence[Mapping[str, Any]]
) -> NDArray[np.bool_] | None:
    """Which evaluated bags are training bags (by either digest); ``None`` when the model
    records no training bags (saved before the record existed): unknown, not guessed."""
    known = metadata.get("training_bags")
    if not isinstance(known, list):
        return None
    files = {b.get("sha256") for b in known} - {None}
    cells = {b.get("points_sha256") for b in known} - {None}
    return np.array([b["sha256"] in files or b["points_sha256"] in cells for b in bags], dtype=bool)
