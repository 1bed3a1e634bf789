"""The invariant fallback of the marginal-transfer models, for new tasks out of range.

A new task unlike every training task (another batch, instrument, centre) is where a
per-task affine batch effect is most likely: the fallback is a model of per-task
standardised tasks, chosen on folds (:meth:`FallbackMixin._choose_fallback`), kept only
where they show it useful, and asked beside the primary model so that a task on which
the two disagree beyond what their fold errors allow is answered by it
(:meth:`FallbackMixin._disagreement`).

The same capacity rule (:func:`_capacity_choice`) also decides whether the primary
model's kernel answers alone or averaged with the pooled linear model
(:meth:`FallbackMixin._choose_capacity`): beside a fallback, the primary answers every
new task in range, new batches included, and its leave-tasks-out folds cannot show
which capacity carries over to another batch.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
from numpy.typing import NDArray
from sklearn.base import clone

from ....bags import Bags
from ....blas import one_thread
from ....representations.base import n_threads_for
from ..trees import class_codes, fit_task_trees, tree_scores
from .cv import FoldEvaluator, coordinate_search
from .strategy import SolverStrategy

__all__ = ["LINEAR_FALLBACK_GRID", "FallbackMixin", "choose_trees"]

#: The low-capacity fallback for tasks out of range: the pooled linear model (on
#: per-task standardised tasks), ``λ`` searched.
LINEAR_FALLBACK_GRID: dict[str, list[Any]] = {
    "sigma": [("absolute", 1.0)],
    "tau": [1.0],
    "gamma": [None],
    "emb": [1.0],
}


def _fits_linear_pooled(strategy: SolverStrategy, loss: str) -> bool:
    """Whether the strategy can fit the pooled linear model (the paper's two-layer
    map cannot)."""
    try:
        strategy.check_parameters(loss, "linear", 1.0)
    except ValueError:
        return False
    return True


class FallbackMixin:
    """The fallback's choice, fit and disagreement test (mixed into the estimator)."""

    def _fixed_model(
        self,
        strategy: SolverStrategy,
        tasks: Bags,
        Y: NDArray[np.float64],
        best: dict,
        normalise: str = "standard",
    ) -> Any:
        """A model of this fit at the configuration ``best`` (its point kernel under
        ``"point_kernel"``), on ``tasks`` normalised as ``normalise``, with this fit's
        random draws, answering alone: no search, fallback, blend or refinement of its
        own. The invariant fallback (per-task standardised tasks, at the configuration
        :meth:`_choose_fallback` chose for them), its blend partner, and the pooled
        linear partner of a blended primary model (:meth:`_choose_capacity`, on the
        tasks as the primary normalises them).

        The cross-validation can only judge a normalisation on tasks like the training
        tasks; a new task outside their range (another batch, instrument, centre) is
        where a per-task affine batch effect is most likely, and where undoing it is the
        safer bet: hence standardised tasks for the fallback.
        """
        kernel = best.get("point_kernel", self.point_kernel_)
        fallback = clone(self).set_params(normalise=normalise, point_kernel=kernel)
        for name in (
            "n_features_in_", "n_tasks_", "loss_", "seed_", "task_kernel_",
            "point_frequencies_", "joint_frequencies_", "classes_", "y_ndim_",
        ):  # fmt: skip
            if hasattr(self, name):
                setattr(fallback, name, getattr(self, name))
        fallback.point_kernel_ = kernel
        fallback.quantile_reference_ = (
            getattr(self, "quantile_reference_", None) if normalise == "quantile" else None
        )
        fallback.selection_ = {"evaluated": [], "folds": [], "best": best}
        fallback.disagreement_threshold_ = None
        # The search's data of these tasks, and with it their statistics.
        fallback._fit_memo = self.__dict__.get("_fit_memo")
        try:
            fallback._fit_on(strategy, tasks, Y, normalise, best)
        finally:
            del fallback._fit_memo
        fallback.fallback_ = None
        fallback.blend_ = None
        # A blend's members are averaged first; whatever refines, refines the average.
        fallback.refine_ = "none"
        return fallback

    def _pooled_linear(self, like: FoldEvaluator, Y: NDArray[np.float64], folds: Any) -> Any:
        """An evaluator of the pooled linear model on ``like``'s tasks, on ``folds``."""
        data = self._training_data(like.setup.data.tasks, Y, self.loss_, "linear")
        return FoldEvaluator(replace(like.setup, data=data, folds=folds), like.strategy)

    def _choose_capacity(
        self, searched: FoldEvaluator, Y: NDArray[np.float64]
    ) -> list[tuple[FoldEvaluator, dict[str, Any]]]:
        """Whether the primary model answers with its kernel alone, the pooled linear
        model, or both averaged (``selection_["capacity"]``), by the fallback's rule
        (:func:`_capacity_choice`) on the leave-tasks-out folds the kernel was chosen
        on; returns the members the refinement and reject rule are then chosen for.

        Asked only beside an invariant fallback, which answers the tasks out of range:
        the primary then answers the tasks in range, and a sample from another
        instrument may be in range. Leave-tasks-out folds show how well each capacity
        labels tasks like the training ones, not which carries over to another batch:
        the kernel must earn its shapes by a clear margin, or it answers with the
        linear model's extrapolation beside it. On samples emulated from the GvHD data
        (gated cells, one batch to the other, ``bench/bench_new_batch.py``), where the
        kernel's folds gained 0.1 to 0.2 points over the linear model's, the kernel
        alone labelled the new batch's in-range samples 0.961 against 0.979 averaged.
        Without a fallback the primary answers the tasks far out of range too, where a
        linear model of cells as they arrived extrapolates worst: on the synthetic
        batches without normalisation (``bench/bench_dg_baselines.py``, the paper
        kernel), averaging took batch 1 → 0 from 0.459 to 0.225 (0 → 1: 0.909 to
        0.977).
        """
        kernel_best = self.selection_["best"]
        linear = self._pooled_linear(searched, Y, searched.setup.folds)
        result = coordinate_search(linear, LINEAR_FALLBACK_GRID)
        linear_best = {**result["best"], "point_kernel": "linear"}
        constant = self._constant_error(Y, searched.setup.data.tasks)
        record = self.selection_["capacity"] = _capacity_choice(
            linear.per_fold(linear_best), searched.per_fold(kernel_best), constant
        )
        record["pooled_linear"] = linear_best
        record["constant_error"] = constant
        if record["chosen"] == "own kernel":
            return [(searched, kernel_best)]
        if record["chosen"] == "pooled linear":
            return [(linear, linear_best)]
        return [(searched, kernel_best), (linear, linear_best)]

    def _choose_fallback(
        self,
        evaluators: dict[str, FoldEvaluator],
        chosen: str,
        grid: dict[str, list[Any]],
        Y: NDArray[np.float64],
        batch_folds: list[Any] | None,
        record: dict[str, Any],
    ) -> None:
        """The invariant fallback's configuration, into ``record["fallback"]`` if kept.

        The fallback answers new tasks out of the training tasks' range: most likely
        another batch. Two models of standardised tasks are candidates: the pooled
        linear one (low capacity) and the model's own kernel (its point bandwidth and
        shares of pooling, at the middle task bandwidths). Without batches no fold
        contains another batch: the primary's folds choose one capacity only by a clear
        margin (:func:`_capacity_choice`), and otherwise the fallback averages both
        (``blend_``), each configured on those folds. With batches
        named, leave-one-batch-out folds, the case it is for, choose one, and the
        fallback is kept only where it beats the primary model there. Where either
        way chooses the kernel, a classifier's boosted trees take its place when the
        same folds show them clearly better (:func:`choose_trees`,
        ``record["fallback_trees"]``). ``record["fallback_model"]`` names what answers:
        ``"pooled linear"``, ``"own kernel"``, ``"blend"`` or ``"boosted trees"``.
        Either way it must get at most half of what a constant prediction gets wrong (a blend: each
        member): where standardising erases what the target depends on (a level, a
        size), there is no fallback.
        """
        standard = evaluators["standard"]
        folds = batch_folds if batch_folds is not None else standard.setup.folds
        options: list[tuple[str, FoldEvaluator, dict[str, list[Any]]]] = []
        if _fits_linear_pooled(standard.strategy, self.loss_):
            options.append(
                ("pooled linear", self._pooled_linear(standard, Y, folds), LINEAR_FALLBACK_GRID)
            )
        # The point bandwidth and the shares of pooling, at the middle task bandwidths.
        small = {**grid, "gamma": [grid["gamma"][len(grid["gamma"]) // 2]]}
        small["emb"] = [grid["emb"][len(grid["emb"]) // 2]]
        own = standard.on_folds(batch_folds) if batch_folds is not None else standard
        options.append(("own kernel", own, small))
        found = []
        for name, ev, option_grid in options:
            result = coordinate_search(ev, option_grid)
            error = min(min(e["cv_error"]) for e in result["evaluated"] if "cv_error" in e)
            kernel = "linear" if name == "pooled linear" else self.point_kernel_
            found.append((error, name, ev, {**result["best"], "point_kernel": kernel}))
        record["fallback_options"] = {name: e for e, name, _, _ in found}
        constant = self._constant_error(Y, evaluators[chosen].setup.data.tasks)
        pick = None
        if batch_folds is None and len(found) > 1:
            (_, _, lin, lin_best), (_, _, ker, ker_best) = found
            record["fallback_choice"] = choice = _capacity_choice(
                lin.per_fold(lin_best), ker.per_fold(ker_best), constant
            )
            pick = None if choice["chosen"] == "blend" else choice["chosen"]
        if batch_folds is None and len(found) > 1 and pick is None:
            # The folds do not show one capacity clearly better: both, their scores
            # averaged. Under the squared loss the ridge fits, the average's error on
            # any task is at most the mean of theirs.
            error = max(f[0] for f in found)
            members = [(f[2], f[3]) for f in found]
            best, record["fallback_blend"] = found[0][3], found[1][3]
            record["fallback_model"] = "blend"
        else:
            # The one the folds chose, or with batch folds the simplest first among
            # equals.
            named = [f for f in found if f[1] == pick] or found
            error, name, ev, best = min(named, key=lambda f: f[0])
            members = [(ev, best)]
            record["fallback_model"] = name
            if name == "own kernel" and self._is_classifier:
                # Capacity pays on these folds: the axis-aligned kind may pay more.
                trees = record["fallback_trees"] = choose_trees(
                    ev, ev.per_fold(best), constant, self.seed_
                )
                if trees["chosen"] == "boosted trees":
                    record["fallback_model"] = "boosted trees"
                    error = float(np.mean(trees["fold_errors"]["boosted trees"]))
        record["fallback_cv"] = "leave-tasks-out" if batch_folds is None else "leave-one-batch-out"
        record["fallback_cv_error"] = error
        record["constant_error"] = constant
        keep = error <= 0.5 * constant
        if batch_folds is not None:
            # The primary model, as chosen, on the same batch folds: a fallback that
            # does no better on unseen batches would only add a second model.
            primary = float(
                evaluators[chosen].on_folds(batch_folds).score(self.selection_["best"]).min()
            )
            record["primary_batch_cv_error"] = primary
            keep = keep and error < primary
        if not keep:
            record.pop("fallback_blend", None)
            record.pop("fallback_model", None)
        else:
            record["fallback"] = best
            # Where both models are as accurate as their folds say, they disagree on a
            # task by at most the sum of their errors there (triangle inequality of the
            # 0-1 disagreement, or of the root mean square): the most either got wrong
            # on a fold bounds what a task like the training ones may show. Each model
            # as it answers: refined, where it refines.
            refine = self.selection_["refine"]
            record["primary_fold_errors"] = refine["fold_errors"][refine["chosen"]]
            if record.get("fallback_model") == "boosted trees":
                # The trees answer as they are: the mixture refinement starts from
                # labels of a smooth model, and its folds were the kernel's.
                errors = np.asarray(record["fallback_trees"]["fold_errors"]["boosted trees"])
                refine = record["fallback_refine"] = {
                    "rule": "boosted trees answer unrefined",
                    "cv_error": {"none": float(errors.mean())},
                    "fold_errors": {"none": errors},
                    "chosen": "none",
                }
            else:
                refine = record["fallback_refine"] = self._choose_refinement(
                    members, for_fallback=True
                )
            record["fallback_fold_errors"] = refine["fold_errors"][refine["chosen"]]
            worst = [
                float(record["primary_fold_errors"].max()),
                float(record["fallback_fold_errors"].max()),
            ]
            if not self._is_classifier:
                worst = [float(np.sqrt(w)) for w in worst]
            record["disagreement_bound"] = sum(worst)

    def _constant_error(self, Y: NDArray[np.float64], tasks: Bags) -> float:
        """The CV error measure of the best constant prediction (the majority class, or
        the mean), per task then averaged, as the folds average it."""
        owner = tasks.bag_index()
        if self._is_classifier:
            labels = class_codes(Y)
            wrong = (labels != np.bincount(labels).argmax()).astype(np.float64)
        else:
            wrong = np.mean((Y - Y.mean(axis=0)) ** 2, axis=1)
        return float(np.mean(np.bincount(owner, weights=wrong) / tasks.sizes))

    def _disagreement(self, a: NDArray[np.float64], b: NDArray[np.float64]) -> float:
        """Share of points labelled differently from scores ``a`` and ``b`` (classifiers),
        or the root mean square difference of the values (regressors)."""
        if self._is_classifier:
            return float(np.mean(self._decode(a) != self._decode(b)))
        return float(np.sqrt(np.mean((a - b) ** 2)))


#: The least gain, as a share of the constant prediction's fold error, for which the
#: folds' choice of one capacity over the other counts (besides their noise).
CAPACITY_GAIN = 0.02


def _capacity_choice(
    linear: NDArray[np.float64], kernel: NDArray[np.float64], constant: float
) -> dict[str, Any]:
    """Which fallback the leave-tasks-out folds choose with no batches named: the pooled
    linear model, the model's own kernel, or (when they cannot tell) both averaged.

    One capacity is chosen when its mean fold error is below the other's by more than
    their paired standard error and by more than ``CAPACITY_GAIN`` of the constant
    prediction's error (2 % of what the majority class gets wrong, or of the targets'
    variance for a regressor). The second bar is
    for what folds of one batch cannot show: on another batch every model errs more,
    and a gain smaller than that is no reason to prefer the shapes the kernel fitted
    to the linear model's extrapolation. Measured on ``bench/bench_new_batch.py``'s
    data before this rule: where the linear model's fold error was within 1 point of
    the kernel's (the synthetic batches), the kernel alone lost 7 to 13 points on the
    new batch against the average; where the kernel removed 1 to 5 points of fold
    error (six runs on samples emulated from the GvHD and FlowSOM data), it changed
    the new batch's accuracy by -0.8 to +3.8 points against the average, +2.0 on mean.
    The 2 % is a judgement from those runs, not a fitted value.

    Returns
    -------
    dict
        ``rule``, both options' ``fold_errors``, the mean ``gain`` of the kernel (the
        linear model's mean fold error minus the kernel's), its ``se``, the ``margin``
        it is compared with, and ``chosen``: ``"own kernel"``, ``"pooled linear"`` or
        ``"blend"``.
    """
    per = {
        "pooled linear": np.asarray(linear, dtype=np.float64),
        "own kernel": np.asarray(kernel, dtype=np.float64),
    }
    rule = _clear_gain(per["pooled linear"], per["own kernel"], constant)
    gain, margin = rule["gain"], rule["margin"]
    chosen = "own kernel" if gain > margin else "pooled linear" if -gain > margin else "blend"
    return {
        "rule": (
            "one capacity when its mean fold error is lower by more than the paired "
            f"standard error and by more than {CAPACITY_GAIN:g} of the constant "
            "prediction's error; otherwise both averaged"
        ),
        "fold_errors": {name: e.tolist() for name, e in per.items()},
        **rule,
        "chosen": chosen,
    }


def _clear_gain(
    errors: NDArray[np.float64], other: NDArray[np.float64], constant: float
) -> dict[str, float]:
    """The fallback's rule for more capacity: ``other``'s mean ``gain`` over ``errors``,
    fold by fold, its paired standard error ``se``, and the ``margin`` the gain must
    exceed: the larger of ``se`` and ``CAPACITY_GAIN`` of the constant prediction's
    error."""
    diff = errors - other
    se = float(diff.std(ddof=1) / np.sqrt(diff.size)) if diff.size > 1 else 0.0
    return {"gain": float(diff.mean()), "se": se, "margin": max(se, CAPACITY_GAIN * constant)}


def choose_trees(
    kernel: FoldEvaluator,
    kernel_errors: NDArray[np.float64],
    constant: float,
    seed: int,
) -> dict[str, Any]:
    """Whether the fallback answers with boosted trees instead of its kernel, by the
    kernel's own folds and held-out points.

    The trees are fitted on each fold's training tasks (per-task standardised, as the
    kernel saw them) and scored on the points the kernel was scored on; they are
    taken when their mean fold error is below the kernel's by more than the paired
    standard error and by more than ``CAPACITY_GAIN`` of the constant prediction's
    error: the rule that chose the kernel over the linear model (:func:`_clear_gain`).

    Folds run a round at a time, one per core, and the evaluation stops as soon as the
    trees cannot be taken whatever the remaining folds show: their error is at least 0,
    so on a fold still to come they gain at most the kernel's error there. Where the
    kernel errs on at most ``CAPACITY_GAIN`` of what the constant prediction does, no tree
    is fitted. The choice is the complete evaluation's.

    Returns
    -------
    dict
        ``rule``, the per-fold ``fold_errors`` of both (the trees': the folds
        evaluated), the ``margin`` and ``chosen``: ``"boosted trees"`` or
        ``"own kernel"``; the trees' mean ``gain`` and its ``se`` when every fold was
        evaluated, else ``stopped_after`` (folds).
    """
    setup = kernel.setup
    tasks, Y = setup.data.tasks, setup.data.Y
    kernel_errors = np.asarray(kernel_errors, dtype=np.float64)
    least = CAPACITY_GAIN * constant
    record: dict[str, Any] = {
        "rule": (
            "boosted trees when their mean fold error is lower than the kernel's by more "
            f"than the paired standard error and by more than {CAPACITY_GAIN:g} of the "
            "constant prediction's error"
        ),
        "fold_errors": {"own kernel": kernel_errors.tolist(), "boosted trees": []},
        "margin": least,
        "chosen": "own kernel",
    }

    def fold_error(f: int) -> float:
        train, val = setup.folds[f]
        with one_thread("openmp"):  # OpenMP's thread count is each thread's own
            trees = fit_task_trees(tasks, Y, seed, train)
        held = [kernel.held_out_points(int(v)) for v in val]
        sizes = np.cumsum([x.shape[0] for x, _ in held])[:-1]
        scores = np.split(tree_scores(trees, np.concatenate([x for x, _ in held])), sizes)
        return float(np.mean([setup.error(sc, y) for sc, (_, y) in zip(scores, held, strict=True)]))

    n_folds = len(setup.folds)
    at_once = max(1, min(n_threads_for(-1), n_folds))
    errors: list[float] = []
    # A fold per core, each fit on one OpenMP thread (its Cython releases the GIL); the
    # fitted trees do not depend on the thread count.
    with ThreadPoolExecutor(at_once) as pool:
        while len(errors) < n_folds:
            done = len(errors)
            best_case = (kernel_errors[:done] - errors).sum() + kernel_errors[done:].sum()
            if best_case / n_folds <= least:
                record["stopped_after"] = done
                record["fold_errors"]["boosted trees"] = errors
                return record
            errors += pool.map(fold_error, range(done, min(done + at_once, n_folds)))
    record["fold_errors"]["boosted trees"] = errors
    record.update(_clear_gain(kernel_errors, np.asarray(errors), constant))
    record["chosen"] = "boosted trees" if record["gain"] > record["margin"] else "own kernel"
    return record
