"""Pivoted incomplete Cholesky: the rows a low-rank factor of a kernel matrix keeps.

The conditional mean embedding's sparse variant (:meth:`.cme.ConditionalMeanEmbedding.
sparsify`, :meth:`~.cme.ConditionalMeanEmbedding.restrict`) starts from these pivots;
re-exported by :mod:`.cme` and the estimators package.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["incomplete_cholesky"]


def incomplete_cholesky(K: ArrayLike, rank: int, tol: float = 1e-12) -> NDArray[np.int64]:
    """Pivots of the pivoted incomplete Cholesky factorisation ``K ≈ G Gᵀ`` (greedy on
    the largest residual diagonal; Shawe-Taylor & Cristianini 2004, §5.2).

    Returns the chosen indices, in order, stopping early when the residual trace
    falls below ``tol`` times the trace.
    """
    K = np.asarray(K, dtype=np.float64)
    n = K.shape[0]
    rank = min(int(rank), n)
    G = np.zeros((n, rank))
    diag = K.diagonal().copy()
    total = float(diag.sum())
    pivots: list[int] = []
    for j in range(rank):
        i = int(np.argmax(diag))
        if diag[i] <= tol * total:
            break
        pivots.append(i)
        G[:, j] = (K[:, i] - G[:, :j] @ G[i, :j]) / np.sqrt(diag[i])
        diag -= G[:, j] ** 2
        diag[pivots] = 0.0
    return np.asarray(pivots, dtype=np.int64)
