"""The prediction use-case: decoded bags in, a typed prediction out, audited.

Every way of asking for a prediction (``/v1`` predict, ``/v2`` infer, asynchronous jobs)
is an adapter around :meth:`Predictor.run`: it decodes its own request format into
bags, calls the use-case, and encodes the typed result its own way. The use-case owns
the steps in between and their errors:

* every validation problem (panel, NaN/Inf, empty bags, sizes, weights) is collected
  and answered together with 422;
* compute happens in a worker; a full queue is 503 with ``Retry-After``, a lost worker
  503, a timeout 504, an input the model refuses 422;
* the input's sha256 is computed while a worker computes;
* one audit line per attempt on a known model, success or failure, with the stage
  timings recorded in the metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from bagserve.core.hashing import bytes_sha256
from bagserve.core.io import DataError, Sample
from bagserve.core.runtime import CellPrediction, ModelKind, Prediction, prediction_from_arrays

from .audit import AuditLog
from .codecs import IncomingBag
from .errors import Problem
from .metrics import Metrics
from .model_stats import ModelStats
from .pool import InputRejected, QueueFull, WorkerLost, WorkerPool, WorkerTimeout
from .registry import ModelEntry
from .settings import Settings
from .wire import SharedBuffer

__all__ = ["Caller", "Outcome", "PredictOptions", "Predictor"]

#: The audit status of a prediction abandoned before its answer: the client went away,
#: or its job was cancelled (nginx's "client closed request").
CANCELLED = 499
#: At most this many quantile levels or exceedance thresholds per request.
MAX_DISTRIBUTION_QUERIES = 99
#: At most this many cells per bag in a ``plot`` sample.
MAX_PLOT_CELLS = 20_000

Decoder = Callable[[], Awaitable[tuple[list[IncomingBag], list[str]]]]


@dataclass(frozen=True)
class Caller:
    """Who asked, as the audit trail records it.

    Attributes
    ----------
    request_id : str
    key_id : str or None
        The API key's id (never the key), when keys are configured.
    route : str
        The path the prediction was asked on (``/v1/jobs/<id>`` for a job).
    files : list of str or None
        Uploaded file names, kept only when the settings allow it.
    """

    request_id: str
    key_id: str | None
    route: str
    files: list[str] | None = None


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
    """

    quantiles: tuple[float, ...] = ()
    exceed: tuple[float, ...] = ()
    coverage: float | None = None
    compensated: bool = False
    cells: bool = True
    probabilities: bool = False
    plot: int = 0

    @classmethod
    def parse(cls, entry: ModelEntry, params: Mapping[str, Any]) -> PredictOptions:
        """The query (or ``/v2`` request) parameters ``quantiles``, ``exceed``,
        ``interval``, ``compensated``, ``cells`` and ``probabilities``, checked against
        the model (422)."""
        quantiles, exceed = params.get("quantiles"), params.get("exceed")
        interval = params.get("interval")
        interval = None if interval is None else str(interval)
        parsed: dict[str, Any] = {}
        problems = []
        for name in ("compensated", "cells", "probabilities"):
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
        cell_only = [n for n in ("cells", "probabilities", "plot") if n in parsed]
        if cell_only and entry.kind is not ModelKind.CELL:
            problems.append(f"{entry.key}: {cell_only[0]} applies to per-cell models only")
        if parsed.get("probabilities"):
            unavailable = entry.info.probability_problem()
            if unavailable is not None:
                problems.append(f"{entry.key}: {unavailable}")
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
        for name in ("compensated", "cells", "probabilities", "plot"):
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


