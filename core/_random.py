"""One way to turn a ``random_state`` argument into a numpy ``Generator``."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_generator"]


def check_generator(random_state: Any) -> np.random.Generator:
    """``None`` → fresh entropy; an int, a sequence of ints or a ``SeedSequence`` →
    seeded; a ``Generator`` → itself (its state advances); a legacy ``RandomState`` → a
    ``Generator`` seeded from it.
    """
    if isinstance(random_state, np.random.Generator):
        return random_state
    if isinstance(random_state, np.random.RandomState):
        return np.random.default_rng(random_state.randint(0, 2**32, size=4))
    if random_state is None or isinstance(random_state, int | np.integer | np.random.SeedSequence):
        return np.random.default_rng(random_state)
    if isinstance(random_state, list | tuple) and all(
        isinstance(v, int | np.integer) for v in random_state
    ):
        return np.random.default_rng(list(random_state))
    raise ValueError(
        f"random_state must be None, an int, a numpy Generator or RandomState; got {random_state!r}"
    )
