"""Streamed training: bags read from their files a few at a time, on threads or Dask.

:func:`train_streaming` trains the bag-level estimators (``DistributionRidge`` and its
classifier) without holding the data set: the files are streamed once for their
summaries (the scaling of every fold), and once per representation for their features
(:mod:`core.streaming`); the search (:class:`_StreamingSearch`) cross-validates on those
features; a last pass explains each bag with its folds' models for the report's regions.
Same folds, same search, same model and same regions as in memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, is_classifier

from ..errors import ConfigError
from ..io import Panel, Preprocessing, dataset_fingerprint, labelled_files, read_file
from .config import CELL_LEVEL, config_panel, resolve_path
from .data import apply_label_map, bag_names
from .folds import make_folds
from .groups import grouping_of, groups_kw
from .saving import Fitted
from .search import Candidate, run_search


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
        from .. import streaming

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
        from .. import streaming

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

    def fold_models(self, final: BaseEstimator) -> dict[int, BaseEstimator]:
        """The model of each fold for the report's regions: the final model's
        parameters fitted on the fold's streamed features (:func:`.regions.fold_explainer`;
        the models in-memory training fits on the fold's cells)."""
        from .regions import fold_explainer

        r = self._blocks([final])[0]
        return {
            f: fold_explainer(final).fit_embedded(
                self.reps[r], self.features.embedding(r, f, train), self.y[train]
            )
            for f, (train, _) in enumerate(self.folds)
        }

    def fit_final(self, estimator: BaseEstimator) -> BaseEstimator:
        r = self._blocks([estimator])[0]
        full = len(self.folds)  # the last scaling is the one fitted on every bag
        every = np.arange(len(self.y))
        return estimator.fit_embedded(
            self.reps[r],
            self.features.embedding(r, full),
            self.y,
            **groups_kw(self.subjects, every),
        )


#: The ``[data]`` keys streaming training reads (one label per bag).
_STREAMING_DATA_KEYS = frozenset(
    {"files", "labels", "file_column", "label_column", "label_map", "n_jobs", "groups",
     "group_column", "sample_column"}
)  # fmt: skip


def train_streaming(
    config: Mapping[str, Any],
    estimator: BaseEstimator,
    candidates: list[Candidate],
    grid: dict[str, list[Any]],
    widen: bool,
    pre_spec: dict[str, Any],
    scheduler: Any,
    progress: bool,
) -> Fitted:
    from .. import streaming

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
    if set(data_cfg) - _STREAMING_DATA_KEYS:
        raise ConfigError(
            f"[data] streaming training takes one label per bag; unsupported key(s) "
            f"{sorted(set(data_cfg) - _STREAMING_DATA_KEYS)}"
        )
    paths, labels = labelled_files(
        resolve_path(base, data_cfg["files"]),
        base / data_cfg["labels"],
        data_cfg.get("file_column", "file"),
        data_cfg.get("label_column", "label"),
    )
    assert labels is not None
    labels = apply_label_map(data_cfg.get("label_map"), labels)
    y = labels if classifier else labels.astype(np.float64)
    panel = config_panel(config) or Panel(tuple(read_file(paths[0])[0].names))
    # Compensation is applied as each file is read (streaming._read_bag).
    stream_pre = Preprocessing(**pre_spec)
    try:
        # Refuse what cannot stream before any file is read.
        streaming.fitted_representations([est for est, _ in candidates], len(panel.markers))
    except ValueError as exc:
        raise ConfigError(f"[estimator] {exc}") from exc
    names = [str(p) for p in paths]
    subjects, grouping = grouping_of(config, names)
    folds = make_folds(config, len(paths), y, classifier, False, None, subjects)
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
        outcome = run_search(candidates, estimator, grid, widen, searcher, y, classifier)
        # Where the model looks: a third pass, each bag explained where it is read.
        regions = streaming.stream_regions(
            executor,
            names,
            panel,
            preps,
            searcher.fold_models(outcome.final),
            folds,
            summaries,
            progress,
        )
    sha = dataset_fingerprint(paths, [s.sha256 for s in summaries], labels)
    training_bags = [
        {"name": n, "sha256": s.sha256, "points_sha256": s.points_sha256}
        for n, s in zip(bag_names(config, names), summaries, strict=True)
    ]
    return Fitted.from_search(
        outcome,
        folds=folds,
        preprocessing=preps[-1],
        y=y,
        panel=panel,
        files=names,
        sha256=sha,
        level="bag",
        n_cells=int(sum(s.n_cells for s in summaries)),
        compute=compute,
        training_bags=training_bags,
        sizes=np.array([s.n_cells for s in summaries]),
        calibration=None,
        grouping=grouping,
        regions=regions,
    )
