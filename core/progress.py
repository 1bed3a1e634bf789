"""Progress bars for long steps deep inside a fit, switched on by the caller.

Estimators keep scikit-learn's signature (no ``progress`` argument), so a caller that
wants bars, such as ``bagserve train`` without ``--quiet``, switches them on for the
steps it runs with :func:`progress_enabled`; a solver's long loop asks
:func:`progress_bar` for a bar, which does nothing unless they are on. The switch is a
context variable: it holds for the calling thread (and tasks it starts with its
context), not for other requests or threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__ = ["progress_bar", "progress_enabled"]

_enabled: ContextVar[bool] = ContextVar("bagserve_progress", default=False)


@contextmanager
def progress_enabled(on: bool = True) -> Iterator[None]:
    """Show the progress bars of the steps run inside this block (when ``on``)."""
    token = _enabled.set(bool(on))
    try:
        yield
    finally:
        _enabled.reset(token)


class _Silent:
    """A bar that shows nothing (the same methods as tqdm's)."""

    total: int | None = None

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int | None, desc: str, unit: str = "it") -> Any:
    """A tqdm bar (cleared when closed) if bars are on, else one that shows nothing."""
    if not _enabled.get():
        return _Silent()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False)
