"""Cross-validation folds, and the out-of-fold predictions made on them.

The folds (``[cv]``: ``n_splits``, ``repeats``, ``seed``) leave out one batch at a time
when the data have batches, whole subjects when they have groups, whole tasks (bags) for
a per-cell model, and otherwise bags, stratified by class for a classifier where every
class is frequent enough. :func:`cv_predictions` predicts every bag (or cell) with a
model, preprocessing included, fitted without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.model_selection import KFold, StratifiedKFold

from ..bags import Bags
from ..errors import ConfigError
from ..estimators._ridge_calibration import for_point_predictions
from ..io import Preprocessing
from ..selection import group_folds, leave_one_group_out_folds, leave_tasks_out_folds
from .groups import groups_kw


def make_folds(
    config: Mapping[str, Any],
    n_bags: int,
    y: np.ndarray | None,
    classifier: bool,
    cell_level: bool,
    batches: np.ndarray | None = None,
    subjects: np.ndarray | None = None,
):
    if batches is not None and np.unique(batches).size > 1:
        # A model for new batches is judged on batches it has not seen.
        return leave_one_group_out_folds(batches)
    cv = dict(config.get("cv", {}))
    n_splits = int(cv.get("n_splits", 5))
    repeats = int(cv.get("repeats", 1))
    seed = int(cv.get("seed", 0))
    if subjects is not None:
        # Whole subjects per fold: a subject's other bags must not vouch for it.
        n_subjects = np.unique(subjects).size
        if n_splits < 2:
            raise ConfigError(f"[cv] n_splits must be 2 or more, got {n_splits}")
        folds = []
        for r in range(repeats):
            fold = group_folds(subjects, n_bags, min(n_splits, n_subjects), seed + r)
            folds += [
                (np.flatnonzero(fold != f), np.flatnonzero(fold == f))
                for f in range(int(fold.max()) + 1)
            ]
        return folds
    if n_splits < 2 or n_splits > n_bags:
        raise ConfigError(
            f"[cv] n_splits must be between 2 and the number of bags ({n_bags}), got {n_splits}"
        )
    if cell_level:
        return leave_tasks_out_folds(n_bags, n_splits, repeats, seed)
    folds = []
    for r in range(repeats):
        if classifier:
            _, counts = np.unique(y, return_counts=True)
            if counts.min() >= n_splits:
                splitter = StratifiedKFold(n_splits, shuffle=True, random_state=seed + r)
                folds += list(splitter.split(np.zeros(n_bags), y))
                continue
        folds += list(KFold(n_splits, shuffle=True, random_state=seed + r).split(np.zeros(n_bags)))
    return folds


def _in_columns(scores: np.ndarray, known: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """A fold model's one-vs-rest scores in the columns of every class of the data.

    A fold whose training samples lack a class (a rare population in a few samples)
    has a model without it: its scores sit in that model's classes' columns, and a
    class it cannot give scores ``-1``, the ``±1`` coding's "not this class". Its
    one margin for two classes is ``(-s, s)``."""
    out = np.full((scores.shape[0], classes.size), -1.0)
    cols = np.searchsorted(classes, known)
    out[:, cols] = np.column_stack([-scores, scores]) if scores.ndim == 1 else scores
    return out


class FoldCache:
    """What every candidate of one search computes alike on a fold, computed once.

    A search cross-validates several candidates on the same folds with the same
    preprocessing, and the widening of an estimator's own grid (``gamma=[...]``,
    ``alpha=[...]``) cross-validates the kept candidate once more with only those
    grids changed. Kept per fold: the preprocessed bags, and for a bag-level model
    with a seeded (so deterministic) representation the fitted representation and
    both embeddings, whose ``T x T`` products stay computed (:meth:`close` drops
    them). Each fit then gets what it would have computed itself: same models, same
    predictions.
    """

    def __init__(self) -> None:
        self._bags: dict[int, tuple[Bags, Bags]] = {}
        self._pre: dict[int, Preprocessing] = {}
        self._embedded: dict[tuple[int, str], tuple[Any, Any, Any]] = {}
        self._stack = ExitStack()

    def bags(
        self,
        i: int,
        raw: Bags,
        train: np.ndarray,
        val: np.ndarray,
        pre_spec: Mapping[str, Any],
        markers: list[str],
    ) -> tuple[Bags, Bags]:
        """Fold ``i``'s training and validation bags, preprocessed as fitted on its
        training bags."""
        if i not in self._bags:
            pre = Preprocessing(**pre_spec).fit(raw[train], markers)
            self._bags[i] = pre.apply(raw[train], markers), pre.apply(raw[val], markers)
            self._pre[i] = pre
        return self._bags[i]

    def control(self, i: int, control: Bags | None, markers: list[str]) -> dict[str, Any]:
        """The ``control=`` keyword of fold ``i``'s fit: the training batch's reference
        control preprocessed as the fold's bags (after :meth:`bags`), or nothing."""
        if control is None:
            return {}
        return {"control": self._pre[i].apply(control, markers).points}

    def embedded(self, i: int | str, model: BaseEstimator, bags_tr: Bags, bags_va: Bags | None):
        """Fold ``i``'s fitted representation and embeddings for ``model`` (``i="all"``,
        ``bags_va=None``: the final fit's on every bag), or ``None`` when they cannot
        be shared (no ``fit_embedded``, or an unseeded representation whose every fit
        draws anew)."""
        if not hasattr(model, "fit_embedded") or not hasattr(model, "unfitted_representation"):
            return None
        rep = model.unfitted_representation()
        params = rep.get_params(deep=False)
        if "random_state" in params and params["random_state"] is None:
            return None
        key = (i, f"{type(rep).__qualname__}{params_key(rep)}")
        if key not in self._embedded:
            rep = rep.fit(bags_tr)
            emb_tr = rep.embed(bags_tr)
            # Kept open until close(): every candidate's fit reads the same T x T matrix.
            self._stack.enter_context(emb_tr.reusing_products())
            emb_va = None if bags_va is None else rep.embed(bags_va)
            self._embedded[key] = (rep, emb_tr, emb_va)
        return self._embedded[key]

    def close(self) -> None:
        """Drop what was kept (the ``T x T`` products with it)."""
        self._stack.close()
        self._bags.clear()
        self._pre.clear()
        self._embedded.clear()


