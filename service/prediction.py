"""The prediction use-case: a request body in, a typed prediction out, audited.

Every way of asking for a prediction (``/v1`` predict, ``/v2`` infer, asynchronous jobs)
is an adapter around :meth:`Predictor.run`: it reads its body, says how to decode it
(:class:`~.codecs.BodySpec`), calls the use-case, and encodes the typed result its own
way. The use-case owns the steps in between and their errors:

* the body goes to a worker as bytes; the worker decodes it within the request limits
  (413 beyond them), checks the bags against the model, collecting every problem
  (422), and predicts: the event loop never parses a body;
* a full queue is 503 with ``Retry-After``, a lost worker 503, a timeout 504, an input
  the model refuses 422;
* the input's sha256 is computed while a worker decodes and computes;
* one audit line per attempt on a known model, success or failure, durable before the
  answer is released (group commit: concurrent requests share a transaction), with
  the stage timings, the audit write's included, recorded in the metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from bagserve.core.hashing import bytes_sha256
from bagserve.core.policy import review_warnings
from bagserve.core.results import (
    CellPrediction,
    ClassificationPrediction,
    Prediction,
    prediction_from_arrays,
)

from .audit import AuditLog
from .codecs import MULTIPART, BodySpec, media_type
from .encoders import Answer
from .errors import Problem
from .explanations import explanations_sha256
from .metrics import Metrics
from .model_stats import ModelStats
from .options import PredictOptions
from .pool import WorkerPool
from .registry import ModelEntry
from .settings import Settings
from .wire import SharedBuffer
from .worker_handle import InputRejected, QueueFull, WorkerLost, WorkerTimeout

__all__ = ["Caller", "Outcome", "Predictor"]

#: The audit status of a prediction abandoned before its answer: the client went away,
#: or its job was cancelled (nginx's "client closed request").
CANCELLED = 499


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


@dataclass
class Outcome:
    """A finished prediction: what went in (ids, sizes) and the model's typed answer.

    Attributes
    ----------
    entry : ModelEntry
    ids : list of str
        Bag ids, in request order.
    result : Prediction
        The runtime's typed answer (:mod:`bagserve.core.results`).
    warnings : list of str
        What should change a reviewer's decision (out of the applicability domain,
        cells clipped into the training range).
    request_sha256 : str
        sha256 of the request body as received.
    timings : dict
        Seconds per stage (read, parse, validate, queue, transfer, compute, audit,
        encode).
    options : PredictOptions
        The options the prediction was made with (``/v2``: from its document).
    plots : list of dict, optional
        Per bag, with ``?plot=N``: cells for a scatter plot
        (:func:`~.validation.plot_samples`; with ``explain``, their contributions).
    echo : dict, optional
        ``/v2``: what the answer needs of the request (:mod:`.tensors`).
    inputs : list of str
        Per bag, the sha256 of its input: its file as uploaded, or its cells sent as
        numbers (:attr:`~.codecs.IncomingBag.input_sha256`).
    notes : list of str
        Routine facts (channels the model does not use, compensation applied): shown
        apart from the warnings, never in a report's notes.
    """

    entry: ModelEntry
    ids: list[str]
    result: Prediction
    warnings: list[str]
    request_sha256: str
    timings: dict[str, float] = field(default_factory=dict)
    options: PredictOptions = field(default_factory=PredictOptions)
    plots: list[dict[str, Any]] | None = None
    echo: dict[str, Any] | None = None
    inputs: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Per bag, when its instrument acquired it (FCS keywords), or None.
    acquired: list[str | None] = field(default_factory=list)
    #: Per bag, with ``explain``: its explanation (:mod:`.explanations`).
    explanations: list[dict[str, Any]] | None = None
    #: Asked with ``fcs``: the one bag's cells with their contributions, an FCS file.
    fcs: bytes | None = None

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
        """What heads every answer: model, request id, request hash, warnings, notes."""
        return {
            "model": self.entry.provenance(),
            "request_id": request_id,
            "request_sha256": self.request_sha256,
            "warnings": self.warnings,
            "notes": self.notes,
        }

    def answer(self, request_id: str) -> Answer:
        """What every output format takes of this prediction (:class:`.encoders.Answer`),
        headed by its :meth:`provenance`."""
        return Answer(
            self.result,
            self.ids,
            self.provenance(request_id),
            self.entry.info,
            inputs=self.inputs,
            acquired=self.acquired,
            plots=self.plots,
            explanations=self.explanations,
        )

    def summary(self, values: bool = False) -> dict[str, Any]:
        """What the audit trail keeps of the output: per bag its status, domain score
        and flag, and no patient value unless ``values`` (``BAGSERVE_AUDIT_VALUES``):
        then the bags' values (bag-level models) or class counts (per-cell models)."""
        r = self.result
        out: dict[str, Any] = {
            "n_bags": len(self.ids),
            "status": [r.status_of(i) for i in range(r.n_bags)],
        }
        if r.domain is not None:
            out["out_of_range"] = [bool(v) for v in r.domain.out_of_range.tolist()]
            out["domain_score"] = [round(float(v), 6) for v in r.domain.score.tolist()]
        if self.explanations is not None:
            # The explanations hold cell values: the trail keeps their hash only.
            out["explanations_sha256"] = explanations_sha256(self.explanations)
        return {**out, **_audited_values(r)} if values else out


