"""Marginal transfer: a label (or value) for every cell of a new sample (paper 004).

One module per concept (issue 44): :mod:`.reference` (what the training batch looks
like), :mod:`.landmarks` (the landmark map and its refusal), :mod:`.calibration`,
:mod:`.perturbation`, :mod:`.task_map`, :mod:`.cell_models` (with :mod:`.trees`),
:mod:`.search`, :mod:`.open_set`, :mod:`.reports`, and the thin estimators in
:mod:`.estimator`.
:mod:`.legacy` is the design before issue 44, frozen: models saved with it load
through :func:`artifact_class` and answer as they did.
"""

from __future__ import annotations

from typing import Any

from .estimator import MarginalTransferClassifier, MarginalTransferRegressor, _MarginalTransfer
from .reports import TaskPrediction, TaskReport

__all__ = [
    "MarginalTransferClassifier",
    "MarginalTransferRegressor",
    "TaskPrediction",
    "TaskReport",
    "artifact_class",
    "is_cell_model",
]

#: Parameters only the design before issue 44 had: a manifest naming one was saved by it.
_LEGACY_PARAMETERS = frozenset({"solver", "task_map", "normalise", "refine", "tau"})


def artifact_class(name: str, params: dict[str, Any]) -> type | None:
    """The class a stored marginal-transfer model of class ``name`` with ``params``
    loads as: the frozen pre-issue-44 class where the parameters are that design's,
    else None (the current class of that name)."""
    if name not in ("MarginalTransferClassifier", "MarginalTransferRegressor"):
        return None
    if not _LEGACY_PARAMETERS & set(params):
        return None
    from . import legacy

    return getattr(legacy, name)


def is_cell_model(cls: type) -> bool:
    """Whether ``cls`` labels every cell (the current design or the frozen one)."""
    if issubclass(cls, _MarginalTransfer):
        return True
    from .legacy.estimator import _MarginalTransfer as Legacy

    return issubclass(cls, Legacy)
