"""Whether a new task out of range is calibrated to the training reference first.

A task out of the training tasks' range is most likely another batch. Calibrating it
(:mod:`core.alignment`: per-marker quantile landmarks, or a monotone map fitted on the
MMD) may bring its populations back where the primary model learnt them, or, where
its proportions differ from the reference's, move them. Only folds of held-out
batches can tell, so the choice is made there: every task of a held-out batch is
calibrated to the reference of the other batches (never its own) and answered by the
primary model fitted on those batches (:class:`CalibratedHeldOut`); the errors are
set against what answers such tasks without calibration (the fallback, or the primary
model itself), with the one-standard-error rule and no calibration first.

Without two batches in the training data nothing measures it, and the stated rule is
not to calibrate: on the emulated instrument batches of ``bench/bench_new_batch.py``
quantile calibration without that evidence lowered every model's accuracy.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..alignment import calibrate, reference_quantiles
from ..bags import Bags
from ._transfer_cv import FoldEvaluator, Folds, one_standard_error_choice
from ._transfer_strategy import Transform

__all__ = ["CalibratedHeldOut", "calibrated_by_batch", "choose_calibration"]

#: Training cells kept as the reference of the MMD calibration (drawn across tasks).
REFERENCE_POINTS = 4000


def reference_points(tasks: Bags, seed: int) -> NDArray[np.float64]:
    """At most :data:`REFERENCE_POINTS` cells drawn evenly from every task."""
    rng = np.random.default_rng([seed, 7])
    per = max(1, REFERENCE_POINTS // len(tasks))
    picks = [
        np.asarray(tasks[t])[rng.choice(tasks.sizes[t], min(per, tasks.sizes[t]), replace=False)]
        for t in range(len(tasks))
    ]
    return np.vstack(picks)


def calibrated_by_batch(raw: Bags, folds: Folds, how: str, seed: int) -> Bags:
    """Every task calibrated to the reference of the tasks outside its held-out fold
    (leave-one-batch-out folds hold every task out exactly once)."""
    arrays: list[NDArray[np.float64] | None] = [None] * len(raw)
    for train, val in folds:
        train_tasks = raw[train]
        done = calibrate(
            raw[val],
            how,  # type: ignore[arg-type]
            reference_quantiles(train_tasks),
            reference_points(train_tasks, seed),
            seed,
        )
        for j, v in enumerate(val):
            arrays[int(v)] = np.asarray(done[j])
    missing = [t for t, a in enumerate(arrays) if a is None]
    if missing:  # pragma: no cover - leave-one-batch-out folds cover every task
        raise ValueError(f"tasks {missing} are held out by no fold")
    return Bags.from_arrays(arrays)  # type: ignore[arg-type]


class CalibratedHeldOut(FoldEvaluator):
    """An evaluator whose held-out tasks are read from other (calibrated) tasks.

    Training tasks of every fold, their embedding and bandwidths come from ``base``'s
    setup; each held-out task's points and its embedding come from ``held_out``
    (same task order, same cells, so the labels still apply) and ``held_out_emb``.
    ``transform`` post-processes every held-out answer (the model's refinement, at the
    one ``λ`` ``alpha``), as :meth:`FoldEvaluator.transformed` does. Nothing is shared
    with ``base``'s caches: its held-out points are the uncalibrated ones.
    """

    def __init__(
        self,
        base: FoldEvaluator,
        folds: Folds,
        held_out: Bags,
        held_out_emb: Bags,
        transform: Transform | None = None,
        alpha: float | None = None,
    ):
        setup = replace(base.setup, folds=folds, transform=transform)
        if alpha is not None:
            setup = replace(setup, alphas=np.array([alpha]))
        super().__init__(setup, base.strategy)
        self._held_tasks = held_out
        self._held_emb = held_out_emb

    def _fold_embedding(self, f: int, factor: float):
        key = (f, factor)
        if key not in self._embeddings:
            train, val = self.setup.folds[f]
            rep, emb = self.setup.fit_embedding(self.setup.emb_tasks[train], factor)
            val_emb = rep.embed(self._held_emb[val])
            self._embeddings[key] = (emb.sq_distances(), val_emb.sq_distances(emb), (emb, val_emb))
        return self._embeddings[key]

    def _held_out_points(self, v: int):
        if v not in self._held_out:
            tasks, Y = self._held_tasks, self.setup.data.Y
            lo, hi = int(tasks.offsets[v]), int(tasks.offsets[v + 1])
            pick = np.arange(lo, hi)
            if pick.size > self.setup.cv_points:
                rng = np.random.default_rng([self.setup.seed, v])
                pick = np.sort(rng.choice(pick, self.setup.cv_points, replace=False))
            self._held_out[v] = (tasks.points[pick], Y[pick])
        return self._held_out[v]


def choose_calibration(
    uncalibrated: NDArray[np.float64],
    evaluators: dict[str, FoldEvaluator],
    best: dict[str, Any],
) -> dict[str, Any]:
    """The calibration of tasks out of range, by the one-standard-error rule with no
    calibration first.

    Parameters
    ----------
    uncalibrated : ndarray of shape (n_folds,)
        Per held-out batch, the error of what answers such tasks today (the
        fallback, or the primary model).
    evaluators : dict
        Per calibration, a :class:`CalibratedHeldOut` of the primary model.
    best : dict
        The primary model's configuration (its ``alpha`` included).
    """
    per_fold: dict[str, NDArray[np.float64]] = {"none": np.asarray(uncalibrated)}
    for name, ev in evaluators.items():
        ev.score(best)
        per_fold[name] = ev.per_fold(best)
    chosen = one_standard_error_choice(per_fold)
    return {
        "rule": "one standard error on leave-one-batch-out folds, none first",
        "cv_error": {n: float(e.mean()) for n, e in per_fold.items()},
        "fold_errors": {n: e.tolist() for n, e in per_fold.items()},
        "chosen": chosen,
    }
