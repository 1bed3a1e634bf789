"""Training from a TOML configuration: data, panel, preprocessing, estimator, search, report.

A configuration (see ``examples/``) has these tables; paths are relative to the file::

    [model]          name, version, output (directory of models; default "models"),
                     description, intended_use, limitations (the model card, card.md)
    [data]           files (glob or list), labels (CSV table) + file_column + label_column
                     for one label per bag, or cell_label_column / cell_label_files for
                     one label per cell; batches (CSV: file_column + batch_column,
                     default "batch"; per-cell models are then cross-validated
                     leave-one-batch-out and choose their fallback for new batches
                     that way); groups (CSV: file_column + group_column, default
                     "group": the subject, patient or donor of each file; the folds,
                     the estimator's own search and calibration and the domain check
                     then leave whole subjects out); n_jobs (parallel reading)
    [panel]          markers (names, in model order), aliases (name -> other names)
    [preprocessing]  compensation ("none" | "file" | a spillover CSV), transform
                     ("none" | "arcsinh" | "log" | "logicle" | "hyperlog"), cofactor,
                     T, W, M, A (logicle/hyperlog), markers (per-marker overrides of
                     these), scale ("none" | "standard"), max_points, seed; see
                     :mod:`core.io.preprocessing`
    [estimator]      class and parameters; nested tables with a "class" key build the
                     representation / embedding
    [search]         optional grid: parameter name -> list of values; widen_edges
                     (default true, see "Grid edges" below)
    [cv]             n_splits (default 5), repeats (default 1), seed
    [compute]        streaming (read bags a few at a time), scheduler (a Dask scheduler
                     address); see :mod:`core.streaming`
    [fhir]           optional: the code system, code, unit, class codings and reference
                     range of the model's output in FHIR answers; see
                     :mod:`core.fhir_coding`
    [serving]        out_of_domain ("flag" | "preliminary" | "withhold", default
                     "preliminary"): what every answer does for a bag outside the
                     applicability domain; see :mod:`core.policy`

Training reads the data, fits the preprocessing on the training cells, runs the
cross-validation (leave-bags-out for one label per bag, leave-tasks-out for one label
per cell), refits on everything, and saves the artifact with its report
(``report/metrics.json`` and PNG plots) under ``output/name/version``.

Grid edges
----------
A hyperparameter chosen at the first or last value of its grid (a numeric grid of at
least 3 values) says only that the optimum may lie beyond what was searched. Training
checks every such choice: the ``[search]`` grid of the configuration (chosen by the
cross-validation) and the grids the estimator searches itself, as its fitted model
records them (``gamma`` and ``alpha`` of :class:`~core.DistributionRidge` and its
classifier, and of :class:`~core.ConditionalMeanEmbedding`; the point bandwidth,
``tau``, task ``gamma`` and ``alpha`` of marginal transfer). With ``[search]
widen_edges = true`` (the default) each edge is widened once
(:func:`core.selection.widen_grid`: the grid is shifted past the edge, same size and
steps, so the old edge sits in its middle): an edge of the ``[search]`` grid adds
the new candidates to the same cross-validation; an edge of an estimator's own grid
refits that candidate, cross-validation included, with the widened grid passed as an
explicit parameter (``gamma=[...]``, ``alpha=[...]``, ...), and that model replaces
the edge one: the estimator's own criterion chose the edge value and the widened grid
still holds it, so by that criterion the refit can only be as good or better (its
outer CV error is reported beside the edge model's, not used to pick between them).
Each hyperparameter is still chosen by the criterion that chose it before; only its
grid moved. One difference: a default grid relative to a median heuristic is resolved
on all the training bags, as the final fit resolved it, and passed as absolute values,
so every fold searches the same values where before each resolved its own.

Every edge is reported as a :class:`GridEdgeWarning` (parameter, grid, value, and what
widening found) and recorded as a ``grid_edges`` entry in the report and in the
manifest's metadata: ``parameter``, ``source`` (``"search"`` or ``"estimator"``),
``side``, ``grid``, ``chosen``, ``widened``, ``widened_grid``,
``chosen_after_widening``, ``still_on_edge``, ``at_domain_bound``, ``note``; the
report's ``widening`` holds the CV metrics before (``cv_at_edge``) and after. A choice
still on an edge after widening is kept, with a warning: widening happens once, so that
training time stays bounded. ``widen_edges = false`` warns and records without
refitting. Two cases are recorded but not widened: a value at the bound of its
parameter's domain (``tau`` of 0 or 1: nothing lies beyond, so no warning either), and
a grid no estimator parameter takes (the warning says so). Streaming and Dask training
(:mod:`core.streaming`) check and widen the same way; a widened ``[search]`` value
that needs another representation streams the files once more, for that representation
only.

Evaluation and the training bags
--------------------------------
The manifest records every training bag (``training_bags``: its name relative to the
configuration, the sha256 of its file and the sha256 of its cells in panel order).
:func:`evaluate` matches the evaluated bags against them and reports metrics on the
unseen bags only, unless asked to include the training bags (their metrics are
optimistic). Models saved before this record existed have an unknown overlap.
"""

from __future__ import annotations

import glob
import json
import re
import tomllib
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray
from sklearn.base import BaseEstimator, clone, is_classifier
from sklearn.model_selection import KFold, ParameterGrid, StratifiedKFold

from . import report
from .artifacts import save
from .bags import Bags
from .calibration import fit_temperature
from .card import render_card
from .errors import ConfigError, CoreError, DataError
from .estimators import (
    DistributionRidge,
    DistributionRidgeClassifier,
    MarginalTransferClassifier,
    MarginalTransferRegressor,
)
from .estimators._grid_choices import GridChoice
from .estimators._ridge_calibration import for_point_predictions
from .fhir_coding import OutputCoding
from .hashing import file_sha256
from .io import (
    Compensation,
    Dataset,
    Panel,
    Preprocessing,
    dataset_fingerprint,
    labelled_files,
    load_dataset,
    read_file,
    read_file_table,
)
from .policy import DEFAULT_POLICY, POLICIES
from .progress import progress_enabled
from .representations import DensityFeatures, HistogramEmbedding, MeanEmbedding, SlicedWasserstein
from .selection import (
    GridEdgeWarning,
    grid_edge,
    group_folds,
    leave_one_group_out_folds,
    leave_tasks_out_folds,
    widen_grid,
)
from .streaming import points_sha256

__all__ = [
    "ConfigError",
    "EvaluationOverlapError",
    "GridChoice",
    "GridEdgeWarning",
    "TrainingResult",
    "bag_fingerprints",
    "build_estimator",
    "estimator_grid_choices",
    "evaluate",
    "load_config",
    "train",
]

