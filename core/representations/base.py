"""The representation protocol: bags → embeddings with a Hilbertian geometry.

A representation is a scikit-learn transformer that is *fitted* once (random
directions, quantile levels, frequencies or landmarks are drawn in ``fit`` and kept)
and then *embeds* any bags. An :class:`Embedding` knows two things about the bags it
holds, which is all the estimators need:

* :meth:`Embedding.sq_distances` — squared Hilbertian distances ``D²`` (``SW_2²``,
  ``SW_1`` or ``MMD²``); kernels on distributions are functions of these;
* :meth:`Embedding.inner` — inner products, for the linear and polynomial kernels.

Explicit representations produce a :class:`FeatureEmbedding` (a feature matrix plus
the geometry of its distance, Euclidean or ℓ1); the exact mean embedding produces a
point-based embedding that keeps the bags (see :mod:`core.representations.mean`).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.utils.validation import check_is_fitted

from ..bags import Bags, BagValidationError, as_bags
from ..kernels import (
    batch_invariant_matmul,
    cityblock_distances,
    squared_euclidean_distances,
)

__all__ = ["BagRepresentation", "Embedding", "FeatureEmbedding", "n_threads_for"]


def n_threads_for(n_jobs: int | None) -> int:
    """joblib's convention: ``None`` is 1, ``-1`` all cores, ``-2`` all but one."""
    if n_jobs is None:
        return 1
    if n_jobs < 0:
        return max(1, (os.cpu_count() or 1) + 1 + n_jobs)
    return max(1, int(n_jobs))


class Embedding(ABC):
    """Embedded bags: squared distances and inner products between them."""

    #: The matrices among these bags kept while :meth:`reusing_products` is open, by
    #: name (``"sq"``, ``"inner"``); ``None`` outside it (nothing is kept).
    _products: dict[str, NDArray[np.float64]] | None = None

    @abstractmethod
    def __len__(self) -> int: ...

    @contextmanager
    def reusing_products(self) -> Iterator[Embedding]:
        """Within the block, ``sq_distances()`` and ``inner()`` among these bags (no
        ``other``) are computed once each and returned read-only.

        A fit asks for the same ``T x T`` matrix more than once (the model's design,
        then the calibration of its domain check); for the exact mean embedding each
        costs ``O(N² n²)`` kernel evaluations. The matrices are dropped when the
        outermost block ends: a fitted model keeps its training embedding, and must not
        keep a ``T x T`` matrix alive (or saved) with it.
        """
        if self._products is not None:  # nested: the outer block keeps and drops them
            yield self
            return
        self._products = {}
        try:
            yield self
        finally:
            self._products = None

    def _reused(self, name: str, compute: Callable[[], NDArray[np.float64]]) -> NDArray[np.float64]:
        """``compute()``, or its result kept under ``name`` in a :meth:`reusing_products`
        block. A kept matrix is read-only: every reader gets the same array, so one that
        wrote into it would change what the others read."""
        products = self._products
        if products is None:
            return compute()
        value = products.get(name)
        if value is None:
            value = compute()
            value.flags.writeable = False
            products[name] = value
        return value

    @abstractmethod
    def sq_distances(self, other: Embedding | None = None) -> NDArray[np.float64]:
        """Squared Hilbertian distances, shape ``(len(self), len(other))``.

        With ``other=None`` the result is the symmetric matrix among ``self``, with an
        exactly zero diagonal.
        """

    @abstractmethod
    def inner(self, other: Embedding | None = None) -> NDArray[np.float64]:
        """Inner products in the embedding space, shape ``(len(self), len(other))``."""


