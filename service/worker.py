"""A compute worker process: holds the served models and answers requests.

Each worker holds a :class:`~bagserve.core.runtime.ModelRuntime` per model version and
answers requests on its own pipe, in the wire format of :mod:`.wire`. A model's arrays
are the bytes the server read and verified, in a sealed memory file the worker maps
read-only (shared by every worker; :mod:`bagserve.core.sealing`): the worker never
opens the model's files, so a file changed or truncated on disk changes no answer and
cannot kill it. Models are loaded and dropped on a second pipe, the control pipe, by
a thread of their own (:class:`_Models`): a load never waits for the request being
computed, and never takes a worker away from requests. A model version is known by
its *model id*, ``name/version@sha256`` (:func:`model_id`): a retrained artifact under
the same version is another id, so the old one keeps answering the requests routed to
it until the pool drops it. A request is a header (model key, how to decode the body,
the options) and the request body as bytes (``body``), in shared memory when large.
The worker decodes the body (:mod:`.codecs`, :mod:`.tensors`), checks the bags against
the model (:mod:`.validation`) and predicts: the server's event loop never parses a
body, and a body that takes time or memory to decode takes this process's. The answer
is the typed prediction as named arrays with the bag ids, warnings and timings, or an
error whose ``type`` tells the pool whether the request was refused with a problem
(``"problem"``: status and details), the model refused the input (``"input"``,
answered 422) or the computation failed (``"internal"``).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .wire import recv_message, recv_with_descriptors, send_message

__all__ = [
    "INPUT_ERROR",
    "INTERNAL_ERROR",
    "PROBLEM_ERROR",
    "model_id",
    "predict_message",
    "worker_main",
]

#: Error types that cross the pipe: the request was refused with a problem (its
#: status and details cross with it) ...
PROBLEM_ERROR = "problem"
#: ... the model refused the input (answered 422) ...
INPUT_ERROR = "input"
#: ... or something else went wrong (answered 500, logged).
INTERNAL_ERROR = "internal"


def model_id(key: str, sha256: str) -> str:
    """How the pool and its workers know a model version: ``name/version@sha256``.

    The manifest's digest is part of it: an artifact retrained in place is another
    model, loaded beside the one it replaces until the switch.
    """
    return f"{key}@{sha256}"


def predict_message(
    runtime: Any,
    entry: Any,
    header: dict[str, Any],
    arrays: dict[str, np.ndarray],
    limits: Any,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One request: its body decoded and validated, the typed prediction out as arrays.

    Returns the answer's header (``kind``, bag ``ids``, each bag's ``inputs`` hash,
    ``notes``, ``plots``, ``explanations``, the options applied, ``/v2``'s ``echo``,
    seconds per stage) and the runtime's arrays; with ``header["fcs"]`` (and the
    option ``explain``) also ``fcs``, the one bag's cells with their contributions as
    an FCS file (:func:`.explanations.explained_fcs`).
    """
    from bagserve.core.bags import Bags

    from .codecs import BodySpec, decode_body
    from .explanations import explained_fcs, explanation_documents
    from .options import PredictOptions
    from .tensors import decode_inference
    from .validation import plot_samples, split_control, validate_bags

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
    control = None
    if options.control is not None:
        bags, points, weights, control, note = split_control(bags, points, weights, options)
        notes = [*notes, note]
    sizes = [a.shape[0] for a in points]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    stacked = np.concatenate(points) if len(points) > 1 else points[0]
    cell_weights = None
    if any(w is not None for w in weights):
        cell_weights = np.concatenate(
            [np.ones(s) if w is None else w for w, s in zip(weights, sizes, strict=True)]
        )
    t2 = time.perf_counter()
    incoming = Bags(stacked, offsets, cell_weights, validate=False)
    result = runtime.predict(
        incoming,
        quantiles=options.quantiles,
        exceed=options.exceed,
        coverage=options.coverage,
        probabilities=options.probabilities,
        unassigned=options.unassigned,
        control=control,
    )
    explanations, extra = None, {}
    if options.explain:
        explanations, plots, explained = explanation_documents(
            runtime, incoming, options.plot, control
        )
        if header.get("fcs"):
            # Built here, where the cells are: only the file crosses the pipe.
            fcs = explained_fcs(bags, explained)
            extra["fcs"] = np.frombuffer(fcs, dtype=np.uint8)
    else:
        plots = plot_samples(entry, points, result, options.plot) if options.plot else None
    t3 = time.perf_counter()
    answer = {
        "kind": str(result.kind),
        "ids": [b.id for b in bags],
        "inputs": [b.input_sha256 for b in bags],
        "acquired": [b.acquired for b in bags],
        "notes": notes,
        "plots": plots,
        "explanations": explanations,
        "options": options.to_json(),
        "echo": echo,
        "seconds": {"parse": t1 - t0, "validate": t2 - t1, "compute": t3 - t2},
    }
    return answer, {**result.to_arrays(), **extra}


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


