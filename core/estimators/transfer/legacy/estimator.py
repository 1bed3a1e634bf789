"""Domain generalisation by marginal transfer learning (paper 004, Blanchard et al.).

Training data are ``N`` labelled *tasks* (one patient's cells with their gates); a new
task arrives unlabelled and every one of its points gets a label. The decision
function acts on augmented points ``x̃ = (P, x)`` where ``P`` is the empirical
distribution of the point's own task, with the product kernel

    k̄((P, x), (P', x')) = k_X(x, x') · (τ + (1 - τ) k_P(P, P'))          (paper 004 eq. 8)

``k_P`` a kernel on the distance between task embeddings (any representation of the
core, the exact mean embedding by default) and ``τ`` a share of pooling: ``τ = 1`` is
the pooled model (``k_P ≡ 1``), ``τ = 0`` the paper's kernel. Every point is weighted
``1 / (N n_i)`` so every task counts equally (eq. 7), and there is no bias term.

Three solver strategies behind ``solver=`` and ``task_map=``, one module each, all
behind :class:`~.strategy.SolverStrategy`:

* ``solver="exact"`` (:mod:`.exact`): the kernel matrix over all training
  points, with the paper's bias-free weighted SVM / SVR (hinge / ε-insensitive) or
  weighted kernel ridge. Small data.
* ``solver="random_features"``: explicit features, a weighted ridge, cost linear in the
  total number of points. ``task_map="nystroem"`` (default, :mod:`.nystroem`)
  uses random Fourier features ``z(x)`` for ``k_X`` and the *exact* Nyström map of
  ``k_P`` over the ``N`` training tasks, ``ψ(P) = Λ^{-1/2} Uᵀ k_P(P_train, P)``, so the
  joint feature is ``[√τ, √(1-τ) ψ(P)] ⊗ z(x)``: exact on the training tasks and
  vanishing for a task unlike all of them, where the model falls back to its pooled part
  ``√τ w_0``. ``task_map="rff"`` (:mod:`.paper_rff`) is the paper's §7.2
  construction (an RFF mean embedding concatenated with ``x``, a second RFF layer), kept
  for comparison: far from the training tasks its features do not vanish and it
  predicts noise.

The estimator validates the parameters, fits, routes each new task to the model that
answers it and keeps the fitted state under the attribute names model artifacts store;
the strategy does the numerics. Its other concepts have a module each, mixed into it:

* :mod:`.search` — folds, grids and the hyperparameter search (fold
  evaluations in :mod:`.cv`);
* :mod:`.fallback` — the invariant fallback for tasks out of range, and the
  disagreement test between it and the primary model;
* :mod:`.calibration` — calibrating a new batch to the training reference
  (landmarks, quantiles, an MMD map), chosen on held-out batches;
* :mod:`.reject` — the rest class and the cells no population claims;
* :mod:`.refine` — the per-task mixture refinement of labels;
* :mod:`.reports` — what each prediction reports per new task
  (:class:`TaskReport`: similarity to the nearest training tasks, out of range, which
  model answered).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from ...._random import check_generator
from ....alignment import CONTROL_LEVELS, control_map
from ....bags import (
    Bags,
    BagValidationError,
    as_bags,
    bag_quantiles,
    normalise_each_bag,
    subsample_bags,
)
from ....blas import one_thread
from ....domain import NEAREST, DomainReport
from ....kernels import get_kernel
from ....representations.base import BagRepresentation, Embedding
from ....representations.mean import sharing_median_distances
from ..._grid_choices import GridChoice, transfer_choices, warn_grid_edges
from ..reports import TaskPrediction, TaskReport, calibration_arrays
from ..trees import fit_task_trees, tree_scores
from .calibration import CalibrationMixin
from .cv import content_digest, release_kept_searches
from .exact import ExactKernelStrategy
from .fallback import FallbackMixin
from .nystroem import NystroemFeatureStrategy
from .paper_rff import PaperRFFStrategy
from .refine import refine_scores
from .reject import OpenSetMixin, far_from_populations, reject_scores
from .search import SearchMixin
from .strategy import (
    POINT_KERNELS,
    FeatureMaps,
    KernelParameters,
    NewTasks,
    SolverStrategy,
    TrainingData,
    TrainingProblem,
    task_similarity,
)

__all__ = [
    "MarginalTransferClassifier",
    "MarginalTransferRegressor",
    "TaskPrediction",
    "TaskReport",
]

#: Per-task normalisations, simplest first: ``normalise="auto"`` applies one only where
#: the folds show it helps (:func:`~.cv.choose_normalisation`).
NORMALISATIONS = ("none", "standard", "quantile")
#: Refinements of a new task's labels, simplest first (:mod:`.refine`).
REFINEMENTS = ("none", "mixture")


def _as_tasks(X: Any) -> tuple[Bags, bool]:
    """Tasks as :class:`Bags`; a single 2-D array is one task (flag returned)."""
    if isinstance(X, np.ndarray) and X.ndim == 2:
        return Bags.from_arrays([X]), True
    return as_bags(X), False


def _single_point_problems(tasks: Bags) -> list[str]:
    """Policy: a task needs at least 2 points, in training and at prediction alike, since
    its distribution (the model's other input) cannot be estimated from one cell."""
    return [
        f"task {int(t)} has a single point: its distribution cannot be estimated"
        for t in np.flatnonzero(tasks.sizes < 2)
    ]


def _as_partner(model: Any, partner: Any) -> Any:
    """``partner`` as ``model``'s blend partner (``model.blend_``). Its
    ``shares_task_view_`` records that it normalises and embeds new tasks as ``model``
    does (the same normalisation, and the one embedding a fit makes of the same tasks,
    see ``_fit_final``): its answers then start from ``model``'s normalised tasks and
    task similarities instead of computing them again (a quarter of a blended model's
    prediction time on 10^5-cell samples)."""
    partner.shares_task_view_ = bool(
        partner.normalise_ == model.normalise_
        and partner.train_embedding_ is model.train_embedding_
    )
    return partner


class _MarginalTransfer(SearchMixin, CalibrationMixin, FallbackMixin, OpenSetMixin, BaseEstimator):
    """Shared implementation; see :class:`MarginalTransferClassifier`."""

    _is_classifier = False

    def __init__(
        self,
        solver: Literal["random_features", "exact"] = "random_features",
        task_map: Literal["nystroem", "rff"] = "nystroem",
        loss: str | None = None,
        embedding: BagRepresentation | None = None,
        embedding_points: int | None = 500,
        task_kernel: str = "gaussian",
        task_gamma: float | ArrayLike | None = None,
        point_kernel: Literal["gaussian", "linear", "gaussian+linear"] | None = None,
        point_bandwidth: float | ArrayLike | None = None,
        tau: float | ArrayLike | None = None,
        pooling: bool = False,
        alpha: float | ArrayLike | None = None,
        epsilon: float = 0.1,
        n_components: int = 128,
        cv: int = 5,
        cv_repeats: int = 1,
        cv_points: int = 2000,
        range_factor: float = 1.5,
        max_exact_points: int = 4000,
        normalise: Literal["auto", "standard", "quantile", "none"] = "auto",
        refine: Literal["auto", "mixture", "none"] = "auto",
        unassigned: Any = None,
        reject: Literal["auto", "off"] | float = "auto",
        calibrate: Literal["auto", "none", "quantile", "mmd"] = "auto",
        random_state: Any = None,
    ):
        self.solver = solver
        self.task_map = task_map
        self.loss = loss
        self.embedding = embedding
        self.embedding_points = embedding_points
        self.task_kernel = task_kernel
        self.task_gamma = task_gamma
        self.point_kernel = point_kernel
        self.point_bandwidth = point_bandwidth
        self.tau = tau
        self.pooling = pooling
        self.alpha = alpha
        self.epsilon = epsilon
        self.n_components = n_components
        self.cv = cv
        self.cv_repeats = cv_repeats
        self.cv_points = cv_points
        self.range_factor = range_factor
        self.max_exact_points = max_exact_points
        self.normalise = normalise
        self.refine = refine
        self.unassigned = unassigned
        self.reject = reject
        self.calibrate = calibrate
        self.random_state = random_state

    # ================================================================= validation
    def _strategy(self) -> SolverStrategy:
        """The solver strategy that ``solver`` and ``task_map`` name.

        Derived from the parameters on every call, never stored: artifacts save the
        fitted attributes only, and a loaded model derives the same strategy.
        """
        if self.solver not in ("exact", "random_features"):
            raise ValueError(f"solver must be 'exact' or 'random_features', got {self.solver!r}")
        if self.task_map not in ("nystroem", "rff"):
            raise ValueError(f"task_map must be 'nystroem' or 'rff', got {self.task_map!r}")
        if self.solver == "exact":
            return ExactKernelStrategy()
        return PaperRFFStrategy() if self.task_map == "rff" else NystroemFeatureStrategy()

    def _loss(self, strategy: SolverStrategy) -> str:
        # Default first: the paper's margin loss (§7.1), for the strategies that can fit it.
        allowed = (
            ("hinge", "squared") if self._is_classifier else ("epsilon_insensitive", "squared")
        )
        if self.point_kernel is not None and self.point_kernel not in POINT_KERNELS:
            raise ValueError(
                f"point_kernel must be one of {POINT_KERNELS} or None, got {self.point_kernel!r}"
            )
        loss = self.loss or strategy.default_loss(allowed)
        if loss not in allowed:
            raise ValueError(f"loss must be one of {allowed}, got {loss!r}")
        # The pooling baseline is the model at τ = 1.
        strategy.check_parameters(
            loss, self._point_kernel(strategy), 1.0 if self.pooling else self.tau
        )
        return loss

    def _point_kernel(self, strategy: SolverStrategy) -> str:
        """``point_kernel``, or its default: the Gaussian plus the low-capacity linear
        part, except for the paper's two-layer map (Gaussian only, §7.2)."""
        if self.point_kernel is not None:
            return self.point_kernel
        return "gaussian" if isinstance(strategy, PaperRFFStrategy) else "gaussian+linear"

    def _normalisations(self) -> tuple[str, ...]:
        """The normalisations the fit considers (``"auto"``: all, in preference order)."""
        if self.normalise == "auto":
            return NORMALISATIONS
        if self.normalise not in NORMALISATIONS:
            raise ValueError(
                f"normalise must be 'auto' or one of {NORMALISATIONS}, got {self.normalise!r}"
            )
        return (self.normalise,)

    def _refinements(self) -> tuple[str, ...]:
        """The refinements the fit considers (``"auto"``: none or the per-task mixture,
        by the folds; regressors have none)."""
        if self.refine not in (*REFINEMENTS, "auto"):
            raise ValueError(f"refine must be 'auto', 'mixture' or 'none', got {self.refine!r}")
        if not self._is_classifier:
            if self.refine == "mixture":
                raise ValueError("refine='mixture' labels a task's points: classifiers only")
            return ("none",)
        return REFINEMENTS if self.refine == "auto" else (self.refine,)

    def _labels(self, y: ArrayLike, tasks: Bags) -> NDArray[np.float64]:
        """Per-point targets as a float matrix (n_points, n_outputs)."""
        if (
            isinstance(y, list | tuple)
            and len(y) == len(tasks)
            and all(np.ndim(part) >= 1 for part in y)
        ):
            problems = [
                f"task {t}: {len(part)} label(s) for {n} point(s)"
                for t, (part, n) in enumerate(zip(y, tasks.sizes, strict=True))
                if len(part) != n
            ]
            if problems:
                raise BagValidationError(problems)
            y = np.concatenate([np.asarray(part) for part in y])
        y = np.asarray(y)
        if y.shape[0] != tasks.n_points:
            raise BagValidationError(
                [f"got {y.shape[0]} label(s) for {tasks.n_points} point(s) in {len(tasks)} task(s)"]
            )
        return self._encode(y)

    # ================================================================= fitting
    def fit(
        self,
        X: Any,
        y: ArrayLike,
        groups: ArrayLike | None = None,
        control: ArrayLike | None = None,
    ) -> _MarginalTransfer:
        """Fit on labelled training tasks.

        Parameters
        ----------
        X : Bags, list of 2-D arrays, or 3-D array
            One bag of points per training task (patient).
        y : array-like of shape (n_points,) or list of per-task arrays
            A label (or value) for every point, task after task.
        groups : array-like of shape (n_tasks,), optional
            The batch (centre, run, instrument) of every task. With two batches or
            more, each model is chosen on folds like the tasks it will answer. Where
            the fit searches an invariant fallback (``normalise="auto"`` and the
            normalisation chosen is not standardisation), the fallback, which answers
            new tasks out of range (most likely another batch), is chosen by
            leave-one-batch-out cross-validation and kept only where it beats the
            primary model there; the primary, which answers the tasks in range (new
            samples of batches like the training ones), leave-tasks-out. Otherwise
            the one model answers every task and is chosen leave-one-batch-out. The
            normalisation itself is chosen leave-tasks-out.
        control : array-like of shape (m, d), optional
            The training batch's *reference control*: a tube of one material measured
            in every batch. Kept as its quantiles (``control_quantiles_``), so that a
            new batch's control, given to :meth:`predict_tasks`, maps every sample of
            that batch onto the training batch before any model sees it
            (:func:`~core.alignment.control_map`). The tasks must then be one batch:
            with ``groups`` of two batches or more, a control cannot say which.
        """
        self._keep_control(control, groups)
        # The search, the final fits and the fallback's ask for the same medians, and
        # share their data (_training_data) and task embeddings (_fit_final); nothing
        # of it stays on the model.
        self._fit_memo: dict[tuple[Any, ...], Any] = {}
        try:
            with sharing_median_distances():
                self._fit_tasks(X, y, groups)
        finally:
            del self._fit_memo
        # Warned from here, so that the warning points at the caller's fit().
        warn_grid_edges(self)
        return self

    def _keep_control(self, control: ArrayLike | None, groups: ArrayLike | None) -> None:
        """The training batch's reference control, as quantiles (or none)."""
        self.control_quantiles_ = self.control_scale_ = None
        if control is None:
            return
        if groups is not None and np.unique(np.asarray(groups)).size > 1:
            raise ValueError(
                "a reference control belongs to one batch: fit with groups of one batch, "
                "or without the control"
            )
        cells = np.asarray(control, dtype=np.float64)
        if cells.ndim != 2 or cells.shape[0] < 2 * CONTROL_LEVELS.size:
            raise BagValidationError(
                [
                    f"the reference control must be cells x markers with at least "
                    f"{2 * CONTROL_LEVELS.size} cells, got shape {cells.shape}"
                ]
            )
        if not np.isfinite(cells).all():
            raise BagValidationError(["the reference control contains NaN or Inf"])
        self.control_quantiles_ = np.quantile(cells, CONTROL_LEVELS, axis=0)
        self.control_scale_ = cells.std(axis=0)

    def _apply_control(self, raw: Bags, control: ArrayLike | None) -> tuple[Bags, list[Any]]:
        """``raw`` mapped by its batch's control onto the training batch, and each
        task's calibration report; ``raw`` as it is without a control."""
        if control is None:
            return raw, [None] * len(raw)
        reference = getattr(self, "control_quantiles_", None)
        if reference is None:
            raise ValueError(
                "this model was fitted without a reference control (fit(..., control=)): "
                "a batch's control has nothing to be mapped onto"
            )
        cells = np.asarray(control, dtype=np.float64)
        if cells.ndim != 2 or cells.shape[1] != raw.dim:
            raise BagValidationError(
                [f"the control has shape {cells.shape}; the samples have {raw.dim} markers"]
            )
        if not np.isfinite(cells).all():
            raise BagValidationError(["the control contains NaN or Inf"])
        mapping, quality = control_map(cells, reference, self.control_scale_)
        mapped = mapping(raw.points)
        unit = np.where(self.control_scale_ > 0, self.control_scale_, 1.0)
        moved = np.abs(mapped - raw.points) / unit
        qualities = [
            replace(quality, moved=np.median(moved[lo:hi], axis=0))
            for lo, hi in zip(raw.offsets[:-1], raw.offsets[1:], strict=True)
        ]
        return Bags(mapped, raw.offsets, raw.weights, validate=False), qualities

    def _fit_tasks(self, X: Any, y: ArrayLike, groups: ArrayLike | None) -> None:
        """:meth:`fit`'s work."""
        strategy = self._strategy()
        loss = self._loss(strategy)
        choices = self._normalisations()
        refinements = self._refinements()
        raw, _ = _as_tasks(X)
        Y = self._labels(y, raw)
        N = len(raw)
        if groups is not None:
            groups = np.asarray(groups)
            if groups.shape != (N,):
                raise BagValidationError(
                    [f"groups must give one batch per task: {N} task(s), got {groups.shape}"]
                )
        if _single_point_problems(raw):
            raise BagValidationError(_single_point_problems(raw))
        too_large = strategy.size_problems(raw.n_points, self.max_exact_points)
        if too_large:
            raise BagValidationError(too_large)
        self.n_features_in_ = raw.dim
        self.n_tasks_ = N
        self.loss_ = loss
        self.point_kernel_ = self._point_kernel(strategy)
        rng = check_generator(self.random_state)
        self.seed_ = int(rng.integers(2**31))
        self.task_kernel_ = get_kernel(self.task_kernel)
        if self.task_kernel_.uses_inner_product:
            raise ValueError("task_kernel must be a radial kernel on embedding distances")
        # Standard normal directions shared by every bandwidth candidate (smooth CV).
        half = max(1, int(self.n_components) // 2)
        self.point_frequencies_ = rng.standard_normal((half, raw.dim))
        self.joint_frequencies_ = strategy.draw_joint_frequencies(rng, half, raw.dim)
        # The quantile reference is the training tasks' mean quantiles: no labels used,
        # so every fold of the search may share it.
        self.quantile_reference_ = (
            bag_quantiles(raw).mean(axis=0) if "quantile" in choices else None
        )
        variants = {n: normalise_each_bag(raw, n, self.quantile_reference_) for n in choices}

        grid, alphas = self._grid(strategy)
        sizes = [len(v) for v in grid.values()]
        if len(choices) > 1 or len(refinements) > 1 or max(sizes) > 1 or alphas.size > 1:
            # The search is thousands of small products: BLAS threads only add
            # synchronisation (and spin badly when the cores are busy).
            with one_thread():
                chosen, best = self._search(strategy, variants, Y, grid, alphas, groups, raw)
            release_kept_searches(strategy)
        else:
            chosen = choices[0]
            best = {name: values[0] for name, values in grid.items()}
            best["alpha"] = float(alphas[0])
            self.selection_ = {"evaluated": [], "folds": [], "best": best}
        capacity = self.selection_.get("capacity") or {}
        if capacity.get("chosen") == "pooled linear":
            best = capacity["pooled_linear"]
            self.point_kernel_ = "linear"
        self._fit_on(strategy, variants[chosen], Y, chosen, best)
        self.blend_ = None
        if capacity.get("chosen") == "blend":
            self.blend_ = _as_partner(
                self,
                self._fixed_model(
                    strategy, variants[chosen], Y, capacity["pooled_linear"], normalise=chosen
                ),
            )
        self.refine_ = (self.selection_.get("refine") or {}).get("chosen", refinements[0])
        self._fit_open_set(variants[chosen], Y)
        if self._is_classifier:
            self._fit_landmarks(raw, Y)
        self._fit_calibration(raw, Y, groups)
        self.fallback_ = None
        record = self.selection_.get("normalisation") or {}
        self.disagreement_threshold_ = None
        if "fallback" in record:
            self.fallback_ = self._fixed_model(
                strategy, variants["standard"], Y, record["fallback"]
            )
            self.fallback_.refine_ = record["fallback_refine"]["chosen"]
            if record.get("fallback_model") == "boosted trees":
                self.fallback_.trees_ = fit_task_trees(variants["standard"], Y, self.seed_)
            if "fallback_blend" in record:
                self.fallback_.blend_ = _as_partner(
                    self.fallback_,
                    self._fixed_model(strategy, variants["standard"], Y, record["fallback_blend"]),
                )
            self.disagreement_threshold_ = self.range_factor * record["disagreement_bound"]

    def grid_choices(self) -> list[GridChoice]:
        """The coordinates of the search chosen from more than one value (see
        :mod:`._grid_choices`)."""
        return transfer_choices(self)

    def _fit_on(
        self, strategy: SolverStrategy, tasks: Bags, Y: NDArray[np.float64], how: str, best: dict
    ) -> None:
        """The final fit on ``tasks`` (normalised as ``how``) at the configuration ``best``."""
        self.normalise_ = how
        data = self._training_data(tasks, Y, self.loss_)
        self.linear_centre_, self.linear_scale_ = data.maps.linear_centre, data.maps.linear_scale
        emb_tasks = subsample_bags(data.tasks, self.embedding_points, self.seed_, canonical=True)
        self._fit_final(strategy, data, emb_tasks, best)

    def _training_data(
        self, tasks: Bags, Y: NDArray[np.float64], loss: str, point_kernel: str | None = None
    ) -> TrainingData:
        """The tasks with the feature maps of this fit (or of ``point_kernel``); the
        linear part of ``k_X`` is standardised by these tasks' pooled mean and standard
        deviation.

        Within :meth:`fit` the same tasks, targets, loss and kernel give the same
        object: the search's folds and the final fit then share what the strategy
        computed of them (:attr:`TrainingData.statistics`)."""
        kernel = point_kernel or self.point_kernel_
        memo = self.__dict__.get("_fit_memo")
        key = (id(tasks), id(Y), loss, kernel)
        if memo is not None and key in memo:
            return memo[key]
        sd = tasks.points.std(axis=0)
        maps = FeatureMaps(
            kernel,
            self.point_frequencies_,
            self.joint_frequencies_,
            tasks.points.mean(axis=0),
            np.where(sd > 0, sd, 1.0),
        )
        data = TrainingData(tasks, Y, maps, loss, self.epsilon)
        if memo is not None:
            memo[key] = data
        return data

    def _feature_maps(self) -> FeatureMaps:
        """``k_X`` and the random draws of the fit."""
        # Models saved before the linear part and the resolved kernel read as before.
        return FeatureMaps(
            getattr(self, "point_kernel_", None) or self.point_kernel or "gaussian",
            self.point_frequencies_,
            self.joint_frequencies_,
            getattr(self, "linear_centre_", None),
            getattr(self, "linear_scale_", None),
        )

    def _normalise(self, tasks: Bags) -> Bags:
        """Tasks normalised as the fit chose."""
        # Models saved before normalise_ existed had normalise "none" or "standard".
        how = getattr(self, "normalise_", None) or self.normalise
        return normalise_each_bag(tasks, how, getattr(self, "quantile_reference_", None))

    def _tasks(self, X: Any) -> Bags:
        """New tasks as :class:`Bags`, normalised as the fit chose."""
        return self._normalise(_as_tasks(X)[0])

    def _point_features(self, pts: NDArray[np.float64], sigma: float) -> NDArray[np.float64]:
        """Rows ``z(x)`` with ``z(x)ᵀz(x') ≈ k_X(x, x')`` (:meth:`FeatureMaps.point_features`)."""
        return self._feature_maps().point_features(pts, sigma)

    # ----------------------------------------------------------------- search

    # ----------------------------------------------------------------- final fit
    def _fit_final(
        self, strategy: SolverStrategy, data: TrainingData, emb_tasks: Bags, best: dict[str, Any]
    ) -> None:
        tasks = data.tasks
        N = len(tasks)
        self.point_bandwidth_ = self._sigma_value(best["sigma"], tasks.points)
        self.tau_ = best["tau"]
        self.alpha_ = float(best["alpha"])
        # A blend's members, and the fallback and its own, are fitted on the same tasks:
        # their embedding and its distances are computed once.
        memo = self.__dict__.get("_fit_memo")
        key = ("task embedding", content_digest(emb_tasks), best["emb"])
        if memo is not None and key in memo:
            rep, emb, sq = memo[key]
        else:
            rep, emb = self._fit_embedding(emb_tasks, best["emb"])
            sq = emb.sq_distances()
            if memo is not None:
                sq.flags.writeable = False  # read by every model that shares it
                memo[key] = (rep, emb, sq)
        self.embedding_ = rep
        self.train_embedding_ = emb
        self.task_sq_distances_ = sq
        self.task_gamma_ = self._gamma_value(best["gamma"], sq)
        if N > 1:
            d = np.sqrt(sq + np.diag(np.full(N, np.inf)))
            nn = d.min(axis=1)
            self.range_threshold_ = float(self.range_factor * nn.max())
        else:
            self.range_threshold_ = 0.0
        problem = TrainingProblem(
            data=data,
            params=self._kernel_parameters(),
            alpha=self.alpha_,
            task_gram=task_similarity(self.task_kernel_, sq, self.task_gamma_),
            embedding=emb,
        )
        for name, value in strategy.fit(problem).items():
            setattr(self, name, value)

    # ================================================================= prediction
    def _kernel_parameters(self) -> KernelParameters:
        return KernelParameters(self.point_bandwidth_, self.tau_, self.task_gamma_)

    def _fitted_state(self, strategy: SolverStrategy) -> dict[str, Any]:
        # Read leniently, as task_basis_ always was: a missing attribute reads None.
        return {name: getattr(self, name, None) for name in strategy.fitted_attributes}

    def _task_similarities(self, tasks: Bags) -> tuple[Embedding, NDArray[np.float64]]:
        problems = []
        if tasks.dim != self.n_features_in_:
            problems.append(
                f"tasks have {tasks.dim} marker column(s) but the model was fitted "
                f"on {self.n_features_in_}"
            )
        problems += _single_point_problems(tasks)
        if problems:
            raise BagValidationError(problems)
        sub = subsample_bags(tasks, self.embedding_points, self.seed_, canonical=True)
        emb = self.embedding_.embed(sub)
        return emb, emb.sq_distances(self.train_embedding_)

    def _new_tasks(self, tasks: Bags, emb: Embedding, sq_new: NDArray[np.float64]) -> NewTasks:
        return NewTasks(
            tasks=tasks,
            embedding=emb,
            task_similarity=task_similarity(self.task_kernel_, sq_new, self.task_gamma_),
            params=self._kernel_parameters(),
            maps=self._feature_maps(),
        )

    def _reports(self, sq_new: NDArray[np.float64]) -> list[TaskReport]:
        kp = task_similarity(self.task_kernel_, sq_new, self.task_gamma_)
        dist = np.sqrt(np.maximum(sq_new, 0.0))
        has_fallback = getattr(self, "fallback_", None) is not None
        out = []
        for row_k, row_d in zip(kp, dist, strict=True):
            order = np.argsort(row_d, kind="stable")[:3]
            far = bool(row_d[order[0]] > self.range_threshold_)
            out.append(
                TaskReport(
                    nearest_tasks=order,
                    similarities=row_k[order],
                    distance=float(row_d[order[0]]),
                    out_of_range=far,
                    fallback=far and has_fallback,
                )
            )
        return out

    def _scores_per_task(
        self, raw: Bags, control: ArrayLike | None = None
    ) -> tuple[list[NDArray[np.float64]], list[TaskReport]]:
        """Scores and reports of tasks given as they arrived (not yet normalised).

        With their batch's reference ``control``, the tasks are first mapped by it
        onto the training batch (:meth:`_apply_control`), and every model that answers
        them (the primary, the fallback, the reject rule) sees the mapped cells.

        With an invariant fallback (``fallback_``), it answers the tasks out of range,
        and every other task is asked of both models: where they disagree by more than
        ``disagreement_threshold_``, the task is out of range too and the fallback
        answers. Each model refines its own answers where its folds chose that
        (``refine_``). Each report says so."""
        check_is_fitted(self, "tau_")
        if raw.sizes.min() < 1:  # pragma: no cover - Bags never holds empty bags
            raise BagValidationError(["empty task"])
        raw, by_control = self._apply_control(raw, control)
        # Tasks out of range are calibrated first where the fit chose that; the primary
        # model answers them then, as the batch folds that chose it measured. A
        # batch's control has calibrated them already.
        tasks = self._normalise(raw)
        emb, sq_new = self._task_similarities(tasks)
        reports = self._reports(sq_new)
        if control is None:
            raw, calibrated = self._calibrated(raw, reports)
        else:
            calibrated = {}
            reports = [
                replace(r, calibrated="control", calibration=q)
                for r, q in zip(reports, by_control, strict=True)
            ]
        if calibrated:
            tasks = self._normalise(raw)
            emb, sq_new = self._task_similarities(tasks)
        for i, arrived in calibrated.items():
            reports[i] = replace(arrived, fallback=False)
        far = [i for i, r in enumerate(reports) if r.fallback]
        near = [i for i, r in enumerate(reports) if not r.fallback]
        threshold = getattr(self, "disagreement_threshold_", None)
        check = getattr(self, "fallback_", None) is not None and threshold is not None
        asked = list(range(len(reports))) if check else far
        fallback_answers: dict[int, tuple[NDArray[np.float64], TaskReport]] = {}
        if asked:
            answered, their = self.fallback_._scores_per_task(raw[np.array(asked)])
            fallback_answers = dict(zip(asked, zip(answered, their, strict=True), strict=True))
        scores: list[NDArray[np.float64]] = [np.empty((0, 0))] * len(reports)
        if near:
            if far:
                # Score only the tasks this model answers: their embeddings (a few
                # hundred points each) are cheap to redo, their cells are not.
                tasks = tasks[np.array(near)]
                emb, sq_new = self._task_similarities(tasks)
            answered = self._model_scores(raw[np.array(near)], tasks, emb, sq_new)
            relabelled: list[float | None] = [None] * len(near)
            if self._refines():
                refined = [
                    refine_scores(np.asarray(tasks[t]), sc, self.seed_)
                    for t, sc in enumerate(answered)
                ]
                answered = [sc for sc, _ in refined]
                relabelled = [share for _, share in refined]
            for i, sc, share in zip(near, answered, relabelled, strict=True):
                scores[i] = sc
                reports[i] = replace(reports[i], relabelled=share)
                if check and i not in calibrated:
                    d = self._disagreement(sc, fallback_answers[i][0])
                    unlike = d > threshold
                    reports[i] = replace(
                        reports[i],
                        out_of_range=reports[i].out_of_range or unlike,
                        fallback=unlike,
                        disagreement=d,
                    )
        for i in range(len(reports)):
            if reports[i].fallback:
                scores[i], theirs = fallback_answers[i]
                reports[i] = replace(reports[i], relabelled=theirs.relabelled)
        reject = getattr(self, "reject_threshold_", None)
        if reject is not None:
            # Whichever model answered: its scores share the ±1 coding.
            scores = [reject_scores(sc, self.rest_code_, reject) for sc in scores]
        return scores, reports

    def _model_scores(
        self, raw: Bags, tasks: Bags, emb: Embedding, sq_new: NDArray[np.float64]
    ) -> list[NDArray[np.float64]]:
        """This model's scores of ``tasks`` (``raw`` as they arrived, normalised; ``emb``
        and ``sq_new`` their embedding and distances to the training tasks), before any
        refinement or reject rule: its boosted trees or its kernel, averaged with its
        blend partner's where it has one (``blend_``)."""
        trees = getattr(self, "trees_", None)
        if trees is not None:
            # A fallback of boosted trees: its task embedding only reports. Every cell
            # is scored on its own, so all tasks go through the trees at once.
            answered = np.split(tree_scores(trees, tasks.points), tasks.offsets[1:-1])
        else:
            strategy = self._strategy()
            answered = strategy.task_scores(
                self._fitted_state(strategy), self._new_tasks(tasks, emb, sq_new)
            )
        blend = getattr(self, "blend_", None)
        if blend is not None:
            if getattr(blend, "shares_task_view_", False):
                partner = blend._model_scores(raw, tasks, emb, sq_new)
            else:  # models saved before the partner recorded it
                partner = blend._primary_scores(raw)
            answered = [(a + b) / 2.0 for a, b in zip(answered, partner, strict=True)]
        return answered

    def _refines(self) -> bool:
        """Whether this model refines its answers (models saved before ``refine_``
        existed do not)."""
        return getattr(self, "refine_", "none") == "mixture"

    def domain_report(self, reports: list[TaskReport]) -> DomainReport:
        """The :class:`~core.domain.DomainReport` of tasks from their :class:`TaskReport`.

        The score is the distance to the nearest training task in units of the median
        such distance among the training tasks (each to its nearest other one), as the
        bag-level models' scores are; the out-of-range flag is the task report's
        (``range_factor`` times the largest of those distances).
        """
        sq = np.asarray(self.task_sq_distances_, dtype=np.float64)
        if sq.shape[0] > 1:
            d = np.sqrt(np.maximum(sq, 0.0) + np.diag(np.full(sq.shape[0], np.inf)))
            scale = float(np.median(d.min(axis=1))) or 1.0
        else:
            scale = 1.0
        nearest = np.full((len(reports), NEAREST), -1, dtype=np.int64)
        sims = np.zeros((len(reports), NEAREST))
        for i, r in enumerate(reports):
            nearest[i, : r.nearest_tasks.size] = r.nearest_tasks[:NEAREST]
            sims[i, : r.similarities.size] = r.similarities[:NEAREST]
        distance = np.array([r.distance for r in reports], dtype=np.float64)
        return DomainReport(
            score=distance / scale,
            out_of_range=np.array([r.out_of_range for r in reports], dtype=bool),
            nearest=nearest,
            similarities=sims,
            distance=distance,
            fallback=np.array([r.fallback for r in reports], dtype=bool),
            disagreement=np.array(
                [np.nan if r.disagreement is None else r.disagreement for r in reports]
            ),
            relabelled=np.array(
                [np.nan if r.relabelled is None else r.relabelled for r in reports]
            ),
            **calibration_arrays(reports),
        )

    def domain_check(self, X: Any, control: ArrayLike | None = None) -> DomainReport:
        """How far each new task lies from the training tasks (see :meth:`domain_report`)."""
        return self.domain_report(self.task_report(X, control))

    def task_report(self, X: Any, control: ArrayLike | None = None) -> list[TaskReport]:
        """Similarity of each new task to the training tasks, and the out-of-range flag.

        With a fallback the flag also depends on how the two models answer the task
        (:class:`TaskReport`), with a refinement the report says how much it
        relabelled, and with a calibration whether it ran, so the tasks are scored as
        :meth:`predict` scores them.
        """
        check_is_fitted(self, "tau_")
        fallback = getattr(self, "fallback_", None)
        refines = self._refines() or (fallback is not None and fallback._refines())
        calibrates = getattr(self, "calibration_", "none") != "none" or control is not None
        if getattr(self, "disagreement_threshold_", None) is not None or refines or calibrates:
            return self._scores_per_task(_as_tasks(X)[0], control)[1]
        return self._reports(self._task_similarities(self._tasks(X))[1])

    def predict_tasks(self, X: Any, control: ArrayLike | None = None) -> list[TaskPrediction]:
        """Per task: a prediction for every point, the scores, and the :class:`TaskReport`.

        ``control``: the reference control measured in the tasks' batch, for a model
        fitted with the training batch's (``fit(..., control=)``): every task is mapped
        by it onto the training batch first, and its report says how
        (:attr:`TaskReport.calibration`)."""
        scores, reports = self._scores_per_task(_as_tasks(X)[0], control)
        return [
            TaskPrediction(self._decode(s), self._squeeze(s), r)
            for s, r in zip(scores, reports, strict=True)
        ]

    def _squeeze(self, s: NDArray[np.float64]) -> NDArray[np.float64]:
        return s[:, 0] if s.shape[1] == 1 else s

    def _all_scores(self, X: Any, control: ArrayLike | None = None) -> NDArray[np.float64]:
        scores, _ = self._scores_per_task(_as_tasks(X)[0], control)
        return np.concatenate(scores)

    def predict(self, X: Any, control: ArrayLike | None = None) -> NDArray[Any]:
        """A label (or value) for every point: one task as a 2-D array, or several tasks
        (a :class:`~core.Bags` or list), concatenated task after task (``control``: as
        in :meth:`predict_tasks`)."""
        return self._decode(self._all_scores(X, control))

    # ================================================================= inspection
    def joint_features(self, X: Any) -> NDArray[np.float64]:
        """Random-feature map of every point of the tasks ``X``: rows ``φ(P, x)`` whose
        inner products approximate the product kernel ``k̄`` (random-feature solver)."""
        check_is_fitted(self, "tau_")
        strategy = self._strategy()
        if not strategy.explicit_features:
            raise TypeError("joint_features needs solver='random_features'")
        tasks = self._tasks(X)
        emb, sq_new = self._task_similarities(tasks)
        return np.concatenate(
            strategy.joint_features(
                self._fitted_state(strategy), self._new_tasks(tasks, emb, sq_new)
            )
        )

    def joint_kernel(self, X: Any, Y: Any = None) -> NDArray[np.float64]:
        """The exact product kernel ``k̄`` between all points of tasks ``X`` and ``Y``
        (paper 004 eq. 8)."""
        check_is_fitted(self, "tau_")
        ta = self._tasks(X)
        tb = ta if Y is None else self._tasks(Y)
        ea, _ = self._task_similarities(ta)
        eb = ea if Y is None else self._task_similarities(tb)[0]
        sq = ea.sq_distances() if Y is None else ea.sq_distances(eb)
        kp = task_similarity(self.task_kernel_, sq, self.task_gamma_)
        K = self._feature_maps().point_gram(ta.points, tb.points, self.point_bandwidth_)
        K *= self.tau_ + (1.0 - self.tau_) * kp[np.ix_(ta.bag_index(), tb.bag_index())]
        return K


class MarginalTransferClassifier(ClassifierMixin, _MarginalTransfer):
    """Label every cell of a new, unlabelled task from labelled training tasks.

    Marginal transfer learning (Blanchard et al., JMLR 2021, paper 004): the decision
    function sees each point together with its own task's distribution, through the
    product kernel ``k_X(x, x') (τ + (1 - τ) k_P(P, P'))`` (see the module docstring).

    Parameters
    ----------
    solver : {"random_features", "exact"}, default="random_features"
        ``"exact"``: the kernel matrix over all training points (at most
        ``max_exact_points``). ``"random_features"``: explicit features, a weighted
        ridge, linear in the number of points.
    task_map : {"nystroem", "rff"}, default="nystroem"
        Random-feature solver only. ``"nystroem"``: exact task map over the training
        tasks, vanishing far from them (robust to new instruments or batches).
        ``"rff"``: the paper's two-layer random features (§7.2).
    loss : {"hinge", "squared"} or None
        ``None``: ``"hinge"`` (the paper's bias-free weighted SVM) for the exact
        solver, ``"squared"`` (one-vs-rest ridge on ±1 codes) for random features.
        Decision scores are returned; neither loss gives probabilities.
    embedding : BagRepresentation or None
        How a task's distribution is embedded; default :class:`~core.MeanEmbedding`
        (exact, Gaussian, median-heuristic bandwidth, not searched); with
        ``task_map="rff"`` an RFF mean embedding. Any representation of the core works.
    embedding_points : int or None, default=500
        Each task's embedding (training and new tasks) is computed from at most this
        many of its points, drawn independently of point order (paper 004 §6.2:
        about ``N`` points suffice). ``None``: all points.
    task_kernel : str, default="gaussian"
        Radial kernel ``k_P`` on embedding distances (:mod:`core.kernels`).
    task_gamma : float, array-like or None
        ``None``: search ×{0.3, 1, 3} around the median heuristic.
    point_kernel : {"gaussian", "linear", "gaussian+linear"} or None
        ``k_X``: ``exp(-‖x - x'‖²/(2σ²))``; ``xᵀx' + 1`` (the ``+1`` gives each task
        its own offset, as the model has no separate bias); or their sum with the
        linear part on standardised markers, ``x̃ᵀx̃'/d + 1`` (the low-capacity part: a
        pooled linear discriminant at ``τ = 1``, what carries over best to an unseen
        batch). ``None``: ``"gaussian+linear"``, or ``"gaussian"`` for
        ``task_map="rff"``.
    point_bandwidth : float, array-like or None
        ``σ``; ``None``: search ×{0.5, 1, 2} around the median distance.
    tau : float, array-like or None
        Share of pooling in ``[0, 1]``; ``None``: search {0, 0.2} and the pooled
        model ``τ = 1`` by the cross-validation: MTL against pooling is decided there
        (for the fallback on leave-one-batch-out folds when ``fit`` is given batches).
    pooling : bool, default=False
        The pooling baseline: ``k_P ≡ 1`` (``τ = 1``). With equal task sizes it is a
        single model on all points pooled.
    alpha : float, array-like or None
        Ridge ``λ`` of eq. 7 (weights ``1/(N n_i)``); ``None``: search 1e-6..1e-1.
    n_components : int, default=128
        Random Fourier features for ``k_X`` (and for each layer of ``task_map="rff"``).
    cv, cv_repeats : int
        Leave-tasks-out folds and repeats for the search (one fold per batch instead
        for the fallback, or a model without one, when ``fit`` is given two batches or
        more in ``groups``).
    cv_points : int, default=2000
        Points per held-out task used to score it during the search.
    range_factor : float, default=1.5
        A new task is out of range when its embedding distance to the nearest training
        task exceeds this factor times the largest such distance among training tasks,
        or (with a fallback) when the model and its fallback disagree on it by more
        than this factor times what their CV errors allow (``disagreement_threshold_``).
    max_exact_points : int, default=4000
    normalise : {"auto", "standard", "quantile", "none"}, default="auto"
        Per-task normalisation, part of the model (fitting and predicting alike):
        ``"standard"`` standardises every task by its own per-marker mean and standard
        deviation (undoes a per-sample affine batch effect whatever the proportions);
        ``"quantile"`` maps every task's marker quantiles onto the training tasks'
        mean quantiles (:func:`~core.bags.align_quantiles`, in the spirit of
        CytoNorm: undoes monotone distortions, moves populations when proportions
        differ); ``"none"``. ``"auto"``: chosen by the cross-validation with the
        one-standard-error rule, simplest first (a normalisation is applied where the
        folds show it helps by more than their noise;
        :func:`~.cv.choose_normalisation`), and, unless that is
        ``"standard"``, an invariant fallback fitted on standardised tasks
        (``fallback_``): the pooled linear model or the model's own kernel where the
        folds show one clearly better, else both with their scores averaged (no fold
        of one batch shows well which capacity carries over to a batch none of them
        contains), or, with batches named, whichever of the two the
        leave-one-batch-out folds prefer; where the kernel is chosen, a classifier
        answers with boosted trees on the same cells instead when the same folds show
        them clearly better (axis-aligned splits, as gates are drawn;
        :func:`~.fallback.choose_trees`). It is kept only
        when the folds find it useful (at most half the error of a constant
        prediction and, with batches named, less error than the primary model's on
        leave-one-batch-out folds), and answers every new task out of the training
        tasks' range (``out_of_range`` in its :class:`TaskReport`, with ``fallback``
        set). Folds drawn from the training tasks judge a normalisation where the
        data look like them; a task outside their range is where a batch effect is
        likely and undoing it the safer bet.
        With every other hyperparameter fixed, ``"auto"`` still cross-validates: fix
        ``normalise`` (and ``refine``) too for a fit without any search.
    refine : {"auto", "mixture", "none"}, default="auto"
        Classifiers: ``"mixture"`` refines each new task's labels by a Gaussian
        mixture fitted to the task's own points, one component per class started at
        the points the model gives it (:func:`~.refine.refine_scores`;
        classes with fewer than ``d + 1`` points keep the model's labels). Where a
        batch effect moved the populations, the task's own cells show where they
        lie; where populations are not Gaussian, it can hurt. ``"auto"``: by each
        model's folds: the primary model refines only where its folds show it helps
        by more than their noise (one-standard-error rule, ``selection_["refine"]``);
        the fallback, which answers tasks unlike the training ones, refines unless
        its folds show it raising the error on average
        (``selection_["normalisation"]["fallback_refine"]``). Regressors:
        ``"auto"`` or ``"none"``, both none. :attr:`TaskReport.relabelled` reports the
        share of labels it changed. Like ``normalise="auto"``, ``"auto"`` runs the
        cross-validation even with every other hyperparameter fixed.
    unassigned : label or None
        The *rest label*: cells of this training label belong to no population (the
        ungated cells), modelled as their own class and, at prediction, joined by
        every cell no population claims with enough confidence (its best population
        score below ``reject_threshold_``; :mod:`.reject`). ``None``: every
        label is a population (cells far from all of them can still be reported, on
        request, by :meth:`far_from_populations`).
    reject : "auto", "off" or float, default="auto"
        With ``unassigned`` set, the reject threshold on the best population score
        (``±1`` coding: ``θ`` reads as a posterior ``(1 + θ) / 2``). ``"auto"``:
        chosen among ``REJECT_THRESHOLDS`` by the folds with the one-standard-error
        rule, the rule off first (``selection_["reject"]``).
    calibrate : {"auto", "none", "quantile", "mmd"}, default="auto"
        How a new task out of the training tasks' range is calibrated to the training
        reference before the primary model answers it (:mod:`core.alignment`):
        per-marker quantile landmarks, or a monotone per-marker map with an affine
        part fitted on the MMD. ``"auto"``: chosen on leave-one-batch-out folds when
        ``fit`` is given two batches or more (every held-out batch calibrated to the
        others' reference, set against the uncalibrated answer, none first); without
        batches, none (``selection_["calibration"]`` records the rule).
    random_state : int, Generator or None

    Attributes
    ----------
    classes_ : ndarray
    tau_, alpha_, point_bandwidth_, task_gamma_ : float
        Selected hyperparameters (``task_gamma_`` is ``None`` for pooling).
    normalise_ : str
        The normalisation chosen (``quantile_reference_`` its reference quantiles).
    fallback_ : MarginalTransferClassifier or None
        The invariant fallback for tasks out of range (``normalise="auto"`` when the
        choice was not ``"standard"``); its ``blend_``, when set, is the second model
        whose scores it averages with its own (``selection_["normalisation"]
        ["fallback_choice"]`` says why: one capacity, or both); its ``trees_``, when
        set, the boosted trees it answers with (``["fallback_trees"]`` says why).
    blend_ : MarginalTransferClassifier or None
        The pooled linear model whose scores the primary model averages with its
        kernel's, where the leave-tasks-out folds its kernel was chosen on do not show
        the kernel clearly better (``selection_["capacity"]``: both models' fold errors,
        the kernel's gain, the margin it had to clear and the choice, by the fallback's
        rule; asked only beside an invariant fallback, which answers the tasks out of
        range); ``None`` where the kernel answers alone (or the pooled linear model in
        its place), without a fallback (then chosen leave-one-batch-out where batches
        are named), or with a fixed linear ``point_kernel``. A partner's
        ``shares_task_view_`` says it answers from its model's normalised new tasks and
        task similarities.
    refine_ : str
        ``"mixture"`` or ``"none"``: whether this model refines its answers (the
        fallback's own ``refine_`` for the tasks it answers).
    disagreement_threshold_ : float or None
        With a fallback: ``range_factor`` times the sum of the two models' worst
        per-fold CV errors (root mean square for regressors). Two models that err
        on a task at most that much disagree on it at most that much (triangle
        inequality); a task where they disagree more is out of range and the
        fallback answers it (:attr:`TaskReport.disagreement`).
    rest_code_, reject_threshold_ : int or None, float or None
        Column of the rest class among ``classes_`` and the reject threshold in use.
    population_means_, population_precisions_ : ndarray
        Every population's mean and inverse covariance on the training cells as the
        model sees them (NaN for the rest class), for :meth:`far_from_populations`.
    calibration_ : str
        ``"none"``, ``"quantile"`` or ``"mmd"``: how tasks out of range are
        calibrated (``calibration_quantiles_`` and ``calibration_points_`` the
        training reference).
    point_kernel_ : str
        ``k_X`` used; ``linear_centre_`` and ``linear_scale_`` standardise its linear
        part.
    embedding_ : BagRepresentation
        Fitted task representation; ``train_embedding_`` its training-task embedding.
    selection_ : dict
        Candidates, their CV errors per ``λ`` (or, for one whose evaluation stopped
        because it could not win, ``pruned_after``: the folds it was evaluated on;
        see :func:`~.cv.coordinate_search`), the folds and their scheme (``cv``:
        ``"leave-tasks-out"`` or ``"leave-one-batch-out"``), and the normalisation
        record (``normalisation``: each option's CV error, the choice; the
        fallback's configuration, its folds' scheme ``fallback_cv``, its CV error,
        what it was held against and ``disagreement_bound``).
    coef_ : ndarray of shape (a, D, n_outputs)
        Random-feature solver: ridge coefficients ``θ`` of the joint features (``a`` task
        coordinates: ``1 + r`` for the Nyström map, 1 for the paper's map).
        ``task_basis_`` is the Nyström basis ``U Λ^{-1/2}`` (``None`` when pooled).
    dual_coef_ : ndarray of shape (n_train_points, n_outputs)
        Exact solver: ``r`` of ``f = Σ_ij r_ij k̄(·, (P_i, x_ij))`` over
        ``train_points_``, whose tasks are ``train_task_index_``.

    References
    ----------
    Blanchard, Deshmukh, Dogan, Lee, Scott. "Domain Generalization by Marginal Transfer
    Learning", JMLR 22 (2021), eq. 7-8, §7.
    """

    _is_classifier = True

    def _encode(self, y: NDArray[Any]) -> NDArray[np.float64]:
        if y.ndim != 1:
            raise BagValidationError([f"labels must be 1-D (one per point), got shape {y.shape}"])
        self.classes_, codes = np.unique(y, return_inverse=True)
        if self.classes_.size < 2:
            raise BagValidationError([f"need at least 2 classes, got only {self.classes_[0]!r}"])
        if self.classes_.size == 2:
            return (2.0 * codes - 1.0)[:, None]
        Y = -np.ones((y.shape[0], self.classes_.size))
        Y[np.arange(y.shape[0]), codes] = 1.0
        return Y

    def _decode(self, scores: NDArray[np.float64]) -> NDArray[Any]:
        if scores.shape[1] == 1:
            return self.classes_[(scores[:, 0] > 0).astype(int)]
        return self.classes_[np.argmax(scores, axis=1)]

    def decision_function(self, X: Any, control: ArrayLike | None = None) -> NDArray[np.float64]:
        """Scores per point: ``(n_points,)`` for two classes (positive means
        ``classes_[1]``), else ``(n_points, n_classes)`` one-vs-rest (``control``: as
        in :meth:`predict_tasks`)."""
        return self._squeeze(self._all_scores(X, control))

    def decode_scores(self, scores: NDArray[np.float64]) -> NDArray[Any]:
        """The labels of scores as :meth:`decision_function` gives them (the labels
        :meth:`predict` would give), without scoring twice."""
        s = np.asarray(scores, dtype=np.float64)
        return self._decode(s[:, None] if s.ndim == 1 else s)

    def far_from_populations(
        self,
        X: Any,
        labels: NDArray[Any],
        level: float = 0.999,
        control: ArrayLike | None = None,
    ) -> NDArray[np.bool_]:
        """Whether each cell lies far from the population it was labelled with: its
        squared Mahalanobis distance to that population's training mean, under its
        training covariance (on the cells as the model sees them, normalised), beyond
        the χ² quantile ``level`` (:func:`~.reject.far_from_populations`).

        What a caller asks for to report cells no population claims when the model
        has no rest class (``unassigned`` unset); cells of the rest class are never far.

        Parameters
        ----------
        X : tasks as for :meth:`predict`
        labels : ndarray of shape (n_points,)
            The labels :meth:`predict` gave them.
        level : float, default=0.999
        control : array-like, optional
            The tasks' batch control, as given to :meth:`predict_tasks`: distances are
            measured on the cells it maps, as the labels were given.
        """
        check_is_fitted(self, "population_means_")
        tasks = self._normalise(self._apply_control(_as_tasks(X)[0], control)[0])
        labels = np.asarray(labels)
        if labels.shape[0] != tasks.n_points:
            raise BagValidationError(
                [f"got {labels.shape[0]} label(s) for {tasks.n_points} point(s)"]
            )
        codes = np.searchsorted(self.classes_, labels)
        return far_from_populations(
            tasks.points, codes, self.population_means_, self.population_precisions_, level
        )


class MarginalTransferRegressor(RegressorMixin, _MarginalTransfer):
    """Predict a value for every point of a new task from labelled training tasks.

    Same model and parameters as :class:`MarginalTransferClassifier`; the exact
    solver's default loss is the paper's ε-insensitive loss (bias-free weighted SVR,
    width ``epsilon``), ``loss="squared"`` gives weighted kernel ridge; the
    random-feature solver fits a weighted ridge.
    """

    def _encode(self, y: NDArray[Any]) -> NDArray[np.float64]:
        Y = np.asarray(y, dtype=np.float64)
        if Y.ndim not in (1, 2):
            raise BagValidationError([f"targets must be 1-D or 2-D, got shape {Y.shape}"])
        if not np.isfinite(Y).all():
            raise BagValidationError(["targets contain NaN or Inf"])
        self.y_ndim_ = Y.ndim
        return Y.reshape(Y.shape[0], -1)

    def _decode(self, scores: NDArray[np.float64]) -> NDArray[np.float64]:
        return scores[:, 0] if self.y_ndim_ == 1 else scores
