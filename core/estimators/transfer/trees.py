"""Gradient-boosted trees, the invariant fallback's axis-aligned member (classifiers).

Gates are drawn as thresholds and polygons on one or two markers at a time, and the
cells no gate claims are whatever lies outside them: on such labels a model of
axis-aligned splits can carry over to a new batch better than a smooth kernel does
(FlowSOM's gated sample, ``bench/bench_new_batch.py``). The fallback takes them where
its folds show it clearly (:func:`~.fallback.choose_trees`).

The trees are fitted by scikit-learn's histogram gradient boosting and kept as plain
arrays (:func:`fit_trees`), so that a model stores them without pickle; answering
rebuilds scikit-learn's compiled tree predictors from those arrays after checking them
(:func:`check_trees`), since a stored model is input like any other.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ...bags import Bags, subsample_rows
from ...errors import BagValidationError

__all__ = [
    "TREE_PARAMETERS",
    "TREE_POINTS",
    "check_trees",
    "class_codes",
    "fit_task_trees",
    "fit_trees",
    "tree_scores",
]

#: The boosting fitted: scikit-learn's, 50 rounds at a learning rate of 0.2, with
#: XGBoost's default unit L2 penalty on leaf values and no early stopping. Measured on
#: ``bench/bench_new_batch.py``'s FlowSOM cells: without the penalty a leaf of few
#: cells took a large value and a fold whose held-out samples differed most erred on
#: 22 to 26 % of the cells (5 % with it); early stopping, on a seeded tenth of the
#: training cells, stopped after 38 rounds in one run and labelled the new batch at
#: 0.937 against 0.958 after 100. Fifty rounds at twice the rate labelled the FlowSOM
#: and GvHD emulations' new batches as 100 at 0.1 did (within 0.001, issue 44) in
#: half the time.
TREE_PARAMETERS: dict[str, Any] = {
    "max_iter": 50,
    "learning_rate": 0.2,
    "early_stopping": False,
    "l2_regularization": 1.0,
}

#: The node fields kept: name here -> (scikit-learn's predictor record field, dtype).
_FIELDS: dict[str, tuple[str, type]] = {
    "value": ("value", np.float64),
    "feature": ("feature_idx", np.int64),
    "threshold": ("num_threshold", np.float64),
    "nan_left": ("missing_go_to_left", np.bool_),
    "left": ("left", np.int64),
    "right": ("right", np.int64),
    "leaf": ("is_leaf", np.bool_),
}

#: Cells of each training task the trees are fitted on, a seeded draw where a task has
#: more (:func:`~core.bags.subsample_rows`): it bounds a fit, linear in the cells, at
#: 20,000 a sample (a cohort of 10^6-cell samples would otherwise fit every fold on all
#: of them). The benchmarks' samples (3,000 cells) are fitted whole.
TREE_POINTS = 20_000


def class_codes(Y: NDArray[np.float64]) -> NDArray[np.int64]:
    """Class codes of ±1-coded targets: the sign of the one column for two classes,
    else the column of the +1."""
    if Y.shape[1] == 1:
        return (Y[:, 0] > 0).astype(np.int64)
    return np.argmax(Y, axis=1).astype(np.int64)


def fit_trees(points: NDArray[np.float64], Y: NDArray[np.float64], seed: int) -> dict[str, Any]:
    """Boosted trees on ``points`` for ±1-coded targets ``Y``, as arrays.

    Returns
    -------
    dict
        Per node of all trees (trees one after another, iterations outer, classes
        inner): ``value``, ``feature``, ``threshold``, ``nan_left``, ``left``,
        ``right`` (indices within the tree), ``leaf``; ``tree_offsets`` (first node of
        each tree, and the total), ``classes`` (the class codes the trees score, in
        order; one code means a constant answer), ``baseline`` (the raw score before
        the first tree, per scored class or one for two classes) and ``n_outputs`` (the
        columns of ``Y``).
    """
    from sklearn.ensemble import HistGradientBoostingClassifier

    codes = class_codes(Y)
    present = np.unique(codes)
    out: dict[str, Any] = {"n_outputs": int(Y.shape[1])}
    if present.size < 2:
        nodes: list[Any] = []
        baseline = np.zeros(1)
    else:
        model = HistGradientBoostingClassifier(**TREE_PARAMETERS, random_state=seed)
        model.fit(points, codes)
        nodes = [p.nodes for it in model._predictors for p in it]
        baseline = np.asarray(model._baseline_prediction, dtype=np.float64).ravel()
    sizes = np.array([n.size for n in nodes], dtype=np.int64)
    out["tree_offsets"] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    flat = np.concatenate(nodes) if nodes else None
    for name, (field, dtype) in _FIELDS.items():
        out[name] = np.zeros(0, dtype) if flat is None else flat[field].astype(dtype)
    if flat is not None and flat["is_categorical"].any():  # pragma: no cover - never asked
        raise ValueError("categorical splits are not kept")
    out["classes"] = present.astype(np.int64)
    out["baseline"] = baseline
    return out


def fit_task_trees(
    tasks: Bags, Y: NDArray[np.float64], seed: int, which: Any = None
) -> dict[str, Any]:
    """:func:`fit_trees` on the cells of tasks ``which`` (default: all), at most
    :data:`TREE_POINTS` of each, drawn as :func:`~core.bags.subsample_bags` draws them
    (from the cells alone: a task gives the same ones in every fold and the final fit)."""
    if which is not None:
        which = np.asarray(which)
        Y = Y[np.concatenate([np.arange(tasks.offsets[t], tasks.offsets[t + 1]) for t in which])]
        tasks = tasks[which]
    rows = subsample_rows(tasks, TREE_POINTS, seed)
    return fit_trees(tasks.points[rows], Y[rows], seed)


def check_trees(trees: dict[str, Any], n_features: int) -> None:
    """Refuse stored trees the compiled predictor could read out of bounds or loop in.

    Every tree's nodes are numbered parents first (children after their parent, within
    the tree), split on a feature that exists; the class codes are in range.

    Raises
    ------
    BagValidationError
        What is wrong with the stored trees.
    """
    problems: list[str] = []
    try:
        offsets = np.asarray(trees["tree_offsets"], dtype=np.int64)
        n = int(offsets[-1]) if offsets.size else 0
        arrays = {k: np.asarray(trees[k]) for k in _FIELDS}
        classes = np.asarray(trees["classes"], dtype=np.int64)
        baseline = np.asarray(trees["baseline"], dtype=np.float64)
        n_outputs = int(trees["n_outputs"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise BagValidationError([f"stored trees are incomplete: {exc}"]) from exc
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 1):
        problems.append("tree offsets must start at 0 and grow by at least one node per tree")
    if any(a.shape != (n,) for a in arrays.values()):
        problems.append(f"every node field must hold {n} nodes")
    n_classes = max(n_outputs, 2)
    if classes.ndim != 1 or classes.size < 1 or np.any((classes < 0) | (classes >= n_classes)):
        problems.append(f"class codes must lie in [0, {n_classes})")
    per_iteration = 1 if classes.size <= 2 else classes.size
    trees_n = offsets.size - 1
    if classes.size >= 2 and (trees_n % per_iteration or baseline.size != per_iteration):
        problems.append("the trees do not come in whole iterations of the classes")
    if problems:
        raise BagValidationError([f"stored trees: {p}" for p in problems])
    if n == 0:
        return
    owner = np.repeat(np.arange(trees_n), np.diff(offsets))
    local = np.arange(n) - offsets[owner]
    size = np.diff(offsets)[owner]
    inner = ~arrays["leaf"].astype(bool)
    left, right = arrays["left"].astype(np.int64), arrays["right"].astype(np.int64)
    feature = arrays["feature"].astype(np.int64)
    bad = inner & (
        (left <= local) | (right <= local) | (left >= size) | (right >= size)
        | (feature < 0) | (feature >= n_features)
    )  # fmt: skip
    if bad.any() or not np.all(np.isfinite(arrays["value"])):
        raise BagValidationError(
            [
                "stored trees: a node points outside its tree, back to an earlier node, "
                "or to a feature the model does not have, or a leaf value is not finite"
            ]
        )


def _predictors(trees: dict[str, Any]) -> list[Any]:
    """scikit-learn's compiled predictors of the stored trees, in order."""
    from sklearn.ensemble._hist_gradient_boosting.common import PREDICTOR_RECORD_DTYPE
    from sklearn.ensemble._hist_gradient_boosting.predictor import TreePredictor

    offsets = np.asarray(trees["tree_offsets"], dtype=np.int64)
    nodes = np.zeros(int(offsets[-1]), dtype=PREDICTOR_RECORD_DTYPE)
    for name, (field, _) in _FIELDS.items():
        nodes[field] = trees[name]
    no_categories = np.zeros((0, 8), dtype=np.uint32)
    return [
        TreePredictor(nodes[lo:hi].copy(), no_categories, no_categories)
        for lo, hi in pairwise(offsets)
    ]


