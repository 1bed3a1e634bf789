"""Training from a TOML configuration: data, panel, preprocessing, estimator, search, report.

A configuration (see ``examples/``) has these tables; paths are relative to the file::

    [model]          name, version, output (directory of models; default "models")
    [data]           files (glob or list), labels (CSV table) + file_column + label_column
                     for one label per bag, or cell_label_column / cell_label_files for
                     one label per cell; n_jobs (parallel reading)
    [panel]          markers (names, in model order), aliases (name -> other names)
    [preprocessing]  transform ("none" | "arcsinh" | "log"), cofactor, scale
                     ("none" | "standard"), max_points, seed
    [estimator]      class and parameters; nested tables with a "class" key build the
                     representation / embedding
    [search]         optional grid: parameter name -> list of values
    [cv]             n_splits (default 5), repeats (default 1), seed
    [compute]        streaming (read bags a few at a time), scheduler (a Dask scheduler
                     address); see :mod:`core.streaming`

Training reads the data, fits the preprocessing on the training cells, runs the
cross-validation (leave-bags-out for one label per bag, leave-tasks-out for one label
per cell), refits on everything, and saves the artifact with its report
(``report/metrics.json`` and PNG plots) under ``output/name/version``.
"""

from __future__ import annotations

import glob
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, clone, is_classifier
from sklearn.model_selection import KFold, ParameterGrid, StratifiedKFold

from . import report
from .artifacts import save
from .bags import Bags
from .errors import ConfigError
from .estimators import (
    DistributionRidge,
    DistributionRidgeClassifier,
    MarginalTransferClassifier,
    MarginalTransferRegressor,
)
from .io import (
    Dataset,
    Panel,
    Preprocessing,
    dataset_fingerprint,
    labelled_files,
    load_dataset,
    read_file,
)
from .representations import DensityFeatures, HistogramEmbedding, MeanEmbedding, SlicedWasserstein
from .selection import leave_tasks_out_folds

__all__ = ["ConfigError", "TrainingResult", "build_estimator", "evaluate", "load_config", "train"]

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


def load_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        config = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from exc
    known = {"model", "data", "panel", "preprocessing", "estimator", "search", "cv", "compute"}
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
    config: Mapping[str, Any], panel: Panel | None = None, progress: bool = False
) -> Dataset:
    base = Path(config["_base"])
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
    )
    if dataset.y is not None:
        dataset.y = _apply_label_map(label_map, dataset.y)
    return dataset


def _apply_label_map(label_map: Mapping[str, Any] | None, y: np.ndarray) -> np.ndarray:
    """Relabel (e.g. merge gates that are not aligned across samples); keys are the labels
    as written in the data, unlisted labels stay as they are."""
    if label_map is None:
        return y
    mapping = {str(k): v for k, v in label_map.items()}
    return np.array([mapping.get(_label_key(v), v) for v in y.tolist()])


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
) -> np.ndarray:
    """Out-of-fold predictions: each bag (or cell) is predicted by a model, preprocessing
    included, that never saw it."""
    pred = np.empty(y.shape, dtype=object if y.dtype.kind in "OUS" else np.float64)
    for train, val in folds:
        pre = Preprocessing(**pre_spec).fit(raw[train], markers)
        bags_tr, bags_va = pre.apply(raw[train], markers), pre.apply(raw[val], markers)
        model = clone(est)
        if cell_level:
            y_tr = np.concatenate([y[raw.offsets[t] : raw.offsets[t + 1]] for t in train])
            rows = np.concatenate([np.arange(raw.offsets[t], raw.offsets[t + 1]) for t in val])
            pred[rows] = model.fit(bags_tr, y_tr).predict(bags_va)
        else:
            pred[val] = model.fit(bags_tr, y[train]).predict(bags_va)
    return pred


def _folds(
    config: Mapping[str, Any], n_bags: int, y: np.ndarray | None, classifier: bool, cell_level: bool
):
    cv = dict(config.get("cv", {}))
    n_splits = int(cv.get("n_splits", 5))
    repeats = int(cv.get("repeats", 1))
    seed = int(cv.get("seed", 0))
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
    try:
        Preprocessing(**pre_spec)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[preprocessing] {exc}") from exc
    grid = list(ParameterGrid({k: list(v) for k, v in config.get("search", {}).items()})) or [{}]
    candidates = []
    for params in grid:
        try:
            candidates.append((clone(estimator).set_params(**params), params))
        except ValueError as exc:
            raise ConfigError(f"[search] {exc}") from exc
    if stream:
        fitted = _train_streaming(config, estimator, candidates, pre_spec, scheduler, progress)
    else:
        fitted = _train_in_memory(config, estimator, candidates, pre_spec, progress)
    return _save(fitted, config, out_dir / name / version, name, version, overwrite)


