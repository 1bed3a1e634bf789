"""From a request to a response: read, decode, validate, dispatch to a worker, encode.

Routes stay thin; this module owns the steps and their errors:

* the body is read incrementally and refused with 413 as soon as it passes the limit
  (before it is all read), and at once when ``Content-Length`` already says so;
* every validation problem (panel, NaN/Inf, empty bags, sizes, weights) is collected
  and answered together with 422;
* compute happens in a worker; a full queue is 503 with ``Retry-After``, a lost worker
  503, a timeout 504;
* the answer carries provenance in body and headers: model name, version and sha256,
  request id, sha256 of the input.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from bagserve.core.io import DataError
from fastapi import Request
from starlette.responses import Response

from .codecs import (
    ACCEPTED,
    JSON,
    MULTIPART,
    NPY,
    OCTET,
    IncomingBag,
    decode_body,
    decode_file,
    media_type,
    npy_bytes,
)
from .errors import Problem
from .registry import ModelEntry
from .workers import (
    MEMFD_MIN_BYTES,
    ComputeError,
    QueueFull,
    SharedBuffer,
    WorkerLost,
    WorkerTimeout,
)

__all__ = ["predict"]

CSV_OUT = "text/csv"
VALIDATION_ERRORS = ("BagValidationError", "DataError", "ValueError")


async def read_limited(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Problem(413, f"the body ({int(declared)} bytes) exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Problem(413, f"the body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    # Later readers (multipart parsing) see the body already read.
    request._body = body
    return body


#: Bodies that are read straight into a shared buffer when large enough: the formats
#: read without a copy (NPY), whose array then reaches the worker without one either,
#: and JSON, which is parsed from the buffer's warm pages instead of a fresh join.
SHARED_TYPES = (NPY, OCTET, JSON)


async def read_body(request: Request, limit: int) -> tuple[bytes | memoryview, SharedBuffer | None]:
    """The body, and the shared buffer it was read into, if any (413 as in read_limited).

    A large NPY body of known length is written, chunk by chunk, into a reused shared
    buffer (a memory file the workers already map) rather than joined into bytes and
    copied into a fresh memory file for the worker: that saves two copies of the body
    and, above all, allocating the memory file's pages for every request. A large JSON
    body goes the same way (its pages are warm; a join allocates and faults in fresh
    ones). The body is then a read-only view of the buffer; the caller gives the
    buffer back to ``app.state.pool.buffers`` when the request is over.
    """
    declared = request.headers.get("content-length")
    pool = getattr(request.app.state.pool, "buffers", None)
    if (
        pool is None
        or declared is None
        or not declared.isdigit()
        or not MEMFD_MIN_BYTES <= int(declared) <= limit
        or media_type(request.headers.get("content-type")) not in SHARED_TYPES
    ):
        return await read_limited(request, limit), None
    size = int(declared)
    buffer = pool.lease(size)
    try:
        target, end = buffer.map, 0
        async for chunk in request.stream():
            start, end = end, end + len(chunk)
            if end > size:  # the HTTP parser frames the body: not expected to happen
                raise Problem(
                    400,
                    f"the body is longer than its Content-Length ({size} bytes)",
                    slug="invalid-request",
                )
            target[start:end] = chunk
    except BaseException:
        pool.give_back(buffer)
        raise
    return memoryview(target).toreadonly()[:end], buffer


async def _incoming(
    request: Request, body: bytes | memoryview
) -> tuple[list[IncomingBag], list[str]]:
    ctype = media_type(request.headers.get("content-type"))
    q = request.query_params.get("markers")
    markers = [m.strip() for m in q.split(",")] if q else None
    if ctype != MULTIPART:
        return decode_body(ctype, body, markers, request.query_params.get("id", "bag-0"))
    form = await request.form()
    bags, errors = [], []
    for i, (part, value) in enumerate(form.multi_items()):
        if not hasattr(value, "read"):
            continue
        name = value.filename or f"{part}-{i}"
        suffix = name.lower().removesuffix(".gz").rsplit(".", 1)[-1]
        kind = suffix if suffix in ("fcs", "csv", "tsv", "npy") else None
        try:
            bags.append(decode_file(await value.read(), name, kind, markers))
        except Problem as exc:
            errors += exc.errors or [exc.detail]
    if not bags and not errors:
        raise Problem(422, "the multipart body holds no files", slug="invalid-request")
    return bags, errors


def _validate(
    bags: list[IncomingBag], entry: ModelEntry, limits: dict[str, int], errors: list[str]
):
    """Align every bag to the model's panel; collect every problem before answering."""
    errors = list(errors)
    warnings: list[str] = []
    panel = entry.panel
    if len(bags) > limits["max_bags"]:
        errors.append(f"{len(bags)} bags, more than the limit of {limits['max_bags']}")
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
        if n > limits["max_points_per_bag"]:
            errors.append(
                f"{where} has {n} points, more than the limit of {limits['max_points_per_bag']}"
            )
        if entry.kind == "cell" and n < 2:
            errors.append(f"{where} has a single cell: its distribution cannot be estimated")
        pts = b.points
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
    if total > limits["max_total_points"]:
        errors.append(f"{total} points in all, more than the limit of {limits['max_total_points']}")
    if errors:
        raise Problem(
            422, f"{len(errors)} problem(s) in the request", errors=errors, slug="invalid-bags"
        )
    return arrays, weights, warnings


