"""The interface of the marginal-transfer solver strategies, and what they are handed.

Every strategy fits the same model of paper 004 (Blanchard et al., JMLR 2021): the
weighted, bias-free regularised risk over the RKHS of the product kernel,

    min_f  Σ_i Σ_j ℓ(f(P_i, x_ij), y_ij) / (N n_i) + λ ‖f‖²                  (eq. 7)

    k̄((P, x), (P', x')) = k_X(x, x') · (τ + (1 - τ) k_P(P, P'))               (eq. 8)

:class:`~.exact.ExactKernelStrategy` solves it on the kernel matrix,
:class:`~.nystroem.NystroemFeatureStrategy` and
:class:`~.paper_rff.PaperRFFStrategy` on explicit joint features. A strategy
holds no state: the estimator derives it from ``solver`` and ``task_map`` whenever it
needs it, and hands it everything it computes with — the tasks, the resolved kernel
parameters, the fit's random feature maps and, at prediction, the fitted arrays under
the estimator attribute names that model artifacts store.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from ....bags import Bags
from ....kernels import DistanceKernel, point_kernel, random_fourier_features
from ....representations.base import BagRepresentation, Embedding
from ....representations.mean import MeanEmbedding

__all__ = [
    "POINT_BLOCK",
    "POINT_KERNELS",
    "FeatureMaps",
    "KernelParameters",
    "NewTasks",
    "RandomFeatureStrategy",
    "SolverStrategy",
    "TrainingData",
    "TrainingProblem",
    "Transform",
    "ValidationFold",
    "held_out_error",
    "task_similarity",
]

#: Rows per block of the per-point products at prediction: with a fixed block, every
#: point's score depends on that point only, whatever batch it arrives in.
POINT_BLOCK = 256
#: A post-processing of one task's scores from its points: ``(points, scores) -> scores``.
Transform = Callable[[NDArray[np.float64], NDArray[np.float64]], NDArray[np.float64]]


@dataclass(frozen=True)
class KernelParameters:
    """Resolved parameters of the product kernel ``k̄`` (paper 004 eq. 8).

    Attributes
    ----------
    sigma : float
        Bandwidth ``σ`` of the point kernel ``k_X`` (1 for the linear kernel).
    tau : float
        Share of pooling ``τ`` in ``[0, 1]``.
    gamma : float or None
        ``γ`` of the task kernel ``k_P``; ``None`` when ``k_P ≡ 1`` (pooled model).
    """

    sigma: float
    tau: float
    gamma: float | None


def task_similarity(
    kernel: DistanceKernel, sq_distances: NDArray[np.float64], gamma: float | None
) -> NDArray[np.float64]:
    """``k_P`` from squared embedding distances; identically 1 for the pooled model."""
    return np.ones_like(sq_distances) if gamma is None else kernel(sq_distances, gamma)


#: Point kernels ``k_X``; ``"gaussian+linear"`` adds the low-capacity linear part.
POINT_KERNELS = ("gaussian", "linear", "gaussian+linear")


@dataclass(frozen=True)
class FeatureMaps:
    """The point kernel ``k_X`` and the random draws of one fit.

    The frequencies are standard normal and shared by every candidate bandwidth (they
    are rescaled, not redrawn), so the validation error is smooth in ``σ``.

    Attributes
    ----------
    point_kernel : {"gaussian", "linear", "gaussian+linear"}
        ``"gaussian+linear"`` is the sum ``k_G(x, x') + x̃ᵀx̃' / d + 1`` with
        ``x̃ = (x - centre) / scale``: the Gaussian part bends where the data need it,
        the linear part (a pooled linear discriminant when ``τ = 1``) carries the
        coarse structure, which is what transfers best to a batch the training data
        did not contain.
    point_frequencies : ndarray of shape (m, d)
        Directions of the random Fourier features of the Gaussian ``k_X``.
    joint_frequencies : ndarray of shape (m, 2m + d) or None
        Second-layer directions of the paper's two-layer map (§7.2) only.
    linear_centre, linear_scale : ndarray of shape (d,) or None
        ``x̃`` of the linear part: the training points' mean and standard deviation.
    """

    point_kernel: str
    point_frequencies: NDArray[np.float64]
    joint_frequencies: NDArray[np.float64] | None = None
    linear_centre: NDArray[np.float64] | None = None
    linear_scale: NDArray[np.float64] | None = None

    def _linear_part(
        self, points: NDArray[np.float64], out: NDArray[np.float64] | None = None
    ) -> NDArray[np.float64]:
        """``[x̃ / √d, 1]``, whose inner products are ``x̃ᵀx̃' / d + 1`` (into ``out``,
        of ``d + 1`` columns, when given)."""
        centre = 0.0 if self.linear_centre is None else self.linear_centre
        scale = 1.0 if self.linear_scale is None else self.linear_scale
        if out is None:
            out = np.empty((points.shape[0], points.shape[1] + 1))
        np.divide(points - centre, scale * np.sqrt(points.shape[1]), out=out[:, :-1])
        out[:, -1] = 1.0
        return out

    def point_features(self, points: NDArray[np.float64], sigma: float) -> NDArray[np.float64]:
        """Rows ``z(x)`` with ``z(x)ᵀz(x') ≈ k_X(x, x')``.

        Random Fourier features of ``exp(-‖x - x'‖²/(2σ²))``; for the linear kernel the
        exact map ``[x, 1]``, whose constant gives each task its own offset (no bias);
        for the sum, both side by side.
        """
        if self.point_kernel == "linear":
            return np.hstack([points, np.ones((points.shape[0], 1))])
        if self.point_kernel != "gaussian+linear":
            return random_fourier_features(points, self.point_frequencies / sigma)
        # Both parts written into one array: the features are the fit's largest arrays.
        d = points.shape[1]
        z = random_fourier_features(points, self.point_frequencies / sigma, d + 1)
        self._linear_part(points, out=z[:, -(d + 1) :])
        return z

    def point_gram(
        self, A: NDArray[np.float64], B: NDArray[np.float64], sigma: float
    ) -> NDArray[np.float64]:
        """The exact ``k_X`` between the rows of ``A`` and ``B``."""
        if self.point_kernel == "linear":
            return A @ B.T + 1.0
        K = point_kernel(A, B, "gaussian", sigma)
        if self.point_kernel == "gaussian+linear":
            K += self._linear_part(A) @ self._linear_part(B).T
        return K


@dataclass(frozen=True)
class TrainingData:
    """Labelled training tasks and what every fit on them shares.

    Attributes
    ----------
    tasks : Bags
        One bag of points per training task.
    Y : ndarray of shape (n_points, n_outputs)
        Targets of every point, task after task (``±1`` codes for classes).
    maps : FeatureMaps
    loss : {"squared", "hinge", "epsilon_insensitive"}
        ``ℓ`` of eq. 7; the random-feature strategies minimise the squared loss only.
    epsilon : float
        Width of the ε-insensitive loss.
    statistics : dict
        Per point bandwidth ``σ``, what a strategy computed of the tasks at it (the
        random-feature strategies' per-task statistics): filled in by the search's
        folds, completed and used by the final fit on the same data.
    """

    tasks: Bags
    Y: NDArray[np.float64]
    maps: FeatureMaps
    loss: str
    epsilon: float
    statistics: dict[float, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class ValidationFold:
    """One leave-tasks-out fold, at one candidate configuration.

    Attributes
    ----------
    data : TrainingData
        All training tasks; the fold selects from them by index.
    train, val : ndarray of int
        Tasks the fold fits on, and tasks it holds out.
    params : KernelParameters
        Resolved on the fold's training tasks only.
    kp_train : ndarray of shape (n_train, n_train)
        ``k_P`` among the training tasks.
    kp_val : ndarray of shape (n_val, n_train)
        ``k_P`` from each held-out task to the training tasks.
    embeddings : tuple of Embedding or None
        The fold's own embeddings (fitted on its training tasks) of its training and its
        held-out tasks; ``None`` for the pooled model, which needs none.
    held_out : list of (ndarray, ndarray)
        Per held-out task, the points it is scored on (at most ``cv_points``) and their
        targets; its embedding comes from all its points.
    error : callable
        Validation error of scores against targets (per task; tasks count equally).
    transform : callable or None
        ``(points, scores) -> scores`` applied to each held-out task's scores before
        the error: the estimator's post-processing of a task's answer (a refinement).
    """

    data: TrainingData
    train: NDArray[np.int64]
    val: NDArray[np.int64]
    params: KernelParameters
    kp_train: NDArray[np.float64]
    kp_val: NDArray[np.float64]
    embeddings: tuple[Embedding, Embedding] | None
    held_out: list[tuple[NDArray[np.float64], NDArray[np.float64]]]
    error: Callable[[NDArray[np.float64], NDArray[np.float64]], float]
    transform: Transform | None = None


def held_out_error(fold: ValidationFold, scores: list[NDArray[np.float64]]) -> float:
    """Mean over the held-out tasks of each task's validation error (of its scores
    after ``fold.transform``, when set)."""
    if fold.transform is not None:
        scores = [fold.transform(x, s) for s, (x, _) in zip(scores, fold.held_out, strict=True)]
    return np.mean(
        [fold.error(s, y) for s, (_, y) in zip(scores, fold.held_out, strict=True)]
    ).item()


@dataclass(frozen=True)
class TrainingProblem:
    """The final fit: all training tasks at the selected configuration.

    Attributes
    ----------
    data : TrainingData
    params : KernelParameters
    alpha : float
        Ridge ``λ`` of eq. 7.
    task_gram : ndarray of shape (N, N)
        ``k_P`` among the training tasks (all ones for the pooled model).
    embedding : Embedding
        The training tasks' embedding.
    """

    data: TrainingData
    params: KernelParameters
    alpha: float
    task_gram: NDArray[np.float64]
    embedding: Embedding


@dataclass(frozen=True)
class NewTasks:
    """Tasks to predict, seen through the fitted model.

    Attributes
    ----------
    tasks : Bags
    embedding : Embedding
        Their embedding by the fitted representation.
    task_similarity : ndarray of shape (n_new, N)
        ``k_P`` from each new task to each training task.
    params : KernelParameters
        The fitted configuration.
    maps : FeatureMaps
        The fit's random draws.
    """

    tasks: Bags
    embedding: Embedding
    task_similarity: NDArray[np.float64]
    params: KernelParameters
    maps: FeatureMaps


class SolverStrategy(ABC):
    """One way to fit, validate and evaluate the marginal-transfer model.

    The hooks before :meth:`fold_errors` say how the strategy constrains the estimator's
    parameters; their defaults constrain nothing.
    """

    #: Estimator attributes :meth:`fit` sets and :meth:`task_scores` reads; model
    #: artifacts store them under these names.
    fitted_attributes: ClassVar[tuple[str, ...]]
    #: Whether the model has explicit joint features ``φ(P, x)`` (:meth:`joint_features`).
    explicit_features: ClassVar[bool] = False
    #: The only share of pooling the strategy can fit besides the pooled model, if any.
    fixed_tau: ClassVar[float | None] = None

    # ------------------------------------------------------------ parameters
    def default_loss(self, losses: tuple[str, str]) -> str:
        """The loss when none is given; ``losses`` are the estimator's, default first."""
        return losses[0]

    def check_parameters(self, loss: str, point_kernel: str, tau: Any) -> None:
        """Raise ``ValueError`` for parameters the strategy cannot fit."""
        return None

    def size_problems(self, n_points: int, max_exact_points: int) -> list[str]:
        """Why the training tasks are too large for the strategy (empty if they are not)."""
        return []

    def draw_joint_frequencies(
        self, rng: np.random.Generator, n_frequencies: int, dim: int
    ) -> NDArray[np.float64] | None:
        """Random directions of a second feature layer, drawn at fit if there is one."""
        return None

    def default_embedding(self, n_components: int) -> BagRepresentation:
        """The task representation when none is given: the exact mean embedding."""
        return MeanEmbedding()

    def check_embedding(self, embedding: Embedding) -> None:
        """Raise ``ValueError`` for task embeddings the strategy cannot use."""
        return None

    # ------------------------------------------------------------ numerics
    #: Whether :meth:`fold_errors` of different folds may run at once on threads, once
    #: :meth:`prepare_folds` has run for them on the caller's thread.
    concurrent_folds: ClassVar[bool] = False

    def prepare_folds(
        self,
        data: TrainingData,
        folds: list[tuple[float, NDArray[np.int64]]],
        cache: dict[Hashable, Any],
        held_out_rows: Mapping[int, NDArray[np.int64]] | None = None,
    ) -> None:
        """Put in ``cache`` what :meth:`fold_errors` shares between folds, for folds of
        these point bandwidths ``σ`` and training tasks, so that folds evaluated at
        once only read it (nothing by default). ``held_out_rows``: per task, the rows
        of ``data.tasks.points`` it is scored on when held out, where those are
        training points (a strategy may compute what it needs of them along)."""
        return None

    def release_search(self, cache: dict[Hashable, Any]) -> None:
        """Drop from ``cache``, once its search is over, what is large and cheap to
        compute again: the cache is kept for later fits that reuse the search's
        evaluations (:func:`~.cv.reusing_fold_evaluations`). Nothing by
        default."""
        return None

    @abstractmethod
    def fold_errors(
        self, fold: ValidationFold, alphas: NDArray[np.float64], cache: dict[Hashable, Any]
    ) -> NDArray[np.float64]:
        """Validation error of the fold for every ridge ``λ`` of ``alphas``.

        ``cache`` lives as long as one search: what the strategy can reuse across folds
        and candidates. :meth:`prepare_folds` has run for this fold before.
        """

    @abstractmethod
    def fit(self, problem: TrainingProblem) -> dict[str, Any]:
        """The fitted arrays, by the estimator attribute names of :attr:`fitted_attributes`."""

    @abstractmethod
    def task_scores(self, fitted: Mapping[str, Any], new: NewTasks) -> list[NDArray[np.float64]]:
        """Scores of shape (n_points, n_outputs) of every point, one array per task."""

    def joint_features(self, fitted: Mapping[str, Any], new: NewTasks) -> list[NDArray[np.float64]]:
        """Rows ``φ(P, x)`` whose inner products approximate ``k̄``, one array per task."""
        raise TypeError("joint_features needs solver='random_features'")


class RandomFeatureStrategy(SolverStrategy):
    """``solver="random_features"``: a weighted ridge on explicit joint features."""

    explicit_features: ClassVar[bool] = True

    def default_loss(self, losses: tuple[str, str]) -> str:
        # The ridge's closed form is what makes the cost linear in the number of points.
        return "squared"

    def check_parameters(self, loss: str, point_kernel: str, tau: Any) -> None:
        if loss != "squared":
            raise ValueError(
                "the random-feature solver fits a weighted ridge (loss='squared'); "
                f"use solver='exact' for loss={loss!r}"
            )