ESTIMATORS: dict[str, type[BaseEstimator]] = {
    cls.__name__: cls
    for cls in (
        DistributionRidge,
        DistributionRidgeClassifier,
        MarginalTransferClassifier,
        MarginalTransferRegressor,
        SlicedWasserstein,
        MeanEmbedding,
        DensityFeatures,
        HistogramEmbedding,
    )
}
CELL_LEVEL = (MarginalTransferClassifier, MarginalTransferRegressor)

#: Whether training widens a grid whose edge was chosen, unless ``[search] widen_edges``
#: says otherwise.
WIDEN_EDGES_DEFAULT = True


class EvaluationOverlapError(DataError):
    """Every evaluated bag was one of the model's training bags: there is nothing
    unseen to evaluate on (``include_training=True`` evaluates on them anyway)."""


def load_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        config = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from exc
    known = {
        "model",
        "data",
        "panel",
        "preprocessing",
        "estimator",
        "search",
        "cv",
        "compute",
        "fhir",
        "serving",
    }
    unknown = set(config) - known
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {sorted(unknown)}; expected {sorted(known)}")
    for table in ("data", "estimator"):
        if table not in config:
            raise ConfigError(f"{path}: missing [{table}] table")
    config["_base"] = str(path.resolve().parent)
    return config


def build_estimator(spec: Mapping[str, Any], where: str = "estimator") -> BaseEstimator:
    """Instantiate ``spec["class"]`` (a core estimator) with the other keys as parameters."""
    spec = dict(spec)
    name = spec.pop("class", None)
    if name not in ESTIMATORS:
        raise ConfigError(f"[{where}] class must be one of {sorted(ESTIMATORS)}, got {name!r}")
    params = {
        k: build_estimator(v, f"{where}.{k}") if isinstance(v, Mapping) and "class" in v else v
        for k, v in spec.items()
    }
    cls = ESTIMATORS[name]
    allowed = set(cls().get_params(deep=False))
    bad = set(params) - allowed
    if bad:
        raise ConfigError(
            f"[{where}] {name} has no parameter(s) {sorted(bad)}; allowed: {sorted(allowed)}"
        )
    return cls(**params)


def _resolve(base: Path, value: str | list[str]) -> list[Path]:
    patterns = [value] if isinstance(value, str) else list(value)
    out: list[Path] = []
    for pat in patterns:
        full = pat if Path(pat).is_absolute() else str(base / pat)
        matches = sorted(glob.glob(full))
        if not matches:
            raise ConfigError(f"[data] files: nothing matches {pat!r}")
        out += [Path(m) for m in matches]
    return out


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
        compensation = _config_compensation(config)
    data = dict(config["data"])
    files = _resolve(base, data.pop("files"))
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
    # config_groups, _bag_names), not here.
    for key in ("batches", "batch_column", "groups", "group_column", "sample_column"):
        data.pop(key, None)
    known = {"file_column", "label_column", "cell_label_column", "n_jobs"}
    if set(data) - known:
        raise ConfigError(f"[data] unknown key(s) {sorted(set(data) - known)}")
    if panel is None:
        panel = _config_panel(config)
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
        dataset.y = _apply_label_map(label_map, dataset.y)
    return dataset


