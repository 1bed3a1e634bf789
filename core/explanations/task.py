"""The sample-context part of a per-cell model: how each cell moves the task embedding's share.

A marginal-transfer model (paper 004) scores a cell ``y`` of task ``P`` with a product
kernel, ``f(P, y) = Σ_j β_j k_X(y, x_j) (τ + (1 - τ) k_P(P, P_j))``: the sample enters only
through the task kernel ``k_P``, a kernel ``κ`` on the representation's embedding of the
task. For any fixed choice of cells ``y`` (one cell, a population, every cell) the
sample-context part is therefore ``s(P) = Σ_j a_j κ(Φ(P), Φ(P_j))`` with
``a_j = (1 - τ) Σ_i β_i k_X(y, x_i)`` over the points ``x_i`` of training task ``j``
(or, for a Nyström task map ``ψ(P) = Λ^{-1/2} Uᵀ k_P(P_train, P)``, ``a = U Λ^{-1/2} w``
folded back onto the training tasks). The estimator knows its ``a``; this module knows
how a cell of the new task moves ``s``, by the rules of :mod:`.cells`, without reaching
into any estimator's state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from ..bags import BagValidationError, as_bags
from ..kernels import get_kernel
from ..representations.base import BagRepresentation, Embedding
from .cells import cell_contributions
from .head import Head, _dual_head
from .result import Explanation

__all__ = ["task_embedding_contributions"]


def task_embedding_contributions(
    representation: BagRepresentation,
    bag: Any,
    train_embedding: Embedding,
    coef: ArrayLike,
    *,
    kernel: str = "gaussian",
    gamma: float | None = None,
    kernel_params: dict[str, Any] | None = None,
    outputs: list[str] | None = None,
    markers: list[str] | None = None,
) -> Explanation:
    """Per-cell contributions to the sample-context part ``s(P) = Σ_j a_j κ(Φ(P), Φ_j)``.

    Parameters
    ----------
    representation : BagRepresentation
        The fitted task representation (its ``embed`` gives ``Φ``).
    bag : ndarray of shape (n_cells, d)
        The new task's cells, as the task representation takes them.
    train_embedding : Embedding
        ``Φ_j`` of the training tasks, by ``representation``.
    coef : array-like of shape (T,) or (T, k)
        ``a_j``, what the model multiplies task ``j``'s kernel value by (per output).
    kernel, gamma, kernel_params
        The task kernel ``κ`` on the embedding (:func:`~core.kernels.get_kernel`).
    outputs, markers : list of str, optional
        Names of the outputs and of the cells' columns.

    Returns
    -------
    Explanation
        ``prediction`` is ``s(P)``; ``method`` as for :func:`~core.explanations.explain`
        (exact for a linear task kernel on a representation linear in the measure).
    """
    bags = as_bags([np.asarray(bag, dtype=np.float64)])
    if bags.dim != representation.n_features_in_:
        raise BagValidationError(
            [
                f"the task has {bags.dim} column(s), the representation takes "
                f"{representation.n_features_in_}"
            ]
        )
    a = np.asarray(coef, dtype=np.float64)
    a = a[:, None] if a.ndim == 1 else a
    if a.shape[0] != len(train_embedding):
        raise ValueError(f"got {a.shape[0]} coefficient row(s) for {len(train_embedding)} tasks")
    kern = get_kernel(kernel, kernel_params)

    def head_at(emb: Embedding) -> Head:
        base = (
            emb.inner(train_embedding)[0]
            if kern.uses_inner_product
            else emb.sq_distances(train_embedding)[0]
        )
        return _dual_head(emb, train_embedding, kern, gamma, a, np.zeros(a.shape[1]), base)

    contributions, exact, head = cell_contributions(representation, bags, head_at)
    k = a.shape[1]
    total = contributions.sum(axis=0)
    return Explanation(
        method="exact" if exact else "influence",
        outputs=outputs or (["context"] if k == 1 else [str(j) for j in range(k)]),
        prediction=head.value.copy(),
        baseline=head.intercept.copy() if exact else head.value - total,
        contributions=contributions,
        points=bags.points,
        markers=markers or [f"x{j}" for j in range(bags.dim)],
    )
