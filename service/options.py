"""What a prediction request may ask besides the prediction itself.

:class:`PredictOptions` is parsed from the query (``/v1``) on the server, before the body
is read, or from the inference document's parameters (``/v2``) in the worker that
decodes it; both check it against the model the same way (422 naming the problem), and
it crosses to the worker, and into a stored job, as JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from bagserve.core.results import ModelKind

from .errors import Problem

if TYPE_CHECKING:
    from .registry import ModelEntry

__all__ = ["MAX_DISTRIBUTION_QUERIES", "MAX_PLOT_CELLS", "PredictOptions"]

#: At most this many quantile levels or exceedance thresholds per request.
MAX_DISTRIBUTION_QUERIES = 99
#: At most this many cells per bag in a ``plot`` sample.
MAX_PLOT_CELLS = 20_000
#: Longest bag id ``?control=`` may name (ids are file names or the caller's labels).
MAX_CONTROL_ID = 256


#: The explanation accounts for the model's own labels; ``unassigned`` relabels cells
#: after it, so an answer with both would explain shares it does not give.
EXPLAIN_OR_UNASSIGNED = (
    "ask for an explanation or unassigned cells, not both: the explanation accounts for "
    "the model's own labels, and unassigned relabels the cells far from their population "
    "after it"
)


@dataclass(frozen=True)
class PredictOptions:
    """What a request may ask besides the prediction itself.

    Attributes
    ----------
    quantiles : tuple of float
        Quantile levels in ``[0, 1]`` (conditional models with a scalar output).
    exceed : tuple of float
        Thresholds ``t`` for ``P(outcome > t)`` (same models).
    coverage : float or None
        ``?interval=``: the coverage of a prediction interval (regressors, conditional
        models) or of a conformal prediction set (classifiers).
    compensated : bool
        ``?compensated=true``: the caller declares the cells already compensated, so a
        model that compensates does not (recorded in the audit trail).
    cells : bool
        Per-cell models: ``?cells=false`` answers the population summary without the
        label of every cell.
    probabilities : bool
        Per-cell classifiers: ``?probabilities=true`` adds every cell's class
        probabilities.
    plot : int
        Per-cell models: ``?plot=N`` adds up to ``N`` cells per bag (a seeded draw),
        preprocessed as the model sees them, with their labels, for a scatter plot.
    unassigned : float or None
        Per-cell classifiers: ``?unassigned=0.999`` answers ``"unassigned"`` for every
        cell beyond that χ² level of Mahalanobis distance from the population it was
        given (a row of its own in the summary); not with ``probabilities``.
    control : str or None
        Per-cell models fitted with a reference control: ``?control=ID`` names the bag
        of the request that is the batch's reference control; it maps every other bag
        onto the training batch first and gets no answer of its own.
    explain : bool
        ``?explain=true`` adds each bag's ``explanation`` (:func:`bagserve.core.explain`:
        baseline, total, by marker, top cells; a per-cell model's explains the share of
        the bag's cells in each class, not with ``unassigned``); with ``plot=N`` the
        plotted cells carry their contributions.
    """

    quantiles: tuple[float, ...] = ()
    exceed: tuple[float, ...] = ()
    coverage: float | None = None
    compensated: bool = False
    cells: bool = True
    probabilities: bool = False
    plot: int = 0
    unassigned: float | None = None
    control: str | None = None
    explain: bool = False

    @classmethod
    def asked_of(
        cls,
        shape: Mapping[str, Any],
        *,
        coverage: float | None = None,
        cells: bool = True,
        compensated: bool = False,
    ) -> PredictOptions:
        """What a command asks of a model (``bagserve predict``, ``batch``, locally or
        through a service): an interval or set of ``coverage`` only where the model
        gives one, and the answer without it elsewhere; ``cells`` of per-cell models
        only. ``shape``: :meth:`~bagserve.core.artifact_info.ArtifactInfo.answer_shape`, as
        ``GET /v1/models/{name}`` also gives it."""
        if coverage is not None and not (shape.get("intervals") and 0.0 < coverage < 1.0):
            coverage = None
        cell = shape.get("kind") == ModelKind.CELL
        return cls(coverage=coverage, cells=cells if cell else True, compensated=compensated)

    @classmethod
    def parse(cls, entry: ModelEntry, params: Mapping[str, Any]) -> PredictOptions:
        """The query (or ``/v2`` request) parameters ``quantiles``, ``exceed``,
        ``interval``, ``compensated``, ``cells``, ``probabilities``, ``plot``,
        ``unassigned`` and ``explain``, checked against the model (422)."""
        quantiles, exceed = params.get("quantiles"), params.get("exceed")
        interval = params.get("interval")
        interval = None if interval is None else str(interval)
        parsed: dict[str, Any] = {}
        problems = []
        for name in ("compensated", "cells", "probabilities", "explain"):
            if params.get(name) is None:
                continue
            flag = _flag(params[name])
            if flag is None:
                problems.append(f"{name} must be true or false, got {params[name]!r}")
            else:
                parsed[name] = flag
        if params.get("plot") not in (None, ""):
            try:
                parsed["plot"] = int(params["plot"])
            except (TypeError, ValueError):
                parsed["plot"] = -1
            if not 0 <= parsed["plot"] <= MAX_PLOT_CELLS:
                problems.append(
                    f"plot must be a number of cells from 0 to {MAX_PLOT_CELLS}, "
                    f"got {params['plot']!r}"
                )
        # Asking a bag model for a per-cell answer is an error; restating a default
        # (cells=true, probabilities=false, plot=0) asks nothing.
        cell_only = [
            n
            for n in ("cells", "probabilities", "plot")
            if n in parsed and parsed[n] != getattr(cls, n)
        ]
        if parsed.get("explain") and "plot" in cell_only and entry.kind is not ModelKind.CELL:
            cell_only.remove("plot")  # a bag model's plot: its cells with their contributions
        if cell_only and entry.kind is not ModelKind.CELL:
            problems.append(f"{entry.key}: {cell_only[0]} applies to per-cell models only")
        if parsed.get("probabilities"):
            unavailable = entry.info.probability_problem()
            if unavailable is not None:
                problems.append(f"{entry.key}: {unavailable}")
        if params.get("unassigned") not in (None, ""):
            level = _level(params["unassigned"])
            unavailable = entry.info.far_cells_problem()
            if level is None:
                problems.append(
                    f"unassigned must be a level in (0, 1) such as 0.999, "
                    f"got {params['unassigned']!r}"
                )
            elif unavailable is not None:
                problems.append(f"{entry.key}: {unavailable}")
            elif parsed.get("probabilities"):
                problems.append("ask for probabilities or unassigned cells, not both")
            elif parsed.get("explain"):
                problems.append(EXPLAIN_OR_UNASSIGNED)
            else:
                parsed["unassigned"] = level
        if params.get("control") not in (None, ""):
            name = params["control"]
            unavailable = entry.info.control_problem()
            if not isinstance(name, str) or len(name) > MAX_CONTROL_ID:
                problems.append(
                    f"control must name one bag of the request (at most {MAX_CONTROL_ID} "
                    f"characters), got {str(name)[:MAX_CONTROL_ID]!r}"
                )
            elif unavailable is not None:
                problems.append(f"{entry.key}: {unavailable}")
            else:
                parsed["control"] = name
        if interval is not None and interval.strip():
            try:
                parsed["coverage"] = float(interval)
            except ValueError:
                problems.append(f"interval must be a coverage such as 0.9, got {interval!r}")
            else:
                unavailable = entry.info.interval_problem(parsed["coverage"])
                if unavailable is not None:
                    problems.append(f"{entry.key}: {unavailable}")
        for name, text in (("quantiles", quantiles), ("exceed", exceed)):
            if text is None or not text.strip():
                continue
            try:
                values = [float(v) for v in text.split(",")]
            except ValueError:
                problems.append(f"{name} must be comma-separated numbers, got {text!r}")
                continue
            if len(values) > MAX_DISTRIBUTION_QUERIES:
                problems.append(f"{name}: at most {MAX_DISTRIBUTION_QUERIES} values")
            elif not all(np.isfinite(values)):
                problems.append(f"{name} must be finite numbers, got {text!r}")
            elif name == "quantiles" and not all(0.0 <= v <= 1.0 for v in values):
                problems.append(f"quantile levels must lie in [0, 1], got {text!r}")
            else:
                parsed[name] = tuple(values)
        unanswerable = entry.info.distribution_query_problem() if quantiles or exceed else None
        if unanswerable is not None:
            problems.append(f"{entry.key}: {unanswerable}")
        if problems:
            raise Problem(422, problems[0], errors=problems, slug="invalid-request")
        return cls(**parsed)

    def to_json(self) -> dict[str, Any]:
        """As stored with a job (only what differs from the defaults)."""
        asked = (("quantiles", self.quantiles), ("exceed", self.exceed))
        out: dict[str, Any] = {k: list(v) for k, v in asked if v}
        if self.coverage is not None:
            out["coverage"] = self.coverage
        for name in (
            "compensated",
            "cells",
            "probabilities",
            "plot",
            "unassigned",
            "control",
            "explain",
        ):
            if getattr(self, name) != getattr(PredictOptions, name):
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_json(cls, spec: dict[str, Any] | None) -> PredictOptions:
        """The options stored with a job (:meth:`to_json`)."""
        spec = dict(spec or {})
        for name in ("quantiles", "exceed"):
            spec[name] = tuple(spec.get(name, ()))
        return cls(**spec)


def _level(value: Any) -> float | None:
    """A level in (0, 1) as a query string or JSON gives it; None if it is not one."""
    try:
        level = float(value)
    except (TypeError, ValueError):
        return None
    return level if 0.0 < level < 1.0 else None


def _flag(value: Any) -> bool | None:
    """A boolean parameter as a query string or JSON gives it; None if it is neither."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    return None