@dataclass
class Outcome:
    """A finished prediction: what went in (ids, sizes) and the model's typed answer.

    Attributes
    ----------
    entry : ModelEntry
    ids : list of str
        Bag ids, in request order.
    result : Prediction
        The runtime's typed answer (:mod:`bagserve.core.runtime`).
    warnings : list of str
        Things the caller should know (ignored markers, clipped points).
    input_sha256 : str
        sha256 of the request body.
    timings : dict
        Seconds per stage (read, parse, validate, queue, transfer, compute, encode).
    """

    entry: ModelEntry
    ids: list[str]
    result: Prediction
    warnings: list[str]
    input_sha256: str
    timings: dict[str, float] = field(default_factory=dict)
    #: Per bag, with ``?plot=N``: cells for a scatter plot (see :func:`_plot_samples`).
    plots: list[dict[str, Any]] | None = None

    @property
    def sizes(self) -> list[int]:
        """Points in each bag, in request order."""
        return [int(n) for n in self.result.sizes]

    def warning_header(self) -> str | None:
        """An HTTP ``Warning`` (code 299) when a bag is out of the applicability domain."""
        domain = self.result.domain
        if domain is None or not domain.out_of_range.any():
            return None
        out = [self.ids[i] for i in np.flatnonzero(domain.out_of_range)]
        shown = ", ".join(out[:5]) + (f" and {len(out) - 5} more" if len(out) > 5 else "")
        text = f"out of the model's applicability domain: {shown}".replace('"', "'")
        return f'299 bagserve "{text}"'

    def provenance(self, request_id: str) -> dict[str, Any]:
        """What heads every answer: model, request id, input hash, warnings."""
        e = self.entry
        return {
            "model": {"name": e.name, "version": e.version, "sha256": e.sha256},
            "request_id": request_id,
            "input_sha256": self.input_sha256,
            "warnings": self.warnings,
        }

    def summary(self) -> dict[str, Any]:
        """What the audit trail keeps of the output: no values per cell."""
        estimate = self.result.estimate
        if self.result.kind in (ModelKind.REGRESSION, ModelKind.CONDITIONAL):
            v = np.asarray(estimate, dtype=np.float64)
            return {
                "n_bags": len(self.ids),
                "mean": float(v.mean()),
                "min": float(v.min()),
                "max": float(v.max()),
            }
        labels, counts = np.unique(np.asarray(estimate).astype(str), return_counts=True)
        out: dict[str, Any] = {
            "n_bags": len(self.ids),
            "label_counts": dict(zip(labels.tolist(), counts.tolist(), strict=True)),
        }
        if isinstance(self.result, CellPrediction) and self.result.domain is not None:
            out["out_of_range_bags"] = int(np.sum(self.result.domain.out_of_range))
        return out


def provenance_headers(entry: ModelEntry, input_sha: str) -> dict[str, str]:
    """Provenance of an answer, as response headers."""
    return {
        "X-Model-Name": entry.name,
        "X-Model-Version": entry.version,
        "X-Model-SHA256": entry.sha256,
        "X-Input-SHA256": input_sha,
    }


