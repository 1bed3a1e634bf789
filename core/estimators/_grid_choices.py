"""The hyperparameters an estimator chose from grids it searched itself, and their edges.

Each bag-level and per-cell estimator records its own search (``selection_``, or
``cv_scores_`` for the conditional mean embedding) and answers :meth:`grid_choices`
from it. A choice at the first or last value of a grid of 3 or more values says only
that the optimum may lie beyond what was searched: the estimator warns
(:class:`~core.selection.GridEdgeWarning`) at the end of its fit, and training
(:mod:`core.training`) widens such grids and reports them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..selection import CME_ALPHA_GRID, GridEdgeWarning, as_grid, grid_edge

__all__ = ["GridChoice", "cme_choices", "ridge_choices", "warn_grid_edges"]


@dataclass(frozen=True)
class GridChoice:
    """One hyperparameter a fitted estimator chose from a grid it searched itself.

    Attributes
    ----------
    parameter : str
        The name the choice is reported under: the estimator parameter that sets the
        grid when there is one (``"gamma"``, ``"alpha"``, ``"point_bandwidth"``, ...).
    grid : list of float
        The values searched, absolute (relative grids are resolved on the training
        data, as the final fit resolved them).
    chosen : float
        The value chosen.
    widen_as : str or None
        The estimator parameter that accepts an explicit grid for this choice; ``None``
        when no parameter does (the grid cannot be widened from outside).
    lower, upper : float or None
        Bounds of the parameter's domain, if any.
    note : str or None
        Why the grid cannot be widened, when ``widen_as`` is ``None``.
    """

    parameter: str
    grid: list[float]
    chosen: float
    widen_as: str | None
    lower: float | None = None
    upper: float | None = None
    note: str | None = None


def float_list(values: Any) -> list[float]:
    return [float(v) for v in np.asarray(values, dtype=np.float64).ravel()]


def ridge_choices(model: Any) -> list[GridChoice]:
    sel = getattr(model, "selection_", None) or {}
    out = []
    for name in ("gamma", "alpha"):
        grid = np.asarray(sel.get(name, []), dtype=np.float64).ravel()
        chosen = getattr(model, f"{name}_", None)
        # A NaN grid is the linear kernel's "no gamma".
        if grid.size > 1 and np.all(np.isfinite(grid)) and chosen is not None:
            out.append(GridChoice(name, float_list(grid), float(chosen), name))
    return out


def cme_choices(model: Any) -> list[GridChoice]:
    sel = getattr(model, "selection_", None)
    scores = getattr(model, "cv_scores_", None)
    if isinstance(sel, Mapping) and "alpha" in sel:
        grids = {name: sel.get(name) for name in ("gamma", "alpha")}
    elif scores is not None and np.isfinite(np.asarray(scores, dtype=np.float64)).any():
        # No record of the grids: they are the parameters' (gamma=None searches no
        # gamma, only the median heuristic; alpha=None searches CME_ALPHA_GRID).
        grids = {
            "gamma": None if model.gamma is None else as_grid(model.gamma, np.ones(1), "gamma"),
            "alpha": as_grid(model.alpha, CME_ALPHA_GRID, "alpha"),
        }
    else:
        return []
    out = []
    for name, grid in grids.items():
        chosen = getattr(model, f"{name}_", None)
        if grid is None or chosen is None:
            continue
        values = np.asarray(grid, dtype=np.float64).ravel()
        if values.size > 1 and np.all(np.isfinite(values)):
            out.append(GridChoice(name, float_list(values), float(chosen), name))
    return out


def warn_grid_edges(model: Any) -> None:
    """One :class:`~core.selection.GridEdgeWarning` per choice ``model`` made at an edge
    of its grid (not at a bound of the parameter's domain, where nothing lies beyond)."""
    for choice in model.grid_choices():
        side = grid_edge(choice.grid, choice.chosen)
        bound = choice.lower if side == "low" else choice.upper
        if side is None or (bound is not None and np.isclose(choice.chosen, bound)):
            continue
        end = "smallest" if side == "low" else "largest"
        warnings.warn(
            f"{type(model).__name__}: {choice.parameter} = {choice.chosen:.3g} is the {end} "
            f"value of its grid [{min(choice.grid):.3g} .. {max(choice.grid):.3g}] "
            f"({len(choice.grid)} values); the best value may lie beyond it: give a wider "
            f"grid ({choice.widen_as or choice.parameter}=[...])",
            GridEdgeWarning,
            stacklevel=3,
        )
