"""Grid choices and their edges: which hyperparameters were chosen at the end of a grid,
and the records and warnings that say so.

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

The widening itself is part of the search (:func:`core.training.search._run_search`);
this module holds what it reads and writes: the estimator's grid choices
(:func:`estimator_grid_choices`), the ``grid_edges`` records (:func:`edge_record`) and
their warnings (:func:`warn_edges`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator

from .. import report
from ..estimators._grid_choices import GridChoice
from ..selection import GridEdgeWarning, grid_edge

#: Whether training widens a grid whose edge was chosen, unless ``[search] widen_edges``
#: says otherwise.
WIDEN_EDGES_DEFAULT = True


def estimator_grid_choices(model: BaseEstimator) -> list[GridChoice]:
    """The hyperparameters ``model`` chose from a grid of more than one value (its
    :meth:`grid_choices`; none for an estimator that searches nothing itself).

    Read from what the fitted model records of its own search: ``selection_`` (grids
    and scores) and the chosen ``gamma_``, ``alpha_``, ... attributes. Values fixed by
    the caller (a one-point grid) are not choices and are left out.
    """
    choices = getattr(model, "grid_choices", None)
    return list(choices()) if choices is not None else []


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def edge_record(
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


def warn_edges(edges: Sequence[Mapping[str, Any]]) -> None:
    """One :class:`GridEdgeWarning` per edge (none at a domain bound: nothing was cut off)."""
    for edge in edges:
        if not edge["at_domain_bound"]:
            warnings.warn(report.describe_edge(edge), GridEdgeWarning, stacklevel=3)