def _train_in_memory(
    config: Mapping[str, Any],
    estimator: BaseEstimator,
    candidates: list[tuple[BaseEstimator, dict[str, Any]]],
    pre_spec: dict[str, Any],
    progress: bool,
) -> _Fitted:
    from tqdm.auto import tqdm

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
    folds = _folds(config, len(data.bags), None if cell_level else y, classifier, cell_level)
    scores = []
    for est, params in tqdm(
        candidates, desc="search", unit="config", disable=not progress or len(candidates) == 1
    ):
        pred = _cv_predictions(est, data.bags, y, folds, cell_level, pre_spec, markers)
        scores.append((report.metrics(y, pred, classifier), pred, params))
    best = _best(scores, classifier)
    pre = Preprocessing(**pre_spec).fit(data.bags, markers)
    final = candidates[best][0].fit(pre.apply(data.bags, markers), y)
    return _Fitted(
        final,
        pre,
        scores,
        best,
        y,
        data.panel,
        data.files,
        data.sha256,
        data.level,
        int(data.bags.n_points),
        len(folds),
        {"mode": "in-memory"},
    )


def _train_streaming(
    config: Mapping[str, Any],
    estimator: BaseEstimator,
    candidates: list[tuple[BaseEstimator, dict[str, Any]]],
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
    known = {"files", "labels", "file_column", "label_column", "label_map", "n_jobs"}
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
    try:
        reps, which = streaming.fitted_representations(
            [est for est, _ in candidates], len(panel.markers)
        )
    except ValueError as exc:
        raise ConfigError(f"[estimator] {exc}") from exc
    folds = _folds(config, len(paths), y, classifier, False)
    names = [str(p) for p in paths]
    if scheduler is not None:
        executor: streaming.Executor = streaming.DaskExecutor(scheduler)
        workers = len(executor.client.scheduler_info().get("workers", {}))
        compute = {"mode": "streaming", "executor": "dask", "workers": workers}
    else:
        n_jobs = int(data_cfg.get("n_jobs") or 1)
        executor = streaming.LocalExecutor(n_jobs)
        compute = {"mode": "streaming", "executor": "threads", "workers": n_jobs}
    with executor:
        summaries = streaming.stream_summaries(
            executor, names, panel, Preprocessing(**pre_spec), progress
        )
        everything = np.arange(len(paths))
        preps = streaming.scalings(pre_spec, summaries, [t for t, _ in folds] + [everything])
        features = streaming.stream_features(executor, names, panel, preps, reps, progress)
        preds = streaming.cross_validate(
            executor, [est for est, _ in candidates], which, reps, features, y, folds, progress
        )
    scores = [
        (report.metrics(y, pred, classifier), pred, params)
        for (_, params), pred in zip(candidates, preds, strict=True)
    ]
    best = _best(scores, classifier)
    r = which[best]
    final = candidates[best][0].fit_embedded(reps[r], features.embedding(r, len(folds)), y)
    sha = dataset_fingerprint(paths, [s.sha256 for s in summaries], labels)
    return _Fitted(
        final,
        preps[-1],
        scores,
        best,
        y,
        panel,
        names,
        sha,
        "bag",
        int(sum(s.n_cells for s in summaries)),
        len(folds),
        compute,
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
) -> TrainingResult:
    classifier = is_classifier(fitted.final)
    key = "accuracy" if classifier else "rmse"
    best_metrics, best_pred, best_params = fitted.scores[fitted.best]
    cell_level = fitted.level == "cell"
    metrics = {
        "cv": {
            "scheme": "leave-tasks-out" if cell_level else "k-fold over bags",
            "n_folds": fitted.n_folds,
            **best_metrics,
        },
        "best_params": best_params,
        "search": [
            {"params": p, **{k: v for k, v in m.items() if not isinstance(v, list)}}
            for m, _, p in fitted.scores
        ],
        "n_bags": len(fitted.files),
        "n_cells": fitted.n_cells,
        "compute": fitted.compute,
    }
    files = report.render(
        fitted.y, best_pred, classifier, metrics, [(s[2], s[0][key]) for s in fitted.scores], key
    )
    files["report/metrics.json"] = json.dumps(metrics, indent=2, default=str).encode()
    saved = save(
        fitted.final,
        path,
        overwrite=overwrite,
        extra_files=files,
        name=name,
        version=version,
        panel=fitted.panel.to_json(),
        preprocessing=fitted.preprocessing.to_json(),
        training_data_sha256=fitted.sha256,
        training_files=[Path(f).name for f in fitted.files],
        label_level=fitted.level,
        metrics=json.loads(json.dumps(metrics["cv"], default=str)),
        config={k: v for k, v in config.items() if not k.startswith("_")},
    )
    return TrainingResult(saved, metrics)


def evaluate(
    model_path: str | Path, config_path: str | Path, *, progress: bool = False
) -> dict[str, Any]:
    """Metrics of a saved model on the data of a configuration's [data] table."""
    from .runtime import ModelRuntime

    runtime = ModelRuntime.open(model_path)
    config = load_config(config_path)
    data = read_data(config, panel=runtime.info.panel, progress=progress)
    if data.y is None:
        raise ConfigError("[data] gives no labels to evaluate against")
    classifier = runtime.info.classifies
    y = data.y if classifier else data.y.astype(np.float64)
    pred = runtime.predict(data.bags).estimate
    return report.metrics(y, pred, classifier)
