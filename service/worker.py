"""A compute worker process: loads every served model once, then answers requests.

Each worker holds a :class:`~bagserve.core.runtime.ModelRuntime` per model (arrays
memory-mapped read-only, so the pages are shared between workers) and answers on its
own pipe, in the wire format of :mod:`.wire`. A request is a header (model key, how to
decode the body, the options) and the request body as bytes (``body``), in shared
memory when large. The worker decodes the body (:mod:`.codecs`, :mod:`.tensors`),
checks the bags against the model (:mod:`.validation`) and predicts: the server's event
loop never parses a body, and a body that takes time or memory to decode takes this
process's. The answer is the typed prediction as named arrays with the bag ids,
warnings and timings, or an error whose ``type`` tells the pool whether the request
was refused with a problem (``"problem"``: status and details), the model refused the
input (``"input"``, answered 422) or the computation failed (``"internal"``).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .wire import recv_message, send_message

__all__ = ["INPUT_ERROR", "INTERNAL_ERROR", "PROBLEM_ERROR", "predict_message", "worker_main"]

#: Error types that cross the pipe: the request was refused with a problem (its
#: status and details cross with it) ...
PROBLEM_ERROR = "problem"
#: ... the model refused the input (answered 422) ...
INPUT_ERROR = "input"
#: ... or something else went wrong (answered 500, logged).
INTERNAL_ERROR = "internal"


def predict_message(
    runtime: Any,
    entry: Any,
    header: dict[str, Any],
    arrays: dict[str, np.ndarray],
    limits: Any,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One request: its body decoded and validated, the typed prediction out as arrays.

    Returns the answer's header (``kind``, bag ``ids``, each bag's ``inputs`` hash,
    ``notes``, ``plots``, the options applied, ``/v2``'s ``echo``, seconds per stage)
    and the runtime's arrays.
    """
    from bagserve.core.bags import Bags

    from .codecs import BodySpec, decode_body
    from .options import PredictOptions
    from .tensors import decode_inference
    from .validation import plot_samples, validate_bags

    t0 = time.perf_counter()
    spec = BodySpec(**header["body"])
    body = memoryview(arrays["body"]).cast("B")
    echo = None
    if spec.protocol == "v2":
        request = decode_inference(spec, body, limits, entry)
        bags, problems, options, echo = request.bags, [], request.options, request.echo
    else:
        bags, problems = decode_body(spec, body, limits)
        options = PredictOptions.from_json(header.get("options"))
    t1 = time.perf_counter()
    points, weights, notes = validate_bags(bags, entry, limits, problems, options)
    sizes = [a.shape[0] for a in points]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    stacked = np.concatenate(points) if len(points) > 1 else points[0]
    cell_weights = None
    if any(w is not None for w in weights):
        cell_weights = np.concatenate(
            [np.ones(s) if w is None else w for w, s in zip(weights, sizes, strict=True)]
        )
    t2 = time.perf_counter()
    result = runtime.predict(
        Bags(stacked, offsets, cell_weights, validate=False),
        quantiles=options.quantiles,
        exceed=options.exceed,
        coverage=options.coverage,
        probabilities=options.probabilities,
        unassigned=options.unassigned,
    )
    plots = plot_samples(entry, points, result, options.plot) if options.plot else None
    t3 = time.perf_counter()
    answer = {
        "kind": str(result.kind),
        "ids": [b.id for b in bags],
        "inputs": [b.input_sha256 for b in bags],
        "acquired": [b.acquired for b in bags],
        "notes": notes,
        "plots": plots,
        "options": options.to_json(),
        "echo": echo,
        "seconds": {"parse": t1 - t0, "validate": t2 - t1, "compute": t3 - t2},
    }
    return answer, result.to_arrays()


def _error(exc: Exception) -> dict[str, Any]:
    """What crosses the pipe of a failed request."""
    from bagserve.core.bags import BagValidationError
    from bagserve.core.io import DataError

    from .errors import Problem

    if isinstance(exc, MemoryError):
        # What the other requests hold counts too: worth a retry, not a refusal.
        exc = Problem(
            503,
            "the server ran out of memory decoding or computing this request; retry later, "
            "or send fewer cells per request",
            slug="out-of-memory",
        )
    if isinstance(exc, Problem):
        return {
            "type": PROBLEM_ERROR,
            "status": exc.status,
            "detail": exc.detail,
            "errors": exc.errors,
            "slug": exc.slug,
            "message": exc.detail,
        }
    # ValueError: the estimators' own argument checks (a wrong number of markers, ...).
    kind = INPUT_ERROR if isinstance(exc, BagValidationError | DataError | ValueError) else None
    return {
        "type": kind or INTERNAL_ERROR,
        "class": type(exc).__name__,
        "message": str(exc),
    }


def worker_main(conn: Connection, models: dict[str, str], limits: dict[str, int]) -> None:
    """Entry point of a worker process: load every model, then serve requests.

    Parameters
    ----------
    conn : Connection
        This worker's end of its pipe to the pool.
    models : dict of str to str
        Model key (``name/version``) to artifact path, already verified by the
        registry.
    limits : dict
        The request limits (:class:`~.codecs.RequestLimits` as JSON).
    """
    # One BLAS thread per worker: the pool, not BLAS, uses the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bagserve.core.runtime import ModelRuntime
    from threadpoolctl import threadpool_limits

    from .codecs import RequestLimits
    from .registry import ModelEntry

    threadpool_limits(1)
    runtimes = {
        key: ModelRuntime.open(path, mmap=True, verify=False) for key, path in models.items()
    }
    entries = {
        key: ModelEntry(*key.split("/", 1), runtime.info) for key, runtime in runtimes.items()
    }
    request_limits = RequestLimits(**limits)
    conn.send_bytes(b"ready")
    mappings: OrderedDict[str, Any] = OrderedDict()
    while True:
        try:
            header, arrays = recv_message(conn, mappings)
        except (EOFError, OSError):
            return
        try:
            key = header["model"]
            out_header, out_arrays = predict_message(
                runtimes[key], entries[key], header, arrays, request_limits
            )
            send_message(conn, {"ok": True, **out_header}, out_arrays)
        except Exception as exc:  # report, keep serving
            send_message(conn, {"ok": False, "error": _error(exc)}, {})