def _file_column(
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


def config_batches(config: Mapping[str, Any], files: Sequence[str]) -> np.ndarray | None:
    """The batch of every data file, from ``[data] batches`` (a CSV with the file name
    in ``file_column`` and the batch in ``batch_column``, default ``"batch"``), or
    ``None`` when the configuration names no batches.

    Raises
    ------
    ConfigError
        The table cannot be read, or a data file has no batch in it.
    """
    return _file_column(config, files, "batches", "batch_column", "batch")


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
    groups = _file_column(config, files, "groups", "group_column", "group")
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


def _apply_label_map(label_map: Mapping[str, Any] | None, y: np.ndarray) -> np.ndarray:
    """Relabel (e.g. merge gates that are not aligned across samples); keys are the labels
    as written in the data, unlisted labels stay as they are."""
    if label_map is None:
        return y
    mapping = {str(k): v for k, v in label_map.items()}
    return np.array([mapping.get(_label_key(v), v) for v in y.tolist()])


def _config_compensation(config: Mapping[str, Any]) -> Compensation:
    """``[preprocessing] compensation``, a spillover CSV read relative to the config."""
    value = config.get("preprocessing", {}).get("compensation")
    try:
        return Compensation.from_config(value, config["_base"])
    except ValueError as exc:  # DataError included: the CSV names itself
        raise ConfigError(f"[preprocessing] compensation: {exc}") from exc


def _config_panel(config: Mapping[str, Any]) -> Panel | None:
    """The ``[panel]`` table, or None when the data's first file sets the panel."""
    if "panel" not in config:
        return None
    return Panel(tuple(config["panel"]["markers"]), dict(config["panel"].get("aliases", {})))


def _label_key(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


@dataclass
class TrainingResult:
    path: Path
    metrics: dict[str, Any]


def _cv_predictions(
    est: BaseEstimator,
    raw: Bags,
    y: np.ndarray,
    folds: list[tuple[np.ndarray, np.ndarray]],
    cell_level: bool,
    pre_spec: Mapping[str, Any],
    markers: list[str],
    progress: bool = False,
    scores_out: dict[str, np.ndarray] | None = None,
    fit_groups: np.ndarray | None = None,
) -> np.ndarray:
    """Out-of-fold predictions: each bag (or cell) is predicted by a model, preprocessing
    included, that never saw it (a progress bar over the folds with ``progress``).

    ``fit_groups`` (one per bag) go to each fold's fit as ``groups``: the batches of a
    per-cell model, the subjects of a bag-level one.

    For a per-cell classifier the out-of-fold scores (``decision_function``) also go
    into ``scores_out`` under the estimator's key (:func:`_params_key`): they calibrate
    its class probabilities (:mod:`core.calibration`).
    """
    from tqdm.auto import tqdm

    pred = np.empty(y.shape, dtype=object if y.dtype.kind in "OUS" else np.float64)
    keep_scores = cell_level and scores_out is not None and hasattr(est, "decode_scores")
    scores: np.ndarray | None = None
    for train, val in tqdm(folds, desc="folds", unit="fold", disable=not progress, leave=False):
        pre = Preprocessing(**pre_spec).fit(raw[train], markers)
        bags_tr, bags_va = pre.apply(raw[train], markers), pre.apply(raw[val], markers)
        model = for_point_predictions(est)
        if cell_level:
            y_tr = np.concatenate([y[raw.offsets[t] : raw.offsets[t + 1]] for t in train])
            rows = np.concatenate([np.arange(raw.offsets[t], raw.offsets[t + 1]) for t in val])
            model.fit(bags_tr, y_tr, **_groups_kw(fit_groups, train))
            if keep_scores:
                s = model.decision_function(bags_va)
                if scores is None:
                    scores = np.empty((y.shape[0], *s.shape[1:]))
                scores[rows] = s
                pred[rows] = model.decode_scores(s)
            else:
                pred[rows] = model.predict(bags_va)
        else:
            model.fit(bags_tr, y[train], **_groups_kw(fit_groups, train))
            pred[val] = model.predict(bags_va)
    if keep_scores and scores is not None:
        assert scores_out is not None
        scores_out[_params_key(est)] = scores
    return pred


def _groups_kw(groups: np.ndarray | None, rows: np.ndarray) -> dict[str, Any]:
    """``{"groups": ...}`` for a fit on ``rows``, or nothing where fewer than two groups
    are among them (a fold that leaves one group to train on has nothing to hold out)."""
    if groups is None or np.unique(groups[rows]).size < 2:
        return {}
    return {"groups": groups[rows]}


def _params_key(est: BaseEstimator) -> str:
    """The same string for estimators with the same parameters (fitted or not)."""
    return repr(sorted(est.get_params(deep=False).items()))


def _folds(
    config: Mapping[str, Any],
    n_bags: int,
    y: np.ndarray | None,
    classifier: bool,
    cell_level: bool,
    batches: np.ndarray | None = None,
    subjects: np.ndarray | None = None,
):
    if batches is not None and np.unique(batches).size > 1:
        # A model for new batches is judged on batches it has not seen.
        return leave_one_group_out_folds(batches)
    cv = dict(config.get("cv", {}))
    n_splits = int(cv.get("n_splits", 5))
    repeats = int(cv.get("repeats", 1))
    seed = int(cv.get("seed", 0))
    if subjects is not None:
        # Whole subjects per fold: a subject's other bags must not vouch for it.
        n_subjects = np.unique(subjects).size
        if n_splits < 2:
            raise ConfigError(f"[cv] n_splits must be 2 or more, got {n_splits}")
        folds = []
        for r in range(repeats):
            fold = group_folds(subjects, n_bags, min(n_splits, n_subjects), seed + r)
            folds += [
                (np.flatnonzero(fold != f), np.flatnonzero(fold == f))
                for f in range(int(fold.max()) + 1)
            ]
        return folds
    if n_splits < 2 or n_splits > n_bags:
        raise ConfigError(
            f"[cv] n_splits must be between 2 and the number of bags ({n_bags}), got {n_splits}"
        )
    if cell_level:
        return leave_tasks_out_folds(n_bags, n_splits, repeats, seed)
    folds = []
    for r in range(repeats):
        if classifier:
            _, counts = np.unique(y, return_counts=True)
            if counts.min() >= n_splits:
                splitter = StratifiedKFold(n_splits, shuffle=True, random_state=seed + r)
                folds += list(splitter.split(np.zeros(n_bags), y))
                continue
        folds += list(KFold(n_splits, shuffle=True, random_state=seed + r).split(np.zeros(n_bags)))
    return folds


# ------------------------------------------------------------------ grid choices
def estimator_grid_choices(model: BaseEstimator) -> list[GridChoice]:
    """The hyperparameters ``model`` chose from a grid of more than one value (its
    :meth:`grid_choices`; none for an estimator that searches nothing itself).

    Read from what the fitted model records of its own search: ``selection_`` (grids
    and scores) and the chosen ``gamma_``, ``alpha_``, ... attributes. Values fixed by
    the caller (a one-point grid) are not choices and are left out.
    """
    choices = getattr(model, "grid_choices", None)
    return list(choices()) if choices is not None else []


# ------------------------------------------------------------------ bag fingerprints
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


def _bag_names(config: Mapping[str, Any], files: Sequence[str]) -> list[str]:
    """A stable name per training bag, as answers name the nearest training samples:
    the ``[data] sample_column`` of the labels table when given (a sample id), else the
    file's name. Never a path: where the files lay on the training machine says nothing
    to a lab reading an answer (and is nobody's business)."""
    ids = None
    if config.get("data", {}).get("sample_column") and config["data"].get("labels"):
        ids = _file_column(config, files, "labels", "sample_column", "sample")
    return [str(v) for v in ids] if ids is not None else [Path(f).name for f in files]


class GroupingWarning(UserWarning):
    """The data file names suggest several bags per subject, and no ``[data] groups``
    says which: the cross-validated metrics and the model's own calibration are then
    optimistic (bags of one subject vouch for each other)."""


def _weak_spots(tables: Mapping[str, Any]) -> dict[str, Any]:
    """What the card says of a per-cell classifier's validation: the frequency
    agreement, the class with the lowest recall and the sample with the lowest
    accuracy (cross-validated)."""
    a = tables["agreement"]
    weakest_class = min(tables["per_class"], key=lambda r: r["recall"])
    weakest_sample = min(tables["per_sample"], key=lambda r: r["accuracy"])
    return {
        "per_class": a["per_class"],
        "worst_pair": a["worst"],
        "weakest_class": {"class": weakest_class["class"], "recall": weakest_class["recall"]},
        "weakest_sample": {
            "file": weakest_sample["file"],
            "accuracy": weakest_sample["accuracy"],
        },
    }


def _chosen_values(best_params: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """The hyperparameters the final model uses, as values: the ``[search]`` choice,
    and where that choice was a grid (the estimator's own, or one widened) the value
    the estimator chose from it."""
    own = {c.parameter: c.chosen for c in estimator_grid_choices(model)}
    chosen: dict[str, Any] = {}
    for k, v in best_params.items():
        if isinstance(v, list | tuple):
            chosen[k] = own.pop(k, v)
        else:
            chosen[k] = v
    chosen.update(own)
    return chosen


def _calibration_record(model: Any) -> dict[str, Any] | None:
    """How the model's intervals were calibrated (for the card), or None without."""
    method = getattr(model, "calibration_", None)
    if method is None:
        return None
    return {
        "method": method,
        "scaling": getattr(model, "interval_scaling", "none"),
        "groups": getattr(model, "calibration_groups_", None) is not None,
    }


def _grouping(
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


def _overlap(
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


# ------------------------------------------------------------------ the search
Score = tuple[dict[str, Any], np.ndarray, dict[str, Any]]
Candidate = tuple[BaseEstimator, dict[str, Any]]

#: What a failed widening refit may raise: the widened values are outside what the
#: estimator or the data accept (a ridge so small every leverage is 1, a count of 0).
_WIDENING_FAILURES = (ValueError, ArithmeticError, CoreError)
_WIDENING_OFF = "widening is off ([search] widen_edges = false)"


class _Searcher(Protocol):
    """What the search needs from a training path (in memory, or streamed)."""

    def cross_validate(self, candidates: Sequence[Candidate], desc: str) -> list[np.ndarray]:
        """Out-of-fold predictions of each candidate, on the training path's folds."""
        ...

    def fit_final(self, estimator: BaseEstimator) -> BaseEstimator:
        """``estimator`` fitted on every training bag."""
        ...


@dataclass
class _SearchOutcome:
    """The search's result: every candidate's CV score, the one kept, its final fit,
    and the grid-edge records."""

    candidates: list[Candidate]
    scores: list[Score]
    best: int
    final: BaseEstimator
    edges: list[dict[str, Any]] = field(default_factory=list)
    widening: dict[str, Any] = field(default_factory=dict)


def _search_table(config: Mapping[str, Any]) -> tuple[dict[str, list[Any]], bool]:
    """``[search]``: the grid (parameter -> values) and the ``widen_edges`` switch."""
    search = dict(config.get("search", {}))
    widen = search.pop("widen_edges", WIDEN_EDGES_DEFAULT)
    if not isinstance(widen, bool):
        raise ConfigError(f"[search] widen_edges must be true or false, got {widen!r}")
    return {k: list(v) for k, v in search.items()}, widen


def _candidates(estimator: BaseEstimator, grid: Sequence[dict[str, Any]]) -> list[Candidate]:
    out = []
    for params in grid:
        try:
            out.append((clone(estimator).set_params(**params), params))
        except ValueError as exc:
            raise ConfigError(f"[search] {exc}") from exc
    return out


def _run_search(
    candidates: list[Candidate],
    estimator: BaseEstimator,
    grid: dict[str, list[Any]],
    widen: bool,
    searcher: _Searcher,
    y: np.ndarray,
    classifier: bool,
) -> _SearchOutcome:
    """Cross-validate the ``[search]`` candidates, fit the best on everything, then check
    (and, if ``widen``, widen once) every grid whose edge was chosen.

    Without an edge this is the plain search: same candidates, same folds, same final
    fit, so the model is the one training gave before edges were checked.
    """
    candidates = list(candidates)
    scores = _scores(candidates, searcher.cross_validate(candidates, "search"), y, classifier)
    best = _best(scores, classifier)
    edges: list[dict[str, Any]] = []
    widening: dict[str, Any] = {"enabled": widen, "refits": 0}

    # 1. The [search] grid: new candidates join the same cross-validation, and the best
    #    of all candidates evaluated wins, as in the first round.
    chosen = dict(scores[best][2])
    hits = {
        name: side
        for name, values in grid.items()
        if (side := grid_edge(values, chosen.get(name))) is not None
    }
    wider = {name: widen_grid(grid[name], side) for name, side in hits.items()}
    failure = None
    if widen and any(v is not None for v in wider.values()):
        seen = [params for _, params in candidates]
        product = {name: wider.get(name) or values for name, values in grid.items()}
        new = [p for p in ParameterGrid(product) if p not in seen]
        try:
            extra = _candidates(estimator, new)
            preds = searcher.cross_validate(extra, "widening")
        except _WIDENING_FAILURES as exc:
            failure = f"widening failed: {' '.join(str(exc).split())}"
        else:
            candidates += extra
            scores += _scores(extra, preds, y, classifier)
            best = _best(scores, classifier)
            widening["refits"] += len(extra)
    for name, side in hits.items():
        widened = widen and failure is None and wider[name] is not None
        if widened:
            note = None
        elif not widen:
            note = _WIDENING_OFF
        else:
            note = failure or "no value fits past this edge"
        edges.append(
            _edge_record(
                name,
                "search",
                side,
                grid[name],
                chosen[name],
                wider[name] if widened else None,
                scores[best][2][name] if widened else None,
                note=note,
            )
        )
    final = searcher.fit_final(candidates[best][0])

    # 2. The estimator's own grids: refit the kept candidate with the widened grids.
    own = [
        (c, side)
        for c in estimator_grid_choices(final)
        if (side := grid_edge(c.grid, c.chosen)) is not None
    ]
    updates: dict[str, list[Any]] = {}
    # Why an edge cannot be widened, and whether that is because nothing lies beyond.
    stuck: dict[str, tuple[str, bool]] = {}
    for c, side in own:
        if c.widen_as is None:
            stuck[c.parameter] = (c.note or "no estimator parameter takes this grid", False)
            continue
        new_grid = widen_grid(c.grid, side, lower=c.lower, upper=c.upper)
        bound = c.lower if side == "low" else c.upper
        if new_grid is not None:
            updates[c.widen_as] = new_grid
        elif bound is not None and np.isclose(c.chosen, bound):
            stuck[c.parameter] = (
                f"at the bound {bound:g} of the parameter's domain: nothing lies beyond",
                True,
            )
        else:
            stuck[c.parameter] = ("no value fits past this edge", False)
    refit_failure = None
    if widen and updates:
        at_edge = candidates[best]
        widened_est = clone(at_edge[0]).set_params(**updates)
        params = {**at_edge[1], **updates}
        try:
            pred = searcher.cross_validate([(widened_est, params)], "widening")[0]
            refit = searcher.fit_final(widened_est)
        except _WIDENING_FAILURES as exc:
            refit_failure = f"widening failed: {' '.join(str(exc).split())}"
        else:
            widening["cv_at_edge"] = _summary(scores[best][0])
            widening["params_at_edge"] = at_edge[1]
            candidates.append((widened_est, params))
            scores += _scores([(widened_est, params)], [pred], y, classifier)
            # The widened model replaces the edge one whatever the outer CV says: its
            # grid holds the old choice, so the estimator's own criterion, which chose
            # the edge, can only be better on it. The outer CV of both is reported,
            # not used to pick between them.
            best = len(scores) - 1
            final = refit
            widening["refits"] += 1
            widening["cv_after_widening"] = _summary(scores[best][0])
    refitted = widen and bool(updates) and refit_failure is None
    after = {c.parameter: c for c in estimator_grid_choices(final)} if refitted else {}
    for c, side in own:
        a = after.get(c.parameter) if c.widen_as in updates else None
        reason, at_bound = stuck.get(c.parameter, (None, False))
        if a is None and reason is None:
            reason = _WIDENING_OFF if not widen else refit_failure
        record = _edge_record(
            c.parameter,
            "estimator",
            side,
            c.grid,
            c.chosen,
            None if a is None else a.grid,
            None if a is None else a.chosen,
            note=reason,
            at_bound=at_bound,
        )
        moved = after.get(c.parameter)
        if a is None and moved is not None:
            # Not widened itself, but the refit that widened other grids chose again on
            # this grid: what the kept model has is that choice.
            record["note"] = (
                f"{reason}; the refit that widened other grids chose {moved.chosen:.4g}"
            )
            if not at_bound:
                record["still_on_edge"] = grid_edge(moved.grid, moved.chosen) is not None
        edges.append(record)
    # A choice that reached an edge only in the refit (another grid moved) is recorded
    # too, not widened again: widening happens once, so training time stays bounded.
    hit = {c.parameter for c, _ in own}
    for name, a in after.items():
        side = grid_edge(a.grid, a.chosen)
        if name not in hit and side is not None:
            edges.append(
                _edge_record(
                    name,
                    "estimator",
                    side,
                    a.grid,
                    a.chosen,
                    None,
                    None,
                    note="reached this edge in the refit that widened another grid; not "
                    "widened again (widening happens once)",
                )
            )
    return _SearchOutcome(candidates, scores, best, final, edges, widening)


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _edge_record(
    parameter: str,
    source: str,
    side: str,
    grid: Sequence[Any],
    chosen: Any,
    widened_grid: Sequence[Any] | None,
    chosen_after: Any,
    *,
    note: str | None = None,
    at_bound: bool = False,
) -> dict[str, Any]:
    """One ``grid_edges`` entry (see "Grid edges" in the module docstring)."""
    widened = widened_grid is not None
    return {
        "parameter": parameter,
        "source": source,
        "side": side,
        "grid": [_plain(v) for v in grid],
        "chosen": _plain(chosen),
        "widened": widened,
        "widened_grid": None if widened_grid is None else [_plain(v) for v in widened_grid],
        "chosen_after_widening": _plain(chosen_after) if widened else None,
        # Not widened: the only grid searched still has the choice on its edge, unless
        # that edge is the domain's bound.
        "still_on_edge": (grid_edge(widened_grid, chosen_after) is not None)
        if widened
        else not at_bound,
        "at_domain_bound": at_bound,
        "note": note,
    }


def _scores(
    candidates: Sequence[Candidate], preds: Sequence[np.ndarray], y: np.ndarray, classifier: bool
) -> list[Score]:
    return [
        (report.metrics(y, pred, classifier), pred, params)
        for (_, params), pred in zip(candidates, preds, strict=True)
    ]


def _summary(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Scalar metrics only (the confusion matrix stays in the report's ``cv``)."""
    return {k: v for k, v in metrics.items() if not isinstance(v, list)}


def _warn_edges(edges: Sequence[Mapping[str, Any]]) -> None:
    """One :class:`GridEdgeWarning` per edge (none at a domain bound: nothing was cut off)."""
    for edge in edges:
        if not edge["at_domain_bound"]:
            warnings.warn(report.describe_edge(edge), GridEdgeWarning, stacklevel=3)


@dataclass
class _Fitted:
    """What either training path hands to :func:`_save`."""

    final: BaseEstimator
    preprocessing: Preprocessing
    scores: list[tuple[dict[str, Any], np.ndarray, dict[str, Any]]]
    best: int
    y: np.ndarray
    panel: Panel
    files: list[str]
    sha256: str
    level: str
    n_cells: int
    n_folds: int
    compute: dict[str, Any]
    training_bags: list[dict[str, Any]]
    edges: list[dict[str, Any]]
    widening: dict[str, Any]
    #: The cross-validation folds (bag indices) and the cells of every bag, for the
    #: report's per-fold and per-sample tables.
    folds: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    sizes: np.ndarray | None = None
    #: Per-cell classifiers: the temperature of their class probabilities.
    calibration: dict[str, Any] | None = None
    #: How the folds were grouped (:func:`_grouping`).
    grouping: dict[str, Any] = field(default_factory=dict)


def _compute_options(
    config: Mapping[str, Any], scheduler: Any, streaming: bool | None
) -> tuple[Any, bool]:
    """``[compute]`` (``scheduler``, ``streaming``) with the caller's overrides.

    A scheduler from the caller (an address or a ``dask.distributed.Client``) wins over
    the configuration's; any scheduler means streaming.
    """
    compute = dict(config.get("compute", {}))
    unknown = set(compute) - {"scheduler", "streaming"}
    if unknown:
        raise ConfigError(
            f"[compute] unknown key(s) {sorted(unknown)}; expected scheduler, streaming"
        )
    if scheduler is None:
        scheduler = compute.get("scheduler")
        if scheduler is not None and not isinstance(scheduler, str):
            raise ConfigError(f"[compute] scheduler must be an address string, got {scheduler!r}")
    stream = streaming if streaming is not None else compute.get("streaming", False)
    if not isinstance(stream, bool):
        raise ConfigError(f"[compute] streaming must be true or false, got {stream!r}")
    return scheduler, stream or scheduler is not None


def train(
    config_path: str | Path,
    *,
    output: str | Path | None = None,
    progress: bool = False,
    overwrite: bool = False,
    scheduler: Any = None,
    streaming: bool | None = None,
) -> TrainingResult:
    """Run a training configuration end to end; returns the artifact path and CV metrics.

    Parameters
    ----------
    scheduler : str or dask.distributed.Client, optional
        Train on a Dask cluster (``[compute] scheduler``): bags are read and featurised
        by its workers (:mod:`core.streaming`).
    streaming : bool, optional
        Stream bags from their files on local threads (``[compute] streaming``), so that
        memory holds a few bags at a time, not the data set. Same model as in memory.

    Warns
    -----
    GridEdgeWarning
        Once per hyperparameter chosen at the edge of its grid (see "Grid edges" in
        the module docstring); the same records are in ``metrics["grid_edges"]``.
    """
    config = load_config(config_path)
    base = Path(config["_base"])
    model_cfg = dict(config.get("model", {}))
    name = str(model_cfg.get("name", Path(config_path).stem))
    version = str(model_cfg.get("version", "1"))
    out_dir = Path(output) if output is not None else base / model_cfg.get("output", "models")
    estimator = build_estimator(config["estimator"])
    scheduler, stream = _compute_options(config, scheduler, streaming)
    pre_spec = dict(config.get("preprocessing", {}))
    # A spillover CSV is read once here and travels in the spec (and the manifest).
    pre_spec["compensation"] = _config_compensation(config)
    try:
        Preprocessing(**pre_spec)
        if "panel" in config:
            Preprocessing(**pre_spec).column_specs(config["panel"]["markers"])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[preprocessing] {exc}") from exc
    _output_coding(config)
    grid, widen = _search_table(config)
    candidates = _candidates(estimator, list(ParameterGrid(grid)) or [{}])
    serving = _serving(config)
    # Bars inside the estimators' own searches too (core.progress), unless quiet. The
    # estimators' own grid-edge warnings (one per fold) are left to the search, which
    # widens those grids and reports each edge once below.
    with progress_enabled(progress), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=GridEdgeWarning)
        if stream:
            fitted = _train_streaming(
                config, estimator, candidates, grid, widen, pre_spec, scheduler, progress
            )
        else:
            fitted = _train_in_memory(
                config, estimator, candidates, grid, widen, pre_spec, progress
            )
    _warn_edges(fitted.edges)
    return _save(fitted, config, out_dir / name / version, name, version, overwrite, serving)


def _serving(config: Mapping[str, Any]) -> dict[str, Any]:
    """The checked ``[serving]`` table as stored in the manifest."""
    table = dict(config.get("serving", {}))
    unknown = set(table) - {"out_of_domain"}
    if unknown:
        raise ConfigError(f"[serving] unknown key(s) {sorted(unknown)}; expected out_of_domain")
    policy = table.get("out_of_domain", DEFAULT_POLICY)
    if policy not in POLICIES:
        raise ConfigError(
            f"[serving] out_of_domain must be one of {list(POLICIES)}, got {policy!r}"
        )
    return {"out_of_domain": policy}


def _output_coding(config: Mapping[str, Any], classes: Any = None) -> dict[str, Any] | None:
    """The checked ``[fhir]`` table as stored in the manifest, or None without one.

    Checked before training (keys, URIs, codes, units) and again with the model's
    ``classes`` once fitted: the class labels are known only then (``[data] label_map``
    leaves unlisted labels as they are)."""
    spec = config.get("fhir")
    if spec is None:
        return None
    return OutputCoding.from_config(spec, classes=classes).to_json()


class _InMemorySearch:
    """The search on bags held in memory: preprocessing fitted per fold."""

    def __init__(
        self,
        bags: Bags,
        y: np.ndarray,
        folds: list[tuple[np.ndarray, np.ndarray]],
        cell_level: bool,
        pre_spec: dict[str, Any],
        markers: list[str],
        progress: bool,
        fit_groups: np.ndarray | None = None,
    ) -> None:
        self.bags, self.y, self.folds = bags, y, folds
        self.fit_groups = fit_groups
        self.cell_level, self.pre_spec, self.markers = cell_level, pre_spec, markers
        self.progress = progress
        self.preprocessing = Preprocessing(**pre_spec).fit(bags, markers)
        #: Out-of-fold scores of per-cell classifiers, by :func:`_params_key`.
        self.oof_scores: dict[str, np.ndarray] = {}

    def cross_validate(self, candidates: Sequence[Candidate], desc: str) -> list[np.ndarray]:
        from tqdm.auto import tqdm

        # One bar: over the candidates, or over the folds of a single candidate.
        per_fold = self.progress and len(candidates) == 1
        return [
            _cv_predictions(
                est,
                self.bags,
                self.y,
                self.folds,
                self.cell_level,
                self.pre_spec,
                self.markers,
                per_fold,
                self.oof_scores,
                self.fit_groups,
            )
            for est, _ in tqdm(
                candidates,
                desc=desc,
                unit="config",
                disable=not self.progress or len(candidates) == 1,
            )
        ]

    def fit_final(self, estimator: BaseEstimator) -> BaseEstimator:
        bags = self.preprocessing.apply(self.bags, self.markers)
        every = np.arange(len(self.bags))
        return estimator.fit(bags, self.y, **_groups_kw(self.fit_groups, every))


def _train_in_memory(
    config: Mapping[str, Any],
    estimator: BaseEstimator,
    candidates: list[Candidate],
    grid: dict[str, list[Any]],
    widen: bool,
    pre_spec: dict[str, Any],
    progress: bool,
) -> _Fitted:
    cell_level = isinstance(estimator, CELL_LEVEL)
    classifier = is_classifier(estimator)
    data = read_data(config, progress=progress)
    if data.y is None:
        raise ConfigError(
            "[data] gives no labels: set labels (one per bag), or cell_label_column or "
            "cell_label_files (one per cell)"
        )
    if cell_level != (data.level == "cell"):
        want = "one label per cell" if cell_level else "one label per bag"
        raise ConfigError(
            f"[estimator] {type(estimator).__name__} needs {want}; [data] gives the other kind"
        )
    y = data.y if classifier else data.y.astype(np.float64)
    markers = list(data.panel.markers)
    if pre_spec.get("max_points") is not None and cell_level:
        raise ConfigError(
            "[preprocessing] max_points drops cells, which a per-cell model needs labelled"
        )
    batches = config_batches(config, data.files)
    if batches is not None and not cell_level:
        raise ConfigError(
            "[data] batches: batch-aware selection is for per-cell models "
            "(MarginalTransferClassifier, MarginalTransferRegressor)"
        )
    subjects, grouping = _grouping(config, data.files)
    folds = _folds(
        config,
        len(data.bags),
        None if cell_level else y,
        classifier,
        cell_level,
        batches,
        subjects,
    )
    # A per-cell model's fit takes the batches (its fallback for new batches); a
    # bag-level model's, the subjects (its search, calibration and domain check).
    fit_groups = batches if cell_level else subjects
    searcher = _InMemorySearch(
        data.bags, y, folds, cell_level, pre_spec, markers, progress, fit_groups
    )
    outcome = _run_search(candidates, estimator, grid, widen, searcher, y, classifier)
    calibration = None
    oof = searcher.oof_scores.get(_params_key(outcome.final))
    if oof is not None:
        calibration = fit_temperature(oof, y, outcome.final.classes_)
    # The file digests are not kept by load_dataset; reading the files' bytes once more
    # costs far less than parsing them did.
    training_bags = bag_fingerprints(
        _bag_names(config, data.files),
        [file_sha256(f) for f in data.files],
        [data.bags[t] for t in range(len(data.bags))],
    )
    return _Fitted(
        outcome.final,
        searcher.preprocessing,
        outcome.scores,
        outcome.best,
        y,
        data.panel,
        data.files,
        data.sha256,
        data.level,
        int(data.bags.n_points),
        len(folds),
        {"mode": "in-memory"}
        if batches is None
        else {"mode": "in-memory", "batches": sorted({str(b) for b in batches})},
        training_bags,
        outcome.edges,
        outcome.widening,
        folds,
        np.asarray(data.bags.sizes),
        calibration,
        grouping,
    )


class _StreamingSearch:
    """The search on streamed features: each candidate's representation is featurised
    once per file pass; widening that brings a new representation streams the files
    once more, for that representation only."""

    def __init__(
        self,
        executor: Any,
        names: list[str],
        panel: Panel,
        preps: list[Preprocessing],
        y: np.ndarray,
        folds: list[tuple[np.ndarray, np.ndarray]],
        progress: bool,
        subjects: np.ndarray | None = None,
    ) -> None:
        self.executor, self.names, self.panel, self.preps = executor, names, panel, preps
        self.y, self.folds, self.progress = y, folds, progress
        self.subjects = subjects
        self.estimators: list[BaseEstimator] = []
        self.reps: list[Any] = []
        self.features: Any = None

    def _blocks(self, estimators: Sequence[BaseEstimator]) -> list[int]:
        """The feature block of each estimator, streaming the features of new
        representations."""
        from . import streaming

        known = len(self.reps)
        try:
            reps, which = streaming.fitted_representations(
                [*self.estimators, *estimators], len(self.panel.markers)
            )
        except ValueError as exc:
            raise ConfigError(f"[estimator] {exc}") from exc
        # The known estimators come first, so their representations keep their indices.
        if len(reps) > known:
            new = streaming.stream_features(
                self.executor, self.names, self.panel, self.preps, reps[known:], self.progress
            )
            if self.features is None:
                self.features = new
            else:
                self.features.blocks += new.blocks
                self.features.geometries += new.geometries
        self.reps = reps
        self.estimators += list(estimators)
        return which[len(which) - len(estimators) :]

    def cross_validate(self, candidates: Sequence[Candidate], desc: str) -> list[np.ndarray]:
        from . import streaming

        ests = [est for est, _ in candidates]
        which = self._blocks(ests)
        return streaming.cross_validate(
            self.executor,
            ests,
            which,
            self.reps,
            self.features,
            self.y,
            self.folds,
            self.progress,
            self.subjects,
        )

    def fit_final(self, estimator: BaseEstimator) -> BaseEstimator:
        r = self._blocks([estimator])[0]
        full = len(self.folds)  # the last scaling is the one fitted on every bag
        every = np.arange(len(self.y))
        return estimator.fit_embedded(
            self.reps[r],
            self.features.embedding(r, full),
            self.y,
            **_groups_kw(self.subjects, every),
        )


def _train_streaming(
    config: Mapping[str, Any],
    estimator: BaseEstimator,
    candidates: list[Candidate],
    grid: dict[str, list[Any]],
    widen: bool,
    pre_spec: dict[str, Any],
    scheduler: Any,
    progress: bool,
) -> _Fitted:
    from . import streaming

    if isinstance(estimator, CELL_LEVEL):
        raise ConfigError(
            f"[estimator] {type(estimator).__name__} learns from every labelled cell; "
            "streaming and Dask training featurise bags and support DistributionRidge and "
            "DistributionRidgeClassifier"
        )
    classifier = is_classifier(estimator)
    base = Path(config["_base"])
    data_cfg = dict(config["data"])
    if data_cfg.get("labels") is None:
        raise ConfigError("[data] streaming training needs labels (one per bag)")
    known = {
        "files",
        "labels",
        "file_column",
        "label_column",
        "label_map",
        "n_jobs",
        "groups",
        "group_column",
        "sample_column",
    }
    if set(data_cfg) - known:
        raise ConfigError(
            f"[data] streaming training takes one label per bag; unsupported key(s) "
            f"{sorted(set(data_cfg) - known)}"
        )
    paths, labels = labelled_files(
        _resolve(base, data_cfg["files"]),
        base / data_cfg["labels"],
        data_cfg.get("file_column", "file"),
        data_cfg.get("label_column", "label"),
    )
    assert labels is not None
    labels = _apply_label_map(data_cfg.get("label_map"), labels)
    y = labels if classifier else labels.astype(np.float64)
    panel = _config_panel(config) or Panel(tuple(read_file(paths[0])[0].names))
    # Compensation is applied as each file is read (streaming._read_bag).
    stream_pre = Preprocessing(**pre_spec)
    try:
        # Refuse what cannot stream before any file is read.
        streaming.fitted_representations([est for est, _ in candidates], len(panel.markers))
    except ValueError as exc:
        raise ConfigError(f"[estimator] {exc}") from exc
    names = [str(p) for p in paths]
    subjects, grouping = _grouping(config, names)
    folds = _folds(config, len(paths), y, classifier, False, None, subjects)
    if scheduler is not None:
        executor: streaming.Executor = streaming.DaskExecutor(scheduler)
        workers = len(executor.client.scheduler_info().get("workers", {}))
        compute = {"mode": "streaming", "executor": "dask", "workers": workers}
    else:
        n_jobs = int(data_cfg.get("n_jobs") or 1)
        executor = streaming.LocalExecutor(n_jobs)
        compute = {"mode": "streaming", "executor": "threads", "workers": n_jobs}
    with executor:
        summaries = streaming.stream_summaries(executor, names, panel, stream_pre, progress)
        everything = np.arange(len(paths))
        preps = streaming.scalings(pre_spec, summaries, [t for t, _ in folds] + [everything])
        searcher = _StreamingSearch(executor, names, panel, preps, y, folds, progress, subjects)
        outcome = _run_search(candidates, estimator, grid, widen, searcher, y, classifier)
    sha = dataset_fingerprint(paths, [s.sha256 for s in summaries], labels)
    training_bags = [
        {"name": n, "sha256": s.sha256, "points_sha256": s.points_sha256}
        for n, s in zip(_bag_names(config, names), summaries, strict=True)
    ]
    return _Fitted(
        outcome.final,
        preps[-1],
        outcome.scores,
        outcome.best,
        y,
        panel,
        names,
        sha,
        "bag",
        int(sum(s.n_cells for s in summaries)),
        len(folds),
        compute,
        training_bags,
        outcome.edges,
        outcome.widening,
        folds,
        np.array([s.n_cells for s in summaries]),
        None,
        grouping,
    )


def _best(scores: list[tuple[dict[str, Any], np.ndarray, dict[str, Any]]], classifier: bool) -> int:
    key = "accuracy" if classifier else "rmse"
    sign = -1.0 if classifier else 1.0
    return int(np.argmin([sign * s[0][key] for s in scores]))


def _save(
    fitted: _Fitted,
    config: Mapping[str, Any],
    path: Path,
    name: str,
    version: str,
    overwrite: bool,
    serving: dict[str, Any],
) -> TrainingResult:
    classifier = is_classifier(fitted.final)
    key = "accuracy" if classifier else "rmse"
    best_metrics, best_pred, best_params = fitted.scores[fitted.best]
    cell_level = fitted.level == "cell"
    grouped = fitted.grouping.get("by") == "groups"
    metrics = {
        "cv": {
            "scheme": (
                "leave-one-batch-out"
                if len(fitted.compute.get("batches", [])) > 1
                else "k-fold over groups (whole subjects per fold)"
                if grouped
                else "leave-tasks-out"
                if cell_level
                else "k-fold over bags"
            ),
            "n_folds": fitted.n_folds,
            **best_metrics,
        },
        "best_params": best_params,
        "chosen_params": _chosen_values(best_params, fitted.final),
        "search": [
            {"params": p, **{k: v for k, v in m.items() if not isinstance(v, list)}}
            for m, _, p in fitted.scores
        ],
        "n_bags": len(fitted.files),
        "n_cells": fitted.n_cells,
        "compute": fitted.compute,
        "grid_edges": fitted.edges,
        "widening": fitted.widening,
        "grouping": fitted.grouping,
    }
    if fitted.calibration is not None:
        metrics["probability_calibration"] = fitted.calibration
    files = report.render(
        fitted.y, best_pred, classifier, metrics, [(s[2], s[0][key]) for s in fitted.scores], key
    )
    tables = report.tables(
        _bag_names(config, fitted.files),
        fitted.y,
        best_pred,
        classifier,
        fitted.folds,
        fitted.sizes if cell_level else None,
    )
    metrics["per_fold"] = tables["per_fold"]
    if not classifier and not cell_level:
        files.update(report.residual_plot(tables))
    if "agreement" in tables:
        files.update(report.bland_altman_plot(tables))
        # With the cross-validated metrics: the card and the manifest keep those.
        metrics["cv"]["frequency_agreement"] = _weak_spots(tables)
    # The report's file keeps every sample's out-of-fold answer and fold (the manifest
    # keeps the summary).
    files["report/metrics.json"] = json.dumps(
        {
            **metrics,
            "per_sample": tables.get("per_sample", []),
            **({"frequencies": tables["frequencies"]} if "frequencies" in tables else {}),
        },
        indent=2,
        default=str,
    ).encode()
    from datetime import UTC, datetime

    from .artifacts import _libraries

    header = {
        "trained": datetime.now(UTC).isoformat(timespec="seconds"),
        "training data sha256": fitted.sha256,
        "libraries": ", ".join(f"{k} {v}" for k, v in sorted(_libraries().items())),
    }
    files["report/report.html"] = report.html(
        name, version, metrics, tables, files, header=header
    ).encode()
    model_cfg = config.get("model", {})
    metadata = {
        "name": name,
        "version": version,
        "description": model_cfg.get("description"),
        "panel": fitted.panel.to_json(),
        "preprocessing": fitted.preprocessing.to_json(),
        "training_data_sha256": fitted.sha256,
        "training_files": [Path(f).name for f in fitted.files],
        "training_bags": fitted.training_bags,
        "grid_edges": fitted.edges,
        "chosen_params": json.loads(json.dumps(metrics["chosen_params"], default=float)),
        "label_level": fitted.level,
        "probability_calibration": fitted.calibration,
        "fhir": _output_coding(config, getattr(fitted.final, "classes_", None)),
        "grouping": fitted.grouping,
        "serving": serving,
        "calibration": _calibration_record(fitted.final),
        "metrics": json.loads(json.dumps(metrics["cv"], default=str)),
        "config": {k: v for k, v in config.items() if not k.startswith("_")},
    }
    from .runtime import kind_of

    # The card is part of the artifact (hashed with it); created and the manifest's
    # sha256 are added where it is served (ArtifactInfo.card).
    files["card.md"] = render_card(
        metadata, estimator=type(fitted.final).__name__, kind=str(kind_of(type(fitted.final)))
    ).encode()
    saved = save(fitted.final, path, overwrite=overwrite, extra_files=files, **metadata)
    return TrainingResult(saved, metrics)


def evaluate(
    model_path: str | Path,
    config_path: str | Path,
    *,
    include_training: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Metrics of a saved model on the data of a configuration's [data] table, on the
    bags it did not see in training.

    The evaluated bags are matched with the training bags the manifest records
    (``training_bags``: the sha256 of each file and of its cells), so that training
    bags, on which the model is optimistic, are never reported as if unseen.

    Parameters
    ----------
    model_path : path
        The artifact.
    config_path : path
        A configuration whose ``[data]`` table names the bags and their labels.
    include_training : bool, default=False
        Report the metrics on every bag, training bags included, and the unseen
        bags' metrics under ``"unseen_only"``. Without it only the unseen bags count.
    progress : bool, default=False
        Show a progress bar while reading.

    Returns
    -------
    dict
        The metrics (``rmse``, ``mae``, ``r2`` or ``accuracy``, ``macro_f1``, ...) of
        the bags ``evaluated_on`` names, and: ``n_bags`` (evaluated bags read),
        ``overlap`` (``"known"`` or ``"unknown"``), ``n_overlapping`` and
        ``overlapping`` (names of the bags that were training bags; ``None`` when
        unknown), ``n_unseen``, ``evaluated_on`` (``"unseen bags only"``,
        ``"all bags, training bags included"``, or ``"all bags, overlap unknown"``),
        ``unseen_only`` (with ``include_training``: ``n_bags`` and the metrics of the
        unseen bags, or ``None`` when there are none), and ``note``, one sentence
        saying what was evaluated.

    Raises
    ------
    EvaluationOverlapError
        Every evaluated bag is a training bag and ``include_training`` is false.
    ConfigError
        The configuration gives no labels.
    """
    from .runtime import ModelRuntime

    runtime = ModelRuntime.open(model_path)
    config = load_config(config_path)
    data = read_data(
        config,
        panel=runtime.info.panel,
        progress=progress,
        compensation=runtime.info.preprocessing.compensation,
    )
    if data.y is None:
        raise ConfigError("[data] gives no labels to evaluate against")
    classifier = runtime.info.classifies
    y = data.y if classifier else data.y.astype(np.float64)
    pred = runtime.predict(data.bags).estimate
    T = len(data.bags)
    names = _bag_names(config, data.files)
    seen = _overlap(
        runtime.info.metadata,
        bag_fingerprints(
            names, [file_sha256(f) for f in data.files], [data.bags[t] for t in range(T)]
        ),
    )
    if seen is None:
        note = (
            f"the model records no fingerprints of its training bags (saved before they "
            f"were recorded): overlap with the {T} evaluated bag(s) unknown; metrics are "
            "on all of them"
        )
        return {
            **report.metrics(y, pred, classifier),
            "n_bags": T,
            "overlap": "unknown",
            "n_overlapping": None,
            "overlapping": None,
            "n_unseen": None,
            "evaluated_on": "all bags, overlap unknown",
            "note": note,
        }
    overlapping = [n for n, s in zip(names, seen, strict=True) if s]
    unseen = np.flatnonzero(~seen)
    if unseen.size == 0 and not include_training:
        raise EvaluationOverlapError(
            f"all {T} evaluated bag(s) were used to train this model (matched by sha256), "
            "so none is unseen and their metrics would be optimistic; evaluate on other "
            "bags, or pass --include-training (include_training=True) to report them anyway"
        )
    if data.level == "cell":
        # Per-cell labels: a bag's rows are its cells.
        rows = [np.arange(data.bags.offsets[t], data.bags.offsets[t + 1]) for t in unseen]
        keep = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    else:
        keep = unseen
    unseen_metrics = report.metrics(y[keep], pred[keep], classifier) if unseen.size else None
    base = {
        "n_bags": T,
        "overlap": "known",
        "n_overlapping": len(overlapping),
        "overlapping": overlapping,
        "n_unseen": int(unseen.size),
    }
    if include_training:
        unseen_part = (
            f"and on the {unseen.size} unseen bag(s) under unseen_only"
            if unseen.size
            else "and no bag is unseen (unseen_only is null)"
        )
        note = (
            f"{len(overlapping)} of {T} evaluated bag(s) were used to train the model; "
            f"metrics are on all bags, training bags included (optimistic), {unseen_part}"
        )
        return {
            **report.metrics(y, pred, classifier),
            **base,
            "evaluated_on": "all bags, training bags included",
            "unseen_only": None
            if unseen_metrics is None
            else {"n_bags": int(unseen.size), **unseen_metrics},
            "note": note,
        }
    note = (
        f"{len(overlapping)} of {T} evaluated bag(s) were used to train the model and are "
        f"left out; metrics are on the {unseen.size} unseen bag(s) "
        "(--include-training to report all)"
        if overlapping
        else f"none of the {T} evaluated bag(s) was used to train the model"
    )
    assert unseen_metrics is not None
    return {**unseen_metrics, **base, "evaluated_on": "unseen bags only", "note": note}