@functools.singledispatch
def _audited_values(result: Prediction) -> dict[str, Any]:
    """The patient values the audit trail keeps when told to, by the kind of the
    result: here each bag's value (or values)."""
    return {"values": np.asarray(result.estimate, dtype=np.float64).tolist()}


@_audited_values.register
def _(result: ClassificationPrediction) -> dict[str, Any]:
    return {"values": [str(v) for v in np.asarray(result.estimate).tolist()]}


@_audited_values.register
def _(result: CellPrediction) -> dict[str, Any]:
    # The population summary, never a label per cell.
    if result.counts is None or result.classes is None:
        return {}
    names = [str(c) for c in result.classes.tolist()]
    return {"class_counts": [dict(zip(names, row, strict=True)) for row in result.counts.tolist()]}


def provenance_headers(entry: ModelEntry, outcome: Outcome) -> dict[str, str]:
    """Provenance of an answer, as response headers: the model, the request body's
    sha256, and for a single bag the sha256 of its input (its file, or its cells)."""
    headers = {
        "X-Model-Name": entry.name,
        "X-Model-Version": entry.version,
        "X-Model-SHA256": entry.sha256,
        "X-Request-SHA256": outcome.request_sha256,
    }
    if len(outcome.inputs) == 1:
        headers["X-Input-SHA256"] = outcome.inputs[0]
    return headers


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
        spec: BodySpec,
        options: PredictOptions | None = None,
        *,
        lent: SharedBuffer | None = None,
        request_sha256: str | None = None,
        timings: dict[str, float] | None = None,
        fcs: bool = False,
    ) -> Outcome:
        """Decode, validate and compute on a worker, and audit, one prediction.

        Parameters
        ----------
        caller : Caller
        entry : ModelEntry
        body : bytes or memoryview
            The request body, as received.
        spec : BodySpec
            How to decode it.
        options : PredictOptions, optional
            Parsed from the query already (``/v1``, jobs); None when the body carries
            them (``/v2``: the worker parses them from the document).
        lent : SharedBuffer, optional
            The shared buffer ``body`` views: the worker reads it in place.
        request_sha256 : str, optional
            The body's sha256 when already known (a stored job).
        timings : dict, optional
            Stages timed so far (``read``); the others are added.
        fcs : bool, default=False
            With ``options.explain``: the answer is the one bag's cells with their
            contributions as FCS (:attr:`Outcome.fcs`; 422 for several bags).

        Raises
        ------
        Problem
            Every failure, with its HTTP status; it is audited before it is raised.
        """
        timings = dict(timings or {})
        digest: list[str] = [] if request_sha256 is None else [request_sha256]

        def hash_input() -> str:
            digest.append(bytes_sha256(body))
            return digest[-1]

        async def input_hash() -> str:
            # Computed beside the worker unless the request failed before it got there.
            return digest[0] if digest else await asyncio.to_thread(hash_input)

        status, outcome, used = 500, None, options
        try:
            outcome = await self.compute(
                entry, body, spec, options, timings, lent, None if digest else hash_input, fcs
            )
            outcome.request_sha256 = await input_hash()
            # A bag whose file is the body itself has the body's hash.
            outcome.inputs = [h or outcome.request_sha256 for h in outcome.inputs]
            used = outcome.options
            status = 200
            return outcome
        except Problem as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = CANCELLED
            raise
        finally:
            if outcome is not None and media_type(spec.content_type) == MULTIPART:
                # The file names are the bags' ids (kept if the settings say so).
                caller = dataclasses.replace(caller, files=outcome.ids)
            try:
                fields = self.record(caller, entry, await input_hash(), status, outcome, used)
                if fields is not None and self.audit_log is not None:
                    t1 = time.perf_counter()
                    # Group commit (:class:`~.audit.AuditLog`): released once the record
                    # is durable. An abandoned request is still recorded: the record is
                    # queued before the wait, and a cancelled wait does not withdraw it.
                    await self.audit_log.append_async(**fields)
                    # The outcome shares this dict: the answer's Server-Timing shows it.
                    timings["audit"] = time.perf_counter() - t1
            finally:
                self.metrics.observe_stages(timings)
                if self.stats is not None and status != CANCELLED:
                    n_bags = 0 if outcome is None else len(outcome.ids)
                    self.stats.observe(entry.key, status == 200, timings, n_bags)

    async def compute(
        self,
        entry: ModelEntry,
        body: bytes | memoryview,
        spec: BodySpec,
        options: PredictOptions | None,
        timings: dict[str, float],
        lent: SharedBuffer | None = None,
        meanwhile: Callable[[], object] | None = None,
        fcs: bool = False,
    ) -> Outcome:
        """Run one request on a worker (decode, validate, predict) and map the pool's
        failures to problems; the outcome's input hash is left for the caller.

        ``meanwhile`` runs while the worker computes, where the pool exchanges with it:
        for a large body in the pool's thread (hashlib releases the GIL, so the input's
        sha256 costs no time there; run beside the event loop instead, it slowed it by
        the GIL's hand-overs); for a body of one write on the loop, where hashing it
        costs microseconds and a thread hop would cost more.
        """
        settings = self.settings
        retry = {"Retry-After": str(settings.retry_after)}
        header = {
            "model": entry.key,
            # The version's id in the workers (name/version@sha256): an artifact
            # retrained in place is computed by the files this entry names, not the new.
            "sha256": entry.sha256,
            "body": spec.to_json(),
            "options": None if options is None else options.to_json(),
        }
        if fcs:
            header["fcs"] = True
        try:
            t1 = time.perf_counter()
            out_header, out_arrays, queued, _ = await self.pool.submit(
                header,
                {"body": np.frombuffer(body, dtype=np.uint8)},
                settings.request_timeout,
                lent=() if lent is None else (lent,),
                meanwhile=meanwhile,
            )
            # "transfer": moving the body to the worker and the answer back.
            exchange = time.perf_counter() - t1 - queued
            worker = {k: float(v) for k, v in out_header["seconds"].items()}
            timings.update(worker, queue=queued, transfer=exchange - sum(worker.values()))
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
        fcs_file = out_arrays.pop("fcs", None)
        result = prediction_from_arrays(out_header["kind"], out_arrays)
        ids = list(out_header["ids"])
        for n in result.sizes.tolist():
            self.metrics.points.observe(n)
        self._observe_domain(entry, result)
        warnings = review_warnings(result, ids)
        return Outcome(
            entry,
            ids,
            result,
            warnings,
            "",
            timings,
            PredictOptions.from_json(out_header["options"]),
            out_header["plots"],
            out_header["echo"],
            list(out_header["inputs"]),
            list(out_header["notes"]),
            list(out_header.get("acquired") or [None] * len(ids)),
            out_header.get("explanations"),
            None if fcs_file is None else fcs_file.tobytes(),
        )

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
            "request_sha256": input_sha,
            "status": status,
        }
        if outcome is not None and status == 200:
            fields["inputs"] = outcome.inputs
            fields["bag_sizes"] = outcome.sizes
            fields["output"] = outcome.summary(self.settings.audit_values)
        if options is not None and options.compensated:
            fields["compensated_by_caller"] = True
        if caller.files and self.settings.audit_file_names:
            fields["files"] = caller.files
        return fields
