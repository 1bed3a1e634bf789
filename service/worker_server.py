"""The process the workers are forked from, started before anything else is imported.

Workers are forked from a server process (multiprocessing's ``forkserver``) that
imported what they need once (:mod:`.worker_preload`): numpy, scipy, scikit-learn and
the estimators, seconds of imports a spawned worker would repeat. ``bagserve serve``
starts it first (:func:`start_worker_server`), so that it imports them on one core
while the main process imports the web framework on the other; each worker, and each
replacement of one, then starts in milliseconds. Where there is no fork server
(Windows), workers are spawned and import everything themselves.

This module imports nothing but :mod:`multiprocessing`: importing it costs nothing on
the way to starting the server.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

__all__ = ["PRELOAD", "start_worker_server", "worker_context"]

#: What the fork server imports before it forks a worker (:mod:`.worker_preload`).
PRELOAD = "bagserve.service.worker_preload"


def worker_context() -> Any:
    """Where workers start: forked from the preloaded server, or spawned without one."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Ignored if the server already runs (then workers import what they lack).
        ctx.set_forkserver_preload([PRELOAD])
        return ctx
    return mp.get_context("spawn")


def start_worker_server() -> None:
    """Start the process the workers are forked from, now, and return at once (it
    imports in the background); without a fork server, nothing."""
    if worker_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
