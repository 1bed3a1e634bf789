"""Leave-tasks-out search of the marginal-transfer hyperparameters.

:class:`FoldEvaluator` scores a candidate configuration on every fold; the solver
strategy scores one fold over the whole ridge path (one factorisation per fold covers
every ``λ``). The evaluator caches, per fold, the fold's own embedding and the point
bandwidths' median heuristic (both from its training tasks only), and the points each
held-out task is scored on, so candidates that share them pay once. Where the
strategy allows it, a candidate's folds run on all cores at once, each computing what
it would alone.
:func:`coordinate_search` walks the grid; :func:`choose_normalisation` picks the per-task
normalisation before it, :func:`choose_refinement` whether a model post-processes each
task's answer after it.

Everything the search needs from the estimator arrives in a :class:`SearchSetup`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from contextvars import ContextVar, copy_context
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ....bags import Bags
from ....kernels import DistanceKernel
from ....progress import progress_bar
from ....representations.base import BagRepresentation, Embedding, n_threads_for
from ....scopes import scoped_store
from .strategy import (
    KernelParameters,
    SolverStrategy,
    TrainingData,
    Transform,
    ValidationFold,
    task_similarity,
)

__all__ = [
    "FoldEvaluator",
    "SearchSetup",
    "choose_normalisation",
    "choose_refinement",
    "content_digest",
    "coordinate_search",
    "mean_squared_error",
    "misclassification_rate",
    "one_standard_error_choice",
    "one_standard_error_record",
    "release_kept_searches",
    "reused_across_fits",
    "reusing_fold_evaluations",
]

#: A hyperparameter value still to be resolved on the tasks at hand:
#: ``("absolute", v)`` or ``("relative", factor of the median heuristic)``.
Spec = tuple[str, float]
Folds = list[tuple[NDArray[np.int64], NDArray[np.int64]]]


def misclassification_rate(scores: NDArray[np.float64], y: NDArray[np.float64]) -> float:
    """Share of points whose label (sign, or one-vs-rest argmax) is wrong."""
    if scores.shape[1] == 1:
        return float(np.mean(np.sign(scores[:, 0]) != np.sign(y[:, 0])))
    return float(np.mean(np.argmax(scores, 1) != np.argmax(y, 1)))


def mean_squared_error(scores: NDArray[np.float64], y: NDArray[np.float64]) -> float:
    """Mean squared error over points and outputs."""
    return float(np.mean((scores - y) ** 2))


@dataclass(frozen=True)
class SearchSetup:
    """What the search needs from the estimator, passed explicitly.

    Attributes
    ----------
    data : TrainingData
        The training tasks, their targets, the fit's feature maps and loss.
    emb_tasks : Bags
        The training tasks as their embeddings see them (subsampled).
    folds : list of (train, val) task index arrays
    alphas : ndarray
        Ridge grid ``λ``; every evaluation covers all of it.
    task_kernel : DistanceKernel
        ``k_P`` on squared embedding distances.
    fit_embedding : callable ``(emb_tasks, factor, base) -> (representation, embedding)``
        Fits the task representation, its bandwidth ``factor`` times ``base``, or with
        ``base=None`` times its own median heuristic on ``emb_tasks``.
    resolve_sigma : callable ``(spec, points) -> float``
        The point bandwidth of a spec, relative ones on the given points.
    resolve_gamma : callable ``(spec, sq_distances) -> float or None``
        ``γ`` of ``k_P`` of a spec, relative ones on the given task distances.
    error : callable ``(scores, targets) -> float``
        Validation error of one task.
    cv_points : int
        Points per held-out task it is scored on.
    seed : int
        Seed of the held-out points' subsample.
    transform : callable or None
        ``(points, scores) -> scores`` applied to every held-out task's scores before
        its error (:meth:`FoldEvaluator.transformed`).
    embedding_bandwidth : callable ``(emb_tasks) -> float or None``, optional
        The base bandwidth of the task representation fitted on ``emb_tasks`` (None
        when it has a fixed one); every fold scales the one of all ``emb_tasks``.
    """

    data: TrainingData
    emb_tasks: Bags
    folds: Folds
    alphas: NDArray[np.float64]
    task_kernel: DistanceKernel
    fit_embedding: Callable[[Bags, float, float | None], tuple[BagRepresentation, Embedding]]
    resolve_sigma: Callable[[Spec, NDArray[np.float64]], float]
    resolve_gamma: Callable[[Spec | None, NDArray[np.float64]], float | None]
    error: Callable[[NDArray[np.float64], NDArray[np.float64]], float]
    cv_points: int
    seed: int
    transform: Transform | None = None
    embedding_bandwidth: Callable[[Bags], float | None] | None = None


#: The evaluations kept across fits (:func:`reusing_fold_evaluations`), by the digest
#: of everything an evaluator's results depend on (:func:`_setup_digest`).
_REUSED: ContextVar[dict[str, dict[str, Any]] | None] = ContextVar(
    "reused_fold_evaluations", default=None
)


def reusing_fold_evaluations() -> AbstractContextManager[None]:
    """Within the block, fits that search on the same tasks, targets, feature maps,
    folds and ``λ`` grid share their fold evaluations.

    Training fits the same estimator on the same fold several times: the kept
    candidate and, when one of its own grids was widened, the candidate again with
    only that grid moved. Every configuration the first fit evaluated (its per-fold
    errors), and every per-fold cache (embeddings, median bandwidths, held-out points,
    the strategy's per-bandwidth statistics), is then taken as computed, so the refit
    evaluates only the configurations it had not seen. The results are the ones the
    evaluations would give again: they are functions of what the digest covers.
    Nested blocks share the outermost one's evaluations.
    """
    return scoped_store(_REUSED)


def release_kept_searches(strategy: SolverStrategy) -> None:
    """After a search, within :func:`reusing_fold_evaluations`: let ``strategy`` drop
    from the caches kept for later fits what it can compute again
    (:meth:`~.strategy.SolverStrategy.release_search`)."""
    reused = _REUSED.get()
    if reused is None:
        return
    for state in list(reused.values()):
        if isinstance(state, dict) and "strategy" in state:
            strategy.release_search(state["strategy"])


def _update(h: Any, value: Any) -> None:
    """Feed ``value`` (arrays by dtype, shape and bytes) into the hash ``h``."""
    if isinstance(value, np.ndarray):
        h.update(f"{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).data)
    elif isinstance(value, Bags):
        _update(h, np.asarray(value.points))
        _update(h, np.asarray(value.offsets))
    elif isinstance(value, list | tuple):
        h.update(f"{type(value).__name__}{len(value)}(".encode())
        for v in value:
            _update(h, v)
        h.update(b")")
    else:
        h.update(repr(value).encode())


def content_digest(*parts: Any) -> str:
    """A digest of ``parts`` (arrays by dtype, shape and bytes; bags; sequences; other
    values by ``repr``): the key of a value computed from them alone."""
    h = hashlib.blake2b(digest_size=20)
    _update(h, parts)
    return h.hexdigest()


def reused_across_fits(parts: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    """``compute()``, or, within :func:`reusing_fold_evaluations`, what it returned for
    the same ``parts`` (arrays, bags and values that determine the result) in the block.

    The caller must not modify what it gets: another fit may get the same object.
    """
    reused = _REUSED.get()
    if reused is None:
        return compute()
    store = reused.setdefault("values", {})
    key = content_digest(*parts)
    if key not in store:
        store[key] = compute()
    return store[key]


def _setup_digest(setup: SearchSetup, strategy: SolverStrategy) -> str | None:
    """A digest of everything a plain evaluator's results depend on, or ``None`` when
    something in ``setup`` cannot be told apart (a transform, a callable not bound to
    a marginal-transfer estimator)."""
    if setup.transform is not None:
        return None
    owner = getattr(setup.fit_embedding, "__self__", None)
    callables = tuple(
        c
        for c in (
            setup.fit_embedding,
            setup.resolve_sigma,
            setup.resolve_gamma,
            setup.embedding_bandwidth,
        )
        if c is not None
    )
    if owner is None or any(getattr(c, "__self__", None) is not owner for c in callables):
        return None
    if not all(hasattr(owner, a) for a in ("seed_", "task_kernel_", "_make_embedding")):
        return None
    data, maps = setup.data, setup.data.maps
    h = hashlib.blake2b(digest_size=20)
    for value in (
        data.tasks,
        data.Y,
        data.loss,
        data.epsilon,
        maps.point_kernel,
        maps.point_frequencies,
        maps.joint_frequencies,
        maps.linear_centre,
        maps.linear_scale,
        setup.emb_tasks,
        list(setup.folds),
        setup.alphas,
        setup.task_kernel.name,
        sorted(setup.task_kernel.params.items()),
        [getattr(c, "__qualname__", repr(c)) for c in (*callables, setup.error)],
        setup.cv_points,
        setup.seed,
        # What the bound callables read of their estimator: the seed (the median
        # heuristic's subsample, the embedding's draws), the task kernel, the embedding.
        owner.seed_,
        owner.task_kernel_.name,
        sorted(owner.task_kernel_.params.items()),
        type(owner._make_embedding()).__qualname__,
        sorted(owner._make_embedding().get_params(deep=False).items()),
        type(strategy).__qualname__,
        sorted(vars(strategy).items()),
    ):
        _update(h, value)
    return h.hexdigest()


class FoldEvaluator:
    """Validation errors of candidate configurations, with caches shared across them.

    Within :func:`reusing_fold_evaluations` a plain evaluator (no transform, not a
    subclass) takes its caches, and the errors of configurations already evaluated,
    from an earlier evaluator of the same setup.
    """

    def __init__(self, setup: SearchSetup, strategy: SolverStrategy):
        self.setup = setup
        self.strategy = strategy
        self._embeddings: dict[
            tuple[int, float], tuple[NDArray[np.float64], NDArray[np.float64], Any]
        ] = {}
        self._medians: dict[str, float | None] = {}
        #: Per configuration: validation error per fold and ``λ``, shape (folds, λ).
        self.fold_errors: dict[tuple[Any, ...], NDArray[np.float64]] = {}
        #: Configurations whose evaluation stopped early (:meth:`score_unless`): their
        #: errors on the folds evaluated so far (by fold), resumed if asked again.
        self._partial: dict[tuple[Any, ...], dict[int, NDArray[np.float64]]] = {}
        self._held_out: dict[int, tuple[NDArray[np.float64], NDArray[np.float64]]] = {}
        self._held_out_picks: dict[int, NDArray[np.int64]] = {}
        self._strategy_cache: dict[Hashable, Any] = {}
        #: Errors of this setup's configurations evaluated by any fit in the block.
        self._reused_errors: dict[tuple[Any, ...], NDArray[np.float64]] | None = None
        reused = _REUSED.get()
        if reused is not None and type(self) is FoldEvaluator:
            digest = _setup_digest(setup, strategy)
            if digest is not None:
                state = reused.setdefault(
                    digest,
                    {
                        "embeddings": self._embeddings,
                        "medians": self._medians,
                        "held_out": self._held_out,
                        "held_out_picks": self._held_out_picks,
                        "strategy": self._strategy_cache,
                        "errors": {},
                        "partial": self._partial,
                    },
                )
                self._embeddings, self._medians = state["embeddings"], state["medians"]
                self._held_out, self._strategy_cache = state["held_out"], state["strategy"]
                self._held_out_picks = state["held_out_picks"]
                self._reused_errors, self._partial = state["errors"], state["partial"]

    def _fold_embedding(
        self, f: int, factor: float
    ) -> tuple[NDArray[np.float64], NDArray[np.float64], tuple[Embedding, Embedding]]:
        """Squared distances among fold ``f``'s training tasks and from its held-out tasks,
        and both embeddings, with a representation fitted on its training tasks only."""
        key = (f, factor)
        if key not in self._embeddings:
            train, val = self.setup.folds[f]
            rep, emb = self.setup.fit_embedding(
                self.setup.emb_tasks[train], factor, self._embedding_base()
            )
            val_emb = rep.embed(self._held_out_sources()[1][val])
            self._embeddings[key] = (emb.sq_distances(), val_emb.sq_distances(emb), (emb, val_emb))
        return self._embeddings[key]

    def _embedding_base(self) -> float | None:
        """The task representation's base bandwidth for every fold: its median
        heuristic on all the tasks, computed once (as the point bandwidth's, see
        :meth:`_sigma`); None where the setup gives no resolver (each fold's own)."""
        if self.setup.embedding_bandwidth is None:
            return None
        if "embedding" not in self._medians:
            self._medians["embedding"] = self.setup.embedding_bandwidth(self.setup.emb_tasks)
        return self._medians["embedding"]

    def _held_out_sources(self) -> tuple[Bags, Bags]:
        """The tasks held-out tasks are read from, and as their embeddings see them
        (the training tasks themselves; a subclass may hold them out transformed)."""
        return self.setup.data.tasks, self.setup.emb_tasks

    def _sigma(self, f: int, spec: Spec) -> float:
        """The point bandwidth of fold ``f``, the same for every fold: relative values
        scale the median heuristic of all the tasks' points, computed once.

        The median is a label-free statistic, and the final fit scales the same median
        of the same points: each fold evaluates the bandwidth the model will have. A
        fold's own median (a 2,000-point subsample of its training tasks, so ~1 % apart
        between folds) would give every fold its own ``σ``, and every task's feature
        statistics would be recomputed for each fold that trains on it.
        """
        kind, value = spec
        if kind == "absolute":
            return value
        if "all" not in self._medians:
            self._medians["all"] = self.setup.resolve_sigma(
                ("relative", 1.0), self.setup.data.tasks.points
            )
        return value * self._medians["all"]

    def _held_out_rows(self, v: int) -> NDArray[np.int64]:
        """Rows (of the held-out sources' points) held-out task ``v`` is scored on: at
        most ``cv_points``, drawn per task."""
        if v not in self._held_out_picks:
            tasks = self._held_out_sources()[0]
            lo, hi = int(tasks.offsets[v]), int(tasks.offsets[v + 1])
            pick = np.arange(lo, hi)
            if pick.size > self.setup.cv_points:
                # Seeded per task: a task is scored on the same points in every fold.
                rng = np.random.default_rng([self.setup.seed, v])
                pick = np.sort(rng.choice(pick, self.setup.cv_points, replace=False))
            self._held_out_picks[v] = pick
        return self._held_out_picks[v]

    def held_out_points(self, v: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Points (at most ``cv_points``, drawn per task) held-out task ``v`` is scored on."""
        if v not in self._held_out:
            pick = self._held_out_rows(v)
            self._held_out[v] = (self._held_out_sources()[0].points[pick], self.setup.data.Y[pick])
        return self._held_out[v]

    def _training_held_out_rows(self) -> dict[int, NDArray[np.int64]] | None:
        """Per task any fold holds out, the rows of the training points it is scored on,
        where held-out tasks are training tasks (else ``None``)."""
        if type(self)._held_out_sources is not FoldEvaluator._held_out_sources:
            return None
        held = {int(v) for _, val in self.setup.folds for v in val}
        return {v: self._held_out_rows(v) for v in sorted(held)}

    def _sharing(self, setup: SearchSetup) -> FoldEvaluator:
        """An evaluator of ``setup`` sharing this one's caches: the held-out points and
        the strategy's per-bandwidth statistics always, the per-fold embeddings when the
        folds are the same, the bandwidth when the tasks are."""
        other = FoldEvaluator(setup, self.strategy)
        other._held_out, other._held_out_picks = self._held_out, self._held_out_picks
        other._strategy_cache = self._strategy_cache
        if setup.folds is self.setup.folds:
            other._embeddings = self._embeddings
        if setup.data is self.setup.data:
            other._medians = self._medians
        return other

    def on_folds(self, folds: Folds) -> FoldEvaluator:
        """The same tasks on other folds."""
        return self._sharing(replace(self.setup, folds=folds))

    def transformed(self, transform: Transform, alpha: float) -> FoldEvaluator:
        """The same folds with every held-out task's scores passed through
        ``transform`` before its error, at the one ``λ`` ``alpha``."""
        return self._sharing(replace(self.setup, alphas=np.array([alpha]), transform=transform))

    @staticmethod
    def key(cand: dict[str, Any]) -> tuple[Any, ...]:
        """The configuration's identity; a pooled model ignores the task coordinates."""
        if cand["tau"] == 1.0:
            return (cand["sigma"], 1.0, None, 1.0)
        return (cand["sigma"], cand["tau"], cand["gamma"], cand["emb"])

    def score(self, cand: dict[str, Any]) -> NDArray[np.float64]:
        """Mean validation error (per task, then over folds) for each ``λ`` of the grid;
        each configuration is evaluated once (per-fold errors in :attr:`fold_errors`)."""
        mean = self.score_unless(cand, None)
        assert mean is not None
        return mean

    def score_unless(
        self, cand: dict[str, Any], cannot_win: Callable[[float], bool] | None
    ) -> NDArray[np.float64] | None:
        """:meth:`score`, a round of folds at a time (:meth:`_next_folds`), or ``None`` as
        soon as ``cannot_win`` holds for a lower bound of the configuration's best mean
        error (over ``λ``).

        Errors are never negative, so the mean over the folds evaluated so far, with
        the missing folds counted as zero, bounds the mean of them all from below.
        It is computed as the complete mean is (the same array shape, the same
        summation), and floating-point sums of non-negative terms are monotone in each
        term: the bound never exceeds the complete value the search would compare.
        A stopped evaluation resumes after its last fold when asked again.
        """
        key = self.key(cand)
        if key not in self.fold_errors:
            reused = self._reused_errors
            if reused is not None and key in reused:
                self.fold_errors[key] = reused[key].copy()
            else:
                rows = self._partial.setdefault(key, {})
                n_folds = len(self.setup.folds)
                while len(rows) < n_folds:
                    if cannot_win is not None and rows:
                        bound = np.zeros((n_folds, self.setup.alphas.size))
                        for f, row in rows.items():
                            bound[f] = row
                        if cannot_win(float(bound.mean(axis=0).min())):
                            return None
                    folds = self._next_folds(rows)
                    rows.update(zip(folds, self._fold_errors(cand, folds), strict=True))
                self.fold_errors[key] = np.array([rows[f] for f in range(n_folds)])
                del self._partial[key]
                if reused is not None:
                    reused[key] = self.fold_errors[key].copy()
        return self.fold_errors[key].mean(axis=0)

    def _next_folds(self, done: dict[int, NDArray[np.float64]]) -> list[int]:
        """The folds :meth:`score_unless` evaluates next, besides those ``done``, before it
        checks its bound again: one per core where the strategy can evaluate folds at
        once, and the last few together rather than one alone; else one.

        The folds on which the configurations evaluated so far erred most come first:
        a configuration that cannot win mostly shows it there, so its bound reaches
        its bar after fewer folds. The order changes only which folds a stopped
        evaluation skipped; a complete one has every fold, each computed as alone.
        """
        n_folds = len(self.setup.folds)
        seen = np.zeros(n_folds)
        for errors in self.fold_errors.values():
            seen += errors.min(axis=1)
        for rows in self._partial.values():
            for f, row in rows.items():
                seen[f] += row.min()
        left = sorted((f for f in range(n_folds) if f not in done), key=lambda f: -seen[f])
        at_once = n_threads_for(-1) if self.strategy.concurrent_folds else 1
        if at_once > 1 and len(left) <= at_once + 1:
            return left
        return left[:at_once]

    def _fold_errors(self, cand: dict[str, Any], folds: list[int]) -> list[NDArray[np.float64]]:
        """Validation errors of ``cand`` on ``folds``, each per ``λ``.

        What the folds share (the median bandwidths, the held-out points, the
        strategy's statistics of the tasks they train on) is computed first, on this
        thread; each fold's own work (its embedding, its ridge path, its held-out
        scores) then runs on a thread of its own. A fold computes what it would alone,
        so the errors are the same to the last bit.
        """
        setup = self.setup
        sigmas = [self._sigma(f, cand["sigma"]) for f in folds]
        if cand["tau"] != 1.0:
            self._embedding_base()
        for f in folds:
            for v in setup.folds[f][1]:
                self.held_out_points(int(v))
        self.strategy.prepare_folds(
            setup.data,
            [(s, setup.folds[f][0]) for s, f in zip(sigmas, folds, strict=True)],
            self._strategy_cache,
            self._training_held_out_rows(),
        )
        if len(folds) == 1:
            return [self._fold_error(cand, folds[0])]
        with ThreadPoolExecutor(len(folds)) as pool:
            runs = [pool.submit(copy_context().run, self._fold_error, cand, f) for f in folds]
            return [run.result() for run in runs]

    def _fold_error(self, cand: dict[str, Any], f: int) -> NDArray[np.float64]:
        """Validation error of ``cand`` on fold ``f``, per ``λ``."""
        return np.asarray(
            self.strategy.fold_errors(
                self._validation_fold(cand, f), self.setup.alphas, self._strategy_cache
            ),
            dtype=np.float64,
        )

    def _validation_fold(self, cand: dict[str, Any], f: int) -> ValidationFold:
        """Fold ``f`` at configuration ``cand``, with its embeddings and bandwidths."""
        setup = self.setup
        train, val = setup.folds[f]
        if cand["tau"] == 1.0:
            # The pooled model ignores the tasks' distributions: no embedding to fit.
            sq_tr = np.zeros((train.size, train.size))
            sq_va = np.zeros((val.size, train.size))
            embeddings = None
            gamma = None
        else:
            sq_tr, sq_va, embeddings = self._fold_embedding(f, cand["emb"])
            gamma = setup.resolve_gamma(cand["gamma"], sq_tr)
        return ValidationFold(
            data=setup.data,
            train=train,
            val=val,
            params=KernelParameters(
                sigma=self._sigma(f, cand["sigma"]), tau=cand["tau"], gamma=gamma
            ),
            kp_train=task_similarity(setup.task_kernel, sq_tr, gamma),
            kp_val=task_similarity(setup.task_kernel, sq_va, gamma),
            embeddings=embeddings,
            held_out=[self.held_out_points(int(v)) for v in val],
            error=setup.error,
            transform=setup.transform,
        )

    def per_fold(self, best: dict[str, Any]) -> NDArray[np.float64]:
        """Validation error per fold of an evaluated configuration at its ``alpha``."""
        li = int(np.argmin(np.abs(self.setup.alphas - best["alpha"])))
        return self.fold_errors[self.key(best)][:, li]

    def best(self, keys: list[tuple[Any, ...]] | None = None) -> tuple[tuple[Any, ...], int]:
        """The evaluated configuration (among ``keys``) and ``λ`` index of least mean error."""
        keys = list(self.fold_errors) if keys is None else keys
        means = {k: self.fold_errors[k].mean(axis=0) for k in keys}
        key = min(means, key=lambda k: means[k].min())
        return key, int(np.argmin(means[key]))


def coordinate_search(evaluator: FoldEvaluator, grid: dict[str, list[Any]]) -> dict[str, Any]:
    """Cross-validated search, coordinate-wise as the authors' code does it.

    (1) the pooled model (``τ = 1``) over the point bandwidths (without a pooled
    model in the grid: the first share ``τ`` over them); at that bandwidth
    (2) the shares of pooling ``τ < 1`` with the middle ``γ_P`` and embedding
    bandwidth, (3) the other ``γ_P`` at the best ``τ``, (4) the other embedding
    bandwidths. Every evaluation covers the whole ``λ`` grid. The best configuration
    seen wins, the pooled model included: MTL against pooling is decided by the same
    cross-validation (on the folds of the evaluator).

    Candidates that cannot win are not evaluated to the end. Each step keeps the
    option of least mean error (the first among equals), so an option whose lower
    bound (:meth:`FoldEvaluator.score_unless`) already reaches an option before it,
    or exceeds one after it, cannot be the step's choice: its evaluation stops.
    Once a configuration errs on no fold (at its best ``λ``), nothing visited later
    can be strictly better and the search ends: the choice and its errors are those
    of the complete search, whose further configurations would only have been
    recorded. The rest of that step's options are recorded unevaluated, so the grid
    the record shows around the choice (its grid-edge warnings, the grids training
    widens) is the complete search's.

    In the last step that evaluates new configurations, an option whose bound
    reaches the least error of the configurations evaluated so far cannot be the
    search's answer either (the first among equals is the one visited first), and
    its evaluation stops too: nothing after that step depends on its choice. (In an
    earlier step it would: the next steps start from its choice, so there the options
    are compared with each other only.) A last step worse than an earlier
    configuration (the task bandwidths where the pooled model fits clearly better,
    the synthetic batches of ``bench/bench_training.py``) then costs a round of folds
    instead of all of them. Every step's choice that a later step starts from, and the
    search's answer, are the complete search's.

    Parameters
    ----------
    evaluator : FoldEvaluator
    grid : dict
        Values of ``"sigma"``, ``"tau"``, ``"gamma"`` and ``"emb"`` (first = default).

    Returns
    -------
    dict
        The selection record: every configuration visited, with its CV error per
        ``λ`` or, if its evaluation stopped, the folds it was evaluated on
        (``pruned_after``) and the bound it stopped at (``bound``); the ``λ`` grid,
        the folds, and the best configuration with its ``alpha``.
    """
    alphas = evaluator.setup.alphas
    others = [t for t in grid["tau"] if t != 1.0]
    bound = len(grid["sigma"]) + len(others) + len(grid["gamma"]) + len(grid["emb"])
    bar = progress_bar(bound, "marginal transfer: search", "config")
    visited: list[tuple[Any, ...]] = []

    def visit(c: dict[str, Any]) -> None:
        key = FoldEvaluator.key(c)
        if key not in visited:
            visited.append(key)
            bar.update(1)

    def value(c: dict[str, Any], cannot_win: Callable[[float], bool]) -> float | None:
        visit(c)
        mean = evaluator.score_unless(c, cannot_win)
        return None if mean is None else float(mean.min())

    # Set once a configuration errs on no fold: nothing visited later can beat it.
    unbeatable = False
    # The bound each stopped configuration last stopped at.
    bounds: dict[tuple[Any, ...], float] = {}

    def least_error() -> float:
        done = [evaluator.fold_errors[k] for k in visited if k in evaluator.fold_errors]
        return min((float(e.mean(axis=0).min()) for e in done), default=np.inf)

    def best_of(
        current: dict[str, Any], options: list[dict[str, Any]], last: bool
    ) -> dict[str, Any]:
        # The option of least error, the first among equals, as min() over complete
        # evaluations would pick it. Options evaluated in an earlier step are known
        # and bound those before them in the list too. In the last step that
        # evaluates anything (``last``) the choice only matters if it is the search's
        # answer: there an option that cannot beat the best configuration seen stops
        # too, and if every option stops, what the step returns is never used.
        nonlocal unbeatable
        if unbeatable:
            return current
        keys = [FoldEvaluator.key(o) for o in options]
        known = {
            i: float(evaluator.fold_errors[k].mean(axis=0).min())
            for i, k in enumerate(keys)
            if k in evaluator.fold_errors
        }
        best_seen = least_error() if last else np.inf
        chosen: tuple[int, float] | None = None
        for i, option in enumerate(options):
            before = chosen[1] if chosen is not None else np.inf
            after = min((v for j, v in known.items() if j > i), default=np.inf)

            def cannot_win(lb: float, i: int = i, b: float = before, a: float = after) -> bool:
                bounds[keys[i]] = lb
                return lb >= b or lb > a or lb >= best_seen

            v = value(option, cannot_win)
            if v is not None and (chosen is None or v < chosen[1]):
                chosen = (i, v)
                if v == 0.0:
                    unbeatable = True
                    # The step's other values are recorded unevaluated: its grid, and
                    # whether the choice sits on an edge of it, stay what they were.
                    for later in options[i + 1 :]:
                        visit(later)
                    break
        return options[chosen[0]] if chosen is not None else current

    def middle(values: list[Any]) -> Any:
        return values[len(values) // 2]

    current = {k: v[0] for k, v in grid.items()}
    more_gammas, more_embs = len(grid["gamma"]) > 1, len(grid["emb"]) > 1
    if 1.0 in grid["tau"]:
        current = best_of(
            current, [{**current, "sigma": s, "tau": 1.0} for s in grid["sigma"]], not others
        )
    if others:
        gamma, emb = middle(grid["gamma"]), middle(grid["emb"])
        if 1.0 not in grid["tau"]:
            # No pooled model to choose the point bandwidth: the first share does.
            current = best_of(
                current,
                [{**current, "sigma": s, "tau": others[0], "gamma": gamma, "emb": emb}
                 for s in grid["sigma"]],
                False,
            )  # fmt: skip
        current = best_of(
            current,
            [{**current, "tau": t, "gamma": gamma, "emb": emb} for t in others],
            not (more_gammas or more_embs),
        )
        current = best_of(current, [{**current, "gamma": g} for g in grid["gamma"]], not more_embs)
        current = best_of(current, [{**current, "emb": e} for e in grid["emb"]], True)
    bar.close()
    key, li = evaluator.best([k for k in visited if k in evaluator.fold_errors])
    best = {"sigma": key[0], "tau": key[1], "gamma": key[2], "emb": key[3]}
    best["alpha"] = float(alphas[li])
    entries = []
    for k in visited:
        entry: dict[str, Any] = {"sigma": k[0], "tau": k[1], "gamma": k[2], "emb": k[3]}
        if k in evaluator.fold_errors:
            entry["cv_error"] = evaluator.fold_errors[k].mean(axis=0).tolist()
        else:
            entry["pruned_after"] = len(evaluator._partial.get(k, {}))
            if k in bounds:
                entry["bound"] = bounds[k]
        entries.append(entry)
    return {
        "evaluated": entries,
        "alpha_grid": alphas,
        "folds": evaluator.setup.folds,
        "best": best,
    }


def one_standard_error_choice(per_fold: dict[str, NDArray[np.float64]]) -> str:
    """The first option (simplest first) whose mean fold error exceeds the least one by
    at most one standard error of their paired per-fold difference (Hastie,
    Tibshirani and Friedman, *Elements of Statistical Learning*, §7.10)."""
    best = min(per_fold, key=lambda n: per_fold[n].mean())
    for name, errs in per_fold.items():
        diff = errs - per_fold[best]
        se = float(diff.std(ddof=1) / np.sqrt(diff.size)) if diff.size > 1 else 0.0
        if diff.mean() <= se:
            return name
    return best  # pragma: no cover - the best option itself always qualifies


def one_standard_error_record(
    per_fold: dict[str, NDArray[np.float64]], rule: str, **extra: Any
) -> dict[str, Any]:
    """The choice among ``per_fold``'s options (:func:`one_standard_error_choice`) as the
    fit records it in ``selection_``: the ``rule`` in words, anything ``extra``, each
    option's mean and per-fold errors, and the option ``chosen``."""
    return {
        "rule": rule,
        **extra,
        "cv_error": {n: float(np.mean(e)) for n, e in per_fold.items()},
        "fold_errors": {n: np.asarray(e).tolist() for n, e in per_fold.items()},
        "chosen": one_standard_error_choice({n: np.asarray(e) for n, e in per_fold.items()}),
    }


def choose_refinement(
    members: list[tuple[FoldEvaluator, dict[str, Any]]],
    transform: Transform,
    name: str,
    unless_worse: bool = False,
) -> dict[str, Any]:
    """Whether a post-processing of each task's answer (``transform``, called ``name``)
    is applied: by the one-standard-error rule, without it first (it must help by more
    than the folds' noise), or, with ``unless_worse``, unless its mean fold error is
    higher than without it (folds that cannot show its gain, where it stays as long as
    they show no harm either).

    Each member (an evaluator and its chosen configuration) is scored with and without
    ``transform`` on its own folds, at its chosen ``λ``; a model of several members
    (a blend) counts, fold by fold, as its worst member, as its disagreement bound does.

    Returns
    -------
    dict
        ``cv_error`` and ``fold_errors`` of ``"none"`` and ``name``, and ``chosen``.
    """
    per_fold: dict[str, NDArray[np.float64]] = {
        "none": np.max([ev.per_fold(best) for ev, best in members], axis=0),
    }
    with_it = []
    for ev, best in members:
        other = ev.transformed(transform, best["alpha"])
        other.score(best)
        with_it.append(other.fold_errors[FoldEvaluator.key(best)][:, 0])
    per_fold[name] = np.max(with_it, axis=0)
    if unless_worse:
        rule = "with it unless its mean fold error is higher"
        chosen = name if per_fold[name].mean() <= per_fold["none"].mean() else "none"
    else:
        rule, chosen = "one standard error, without it first", one_standard_error_choice(per_fold)
    return {
        "rule": rule,
        "cv_error": {n: float(e.mean()) for n, e in per_fold.items()},
        "fold_errors": dict(per_fold),
        "chosen": chosen,
    }


def choose_normalisation(
    evaluators: dict[str, FoldEvaluator], cand: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The per-task normalisation, by the one-standard-error rule.

    Each candidate (keys of ``evaluators``, simplest first) is scored at one
    configuration ``cand`` (the pooled model at the middle point bandwidth, where the
    strategy has one), on the same folds, at its best ``λ``. The first candidate whose
    mean error exceeds the least one by at most one standard error of their paired
    per-fold difference is chosen (Hastie, Tibshirani and Friedman, *Elements of
    Statistical Learning*, §7.10): a normalisation is applied only where the folds
    show it helps by more than their noise.

    Parameters
    ----------
    evaluators : dict
        One evaluator per normalisation, on the same folds, simplest first.
    cand : dict
        The configuration (``sigma``, ``tau``, ``gamma``, ``emb``) they are compared at.

    Returns
    -------
    name : str
    record : dict
        Per candidate its CV error and per-fold errors, the order, the choice.
    """
    bar = progress_bar(len(evaluators), "marginal transfer: normalisation", "option")
    per_fold: dict[str, NDArray[np.float64]] = {}
    for name, ev in evaluators.items():
        mean = ev.score(cand)
        per_fold[name] = ev.fold_errors[FoldEvaluator.key(cand)][:, int(np.argmin(mean))]
        bar.update(1)
    bar.close()
    record = one_standard_error_record(
        per_fold, "one standard error, simplest first", order=list(evaluators)
    )
    return record["chosen"], record
