"""The hyperparameter search: candidates cross-validated, the best kept, edges widened.

The ``[search]`` grid (:func:`search_table`) gives the candidates; each is
cross-validated by the training path (a :class:`_Searcher`: in memory or streamed), the
best by the cross-validated error (accuracy for a classifier) is fitted on every bag,
and every grid whose edge was chosen, the ``[search]`` grid's and the estimator's own,
is widened once (see "Grid edges" in :mod:`core.training.edges`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from sklearn.base import BaseEstimator, clone
from sklearn.model_selection import ParameterGrid

from .. import report
from ..errors import ConfigError, CoreError
from ..selection import grid_edge, widen_grid
from .edges import WIDEN_EDGES_DEFAULT, edge_record, estimator_grid_choices

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
class SearchOutcome:
    """The search's result: every candidate's CV score, the one kept, its final fit,
    and the grid-edge records."""

    candidates: list[Candidate]
    scores: list[Score]
    best: int
    final: BaseEstimator
    edges: list[dict[str, Any]] = field(default_factory=list)
    widening: dict[str, Any] = field(default_factory=dict)


def search_table(config: Mapping[str, Any]) -> tuple[dict[str, list[Any]], bool]:
    """``[search]``: the grid (parameter -> values) and the ``widen_edges`` switch."""
    search = dict(config.get("search", {}))
    widen = search.pop("widen_edges", WIDEN_EDGES_DEFAULT)
    if not isinstance(widen, bool):
        raise ConfigError(f"[search] widen_edges must be true or false, got {widen!r}")
    return {k: list(v) for k, v in search.items()}, widen


def search_candidates(estimator: BaseEstimator, grid: Sequence[dict[str, Any]]) -> list[Candidate]:
    out = []
    for params in grid:
        try:
            out.append((clone(estimator).set_params(**params), params))
        except ValueError as exc:
            raise ConfigError(f"[search] {exc}") from exc
    return out


def run_search(
    candidates: list[Candidate],
    estimator: BaseEstimator,
    grid: dict[str, list[Any]],
    widen: bool,
    searcher: _Searcher,
    y: np.ndarray,
    classifier: bool,
) -> SearchOutcome:
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

    best = _widen_search_grid(
        candidates, scores, best, grid, widen, estimator, searcher, y, classifier, edges, widening
    )
    final = searcher.fit_final(candidates[best][0])

    # 2. The estimator's own grids: refit the kept candidate with the widened grids.
    own, updates, stuck = _own_grid_edges(final)
    refit_failure = None
    if widen and updates:
        refit_failure, best, final = _refit_widened(
            candidates, scores, best, final, updates, searcher, y, classifier, widening
        )
    refitted = widen and bool(updates) and refit_failure is None
    after = {c.parameter: c for c in estimator_grid_choices(final)} if refitted else {}
    edges += _own_edge_records(own, updates, stuck, after, widen, refit_failure)
    return SearchOutcome(candidates, scores, best, final, edges, widening)


def _widen_search_grid(
    candidates: list[Candidate],
    scores: list[Score],
    best: int,
    grid: dict[str, list[Any]],
    widen: bool,
    estimator: BaseEstimator,
    searcher: _Searcher,
    y: np.ndarray,
    classifier: bool,
    edges: list[dict[str, Any]],
    widening: dict[str, Any],
) -> int:
    """The ``[search]`` grid's edges: widened once (new candidates join the same
    cross-validation; the best of all wins) and recorded in ``edges``. Extends
    ``candidates`` and ``scores`` in place; returns the best candidate's index."""
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
            extra = search_candidates(estimator, new)
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
            edge_record(
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
    return best


def _own_grid_edges(
    final: BaseEstimator,
) -> tuple[list[tuple[Any, str]], dict[str, list[Any]], dict[str, tuple[str, bool]]]:
    """The grids the fitted estimator searched itself whose edge it chose: each with
    its side, the widened grids by estimator parameter, and why the others cannot be
    widened (and whether nothing lies beyond them)."""
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
    return own, updates, stuck


def _refit_widened(
    candidates: list[Candidate],
    scores: list[Score],
    best: int,
    final: BaseEstimator,
    updates: dict[str, list[Any]],
    searcher: _Searcher,
    y: np.ndarray,
    classifier: bool,
    widening: dict[str, Any],
) -> tuple[str | None, int, BaseEstimator]:
    """The kept candidate refitted with its own grids widened: (why it failed or None,
    the best index, the final model). Extends ``candidates`` and ``scores`` in place."""
    refit_failure = None
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
    return refit_failure, best, final


def _own_edge_records(
    own: list[tuple[Any, str]],
    updates: dict[str, list[Any]],
    stuck: dict[str, tuple[str, bool]],
    after: dict[str, Any],
    widen: bool,
    refit_failure: str | None,
) -> list[dict[str, Any]]:
    """The records of the estimator's own grid edges, before and after the refit."""
    edges: list[dict[str, Any]] = []
    for c, side in own:
        a = after.get(c.parameter) if c.widen_as in updates else None
        reason, at_bound = stuck.get(c.parameter, (None, False))
        if a is None and reason is None:
            reason = _WIDENING_OFF if not widen else refit_failure
        record = edge_record(
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
                edge_record(
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
    return edges


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


def _best(scores: list[tuple[dict[str, Any], np.ndarray, dict[str, Any]]], classifier: bool) -> int:
    key = "accuracy" if classifier else "rmse"
    sign = -1.0 if classifier else 1.0
    return int(np.argmin([sign * s[0][key] for s in scores]))
