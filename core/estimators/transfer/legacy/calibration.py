"""Whether a new task from another batch is calibrated to the training data first.

A task out of the training tasks' range is most likely another batch. Calibrating it
(:mod:`core.alignment`: population landmarks, per-marker quantile landmarks, or a
monotone map fitted on the MMD) may bring its populations back where the primary model
learnt them, or, where its proportions differ from the reference's, move them.

* With batches named, folds of held-out batches tell: every task of a held-out batch
  is calibrated to the reference of the other batches (never its own) and answered by
  the primary model fitted on those batches (:class:`CalibratedHeldOut` for the
  quantile and MMD maps; refits of the chosen configuration for the landmarks, which
  need the model's labels); the errors are set against what answers such tasks
  without calibration (the fallback, or the primary model itself), with the
  one-standard-error rule and no calibration first.
* Without two batches nothing measures it, and the stated rule (:data:`LANDMARK_RULE`)
  is the landmark shift, for classifiers, of the tasks whose populations sit farther
  from the training ones than any training task's do, and of the tasks out of range
  where no invariant fallback answers them. Quantile calibration without evidence
  lowered accuracy on the emulated instrument batches of ``bench/bench_new_batch.py``
  (samples' proportions differ, so aligning pooled quantiles moves populations); the
  landmark shift, whose landmarks are the populations' centres, did not.

:class:`CalibrationMixin` holds the estimator's side: the choice at fit time and the
calibration of new tasks at prediction.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from numpy.typing import NDArray
from sklearn.base import clone

from ....bags import Bags, normalise_each_bag, subsample_bags
from ....selection import leave_one_group_out_folds
from ..reports import TaskReport
from ..trees import class_codes
from .alignment import CALIBRATIONS, calibrate, landmark_shift, reference_quantiles
from .cv import FoldEvaluator, Folds, one_standard_error_record
from .refine import refine_scores
from .strategy import Transform

__all__ = [
    "LANDMARK_ITERATIONS",
    "CalibratedHeldOut",
    "CalibrationMixin",
    "calibrated_by_batch",
    "choose_calibration",
]

#: Rounds of labelling and shifting of ``calibrate="landmarks"``.
LANDMARK_ITERATIONS = 3
#: The calibration of a classifier fitted without batches, and why.
LANDMARK_RULE = (
    "no two batches to measure it on: landmarks, the stated rule (a task out of range, "
    "or whose populations sit farther from the training ones than any training "
    "task's, is shifted onto the training populations' centres; on instrument "
    "batches emulated from the GvHD samples it raised the accuracy of all cells from "
    "0.678 to 0.779 and from 0.818 to 0.842, left the FlowSOM and synthetic batches "
    "as they were, and no real GvHD sample left sample out crossed that range: "
    "bench/bench_new_batch.py)"
)
#: Cells of a new task its landmark shift is estimated on (a seeded draw).
LANDMARK_POINTS = 5000
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

    def _held_out_sources(self) -> tuple[Bags, Bags]:
        return self._held_tasks, self._held_emb


def choose_calibration(
    uncalibrated: NDArray[np.float64],
    evaluators: dict[str, list[tuple[FoldEvaluator, dict[str, Any]]]],
) -> dict[str, Any]:
    """The calibration of tasks out of range, by the one-standard-error rule with no
    calibration first.

    Parameters
    ----------
    uncalibrated : ndarray of shape (n_folds,)
        Per held-out batch, the error of what answers such tasks today (the
        fallback, or the primary model).
    evaluators : dict
        Per calibration, the primary model's members: for each, a
        :class:`CalibratedHeldOut` and its configuration (its ``alpha`` included). A
        model of several members (a blend) counts, fold by fold, as its worst member,
        as its refinement and reject rule are chosen.
    """
    per_fold: dict[str, NDArray[np.float64]] = {"none": np.asarray(uncalibrated)}
    for name, members in evaluators.items():
        for ev, best in members:
            ev.score(best)
        per_fold[name] = np.max([ev.per_fold(best) for ev, best in members], axis=0)
    return one_standard_error_record(
        per_fold, "one standard error on leave-one-batch-out folds, none first"
    )


class CalibrationMixin:
    """The calibration of new tasks: its choice at fit time and its use at prediction
    (mixed into the estimator)."""

    def _fit_calibration(
        self, raw: Bags, Y: NDArray[np.float64], groups: NDArray[Any] | None
    ) -> None:
        """The calibration of tasks out of range (``calibration_``) and its reference:
        chosen on held-out batches, fixed by ``calibrate``, or, without batches, the
        stated rule of :mod:`.calibration` (classifiers: landmarks)."""
        if self.calibrate not in ("auto", *CALIBRATIONS):
            raise ValueError(
                f"calibrate must be 'auto' or one of {CALIBRATIONS}, got {self.calibrate!r}"
            )
        record = self.selection_.get("calibration")
        batches = groups is not None and np.unique(groups).size > 1
        if self.calibrate != "auto":
            how = self.calibrate
        elif record is not None:
            how = record["chosen"]
            if self._is_classifier and batches:
                folds = leave_one_group_out_folds(groups)
                record["landmarks"] = self._landmark_fold_errors(raw, Y, folds)
                if record["landmarks"]["chosen"] == "landmarks":
                    how = record["chosen"] = "landmarks"
        elif self._is_classifier and self.calibrate == "auto":
            how = "landmarks"
            self.selection_["calibration"] = {
                "rule": LANDMARK_RULE,
                "chosen": how,
            }
        else:
            how = "none"
            self.selection_["calibration"] = {
                "rule": "no two batches to measure it on: not calibrated",
                "chosen": "none",
            }
        if how == "landmarks" and not self._is_classifier:
            raise ValueError("calibrate='landmarks' needs class labels: classifiers only")
        self.calibration_ = how
        if how in ("quantile", "mmd"):
            self.calibration_quantiles_ = reference_quantiles(raw)
            self.calibration_points_ = reference_points(raw, self.seed_)

    def _landmark_fold_errors(
        self, raw: Bags, Y: NDArray[np.float64], folds: list[Any]
    ) -> dict[str, Any]:
        """Landmark calibration against none on held-out batches: the model at its
        chosen configuration refitted on each fold's other batches, its held-out
        tasks answered both ways (paired per fold, one standard error, none first)."""
        labels = self._decode(Y)
        fixed = {
            "normalise": self.normalise_,
            "refine": self.refine_,
            "point_bandwidth": self.point_bandwidth_,
            "task_gamma": 1.0 if self.task_gamma_ is None else self.task_gamma_,
            "tau": self.tau_,
            "alpha": self.alpha_,
            "reject": "off",
            "calibrate": "landmarks",
        }
        owner = raw.bag_index()
        per_fold: dict[str, list[float]] = {"none": [], "landmarks": []}
        for train, val in folds:
            model = clone(self).set_params(**fixed)
            model.fit(raw[train], labels[np.isin(owner, train)])
            truth = [labels[owner == v] for v in val]
            for how in ("none", "landmarks"):
                model.calibration_ = how
                answers = model.predict_tasks(raw[val])
                wrong = [np.mean(a.predictions != t) for a, t in zip(answers, truth, strict=True)]
                per_fold[how].append(float(np.mean(wrong)))
        return one_standard_error_record(
            {k: np.asarray(v) for k, v in per_fold.items()},
            "one standard error on leave-one-batch-out refits, none first",
        )

    def _fit_landmarks(self, raw: Bags, Y: NDArray[np.float64]) -> None:
        """The training populations' centres on the cells as they arrived (the
        landmarks of ``calibrate="landmarks"``)."""
        codes = class_codes(Y)
        sums = np.zeros((self.classes_.size, raw.dim))
        np.add.at(sums, codes, raw.points)
        counts = np.bincount(codes, minlength=self.classes_.size)[:, None]
        self.landmark_centres_ = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        squares = np.zeros((self.classes_.size, raw.dim))
        np.add.at(squares, codes, raw.points**2)
        mean_sq = squares / np.maximum(counts, 1)
        self.landmark_spread_ = np.maximum(mean_sq - np.nan_to_num(self.landmark_centres_) ** 2, 0)
        sd = raw.points.std(axis=0)
        self.landmark_scale_ = np.where(sd > 0, sd, 1.0)
        # How far the training tasks' own populations sit from the pooled centres: a
        # new task whose populations sit farther is shifted by more than patients
        # differ (an instrument, a stain), whatever its embedding distance says.
        owner = raw.bag_index()
        norms = []
        for t in range(len(raw)):
            rows = owner == t
            shift = landmark_shift(
                raw.points[rows],
                codes[rows],
                self.landmark_centres_,
                self.rest_code_,
                self._landmark_spread(),
            )
            if shift is not None:
                norms.append(float(np.linalg.norm(shift / self.landmark_scale_)))
        self.landmark_threshold_ = self.range_factor * max(norms) if norms else np.inf

    def _landmark_spread(self) -> NDArray[np.float64] | None:
        """The training populations' variances (None for models saved without)."""
        return getattr(self, "landmark_spread_", None)

    def _primary_scores(self, raw: Bags) -> list[NDArray[np.float64]]:
        """The primary model's scores of ``raw``, whatever their range (no fallback,
        refinement or reject rule; a blend averaged)."""
        tasks = self._normalise(raw)
        emb, sq_new = self._task_similarities(tasks)
        return self._model_scores(raw, tasks, emb, sq_new)

    def _landmark_aligned(
        self, x: NDArray[np.float64], only_beyond: bool = False
    ) -> NDArray[np.float64] | None:
        """One task shifted per marker until its populations, as the primary model
        labels them, sit on the training populations' centres
        (:func:`~core.alignment.landmark_shift`, :data:`LANDMARK_ITERATIONS` rounds).
        With ``only_beyond``, None unless the first shift exceeds what the training
        tasks show (``landmark_threshold_``).

        The shift (one number per marker) is estimated on at most
        :data:`LANDMARK_POINTS` of the task's cells, a seeded draw: asked of every new
        task, it must not cost a scoring of all of a large sample's cells per round.
        """
        sample = x
        if x.shape[0] > LANDMARK_POINTS:
            rng = np.random.default_rng([self.seed_, x.shape[0]])
            sample = x[np.sort(rng.choice(x.shape[0], LANDMARK_POINTS, replace=False))]
        z = sample
        shift = None
        for round_ in range(LANDMARK_ITERATIONS):
            (scores,) = self._primary_scores(Bags.from_arrays([z]))
            codes = np.argmax(scores, axis=1) if scores.shape[1] > 1 else (scores[:, 0] > 0)
            step = landmark_shift(
                sample,
                codes.astype(np.int64),
                self.landmark_centres_,
                self.rest_code_,
                self._landmark_spread(),
            )
            if step is None:
                break
            if only_beyond and round_ == 0:
                size = float(np.linalg.norm(step / self.landmark_scale_))
                if size <= self.landmark_threshold_:
                    return None
            shift = step
            z = sample + shift
        if shift is None:
            return None if only_beyond else x
        return x + shift

    def _calibrated(
        self, raw: Bags, reports: list[TaskReport]
    ) -> tuple[Bags, dict[int, TaskReport]]:
        """``raw`` with every task out of range calibrated to the training reference
        (``calibration_``), and those tasks' reports as they arrived (``reports``, the
        tasks' own)."""
        how = getattr(self, "calibration_", "none")
        if how == "none":
            return raw, {}
        reports = list(reports)
        far = [i for i, r in enumerate(reports) if r.out_of_range]
        if how == "landmarks":
            # Tasks whose populations sit farther from the training ones than any
            # training task's do (then out of range too), and tasks out of range where
            # there is no invariant fallback to answer them: on the synthetic batches,
            # whose populations move apart, the fallback answers those better.
            has_fallback = getattr(self, "fallback_", None) is not None
            done, moved = [], []
            for t in range(len(raw)):
                if t in far and has_fallback:
                    continue
                shifted = self._landmark_aligned(np.asarray(raw[t]), only_beyond=t not in far)
                if shifted is not None:
                    done.append(shifted)
                    moved.append(t)
                    reports[t] = replace(reports[t], out_of_range=True)
            far = moved
        elif not far:
            return raw, {}
        else:
            done = calibrate(
                raw[np.array(far)],
                how,
                self.calibration_quantiles_,
                self.calibration_points_,
                self.seed_,
            )
        arrays = [np.asarray(raw[t]) for t in range(len(raw))]
        for j, t in enumerate(far):
            arrays[t] = np.asarray(done[j])
        return Bags.from_arrays(arrays), {t: replace(reports[t], calibrated=how) for t in far}

    def _choose_calibration(
        self,
        raw: Bags,
        members: list[tuple[FoldEvaluator, dict[str, Any]]],
        normalisation: str,
        batch_folds: list[Any],
        record: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Whether tasks out of range are calibrated to the training reference and then
        answered by the primary model (its ``members``: evaluators and configurations,
        two for a blend), on leave-one-batch-out folds (:mod:`.calibration`)."""
        seed = self.seed_
        refines = self.selection_["refine"]["chosen"] == "mixture"
        transform = (lambda x, sc: refine_scores(x, sc, seed)[0]) if refines else None
        if record is not None and "fallback" in record:
            uncalibrated = np.asarray(record["fallback_fold_errors"])
        else:
            errors = []
            for ev, best in members:
                on_batches = ev.on_folds(batch_folds)
                if transform is not None:
                    on_batches = on_batches.transformed(transform, best["alpha"])
                on_batches.score(best)
                errors.append(on_batches.per_fold(best))
            uncalibrated = np.max(errors, axis=0)
        evaluators = {}
        for how in ("quantile", "mmd"):
            held = normalise_each_bag(
                calibrated_by_batch(raw, batch_folds, how, seed),
                normalisation,
                self.quantile_reference_,
            )
            emb = subsample_bags(held, self.embedding_points, seed, canonical=True)
            evaluators[how] = [
                (CalibratedHeldOut(ev, batch_folds, held, emb, transform, best["alpha"]), best)
                for ev, best in members
            ]
        return choose_calibration(uncalibrated, evaluators)