def tree_scores(trees: dict[str, Any], points: NDArray[np.float64]) -> NDArray[np.float64]:
    """Scores of ``points`` (n, d) in the models' ±1 coding: ``2 p - 1`` from the trees'
    class probabilities ``p`` (−1 for a class the trees never saw), one column for two
    classes (positive means the second)."""
    from sklearn.utils._openmp_helpers import _openmp_effective_n_threads

    X = np.ascontiguousarray(points, dtype=np.float64)
    check_trees(trees, X.shape[1])
    classes = np.asarray(trees["classes"], dtype=np.int64)
    n_outputs = int(trees["n_outputs"])
    probs = np.ones((X.shape[0], 1))
    if classes.size >= 2:
        baseline = np.asarray(trees["baseline"], dtype=np.float64)
        raw = np.tile(baseline, (X.shape[0], 1))
        k = baseline.size
        no_categories = np.zeros((0, 8), dtype=np.uint32)
        f_idx_map = np.zeros(X.shape[1], dtype=np.uint32)
        # Cells in parallel, as many OpenMP threads as allowed here (one in a service
        # worker); each cell's sum over the trees is the same whatever the count.
        threads = _openmp_effective_n_threads()
        for i, predictor in enumerate(_predictors(trees)):
            raw[:, i % k] += predictor.predict(X, no_categories, f_idx_map, threads)
        if k == 1:
            p1 = 1.0 / (1.0 + np.exp(-raw[:, 0]))
            probs = np.column_stack([1.0 - p1, p1])
        else:
            raw -= raw.max(axis=1, keepdims=True)
            np.exp(raw, out=raw)
            probs = raw / raw.sum(axis=1, keepdims=True)
    full = np.zeros((X.shape[0], max(n_outputs, 2)))
    full[:, classes] = probs
    scores = 2.0 * full - 1.0
    return scores[:, 1:2] if n_outputs == 1 else scores