class FeatureEmbedding(Embedding):
    """Explicit feature vectors whose Euclidean or ℓ1 distance is the bag distance.

    Parameters
    ----------
    features : ndarray of shape (T, D)
    geometry : {"euclidean", "l1"}
        ``"euclidean"``: ``D² = ‖a - b‖₂²`` (``SW_2²``, ``MMD²`` of explicit features).
        ``"l1"``: ``D² = ‖a - b‖₁`` (``SW_1``; ``√SW_1`` is the Hilbertian distance).
        For ``"l1"`` the inner product is taken with the zero vector as origin,
        ``½(‖a‖₁ + ‖b‖₁ - ‖a - b‖₁)``.
    """

    def __init__(self, features: NDArray[np.float64], geometry: Literal["euclidean", "l1"]):
        if geometry not in ("euclidean", "l1"):
            raise ValueError(f"geometry must be 'euclidean' or 'l1', got {geometry!r}")
        self.features = np.ascontiguousarray(features, dtype=np.float64)
        self.geometry = geometry
        self._sqnorms: NDArray[np.float64] | None = None

    def sqnorms(self) -> NDArray[np.float64]:
        """``‖a‖²`` of every row, computed once: a model's training embedding is compared
        with every new bag."""
        if self._sqnorms is None:
            self._sqnorms = np.einsum("ij,ij->i", self.features, self.features)
        return self._sqnorms

    def __len__(self) -> int:
        return int(self.features.shape[0])

    def _other(self, other: Embedding | None) -> FeatureEmbedding | None:
        if other is None:
            return None
        if not isinstance(other, FeatureEmbedding) or other.geometry != self.geometry:
            raise TypeError("both embeddings must come from the same fitted representation")
        if other.features.shape[1] != self.features.shape[1]:
            raise ValueError(
                f"feature lengths differ: {self.features.shape[1]} vs {other.features.shape[1]}"
            )
        return other

    def sq_distances(self, other: Embedding | None = None) -> NDArray[np.float64]:
        o = self._other(other)
        if o is None:
            if self.geometry == "euclidean":
                return self._reused("sq", lambda: squared_euclidean_distances(self.features))
            return self._reused("sq", lambda: cityblock_distances(self.features))
        if self.geometry == "l1":
            return cityblock_distances(self.features, o.features)
        # Row by row in effect (batch_invariant_matmul): new bags never change each other.
        a2 = np.einsum("ij,ij->i", self.features, self.features)
        b2 = o.sqnorms()
        D = batch_invariant_matmul(self.features, o.features.T)
        D *= -2.0
        D += a2[:, None]
        D += b2[None, :]
        return np.maximum(D, 0.0, out=D)

    def inner(self, other: Embedding | None = None) -> NDArray[np.float64]:
        o = self._other(other)
        B = self.features if o is None else o.features
        if self.geometry == "euclidean":
            if o is None:
                return self._reused("inner", lambda: self.features @ B.T)
            return batch_invariant_matmul(self.features, B.T)
        na = np.abs(self.features).sum(axis=1)
        nb = np.abs(B).sum(axis=1)
        return 0.5 * (na[:, None] + nb[None, :] - self.sq_distances(other))


class BagRepresentation(TransformerMixin, BaseEstimator, ABC):
    """Base class of bag representations (scikit-learn transformers on bags).

    Subclasses implement :meth:`_fit` (draw and store the random state of the map,
    attributes ending in ``_``) and :meth:`embed`. ``fit`` accepts a :class:`~core.Bags`,
    a list of 2-D arrays, or a 3-D array.
    """

    def fit(self, X: Any, y: Any = None) -> BagRepresentation:
        """Learn the representation's random draws and data-dependent scales."""
        bags = as_bags(X)
        self.n_features_in_ = bags.dim
        self._fit(bags)
        return self

    @abstractmethod
    def _fit(self, bags: Bags) -> None: ...

    def data_dependence(self) -> str | None:
        """Why :meth:`fit` needs the training cells, or ``None`` if it reads only their
        dimension (random draws and fixed scales).

        Training that featurises bags where they are read (:mod:`core.streaming`) fits
        the representation before any cell is seen, which only a data-free fit allows.
        """
        return "its fit learns from the training cells"

    def fit_to_dimension(self, dim: int) -> BagRepresentation:
        """Fit a data-free representation (see :meth:`data_dependence`) for ``dim`` markers.

        The result is the same as :meth:`fit` on any bags with ``dim`` columns.
        """
        reason = self.data_dependence()
        if reason is not None:
            raise ValueError(f"{type(self).__name__} cannot be fitted without data: {reason}")
        # Only the dimension is read by a data-free fit: one cell of zeros stands in.
        return self.fit(Bags(np.zeros((1, int(dim))), np.array([0, 1]), validate=False))

    @abstractmethod
    def embed(self, X: Any) -> Embedding:
        """Embed bags with the fitted map."""

    def transform(self, X: Any) -> NDArray[np.float64]:
        """Explicit feature vectors, shape ``(n_bags, n_output_features)``."""
        emb = self.embed(X)
        if not isinstance(emb, FeatureEmbedding):
            raise TypeError(
                f"{type(self).__name__} with these parameters has no finite feature vector; "
                "use embed() and the estimators, or an explicit method"
            )
        return emb.features

    def _validated_bags(self, X: Any) -> Bags:
        check_is_fitted(self)
        bags = as_bags(X)
        if bags.dim != self.n_features_in_:
            raise BagValidationError(
                [
                    f"bags have {bags.dim} feature column(s) but {type(self).__name__} "
                    f"was fitted on {self.n_features_in_}"
                ]
            )
        return bags
