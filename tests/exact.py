"""Equality to the last bit, for comparing a fit with its reference fit."""

from __future__ import annotations

from typing import Any

import numpy as np


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """``a`` and ``b`` equal to the last bit (dicts, sequences, arrays, floats; NaN
    equals NaN); ``path`` names where they first differ."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert np.array_equal(np.asarray(a), np.asarray(b)), path
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), path
