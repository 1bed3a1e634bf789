"""The training search shares what its candidates compute alike, and answers the same.

The folds' preprocessed bags, and a bag-level model's fitted representation and
embeddings (with their ``T x T`` products), are computed once per fold for the whole
search (:class:`core.training.folds.FoldCache`); the widening of an estimator's own
grid cross-validates again on them. Every out-of-fold prediction must be bit for bit
the one the fit-from-bags path (the code before the cache, written out here) gives.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from bagserve.core import DistributionRidge, DistributionRidgeClassifier, SlicedWasserstein
from bagserve.core.datasets import make_dose_response_bags
from bagserve.core.estimators._ridge_calibration import for_point_predictions
from bagserve.core.io import Preprocessing
from bagserve.core.training.folds import FoldCache
from bagserve.core.training.folds import cv_predictions as _cv_predictions
from sklearn.base import clone
from sklearn.model_selection import KFold

PRE = {"transform": "arcsinh", "cofactor": 150.0, "scale": "standard"}


def _fit_from_bags(est, bags, y, folds, markers):
    """The out-of-fold predictions as training made them before the cache."""
    pred = np.empty(y.shape, dtype=object if y.dtype.kind in "OUS" else np.float64)
    for train, val in folds:
        pre = Preprocessing(**PRE).fit(bags[train], markers)
        model = for_point_predictions(est)
        model.fit(pre.apply(bags[train], markers), y[train])
        pred[val] = model.predict(pre.apply(bags[val], markers))
    return pred


@pytest.fixture(scope="module")
def data():
    bags, y, markers = make_dose_response_bags(21, 200, random_state=0)
    folds = list(KFold(7, shuffle=True, random_state=0).split(np.zeros(len(bags))))
    return bags, y, markers, folds


def _candidates(cls=DistributionRidge):
    base = cls(
        kernel="gaussian",
        random_state=0,
        representation=SlicedWasserstein(n_directions=10, n_levels=10),
    )
    first = [clone(base).set_params(representation__p=p) for p in (1, 2)]
    # The widening refit: the kept candidate with its own grids moved.
    widened = clone(first[0]).set_params(
        gamma=list(np.logspace(-6, 0, 7)), alpha=[1e-12, 1e-9, 1e-6]
    )
    return [*first, widened]


@pytest.mark.parametrize("classifier", [False, True])
def test_shared_folds_predict_as_fits_from_bags(data, classifier):
    bags, y, markers, folds = data
    cls = DistributionRidgeClassifier if classifier else DistributionRidge
    labels = np.where(y > np.median(y), "high", "low") if classifier else y
    cache = FoldCache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            shared = [
                _cv_predictions(est, bags, labels, folds, False, PRE, markers, cache=cache)
                for est in _candidates(cls)
            ]
            # One representation per fold and p: the widening refit embedded nothing anew.
            assert len(cache._embedded) == 2 * len(folds)
        finally:
            cache.close()
        alone = [_fit_from_bags(est, bags, labels, folds, markers) for est in _candidates(cls)]
    for got, want in zip(shared, alone, strict=True):
        assert np.array_equal(got, want)


def test_close_drops_the_kept_products(data):
    bags, y, markers, folds = data
    cache = FoldCache()
    est = _candidates()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _cv_predictions(est, bags, y, folds[:1], False, PRE, markers, cache=cache)
    (_, emb_tr, _), *_ = cache._embedded.values()
    assert emb_tr._products  # kept between candidates
    cache.close()
    assert emb_tr._products is None


def test_unseeded_representation_is_not_shared(data):
    bags, y, markers, folds = data
    est = DistributionRidge(representation=SlicedWasserstein(n_directions=5, n_levels=5))
    cache = FoldCache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _cv_predictions(est, bags, y, folds[:1], False, PRE, markers, cache=cache)
    # Each fit draws its own directions: sharing one draw would change the model.
    assert cache._embedded == {}
    cache.close()


def test_final_fits_share_the_embedding_of_every_bag(data):
    from bagserve.core.training.fit_memory import _InMemorySearch

    bags, y, markers, folds = data
    searcher = _InMemorySearch(bags, y, folds, False, PRE, markers, progress=False)
    edge, widened = _candidates()[0], _candidates()[2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            shared = [searcher.fit_final(clone(est)) for est in (edge, widened)]
            assert len(searcher.fold_cache._embedded) == 1
        finally:
            searcher.fold_cache.close()
        pre = Preprocessing(**PRE).fit(bags, markers)
        alone = [clone(est).fit(pre.apply(bags, markers), y) for est in (edge, widened)]
    for s, a in zip(shared, alone, strict=True):
        assert s.gamma_ == a.gamma_ and s.alpha_ == a.alpha_
        assert np.array_equal(s.selection_["score"], a.selection_["score"], equal_nan=True)
        assert np.array_equal(s.predict(bags), a.predict(bags))
        # Nothing T x T stays attached to the model once the search is over.
        assert s.train_embedding_._products is None