def _accept(request: Request) -> str:
    accept = request.headers.get("accept", "") or "*/*"
    for part in accept.split(","):
        t = media_type(part)
        if t in (JSON, "*/*", "application/*", ""):
            return JSON
        if t in (CSV_OUT, "text/*"):
            return CSV_OUT
        if t == NPY:
            return NPY
    raise Problem(406, f"cannot answer {accept!r}; available: {JSON}, {CSV_OUT}, {NPY}")


def _encode(
    kind: str,
    ids: list[str],
    sizes: list[int],
    header: dict[str, Any],
    arrays: list[np.ndarray],
    fmt: str,
    meta: dict[str, Any],
) -> tuple[bytes, str]:
    if kind == "cell":
        labels, oor, dist, nearest, sims = arrays
        if fmt == NPY:
            return npy_bytes(np.asarray(labels)), NPY
        starts = np.concatenate([[0], np.cumsum(sizes)])
        if fmt == CSV_OUT:
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            w.writerow(["id", "cell", "label"])
            for i, bag_id in enumerate(ids):
                for j, lab in enumerate(labels[starts[i] : starts[i + 1]].tolist()):
                    w.writerow([bag_id, j, lab])
            return buf.getvalue().encode(), CSV_OUT
        preds = [
            {
                "id": bag_id,
                "n_points": sizes[i],
                "labels": labels[starts[i] : starts[i + 1]].tolist(),
                "report": {
                    "out_of_range": bool(oor[i]),
                    "distance_to_nearest": float(dist[i]),
                    "nearest_training_tasks": [int(t) for t in nearest[i] if t >= 0],
                    "similarities": [
                        float(s) for s, t in zip(sims[i], nearest[i], strict=True) if t >= 0
                    ],
                },
            }
            for i, bag_id in enumerate(ids)
        ]
        return orjson.dumps({**meta, "predictions": preds}), JSON
    values = arrays[0]
    if kind == "conditional":
        return _encode_conditional(ids, header, arrays, fmt, meta)
    if fmt == NPY:
        return npy_bytes(np.asarray(values)), NPY
    if kind == "classification":
        scores, classes = arrays[1], arrays[2].tolist()
        if scores.shape[1] == 1:  # binary: one margin for classes[1]
            scores = np.hstack([-scores, scores])
        if fmt == CSV_OUT:
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            w.writerow(["id", "prediction", *[f"score_{c}" for c in classes]])
            for i, bag_id in enumerate(ids):
                w.writerow([bag_id, values[i], *scores[i].tolist()])
            return buf.getvalue().encode(), CSV_OUT
        preds = [
            {
                "id": bag_id,
                "prediction": values[i].item(),
                "scores": dict(zip(map(str, classes), scores[i].tolist(), strict=True)),
            }
            for i, bag_id in enumerate(ids)
        ]
        return orjson.dumps({**meta, "predictions": preds}), JSON
    if fmt == CSV_OUT:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        multi = values.ndim == 2
        w.writerow(
            [
                "id",
                *([f"prediction_{j}" for j in range(values.shape[1])] if multi else ["prediction"]),
            ]
        )
        for i, bag_id in enumerate(ids):
            w.writerow([bag_id, *(values[i].tolist() if multi else [values[i].item()])])
        return buf.getvalue().encode(), CSV_OUT
    preds = [{"id": bag_id, "prediction": values[i].tolist()} for i, bag_id in enumerate(ids)]
    return orjson.dumps({**meta, "predictions": preds}), JSON


