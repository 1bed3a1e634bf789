"""Which cells moved this prediction: per-cell contributions of bag-level models.

:func:`explain` takes a fitted :class:`~core.DistributionRidge`,
:class:`~core.DistributionRidgeClassifier` or :class:`~core.ConditionalMeanEmbedding`
(on bags) and one bag, and returns an :class:`Explanation`: each cell's signed
contribution to each output, the baseline, and summaries (by population, by marker,
top cells). Exact where the model is linear in the bag's measure, the first-order
influence of each cell otherwise (:mod:`.cells` gives both definitions). A per-cell
marginal-transfer model explains its own answer (the share of the sample's cells in
each class): :meth:`~core.MarginalTransferClassifier.explain`, which :func:`explain`
hands it to (:mod:`core.estimators.transfer.explain`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from sklearn.utils.validation import check_is_fitted

from ..bags import Bags, BagValidationError, as_bags
from .cells import cell_contributions
from .head import Head, head_of
from .result import Explanation, MarkerEffect, PopulationShare, TopCell

__all__ = [
    "Explanation",
    "MarkerEffect",
    "PopulationShare",
    "TopCell",
    "explain",
]


def _one_bag(bag: Any) -> Bags:
    """A :class:`Bags` of one bag, or a 2-D array of cells as one."""
    if not isinstance(bag, Bags):
        arr = np.asarray(bag, dtype=np.float64)
        bag = as_bags([arr]) if arr.ndim == 2 else as_bags(bag)
    if len(bag) != 1:
        raise BagValidationError([f"explain takes one bag, got {len(bag)}"])
    return bag


def _output_names(model: Any, k: int) -> list[str]:
    classes = getattr(model, "classes_", None)
    if classes is not None:
        return [str(c) for c in classes]
    return ["prediction"] if k == 1 else [str(j) for j in range(k)]


def explain(model: Any, bag: Any, *, markers: ArrayLike | None = None) -> Explanation:
    """Per-cell contributions to a bag-level model's prediction for one bag.

    Parameters
    ----------
    model : DistributionRidge, DistributionRidgeClassifier, ConditionalMeanEmbedding,
        MarginalTransferClassifier or MarginalTransferRegressor
        Fitted on bags (a conditional mean embedding needs a ``representation``); a
        marginal-transfer model answers with its own ``explain`` (``method="assignment"``,
        :mod:`core.estimators.transfer.explain`).
    bag : ndarray of shape (n_cells, d), or a Bags of one bag
        The cells as the model takes them (after any preprocessing the model's
        artifact applies).
    markers : sequence of str, optional
        Names of the ``d`` columns, for the summaries (``x0``, ``x1``, ... otherwise).

    Returns
    -------
    Explanation
        ``method="exact"`` when the model is linear in the bag's measure (mean
        embeddings, ``l2`` density features, with a linear kernel or a primal linear
        ridge): ``baseline + contributions.sum(axis=0) == prediction`` to rounding.
        ``method="influence"`` otherwise (Gaussian kernels, sliced-Wasserstein
        quantiles, density divergences): each cell's weight times the derivative of
        the model along the empirical measure towards it; removing cells ``S`` moves
        the prediction by about ``-(n/(n-|S|)) Σ_S c_x``. For a classifier the columns
        are the classes' ridge scores.

    Raises
    ------
    TypeError
        The model or its representation has no explanation (point inputs, histograms).
    """
    check_is_fitted(model)
    # Read off the fitted state, not the class (the estimators import this package).
    if getattr(model, "task_map_", None) is not None:
        return model.explain(bag, markers=markers)
    if getattr(model, "representation_", None) is None:
        raise TypeError(f"{type(model).__name__} without a bag representation has no cells")
    bags = _one_bag(bag)
    rep = model.representation_
    if bags.dim != rep.n_features_in_:
        raise BagValidationError(
            [f"the bag has {bags.dim} marker(s), the model takes {rep.n_features_in_}"]
        )
    heads: list[Head] = []

    def head_at(emb: Any) -> Head:
        heads.append(head_of(model, emb))
        return heads[-1]

    contributions, exact, head = cell_contributions(rep, bags, head_at)
    names = [str(m) for m in markers] if markers is not None else [f"x{j}" for j in range(bags.dim)]
    if len(names) != bags.dim:
        raise ValueError(f"got {len(names)} marker name(s) for {bags.dim} column(s)")
    total = contributions.sum(axis=0)
    baseline = head.intercept.copy() if exact else head.value - total
    return Explanation(
        method="exact" if exact else "influence",
        outputs=_output_names(model, head.value.size),
        prediction=head.value.copy(),
        baseline=baseline,
        contributions=contributions,
        points=bags.points,
        markers=names,
    )
