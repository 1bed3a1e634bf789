"""A fit computes the T x T matrix among its training bags once.

The model's design and the calibration of its domain check both read the squared
distances (or the Gram) among the training bags. For the exact mean embedding that
matrix is a set-kernel Gram, O(N² n²) kernel evaluations, and it used to be computed
twice per fit. A spy on :func:`set_kernel_gram` counts the computations; the fitted
model must be bit for bit the one the double computation gave, and its domain
calibration must match a naive double-sum oracle.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
from bagserve.core import (
    ConditionalMeanEmbedding,
    DistributionRidge,
    DistributionRidgeClassifier,
    MeanEmbedding,
)
from bagserve.core.domain import knn_mean_distances
from bagserve.core.representations import mean
from bagserve.core.representations.base import Embedding, FeatureEmbedding
from scipy.spatial.distance import cdist

SIGMA = 1.3


@pytest.fixture
def data():
    rng = np.random.default_rng(7)
    bags = [
        rng.normal(rng.uniform(-1, 1), 1.0, size=(int(rng.integers(15, 30)), 2)) for _ in range(24)
    ]
    new = [rng.normal(rng.uniform(-3, 3), 1.0, size=(20, 2)) for _ in range(4)]
    y = np.array([b.mean() for b in bags])
    return bags, new, y


def _estimators() -> dict[str, tuple[object, dict[str, object]]]:
    rep = MeanEmbedding(bandwidth=SIGMA)
    return {
        "ridge (gaussian, cv+)": (DistributionRidge(rep, random_state=0), {}),
        "ridge (linear kernel)": (DistributionRidge(rep, kernel="linear", random_state=0), {}),
        "ridge (groups)": (DistributionRidge(rep, random_state=0), {"groups": np.arange(24) % 6}),
        "classifier": (DistributionRidgeClassifier(rep, random_state=0), {"classes": True}),
        "cme": (ConditionalMeanEmbedding(representation=rep, gamma=0.5, alpha=0.1), {}),
    }


def _fit(name: str, bags, y):
    est, options = _estimators()[name]
    options = dict(options)
    target = (y > np.median(y)).astype(int) if options.pop("classes", False) else y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grid-edge warnings of a tiny problem
        return est.fit(bags, target, **options)


def _fitted_arrays(model) -> dict[str, np.ndarray]:
    return {
        k: np.asarray(v)
        for k, v in vars(model).items()
        if k.endswith("_") and isinstance(v, np.ndarray | float | int)
    }


@pytest.fixture
def spy(monkeypatch):
    """The sizes ``(len(A), len(B) or None)`` of every set-kernel Gram computed."""
    calls: list[tuple[int, int | None]] = []
    real = mean.set_kernel_gram

    def counting(A, B, *args, **kwargs):
        calls.append((len(A), None if B is None else len(B)))
        return real(A, B, *args, **kwargs)

    monkeypatch.setattr(mean, "set_kernel_gram", counting)
    return calls


@pytest.mark.parametrize("name", list(_estimators()))
def test_a_fit_computes_the_set_kernel_gram_once(name, data, spy):
    bags, _, y = data
    model = _fit(name, bags, y)
    assert spy == [(24, None)]  # one Gram among the training bags, nothing else
    # Nothing is kept past the fit: the model holds its embedding, not a T x T matrix.
    assert model.train_embedding_._products is None


@pytest.mark.parametrize("name", list(_estimators()))
def test_the_model_is_the_one_the_double_computation_gave(name, data, spy, monkeypatch):
    """Against the old path (no reuse: the Gram computed by each reader)."""
    bags, new, y = data
    model = _fit(name, bags, y)
    once = {**_fitted_arrays(model), "score": model.domain_check(new).score}
    once["predict"] = np.asarray(model.predict(new), dtype=float)

    @contextlib.contextmanager
    def no_reuse(self):
        yield self

    monkeypatch.setattr(Embedding, "reusing_products", no_reuse)
    spy.clear()
    old = _fit(name, bags, y)
    assert spy == [(24, None), (24, None)]  # the old path did compute it twice
    twice = {**_fitted_arrays(old), "score": old.domain_check(new).score}
    twice["predict"] = np.asarray(old.predict(new), dtype=float)
    assert once.keys() == twice.keys()
    for key in once:
        np.testing.assert_array_equal(once[key], twice[key], err_msg=key)


def test_the_domain_calibration_matches_a_naive_double_sum(data):
    bags, _, y = data
    model = _fit("ridge (gaussian, cv+)", bags, y)
    T = len(bags)
    G = np.array(
        [[np.exp(-cdist(a, b, "sqeuclidean") / (2 * SIGMA**2)).mean() for b in bags] for a in bags]
    )
    mmd2 = np.diag(G)[:, None] + np.diag(G)[None, :] - 2 * G
    loo, _ = knn_mean_distances(mmd2, model.domain_k_, leave_one_out=True)
    assert model.domain_scores_.shape == (T,)
    np.testing.assert_allclose(model.domain_scores_ * model.domain_scale_, loo, rtol=1e-9)


def test_reused_products_are_shared_read_only_and_dropped():
    emb = FeatureEmbedding(np.random.default_rng(0).normal(size=(6, 3)), "euclidean")
    outside = emb.sq_distances()
    assert outside.flags.writeable and emb.sq_distances() is not outside
    with emb.reusing_products():
        first = emb.sq_distances()
        with emb.reusing_products():  # nested: the outer block keeps them
            assert emb.sq_distances() is first
        assert emb.sq_distances() is first and not first.flags.writeable
        np.testing.assert_array_equal(first, outside)
        assert emb.inner() is emb.inner()
    assert emb._products is None and emb.sq_distances() is not first
