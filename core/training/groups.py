"""Batches and groups: which data files belong together, for the folds and the fit.

``[data] batches`` names the batch of every file: a per-cell model is then
cross-validated leave-one-batch-out and fits its fallback for new batches on them.
``[data] groups`` names the subject (patient, donor) of every file: the folds, the
estimator's own search and calibration and the domain check then leave whole subjects
out. Without groups, file names that suggest several bags per subject
(:func:`repeated_subjects`) raise a :class:`GroupingWarning`: the cross-validated
metrics would be optimistic.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from .data import file_column


def config_batches(config: Mapping[str, Any], files: Sequence[str]) -> np.ndarray | None:
    """The batch of every data file, from ``[data] batches`` (a CSV with the file name
    in ``file_column`` and the batch in ``batch_column``, default ``"batch"``), or
    ``None`` when the configuration names no batches.

    Raises
    ------
    ConfigError
        The table cannot be read, or a data file has no batch in it.
    """
    return file_column(config, files, "batches", "batch_column", "batch")


def config_groups(config: Mapping[str, Any], files: Sequence[str]) -> np.ndarray | None:
    """The group (subject, patient, donor) of every data file, from ``[data] groups``
    (a CSV with the file name in ``file_column`` and the group in ``group_column``,
    default ``"group"``), or ``None`` when the configuration names no groups.

    Raises
    ------
    ConfigError
        The table cannot be read, a data file has no group in it, or every file is
        in one group.
    """
    groups = file_column(config, files, "groups", "group_column", "group")
    if groups is not None and np.unique(groups).size < 2:
        raise ConfigError("[data] groups: every file is in one group; leaving a group out needs 2")
    return groups


#: Tokens of a file name (extensions dropped) split on these characters.
_NAME_TOKENS = re.compile(r"[_\-\s.]+")


def repeated_subjects(files: Sequence[str]) -> dict[str, int]:
    """Subjects that file names suggest appear more than once, with their file counts.

    For each prefix length, files are grouped by their first name tokens (``P01`` of
    ``P01_t1.fcs`` and ``P01_t2.fcs``); the shortest prefix that splits the files into
    several groups, some of them with several files, names the suspected subjects.
    Empty when the names give no such hint (every name unique at every prefix, or one
    prefix shared by all).
    """
    stems = [Path(f).name.split(".")[0] for f in files]
    tokens = [[t for t in _NAME_TOKENS.split(stem) if t] for stem in stems]
    longest = max((len(t) for t in tokens), default=0)
    for length in range(1, longest):
        keys = ["_".join(t[:length]) for t in tokens if len(t) > length]
        if len(keys) < len(tokens):
            break
        counts: dict[str, int] = {}
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
        if len(counts) > 1 and max(counts.values()) > 1:
            return {k: n for k, n in counts.items() if n > 1}
        if len(counts) == len(keys):
            break
    return {}


class GroupingWarning(UserWarning):
    """The data file names suggest several bags per subject, and no ``[data] groups``
    says which: the cross-validated metrics and the model's own calibration are then
    optimistic (bags of one subject vouch for each other)."""


def grouping_of(
    config: Mapping[str, Any], files: Sequence[str]
) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The subject of every file (``[data] groups``) and the report's record of how the
    folds were grouped; warns (:class:`GroupingWarning`) where the names suggest
    repeated subjects and no groups were given."""
    subjects = config_groups(config, files)
    if subjects is not None:
        counts = np.unique(subjects, return_counts=True)[1]
        return subjects, {
            "by": "groups",
            "table": str(config["data"]["groups"]),
            "column": str(config["data"].get("group_column", "group")),
            "n_groups": int(counts.size),
            "bags_per_group_max": int(counts.max()),
        }
    repeats = repeated_subjects(files)
    record: dict[str, Any] = {"by": "bags", "n_groups": None}
    if repeats:
        shown = ", ".join(f"{k} ({n} files)" for k, n in list(repeats.items())[:5])
        warnings.warn(
            f"the data file names suggest several bags per subject ({shown}"
            f"{' ...' if len(repeats) > 5 else ''}) but [data] groups names no subjects: "
            "the folds, the model's calibration and its domain check treat every bag as "
            "a subject of its own, which is optimistic when a subject's bags resemble "
            "each other; give [data] groups (a CSV of file and group)",
            GroupingWarning,
            stacklevel=4,
        )
        record["suspected_repeats"] = repeats
    return None, record


def groups_kw(groups: np.ndarray | None, rows: np.ndarray) -> dict[str, Any]:
    """``{"groups": ...}`` for a fit on ``rows``, or nothing where fewer than two groups
    are among them (a fold that leaves one group to train on has nothing to hold out)."""
    if groups is None or np.unique(groups[rows]).size < 2:
        return {}
    return {"groups": groups[rows]}
