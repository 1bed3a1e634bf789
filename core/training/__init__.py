"""Training from a TOML configuration: data, panel, preprocessing, estimator, search, report.

Training reads the data, fits the preprocessing on the training cells, runs the
cross-validation (leave-bags-out for one label per bag, leave-tasks-out for one label
per cell), refits on everything, and saves the artifact with its report
(``report/metrics.json`` and PNG plots) under ``output/name/version``.

One module per concept; each imports only modules listed below it::

    evaluation.py     a saved model evaluated on the bags it did not see
    fit.py            train(): checks, refuses an existing version, picks the path, saves
    fit_memory.py     in-memory training: every bag read, preprocessing fitted per fold
    fit_streaming.py  streamed training: bags read a few at a time (threads or Dask)
    saving.py         the artifact, its report, card and manifest
    search.py         the hyperparameter search, with widening at grid edges
    edges.py          grid choices, grid-edge records and warnings ("Grid edges")
    folds.py          cross-validation folds and out-of-fold predictions
    groups.py         batches and groups (subjects) of the data files
    data.py           the configured files read into bags; bag names and fingerprints
    config.py         the TOML configuration: its tables, checks and estimator

The configuration's tables are described in :mod:`core.training.config`, the grid edges
in :mod:`core.training.edges`, the evaluation against the training bags in
:mod:`core.training.evaluation`. The package re-exports the public names (``__all__``);
the private ones stay in their modules.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..estimators._grid_choices import GridChoice
from ..selection import GridEdgeWarning
from .config import CELL_LEVEL, ESTIMATORS, build_estimator, load_config
from .data import bag_fingerprints, read_data
from .edges import WIDEN_EDGES_DEFAULT, estimator_grid_choices
from .evaluation import EvaluationOverlapError, evaluate
from .fit import train
from .groups import GroupingWarning, config_batches, config_groups, repeated_subjects
from .saving import TrainingResult
from .search import Candidate, Score

__all__ = [
    "CELL_LEVEL",
    "ESTIMATORS",
    "WIDEN_EDGES_DEFAULT",
    "Candidate",
    "ConfigError",
    "EvaluationOverlapError",
    "GridChoice",
    "GridEdgeWarning",
    "GroupingWarning",
    "Score",
    "TrainingResult",
    "bag_fingerprints",
    "build_estimator",
    "config_batches",
    "config_groups",
    "estimator_grid_choices",
    "evaluate",
    "load_config",
    "read_data",
    "repeated_subjects",
    "train",
]