def _encode_conditional(
    ids: list[str],
    header: dict[str, Any],
    arrays: list[np.ndarray],
    fmt: str,
    meta: dict[str, Any],
) -> tuple[bytes, str]:
    """Mean, then the requested quantiles and exceedance probabilities, per bag."""
    values, extra = arrays
    levels, thresholds = header.get("quantiles", []), header.get("exceed", [])
    q, e = extra[:, : len(levels)], extra[:, len(levels) :]
    if fmt == NPY:
        # Columns: mean, then the quantiles, then the exceedance probabilities.
        table = np.column_stack([values, extra]) if extra.shape[1] else values
        return npy_bytes(np.asarray(table)), NPY
    if fmt == CSV_OUT:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(
            [
                "id",
                "prediction",
                *[f"q_{v:g}" for v in levels],
                *[f"p_gt_{t:g}" for t in thresholds],
            ]
        )
        for i, bag_id in enumerate(ids):
            w.writerow([bag_id, values[i].item(), *q[i].tolist(), *e[i].tolist()])
        return buf.getvalue().encode(), CSV_OUT
    preds = []
    for i, bag_id in enumerate(ids):
        pred: dict[str, Any] = {"id": bag_id, "prediction": values[i].tolist()}
        if levels:
            pred["quantiles"] = {f"{v:g}": x for v, x in zip(levels, q[i].tolist(), strict=True)}
        if thresholds:
            pred["exceedance"] = {
                f"{t:g}": x for t, x in zip(thresholds, e[i].tolist(), strict=True)
            }
        preds.append(pred)
    return orjson.dumps({**meta, "predictions": preds}), JSON


@dataclass
class Outcome:
    """A finished prediction: what went in (ids, sizes) and what the worker sent back."""

    entry: ModelEntry
    ids: list[str]
    sizes: list[int]
    header: dict[str, Any]
    arrays: list[np.ndarray]
    warnings: list[str]
    timings: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """What the audit trail keeps of the output: no values per cell."""
        values = self.arrays[0]
        if self.entry.kind == "regression":
            v = np.asarray(values, dtype=np.float64)
            return {
                "n_bags": len(self.ids),
                "mean": float(v.mean()),
                "min": float(v.min()),
                "max": float(v.max()),
            }
        labels, counts = np.unique(np.asarray(values).astype(str), return_counts=True)
        out: dict[str, Any] = {
            "n_bags": len(self.ids),
            "label_counts": dict(zip(labels.tolist(), counts.tolist(), strict=True)),
        }
        if self.entry.kind == "cell":
            out["out_of_range_bags"] = int(np.sum(self.arrays[1]))
        return out


def limits_of(settings: Any) -> dict[str, int]:
    return {
        "max_bags": settings.max_bags,
        "max_points_per_bag": settings.max_points_per_bag,
        "max_total_points": settings.max_total_points,
    }


#: At most this many quantile levels or exceedance thresholds per request.
MAX_DISTRIBUTION_QUERIES = 99


def distribution_options(
    entry: ModelEntry, quantiles: str | None, exceed: str | None
) -> dict[str, list[float]]:
    """The ``quantiles`` / ``exceed`` query parameters, checked against the model.

    Comma-separated levels in ``[0, 1]`` and finite thresholds; only conditional models
    (:class:`~core.ConditionalMeanEmbedding`) with a scalar output answer them.
    """
    options: dict[str, list[float]] = {}
    problems = []
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
            options[name] = values
    if (quantiles or exceed) and entry.kind != "conditional":
        problems.append(
            f"quantiles and exceed need a conditional model (ConditionalMeanEmbedding); "
            f"{entry.key} is a {entry.estimator}"
        )
    elif options and entry.n_outputs != 1:
        problems.append(
            f"quantiles and exceed need a scalar output; {entry.key} has {entry.n_outputs}"
        )
    if problems:
        raise Problem(422, problems[0], errors=problems, slug="invalid-request")
    return options


