"""In-memory training: every bag read first, preprocessing fitted per fold.

:func:`train_in_memory` reads the data (:func:`core.training.data.read_data`), checks
that the estimator and the labels agree (one per bag, or one per cell), builds the folds
from the batches or groups, runs the search (:class:`_InMemorySearch`), calibrates a
per-cell classifier's class probabilities on its out-of-fold scores, and fingerprints
the training bags.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, is_classifier

from ..bags import Bags
from ..calibration import fit_temperature
from ..errors import ConfigError
from ..hashing import file_sha256
from ..io import Preprocessing
from .config import CELL_LEVEL
from .data import bag_fingerprints, bag_names, read_control, read_data
from .folds import FoldCache, cv_predictions, make_folds, params_key
from .groups import config_batches, grouping_of, groups_kw
from .regions import held_out_cell_regions, held_out_regions
from .saving import Fitted
from .search import Candidate, run_search


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
        control: Bags | None = None,
    ) -> None:
        self.bags, self.y, self.folds = bags, y, folds
        self.fit_groups, self.control = fit_groups, control
        self.cell_level, self.pre_spec, self.markers = cell_level, pre_spec, markers
        self.progress = progress
        self.preprocessing = Preprocessing(**pre_spec).fit(bags, markers)
        #: Out-of-fold scores of per-cell classifiers, by :func:`params_key`.
        self.oof_scores: dict[str, np.ndarray] = {}
        #: Out-of-fold answers of per-cell models (every cell), by :func:`params_key`.
        self.oof_cells: dict[str, np.ndarray] = {}
        #: What the folds compute alike for every candidate (widening's too).
        self.fold_cache = FoldCache()
        self._final_bags: Bags | None = None

    def cross_validate(self, candidates: Sequence[Candidate], desc: str) -> list[np.ndarray]:
        from tqdm.auto import tqdm

        # One bar: over the candidates, or over the folds of a single candidate.
        per_fold = self.progress and len(candidates) == 1
        answers = []
        for est, _ in tqdm(
            candidates, desc=desc, unit="config", disable=not self.progress or len(candidates) == 1
        ):
            pred = cv_predictions(
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
                self.fold_cache,
                self.control,
            )
            if self.cell_level:
                self.oof_cells[params_key(est)] = pred
            answers.append(pred)
        return answers

    def fit_final(self, estimator: BaseEstimator) -> BaseEstimator:
        if self._final_bags is None:
            self._final_bags = self.preprocessing.apply(self.bags, self.markers)
        bags = self._final_bags
        every = np.arange(len(self.bags))
        groups = groups_kw(self.fit_groups, every)
        if self.control is not None:
            groups["control"] = self.preprocessing.apply(self.control, self.markers).points
        # The kept candidate and its widened refit embed every bag alike: once.
        shared = self.fold_cache.embedded("all", estimator, bags, None)
        if shared is not None:
            rep, emb, _ = shared
            return estimator.fit_embedded(rep, emb, self.y, **groups)
        return estimator.fit(bags, self.y, **groups)


def _check_batches(has_control: bool, batches: np.ndarray | None, cell_level: bool) -> None:
    """Refuse a reference control or batches given to a model that cannot use them."""
    if has_control and not cell_level:
        raise ConfigError(
            "[data] control: a batch's reference control calibrates per-cell models "
            "(MarginalTransferClassifier, MarginalTransferRegressor) only"
        )
    if has_control and batches is not None and np.unique(batches).size > 1:
        raise ConfigError(
            "[data] control: a reference control belongs to one batch, and [data] "
            "batches names several"
        )
    if batches is not None and not cell_level:
        raise ConfigError(
            "[data] batches: batch-aware selection is for per-cell models "
            "(MarginalTransferClassifier, MarginalTransferRegressor)"
        )


def train_in_memory(
    config: Mapping[str, Any],
    estimator: BaseEstimator,
    candidates: list[Candidate],
    grid: dict[str, list[Any]],
    widen: bool,
    pre_spec: dict[str, Any],
    progress: bool,
) -> Fitted:
    """Train with every bag in memory: read, checked, folded, searched, calibrated."""
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
    control, control_file = read_control(config, data.panel) or (None, None)
    _check_batches(control is not None, batches, cell_level)
    subjects, grouping = grouping_of(config, data.files)
    folds = make_folds(
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
        data.bags, y, folds, cell_level, pre_spec, markers, progress, fit_groups, control
    )
    try:
        outcome = run_search(candidates, estimator, grid, widen, searcher, y, classifier)
    finally:
        searcher.fold_cache.close()
    calibration = None
    oof = searcher.oof_scores.get(params_key(outcome.final))
    if oof is not None:
        calibration = fit_temperature(oof, y, outcome.final.classes_)
    # Where the model looks, from held-out explanations (per-cell models: from the
    # labels their folds gave, the part of their explanation each cell carries).
    if cell_level:
        given = searcher.oof_cells.get(params_key(outcome.final))
        classes = getattr(outcome.final, "classes_", None)
        regions = None
        if given is not None:
            regions = held_out_cell_regions(data.bags, given, classes, folds, pre_spec, markers)
    else:
        regions = held_out_regions(outcome.final, data.bags, y, folds, pre_spec, markers)
    # The file digests are not kept by load_dataset; reading the files' bytes once more
    # costs far less than parsing them did.
    training_bags = bag_fingerprints(
        bag_names(config, data.files),
        [file_sha256(f) for f in data.files],
        [data.bags[t] for t in range(len(data.bags))],
    )
    return Fitted.from_search(
        outcome,
        folds=folds,
        preprocessing=searcher.preprocessing,
        y=y,
        panel=data.panel,
        files=data.files,
        sha256=data.sha256,
        level=data.level,
        n_cells=int(data.bags.n_points),
        compute={"mode": "in-memory"}
        if batches is None
        else {"mode": "in-memory", "batches": sorted({str(b) for b in batches})},
        training_bags=training_bags,
        sizes=np.asarray(data.bags.sizes),
        calibration=calibration,
        grouping=grouping,
        control=control_file,
        regions=regions,
    )