def cv_predictions(
    est: BaseEstimator,
    raw: Bags,
    y: np.ndarray,
    folds: list[tuple[np.ndarray, np.ndarray]],
    cell_level: bool,
    pre_spec: Mapping[str, Any],
    markers: list[str],
    progress: bool = False,
    scores_out: dict[str, np.ndarray] | None = None,
    fit_groups: np.ndarray | None = None,
    cache: FoldCache | None = None,
    control: Bags | None = None,
) -> np.ndarray:
    """Out-of-fold predictions: each bag (or cell) is predicted by a model, preprocessing
    included, that never saw it (a progress bar over the folds with ``progress``).

    ``control``: a per-cell model's training-batch reference control (``[data]
    control``), given to each fold's fit preprocessed as its bags; the held-out bags
    are of that batch, so they are predicted as they are.

    ``fit_groups`` (one per bag) go to each fold's fit as ``groups``: the batches of a
    per-cell model, the subjects of a bag-level one.

    For a per-cell classifier the out-of-fold scores (``decision_function``) also go
    into ``scores_out`` under the estimator's key (:func:`params_key`): they calibrate
    its class probabilities (:mod:`core.calibration`).

    ``cache`` (shared by the calls of one search) keeps what the folds compute alike
    for every candidate (:class:`FoldCache`); the predictions are the same without it.
    """
    from tqdm.auto import tqdm

    pred = np.empty(y.shape, dtype=object if y.dtype.kind in "OUS" else np.float64)
    keep_scores = cell_level and scores_out is not None and hasattr(est, "decode_scores")
    classes = np.unique(y) if keep_scores else np.empty(0)
    scores: np.ndarray | None = None
    own = cache is None
    cache = FoldCache() if cache is None else cache
    try:
        for i, (train, val) in enumerate(
            tqdm(folds, desc="folds", unit="fold", disable=not progress, leave=False)
        ):
            bags_tr, bags_va = cache.bags(i, raw, train, val, pre_spec, markers)
            model = for_point_predictions(est)
            if cell_level:
                y_tr = np.concatenate([y[raw.offsets[t] : raw.offsets[t + 1]] for t in train])
                rows = np.concatenate([np.arange(raw.offsets[t], raw.offsets[t + 1]) for t in val])
                model.fit(
                    bags_tr,
                    y_tr,
                    **groups_kw(fit_groups, train),
                    **cache.control(i, control, markers),
                )
                if keep_scores:
                    s = model.decision_function(bags_va)
                    pred[rows] = model.decode_scores(s)
                    if scores is None:
                        scores = np.full((y.shape[0], classes.size), np.nan)
                    scores[rows] = _in_columns(s, model.classes_, classes)
                else:
                    pred[rows] = model.predict(bags_va)
            elif (shared := cache.embedded(i, model, bags_tr, bags_va)) is not None:
                rep, emb_tr, emb_va = shared
                model.fit_embedded(rep, emb_tr, y[train], **groups_kw(fit_groups, train))
                pred[val] = model.predict_embedded(emb_va)
            else:
                model.fit(bags_tr, y[train], **groups_kw(fit_groups, train))
                pred[val] = model.predict(bags_va)
    finally:
        if own:
            cache.close()
    if keep_scores and scores is not None:
        assert scores_out is not None
        # Two classes: the one margin of classes[1], as the final model gives it.
        scores_out[params_key(est)] = scores[:, 1] if classes.size == 2 else scores
    return pred


def params_key(est: BaseEstimator) -> str:
    """The same string for estimators with the same parameters (fitted or not)."""
    return repr(sorted(est.get_params(deep=False).items()))
