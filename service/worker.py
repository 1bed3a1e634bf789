"""A compute worker process: loads every served model once, then answers requests.

Each worker holds a :class:`~bagserve.core.runtime.ModelRuntime` per model (arrays
memory-mapped read-only, so the pages are shared between workers) and answers on its
own pipe, in the wire format of :mod:`.wire`. A request is a header (model key, query
options) and the bags as named arrays (``points``, ``offsets``, optional ``weights``);
the answer is the typed prediction as named arrays, or an error whose ``type`` tells the
pool whether the input was refused (``"input"``) or the computation failed
(``"internal"``).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .wire import recv_message, send_message

__all__ = ["INPUT_ERROR", "INTERNAL_ERROR", "predict_message", "worker_main"]

#: Error types that cross the pipe: the model refused the input (answered 422) ...
INPUT_ERROR = "input"
#: ... or something else went wrong (answered 500, logged).
INTERNAL_ERROR = "internal"


def predict_message(
    runtime: Any, header: dict[str, Any], arrays: dict[str, np.ndarray]
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One request: bags in, the runtime's typed prediction out as named arrays."""
    from bagserve.core.bags import Bags

    bags = Bags(arrays["points"], arrays["offsets"], arrays.get("weights"), validate=False)
    result = runtime.predict(
        bags,
        quantiles=header.get("quantiles") or (),
        exceed=header.get("exceed") or (),
        coverage=header.get("coverage"),
        probabilities=bool(header.get("probabilities")),
    )
    return {"kind": str(result.kind)}, result.to_arrays()


def _error_type(exc: Exception) -> str:
    from bagserve.core.bags import BagValidationError
    from bagserve.core.io import DataError

    # ValueError: the estimators' own argument checks (a wrong number of markers, ...).
    return (
        INPUT_ERROR
        if isinstance(exc, BagValidationError | DataError | ValueError)
        else (INTERNAL_ERROR)
    )


def worker_main(conn: Connection, models: dict[str, str]) -> None:
    """Entry point of a worker process: load every model, then serve requests.

    Parameters
    ----------
    conn : Connection
        This worker's end of its pipe to the pool.
    models : dict of str to str
        Model key (``name/version``) to artifact path, already verified by the
        registry.
    """
    # One BLAS thread per worker: the pool, not BLAS, uses the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bagserve.core.runtime import ModelRuntime
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    runtimes = {
        key: ModelRuntime.open(path, mmap=True, verify=False) for key, path in models.items()
    }
    conn.send_bytes(b"ready")
    mappings: OrderedDict[str, Any] = OrderedDict()
    while True:
        try:
            header, arrays = recv_message(conn, mappings)
        except (EOFError, OSError):
            return
        try:
            t0 = time.perf_counter()
            out_header, out_arrays = predict_message(runtimes[header["model"]], header, arrays)
            out_header["seconds"] = time.perf_counter() - t0
            send_message(conn, {"ok": True, **out_header}, out_arrays)
        except Exception as exc:  # report, keep serving
            error = {"type": _error_type(exc), "class": type(exc).__name__, "message": str(exc)}
            send_message(conn, {"ok": False, "error": error}, {})