async def compute(
    app: Any,
    entry: ModelEntry,
    bags: list[IncomingBag],
    decode_errors: list[str],
    timings: dict[str, float],
    options: dict[str, list[float]] | None = None,
    lent: SharedBuffer | None = None,
    on_valid: Callable[[], object] | None = None,
) -> Outcome:
    """Validate against the model, run on a worker, map pool failures to problems.

    Points that view ``lent`` (the shared buffer the body was read into) reach the
    worker without a copy. ``on_valid`` is called once the bags are valid, just
    before they go to the worker.
    """
    settings = app.state.settings
    t0 = time.perf_counter()
    arrays, weights, warnings = _validate(bags, entry, limits_of(settings), decode_errors)
    sizes = [a.shape[0] for a in arrays]
    points = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    weighted = any(w is not None for w in weights)
    payload = [points, offsets]
    if weighted:
        payload.append(
            np.concatenate(
                [np.ones(s) if w is None else w for w, s in zip(weights, sizes, strict=True)]
            )
        )
    timings["validate"] = time.perf_counter() - t0
    if on_valid is not None:
        on_valid()
    metrics = getattr(app.state, "metrics", None)
    if metrics is not None:
        for n in sizes:
            metrics.points.observe(n)
    retry = {"Retry-After": str(settings.retry_after)}
    try:
        t1 = time.perf_counter()
        out_header, out_arrays, queued = await app.state.pool.submit(
            {"model": entry.key, "weighted": weighted, **(options or {})},
            payload,
            settings.request_timeout,
            lent=() if lent is None else (lent,),
        )
        out_header.update(options or {})
        # "transfer": moving the points to the worker and the answer back.
        exchange = time.perf_counter() - t1 - queued
        worker_seconds = float(out_header.pop("seconds", exchange))
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
    except ComputeError as exc:
        message = str(exc)
        if message.split(":", 1)[0] in VALIDATION_ERRORS:
            detail = message.split(": ", 1)[-1]
            raise Problem(422, detail, errors=[detail], slug="invalid-bags") from None
        raise
    for bag, n in zip(bags, out_header.pop("clipped", []), strict=False):
        if n:
            warnings.append(
                f"bag {bag.id!r}: {n} of {bag.points.shape[0]} cell(s) lie outside the model's "
                "training range and were clipped into it"
            )
    return Outcome(entry, [b.id for b in bags], sizes, out_header, out_arrays, warnings, timings)


def encode_json(outcome: Outcome, request_id: str, input_sha: str) -> dict[str, Any]:
    """The JSON answer of predict, as a document (stored for jobs)."""
    e = outcome.entry
    meta = {
        "model": {"name": e.name, "version": e.version, "sha256": e.sha256},
        "request_id": request_id,
        "input_sha256": input_sha,
        "warnings": outcome.warnings,
    }
    content, _ = _encode(
        e.kind, outcome.ids, outcome.sizes, outcome.header, outcome.arrays, JSON, meta
    )
    return orjson.loads(content)


async def decode_job_body(
    content_type: str, body: bytes, markers: str | None
) -> tuple[list[IncomingBag], list[str]]:
    """Bags of a stored job's body (multipart included) without an HTTP request."""
    from starlette.requests import Request as StarletteRequest

    query = b"" if not markers else b"markers=" + markers.encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/jobs",
        "query_string": query,
        "headers": [(b"content-type", content_type.encode())],
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    request = StarletteRequest(scope, receive)
    request._body = body
    return await _incoming(request, body)


def provenance_headers(entry: ModelEntry, input_sha: str) -> dict[str, str]:
    return {
        "X-Model-Name": entry.name,
        "X-Model-Version": entry.version,
        "X-Model-SHA256": entry.sha256,
        "X-Input-SHA256": input_sha,
    }


