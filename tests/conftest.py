"""Shared fixtures: small seeded bags, the shared state's database per engine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from bagserve.core import Bags

#: The shared real data sets (``../shared/data`` beside the repository, as in CI).
SHARED_DATA = Path(
    os.environ.get("BAGSERVE_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


def random_bags(
    rng: np.random.Generator,
    n_bags: int = 12,
    dim: int = 3,
    sizes: tuple[int, int] = (15, 40),
    weighted: bool = False,
) -> Bags:
    """Bags of varied sizes whose means and spreads differ (so distances do too)."""
    arrays, weights = [], []
    for t in range(n_bags):
        n = int(rng.integers(*sizes))
        arrays.append(rng.normal(loc=0.3 * t, scale=1.0 + 0.1 * t, size=(n, dim)))
        weights.append(rng.uniform(0.1, 1.0, size=n))
    return Bags.from_arrays(arrays, weights=weights if weighted else None)


@pytest.fixture
def bags(rng: np.random.Generator) -> Bags:
    return random_bags(rng)


@pytest.fixture
def weighted_bags(rng: np.random.Generator) -> Bags:
    return random_bags(rng, weighted=True)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database(request, tmp_path_factory) -> Iterator[str]:
    """The shared state's database URL, once per engine: a SQLite file, then a
    PostgreSQL server of the test's own (:mod:`tests.postgres`)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'state.sqlite3'}"
        return
    from .postgres import postgres_server

    with postgres_server() as url:
        yield url
