"""Stores that live as long as the outermost ``with`` block that opened them.

A fit (or a training search) keeps values it would otherwise compute again, such as
a median heuristic or a fold's errors, in a store that only code run inside its block
sees: a :class:`~contextvars.ContextVar` holding a dict. Nested blocks share the
outermost one's store, and the store is dropped when that block ends, so that
nothing outlives the work it was kept for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__ = ["scoped_store"]


@contextmanager
def scoped_store(var: ContextVar[dict[Any, Any] | None]) -> Iterator[None]:
    """Within the block, ``var`` holds a dict, empty when the block is the outermost
    one and the outer block's otherwise; afterwards it holds what it held before."""
    if var.get() is not None:
        yield
        return
    token = var.set({})
    try:
        yield
    finally:
        var.reset(token)