class Predictor:
    """The prediction use-case shared by every route and the job runner.

    Parameters
    ----------
    settings : Settings
        Limits (bags, points), the request timeout and ``Retry-After``.
    pool : WorkerPool
    metrics : Metrics
    audit : AuditLog or None
        Where each attempt is recorded (``None``: not audited).
    stats : ModelStats, optional
        Per-model counts and times (Triton's statistics extension).
    """

    def __init__(
        self,
        settings: Settings,
        pool: WorkerPool,
        metrics: Metrics,
        audit: AuditLog | None,
        stats: ModelStats | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.audit_log = audit
        self.stats = stats

    async def run(
        self,
        caller: Caller,
        entry: ModelEntry,
        body: bytes | memoryview,
        decode: Decoder,
        options: PredictOptions = PredictOptions(),
        *,
        lent: SharedBuffer | None = None,
        input_sha256: str | None = None,
        timings: dict[str, float] | None = None,
    ) -> Outcome:
        """Decode, validate, compute on a worker, and audit one prediction.

        Parameters
        ----------
        caller : Caller
        entry : ModelEntry
        body : bytes or memoryview
            The request body, for its sha256.
        decode : callable
            Awaited for the bags and the problems found decoding them.
        options : PredictOptions
        lent : SharedBuffer, optional
            The shared buffer ``body`` views: points in it reach the worker uncopied.
        input_sha256 : str, optional
            The body's sha256 when already known (a stored job).
        timings : dict, optional
            Stages timed so far (``read``); the others are added.

        Raises
        ------
        Problem
            Every failure, with its HTTP status; it is audited before it is raised.
        """
        timings = dict(timings or {})
        loop = asyncio.get_running_loop()
        hashing: asyncio.Future[str] | None = None

        def hash_input() -> None:
            # hashlib releases the GIL: the input's sha256 is computed while a worker
            # computes. It starts once the bags are valid: run beside parsing,
            # validation or the hand-over to the worker, it slowed them down by as much
            # as it took (a few ms for 8 MB on two cores).
            nonlocal hashing
            if hashing is None and input_sha256 is None:
                hashing = loop.run_in_executor(None, bytes_sha256, body)

        async def input_hash() -> str:
            if input_sha256 is not None:
                return input_sha256
            hash_input()
            assert hashing is not None
            return await hashing

        status, outcome = 500, None
        try:
            t0 = time.perf_counter()
            bags, decode_errors = await decode()
            # Added to what the caller parsed itself before (a /v2 document).
            timings["parse"] = timings.get("parse", 0.0) + time.perf_counter() - t0
            result, warnings, plots = await self.compute(
                entry, bags, decode_errors, options, timings, lent, hash_input
            )
            ids = [b.id for b in bags]
            outcome = Outcome(entry, ids, result, warnings, await input_hash(), timings, plots)
            status = 200
            return outcome
        except Problem as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = CANCELLED
            raise
        finally:
            self.metrics.observe_stages(timings)
            if self.stats is not None and status != CANCELLED:
                n_bags = 0 if outcome is None else len(outcome.ids)
                self.stats.observe(entry.key, status == 200, timings, n_bags)
            fields = self.record(caller, entry, await input_hash(), status, outcome, options)
            if fields is not None and self.audit_log is not None:
                # Shielded: an abandoned request is still recorded.
                await asyncio.shield(asyncio.to_thread(self.audit_log.append, **fields))

    async def compute(
        self,
        entry: ModelEntry,
        bags: list[IncomingBag],
        decode_errors: list[str],
        options: PredictOptions,
        timings: dict[str, float],
        lent: SharedBuffer | None = None,
        on_valid: Callable[[], object] | None = None,
    ) -> tuple[Prediction, list[str], list[dict[str, Any]] | None]:
        """Validate against the model, run on a worker, map pool failures to problems.

        ``on_valid`` is called once the bags are valid, just before they go to the
        worker. Returns the typed prediction, the warnings for the caller, and the
        plot samples (``?plot=N``, else None).
        """
        settings = self.settings
        t0 = time.perf_counter()
        arrays, weights, warnings = _validate(bags, entry, settings, decode_errors, options)
        sizes = [a.shape[0] for a in arrays]
        payload = {
            "points": np.concatenate(arrays) if len(arrays) > 1 else arrays[0],
            "offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        }
        if any(w is not None for w in weights):
            payload["weights"] = np.concatenate(
                [np.ones(s) if w is None else w for w, s in zip(weights, sizes, strict=True)]
            )
        timings["validate"] = time.perf_counter() - t0
        if on_valid is not None:
            on_valid()
        for n in sizes:
            self.metrics.points.observe(n)
        retry = {"Retry-After": str(settings.retry_after)}
        try:
            t1 = time.perf_counter()
            out_header, out_arrays, queued = await self.pool.submit(
                {
                    "model": entry.key,
                    "quantiles": options.quantiles,
                    "exceed": options.exceed,
                    "coverage": options.coverage,
                    "probabilities": options.probabilities,
                },
                payload,
                settings.request_timeout,
                lent=() if lent is None else (lent,),
            )
            # "transfer": moving the points to the worker and the answer back.
            exchange = time.perf_counter() - t1 - queued
            worker_seconds = float(out_header.get("seconds", exchange))
            timings.update(queue=queued, compute=worker_seconds, transfer=exchange - worker_seconds)
        except QueueFull:
            raise Problem(
                503,
                "all workers are busy and the queue is full; retry later",
                headers=retry,
                slug="queue-full",
            ) from None
        except WorkerLost as exc:
            raise Problem(
                503,
                f"the worker computing this request stopped ({exc}); it is being replaced, retry",
                headers=retry,
                slug="worker-lost",
            ) from None
        except WorkerTimeout as exc:
            raise Problem(
                504, f"the prediction did not finish in time ({exc})", slug="timeout"
            ) from None
        except InputRejected as exc:
            raise Problem(422, str(exc), errors=[str(exc)], slug="invalid-bags") from None
        result = prediction_from_arrays(out_header["kind"], out_arrays)
        self._observe_domain(entry, result)
        if result.domain is not None:
            for bag, score, flag in zip(
                bags, result.domain.score.tolist(), result.domain.out_of_range.tolist(), strict=True
            ):
                if flag:
                    warnings.append(
                        f"bag {bag.id!r} lies outside the model's applicability domain (domain "
                        f"score {score:.3g}; the training bags score about 1): do not trust "
                        "this answer without review"
                    )
        if result.clipped is not None:
            for bag, n in zip(bags, result.clipped.tolist(), strict=True):
                if n:
                    warnings.append(
                        f"bag {bag.id!r}: {n} of {bag.points.shape[0]} cell(s) lie outside the "
                        "model's training range and were clipped into it"
                    )
        plots = None
        if options.plot and isinstance(result, CellPrediction):
            plots = _plot_samples(entry, arrays, result, options.plot)
        return result, warnings, plots

    def _observe_domain(self, entry: ModelEntry, result: Prediction) -> None:
        """Domain scores and out-of-range answers per model, so drift shows on a dashboard."""
        if result.domain is None:
            return
        for score in result.domain.score.tolist():
            self.metrics.domain_score.labels(entry.key).observe(score)
        flagged = int(result.domain.out_of_range.sum())
        if flagged:
            self.metrics.out_of_range.labels(entry.key).inc(flagged)

    def record(
        self,
        caller: Caller,
        entry: ModelEntry,
        input_sha: str | None,
        status: int,
        outcome: Outcome | None,
        options: PredictOptions | None = None,
    ) -> dict[str, Any] | None:
        """The audit record of a prediction attempt on a known model (success or
        failure); None when the service keeps no audit trail.

        A caller's declaration that the cells were compensated already is recorded: the
        model's own compensation was skipped on the caller's word.
        """
        if self.audit_log is None:
            return None
        fields: dict[str, Any] = {
            "request_id": caller.request_id,
            "api_key_id": caller.key_id,
            "route": caller.route,
            "model": {"name": entry.name, "version": entry.version, "sha256": entry.sha256},
            "input_sha256": input_sha,
            "status": status,
        }
        if outcome is not None and status == 200:
            fields["bag_sizes"] = outcome.sizes
            fields["output"] = outcome.summary()
        if options is not None and options.compensated:
            fields["compensated_by_caller"] = True
        if caller.files and self.settings.audit_file_names:
            fields["files"] = caller.files
        return fields


def _validate(
    bags: list[IncomingBag],
    entry: ModelEntry,
    settings: Settings,
    errors: list[str],
    options: PredictOptions,
) -> tuple[list[np.ndarray], list[np.ndarray | None], list[str]]:
    """Compensate and align every bag to the model's panel; collect every problem
    before answering."""
    errors = list(errors)
    warnings: list[str] = []
    panel = entry.panel
    compensation = entry.info.preprocessing.compensation
    compensate = compensation.active and not options.compensated
    if len(bags) > settings.max_bags:
        errors.append(f"{len(bags)} bags, more than the limit of {settings.max_bags}")
    ids = [b.id for b in bags]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        errors.append(f"bag ids must be unique, repeated: {dup}")
    arrays, weights = [], []
    total = 0
    for b in bags:
        where = f"bag {b.id!r}"
        n = b.points.shape[0]
        total += n
        if n == 0:
            errors.append(f"{where} is empty (0 points)")
            continue
        if n > settings.max_points_per_bag:
            errors.append(
                f"{where} has {n} points, more than the limit of {settings.max_points_per_bag}"
            )
        if entry.kind is ModelKind.CELL and n < 2:
            errors.append(f"{where} has a single cell: its distribution cannot be estimated")
        pts = b.points
        if compensate:
            if b.names is None:
                errors.append(
                    f"{where}: the model compensates ({compensation.describe()}), which needs "
                    "the channel names: send them (markers), or declare the cells compensated "
                    "already (compensated=true)"
                )
                continue
            try:
                pts = compensation.apply(
                    Sample(pts, b.names, b.alt_names or b.names, where, b.spillover)
                ).points
            except DataError as exc:
                errors.append(f"{exc} (cells compensated already: compensated=true)")
                continue
        if b.names is not None and panel is not None:
            try:
                cols = panel.columns(b.names, b.alt_names, source=where)
            except DataError as exc:
                errors.append(str(exc))
                continue
            extra = [b.names[j] for j in range(len(b.names)) if j not in set(cols.tolist())]
            if extra:
                warnings.append(f"{where}: ignored marker(s) {extra}")
            if not np.array_equal(cols, np.arange(pts.shape[1])):
                pts = pts[:, cols]
        elif pts.shape[1] != entry.n_features:
            expected = f" {list(panel.markers)}" if panel is not None else ""
            errors.append(
                f"{where} has {pts.shape[1]} column(s), the model takes "
                f"{entry.n_features}{expected}"
            )
            continue
        # A second pass over 10^6 values costs about 0.5 ms: skipped when done already.
        if not b.finite and not np.isfinite(pts).all():
            bad = ~np.isfinite(pts)
            row, col = np.argwhere(bad)[0]
            errors.append(
                f"{where}: {int(bad.sum())} non-finite value(s) (NaN/Inf), first at row {row}, "
                f"column {col}"
            )
            continue
        w = b.weights
        if w is not None:
            if w.shape != (n,):
                errors.append(f"{where}: {w.size} weight(s) for {n} point(s)")
                continue
            if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
                errors.append(f"{where}: weights must be finite, non-negative, with a positive sum")
                continue
        arrays.append(np.ascontiguousarray(pts, dtype=np.float64))
        weights.append(w)
    if total > settings.max_total_points:
        errors.append(f"{total} points in all, more than the limit of {settings.max_total_points}")
    if errors:
        raise Problem(
            422, f"{len(errors)} problem(s) in the request", errors=errors, slug="invalid-bags"
        )
    return arrays, weights, warnings


def _plot_samples(
    entry: ModelEntry, arrays: list[np.ndarray], result: CellPrediction, n: int
) -> list[dict[str, Any]]:
    """Up to ``n`` cells of each bag (a seeded draw, in cell order), transformed and
    scaled as the model sees them, with their labels: what a scatter plot needs."""
    pre = entry.info.preprocessing
    markers = list(entry.info.markers)
    rng = np.random.default_rng(0)
    out = []
    for i, points in enumerate(arrays):
        rows = np.arange(points.shape[0])
        if rows.size > n:
            rows = np.sort(rng.choice(rows.size, n, replace=False))
        cells = pre.scale_points(pre.transform_points(points[rows], markers))
        out.append(
            {
                "markers": markers,
                "cells": rows.tolist(),
                "points": np.round(cells, 5).tolist(),
                "labels": result.labels_of(i)[rows].tolist(),
            }
        )
    return out
