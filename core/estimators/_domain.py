"""The applicability-domain check of the bag-level estimators (see :mod:`core.domain`).

A mixin: at fit the estimator hands its training embedding to :meth:`_fit_domain`,
which stores the calibration as fitted attributes (and the embedding itself where the
model does not keep it for prediction); :meth:`domain_check` then answers for new bags,
or for bags already embedded, so that a prediction embeds each bag once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..domain import K_NEAREST, DomainCalibration, DomainReport, knn_mean_distances
from ..representations.base import Embedding, FeatureEmbedding

__all__ = ["DomainCheckMixin"]

#: Training bags per block when their leave-one-out distances are computed: bounds the
#: memory to a block of rows instead of the T x T matrix (primal models of many bags).
_ROWS = 1024


def _loo_distances(
    emb: Embedding, k: int, groups: NDArray[np.int64] | None = None
) -> NDArray[np.float64]:
    """Each training bag's mean distance to its ``k`` nearest other training bags (with
    ``groups``, bags of other groups only: a subject's other bags would make its bags
    look typical)."""
    T = len(emb)
    out = np.empty(T)
    step = T if T <= _ROWS or not isinstance(emb, FeatureEmbedding) else _ROWS
    full = None if step < T else emb.sq_distances()
    for start in range(0, T, step):
        rows = np.arange(start, min(T, start + step))
        if full is not None:
            sq = full.copy()
        else:
            assert isinstance(emb, FeatureEmbedding)
            sq = FeatureEmbedding(emb.features[rows], emb.geometry).sq_distances(emb)
        sq[np.arange(rows.size), rows] = np.inf  # each row skips itself
        if groups is not None:
            sq[groups[rows][:, None] == groups[None, :]] = np.inf
        out[rows] = knn_mean_distances(sq, k)[0]
    return out


class DomainCheckMixin:
    """``domain_check`` for estimators with ``representation_`` and a training embedding.

    The host sets ``train_embedding_`` (``None`` when it predicts without it), and
    optionally ``kernel_`` and ``gamma_`` (a radial kernel on squared distances, whose
    values become the report's similarities).
    """

    representation_: Any
    train_embedding_: Embedding | None

    def _fit_domain(self, emb: Embedding, groups: NDArray[np.int64] | None = None) -> None:
        """Calibrate the domain check on the training embedding (call at the end of fit).

        With ``groups`` each training bag is scored against the other groups' bags: the
        threshold then says how far a new subject lies, not a new bag of a known one.
        """
        k = max(1, min(K_NEAREST, len(emb) - 1))
        if groups is not None:
            others = len(emb) - np.bincount(groups).max()
            k = max(1, min(k, others))
        calibration = DomainCalibration.fit(_loo_distances(emb, k, groups), k)
        for name, value in calibration.to_state().items():
            setattr(self, name, value)
        # Kept only where prediction does not keep it already (primal models).
        self.domain_embedding_ = emb if self.train_embedding_ is None else None

    def _sq_to_training(self, emb: Embedding, train: Embedding) -> NDArray[np.float64]:
        """Squared distances from ``emb`` to ``train``, kept for the last embedding asked:
        a prediction and its domain check compare the same bags with the same training
        bags, and this product is most of the cost of both."""
        cached = getattr(self, "_last_distances", None)
        if cached is not None and cached[0] is emb and cached[1] is train:
            return cached[2]
        sq = emb.sq_distances(train)
        # The embeddings are kept with the result, so their ids cannot be reused.
        self._last_distances = (emb, train, sq)
        return sq

    def _embedding(self, X: Any) -> Embedding:
        """Bags embedded by ``representation_`` (an embedding is taken as it is)."""
        return X if isinstance(X, Embedding) else self.representation_.embed(X)

    def _domain_training(self) -> Embedding | None:
        train = self.train_embedding_
        return train if train is not None else getattr(self, "domain_embedding_", None)

    def domain_check(self, X: Any) -> DomainReport | None:
        """How far each bag lies from the training bags (:class:`~core.domain.DomainReport`).

        Parameters
        ----------
        X : Bags, list of 2-D arrays, or Embedding
            New bags, or bags already embedded by ``representation_``.

        Returns
        -------
        DomainReport or None
            ``None`` for a model saved before the check existed that kept no training
            embedding.
        """
        train = self._domain_training()
        if train is None:
            return None
        emb = self._embedding(X)
        calibration = DomainCalibration.from_state(self)
        if calibration is None:  # fitted before the check existed: calibrate now
            k = max(1, min(K_NEAREST, len(train) - 1))
            calibration = DomainCalibration.fit(_loo_distances(train, k), k)
        kernel = getattr(self, "kernel_", None)
        similarity = None
        if kernel is not None and not kernel.uses_inner_product:
            gamma = getattr(self, "gamma_", None)
            similarity = lambda sq: kernel(sq, gamma)  # noqa: E731 - a one-line closure
        return calibration.report(self._sq_to_training(emb, train), similarity)