class _Models:
    """The runtimes a worker holds, by model id; changed by the control thread only.

    The mapping is replaced, never changed in place: the request loop reads whatever
    mapping is current without a lock, and a request keeps the runtime it started
    with even if its model is dropped meanwhile.
    """

    def __init__(self) -> None:
        self.runtimes: dict[str, tuple[Any, Any]] = {}

    def load(self, mid: str, artifact: dict[str, Any], fds: list[int]) -> str | None:
        """Load one model version from the verified bytes the pool hands over
        (:meth:`~bagserve.core.artifacts.VerifiedArtifact.handle`, the descriptor of its
        sealed memory in ``fds``, taken over); returns why not, or None."""
        from bagserve.core.artifacts import VerifiedArtifact
        from bagserve.core.runtime import ModelRuntime

        from .registry import ModelEntry

        if mid in self.runtimes:
            for fd in fds:
                os.close(fd)
            return None
        try:
            verified = VerifiedArtifact.attach(artifact, fds)
            key, sha256 = mid.rsplit("@", 1)
            if verified.sha256 != sha256:
                return f"the verified bytes handed over are model {verified.sha256}, not {sha256}"
            runtime = ModelRuntime.from_verified(verified)
            name, version = key.split("/", 1)
            entry = ModelEntry(name, version, runtime.info)
        except Exception as exc:  # reported to the pool: the load fails, serving goes on
            return f"{type(exc).__name__}: {exc}"
        self.runtimes = {**self.runtimes, mid: (runtime, entry)}
        return None

    def drop(self, ids: list[str]) -> None:
        """Drop model versions ``ids`` (their memory is unmapped when the last request
        using them is done)."""
        gone = set(ids)
        self.runtimes = {k: v for k, v in self.runtimes.items() if k not in gone}

    def find(self, key: str, sha256: str | None) -> tuple[Any, Any]:
        """The runtime and entry of ``key`` at ``sha256`` (or its only version held)."""
        from .errors import Problem

        runtimes = self.runtimes
        if sha256 is not None:
            found = runtimes.get(model_id(key, sha256))
        else:
            held = [v for k, v in runtimes.items() if k.rsplit("@", 1)[0] == key]
            found = held[-1] if held else None
        if found is None:
            # The pool routes only models every worker holds; this is a request that
            # waited across a reload that dropped its version. Its retry finds the new one.
            raise Problem(
                503,
                f"model {key} is not loaded (it was reloaded meanwhile); retry",
                slug="model-loading",
            )
        return found


def _control_loop(control: Connection, models: _Models) -> None:
    """Serve the pool's control messages in turn: ``load`` one model, ``drop`` some."""
    while True:
        try:
            message, fds = recv_with_descriptors(control)
        except (EOFError, OSError):
            return
        op = message.get("op")
        if op == "load":
            reason = models.load(message["id"], message["artifact"], fds)
            answer = {"ok": reason is None, "reason": reason}
        elif op == "drop":
            models.drop(list(message["ids"]))
            answer = {"ok": True}
        else:
            answer = {"ok": False, "reason": f"unknown control operation {op!r}"}
        try:
            control.send(answer)
        except (EOFError, OSError):
            return


def worker_main(conn: Connection, control: Connection, limits: dict[str, int]) -> None:
    """Entry point of a worker process: greet the pool, then serve requests and, on the
    control pipe, the models it hands over.

    Parameters
    ----------
    conn : Connection
        This worker's end of its request pipe to the pool.
    control : Connection
        This worker's end of its control pipe: the greeting, then ``load`` (a model's
        verified bytes, :meth:`_Models.load`) and ``drop`` messages, answered in turn
        by a thread of their own.
    limits : dict
        The request limits (:class:`~.codecs.RequestLimits` as JSON).
    """
    # One BLAS thread per worker: the pool, not BLAS, uses the cores (a worker forked
    # from the preloaded server has it already, see .worker_preload).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from threadpoolctl import threadpool_limits

    from .codecs import RequestLimits

    threadpool_limits(1)
    held = _Models()
    request_limits = RequestLimits(**limits)
    control.send({"started": os.getpid()})
    threading.Thread(
        target=_control_loop, args=(control, held), name="bagserve-control", daemon=True
    ).start()
    mappings: OrderedDict[str, Any] = OrderedDict()
    while True:
        try:
            header, arrays = recv_message(conn, mappings)
        except (EOFError, OSError):
            return
        try:
            runtime, entry = held.find(header["model"], header.get("sha256"))
            out_header, out_arrays = predict_message(runtime, entry, header, arrays, request_limits)
            send_message(conn, {"ok": True, **out_header}, out_arrays)
        except Exception as exc:  # report, keep serving
            send_message(conn, {"ok": False, "error": _error(exc)}, {})
