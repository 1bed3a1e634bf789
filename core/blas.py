"""One BLAS thread for a block of work, at the cost of a context switch.

``threadpoolctl.threadpool_limits`` inspects the loaded libraries every time it is
entered (about 4 ms here): around each of the thousand ridge paths of a training
search that was seconds. The controller made once keeps what it found; entering and
leaving its limit then costs microseconds.
"""

from __future__ import annotations

import threading
from typing import Any

from threadpoolctl import ThreadpoolController

__all__ = ["one_thread"]

_CONTROLLER: ThreadpoolController | None = None
_LOCK = threading.Lock()


def one_thread(user_api: str | None = None) -> Any:
    """A context manager holding the thread pools of ``user_api`` (``"blas"``,
    ``"openmp"``, or None for both) to one thread while it is entered.

    Where many small products run (a search's ridge paths, a Gram's blocks) or where
    threads of our own share the cores, BLAS threads only add synchronisation.
    """
    global _CONTROLLER
    with _LOCK:
        if _CONTROLLER is None:
            _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=1, user_api=user_api)
