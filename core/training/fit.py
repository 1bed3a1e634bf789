"""Training end to end: :func:`train` checks the configuration, refuses a model version
that exists before any work, trains in memory or streamed, warns of grid edges and saves.

The two training paths are :mod:`core.training.fit_memory` (every bag read first) and
:mod:`core.training.fit_streaming` (bags streamed from their files, on threads or a Dask
cluster); both run the same search (:mod:`core.training.search`) and hand their result
to :func:`core.training.saving._save`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from sklearn.model_selection import ParameterGrid

from ..artifacts import ArtifactError
from ..errors import ConfigError
from ..io import Preprocessing
from ..progress import progress_enabled
from ..selection import GridEdgeWarning
from .config import (
    build_estimator,
    compute_options,
    config_compensation,
    load_config,
    output_coding,
    serving_options,
    with_rest_label,
)
from .edges import warn_edges
from .fit_memory import train_in_memory
from .fit_streaming import train_streaming
from .saving import TrainingResult, save_trained
from .search import search_candidates, search_table


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
    overwrite : bool, default=False
        Replace an existing model version (once the new one is complete). Without it an
        existing version is refused before training starts.
    scheduler : str or dask.distributed.Client, optional
        Train on a Dask cluster (``[compute] scheduler``): bags are read and featurised
        by its workers (:mod:`core.streaming`).
    streaming : bool, optional
        Stream bags from their files on local threads (``[compute] streaming``), so that
        memory holds a few bags at a time, not the data set. Same model as in memory.

    Raises
    ------
    ArtifactError
        The model version exists (``output/name/version``) and ``overwrite`` is false:
        refused before any data is read, so nothing is trained and nothing stored is
        touched.
    ConfigError
        The configuration is invalid.

    Warns
    -----
    GridEdgeWarning
        Once per hyperparameter chosen at the edge of its grid (see "Grid edges" in
        :mod:`core.training.edges`); the same records are in ``metrics["grid_edges"]``.
    """
    config = load_config(config_path)
    base = Path(config["_base"])
    model_cfg = dict(config.get("model", {}))
    name = str(model_cfg.get("name", Path(config_path).stem))
    version = str(model_cfg.get("version", "1"))
    out_dir = Path(output) if output is not None else base / model_cfg.get("output", "models")
    estimator = with_rest_label(config, build_estimator(config["estimator"]))
    scheduler, stream = compute_options(config, scheduler, streaming)
    pre_spec = dict(config.get("preprocessing", {}))
    # A spillover CSV is read once here and travels in the spec (and the manifest).
    pre_spec["compensation"] = config_compensation(config)
    try:
        Preprocessing(**pre_spec)
        if "panel" in config:
            Preprocessing(**pre_spec).column_specs(config["panel"]["markers"])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[preprocessing] {exc}") from exc
    output_coding(config)
    grid, widen = search_table(config)
    candidates = search_candidates(estimator, list(ParameterGrid(grid)) or [{}])
    serving = serving_options(config)
    path = out_dir / name / version
    if path.exists() and not overwrite:
        # Before the data are read: training only to be refused at the end wastes it all.
        # The artifact's own check (core.artifacts.save) still guards the directory
        # appearing while this trains.
        raise ArtifactError(
            f"{path} already exists: pass --overwrite (bagserve train) or overwrite=True "
            "(train()) to replace it, or give the model another [model] version"
        )
    # Bars inside the estimators' own searches too (core.progress), unless quiet. The
    # estimators' own grid-edge warnings (one per fold) are left to the search, which
    # widens those grids and reports each edge once below.
    with progress_enabled(progress), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=GridEdgeWarning)
        if stream:
            fitted = train_streaming(
                config, estimator, candidates, grid, widen, pre_spec, scheduler, progress
            )
        else:
            fitted = train_in_memory(config, estimator, candidates, grid, widen, pre_spec, progress)
    warn_edges(fitted.edges)
    return save_trained(fitted, config, path, name, version, overwrite, serving)