def audit(
    request: Request,
    entry: ModelEntry,
    input_sha: str | None,
    status: int,
    outcome: Outcome | None,
    sources: list[str] | None = None,
) -> None:
    """One audit line for a prediction attempt on a known model (success or failure)."""
    log = getattr(request.app.state, "audit", None)
    if log is None:
        return
    fields: dict[str, Any] = {
        "request_id": request.state.request_id,
        "api_key_id": getattr(request.state, "key_id", None),
        "route": request.url.path,
        "model": {"name": entry.name, "version": entry.version, "sha256": entry.sha256},
        "input_sha256": input_sha,
        "status": status,
    }
    if outcome is not None:
        fields["bag_sizes"] = outcome.sizes
        fields["output"] = outcome.summary()
    if sources and request.app.state.settings.audit_file_names:
        fields["files"] = sources
    log.append(**fields)


async def predict_body(
    request: Request,
    entry: ModelEntry,
    body: bytes | memoryview,
    lent: SharedBuffer | None = None,
) -> Response:
    """The predict exchange once the body is read (shared by the route and replays).

    ``lent`` is the shared buffer ``body`` views, if :func:`read_body` used one.
    """
    fmt = _accept(request)
    timings = dict(getattr(request.state, "timings", {}))
    loop = asyncio.get_running_loop()
    status, outcome = 500, None
    input_hash: asyncio.Future[str] | None = None
    try:
        t0 = time.perf_counter()
        bags, decode_errors = await _incoming(request, body)
        timings["parse"] = time.perf_counter() - t0
        options = _options(request, entry)

        def hash_input() -> None:
            # hashlib releases the GIL: the input's sha256 is computed while a worker
            # computes. It starts once the bags are valid: run beside parsing,
            # validation or the hand-over to the worker, it slowed them down by as
            # much as it took (a few ms for 8 MB on two cores).
            nonlocal input_hash
            input_hash = loop.run_in_executor(None, lambda: hashlib.sha256(body).hexdigest())

        outcome = await compute(
            request.app, entry, bags, decode_errors, timings, options, lent, hash_input
        )
        assert input_hash is not None
        input_sha = await input_hash
        meta = {
            "model": {"name": entry.name, "version": entry.version, "sha256": entry.sha256},
            "request_id": request.state.request_id,
            "input_sha256": input_sha,
            "warnings": outcome.warnings,
        }
        t1 = time.perf_counter()
        content, media = _encode(
            entry.kind, outcome.ids, outcome.sizes, outcome.header, outcome.arrays, fmt, meta
        )
        timings["encode"] = time.perf_counter() - t1
        status = 200
        headers = provenance_headers(entry, input_sha)
        # Where the time went, for the caller's own dashboards (W3C Server Timing).
        headers["Server-Timing"] = ", ".join(
            f"{stage};dur={1000 * timings[stage]:.1f}"
            for stage in ("read", "parse", "validate", "queue", "transfer", "compute", "encode")
            if stage in timings
        )
        return Response(content, media_type=media, headers=headers)
    except Problem as exc:
        status = exc.status
        raise
    finally:
        request.state.timings = timings
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.observe_stages(timings)
        if input_hash is None:  # the body did not parse: still audited, with its hash
            input_hash = loop.run_in_executor(None, lambda: hashlib.sha256(body).hexdigest())
        audit(request, entry, await input_hash, status, outcome if status == 200 else None)


def accepted_content_type(request: Request) -> str:
    """The request's media type, or 415 before the body is read."""
    ctype = media_type(request.headers.get("content-type"))
    if ctype not in ACCEPTED:
        raise Problem(
            415,
            f"unsupported content type {ctype or '(none)'!r}; expected one of {list(ACCEPTED)}",
            slug="unsupported-media-type",
        )
    return ctype


async def predict(request: Request, entry: ModelEntry) -> Response:
    """The whole predict exchange for one model version."""
    _accept(request)
    accepted_content_type(request)
    _options(request, entry)  # refuse bad query parameters before reading the body
    t0 = time.perf_counter()
    body, lent = await read_body(request, request.app.state.settings.max_body_bytes)
    request.state.timings = {"read": time.perf_counter() - t0}
    try:
        return await predict_body(request, entry, body, lent)
    finally:
        if lent is not None:
            request.app.state.pool.buffers.give_back(lent)


def _options(request: Request, entry: ModelEntry) -> dict[str, list[float]]:
    qp = request.query_params
    return distribution_options(entry, qp.get("quantiles"), qp.get("exceed"))
