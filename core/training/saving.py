"""Saving a trained model: the artifact with its report, card and manifest.

Either training path (:mod:`core.training.fit_memory`, :mod:`core.training.fit_streaming`)
hands a :class:`Fitted` to :func:`save_trained`, which renders the report (cross-validated
metrics, per-fold and per-sample tables, plots, ``report/report.html``), the model card,
and writes the artifact (:func:`core.artifacts.save`) whose manifest records the panel,
the preprocessing, the training bags, the grid edges, the chosen hyperparameters and
the configuration.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, is_classifier

from .. import report
from ..artifacts import save
from ..card import render_card
from ..io import Panel, Preprocessing
from .config import output_coding
from .data import bag_names
from .edges import estimator_grid_choices
from .search import SearchOutcome


@dataclass
class TrainingResult:
    path: Path
    metrics: dict[str, Any]


@dataclass(kw_only=True)
class Fitted:
    """What either training path hands to :func:`save_trained`; built by
    :meth:`from_search` (keywords only: 19 fields are not read by position)."""

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
    #: How the folds were grouped (:func:`grouping_of`).
    grouping: dict[str, Any] = field(default_factory=dict)
    #: Per-cell models: the training batch's reference control (file, sha256).
    control: dict[str, str] | None = None
    #: Bag-level models trained in memory: where the model looks
    #: (:func:`.regions.held_out_regions`).
    regions: dict[str, Any] | None = None

    @classmethod
    def from_search(
        cls,
        outcome: SearchOutcome,
        *,
        folds: list[tuple[np.ndarray, np.ndarray]],
        **fields: Any,
    ) -> Fitted:
        """The fitted result of a training path: the search's kept model, its scores
        and grid records, the folds it ran on, and the path's own ``fields``."""
        return cls(
            final=outcome.final,
            scores=outcome.scores,
            best=outcome.best,
            edges=outcome.edges,
            widening=outcome.widening,
            folds=folds,
            n_folds=len(folds),
            **fields,
        )


def save_trained(
    fitted: Fitted,
    config: Mapping[str, Any],
    path: Path,
    name: str,
    version: str,
    overwrite: bool,
    serving: dict[str, Any],
) -> TrainingResult:
    """Save ``fitted`` at ``path`` with its report (metrics, tables, plots, HTML) and
    model card, and the metadata the manifest keeps."""
    classifier = is_classifier(fitted.final)
    key = "accuracy" if classifier else "rmse"
    best_metrics, best_pred, best_params = fitted.scores[fitted.best]
    cell_level = fitted.level == "cell"
    metrics = _metrics(fitted, best_metrics, best_params, cell_level)
    files = report.render(
        fitted.y, best_pred, classifier, metrics, [(s[2], s[0][key]) for s in fitted.scores], key
    )
    tables = report.tables(
        bag_names(config, fitted.files),
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

    from ..artifacts import library_versions

    header = {
        "trained": datetime.now(UTC).isoformat(timespec="seconds"),
        "training data sha256": fitted.sha256,
        "libraries": ", ".join(f"{k} {v}" for k, v in sorted(library_versions().items())),
    }
    files["report/report.html"] = report.html(
        name, version, metrics, tables, files, header=header
    ).encode()
    metadata = _metadata(fitted, config, name, version, serving, metrics)
    from ..artifact_info import kind_of

    # The card is part of the artifact (hashed with it); created and the manifest's
    # sha256 are added where it is served (ArtifactInfo.card).
    files["card.md"] = render_card(
        metadata, estimator=type(fitted.final).__name__, kind=str(kind_of(type(fitted.final)))
    ).encode()
    saved = save(fitted.final, path, overwrite=overwrite, extra_files=files, **metadata)
    return TrainingResult(saved, metrics)


def _metrics(
    fitted: Fitted,
    best_metrics: dict[str, Any],
    best_params: dict[str, Any],
    cell_level: bool,
) -> dict[str, Any]:
    """The training metrics: the kept candidate's cross-validation (and its scheme),
    every candidate's, the choices, sizes, compute, grid edges and grouping."""
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
    if fitted.control is not None:
        metrics["reference_control"] = fitted.control
    if fitted.regions is not None:
        metrics["explained_regions"] = fitted.regions
    return metrics


def _metadata(
    fitted: Fitted,
    config: Mapping[str, Any],
    name: str,
    version: str,
    serving: dict[str, Any],
    metrics: dict[str, Any],
) -> dict[str, Any]:
    """What the manifest keeps of the training (and the card reads)."""
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
        "fhir": output_coding(config, getattr(fitted.final, "classes_", None)),
        "grouping": fitted.grouping,
        "serving": serving,
        "calibration": _calibration_record(fitted.final),
        "new_batches": _new_batch_record(fitted.final),
        "reference_control": fitted.control,
        "metrics": json.loads(json.dumps(metrics["cv"], default=str)),
        "config": {k: v for k, v in config.items() if not k.startswith("_")},
    }
    return metadata


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
    from ..artifact_info import kind_of
    from ..results import ModelKind

    method = getattr(model, "calibration_", None)
    # A per-cell model's calibration_ is that of new batches (_new_batch_record).
    if method is None or kind_of(type(model)) is ModelKind.CELL:
        return None
    return {
        "method": method,
        "scaling": getattr(model, "interval_scaling", "none"),
        "groups": getattr(model, "calibration_groups_", None) is not None,
    }


def _new_batch_record(model: Any) -> dict[str, Any] | None:
    """How a per-cell model calibrates and labels a new sample (for the card): the
    calibration (and the one without the batch's control), the cell model, the rest
    threshold, and the folds that chose them, with the chosen candidate's fold score;
    None for other models."""
    from ..artifact_info import kind_of
    from ..results import ModelKind

    if kind_of(type(model)) is not ModelKind.CELL:
        return None
    selection = getattr(model, "selection_", None) or {}
    chosen = f"{selection.get('cell_model')}/{selection.get('calibration')}"
    return {
        "calibration": getattr(model, "calibration_", None),
        "calibration_without_control": getattr(model, "calibration_without_control_", None),
        "cell_model": selection.get("cell_model"),
        "reject_threshold": getattr(model, "reject_threshold_", None),
        "folds": selection.get("folds"),
        "fold_score": (selection.get("scores") or {}).get(chosen),
    }
