"""Kernel ridge regression and classification on bags (papers 000 and 003).

The model is ``f̂(P) = k_Pᵀ (K + λ T I)⁻¹ y`` (paper 000 eq. 5 / Prop. 12, paper 003
eq. 3): ``K`` the Gram matrix of a kernel on distributions over the ``T`` training
bags, ``k_P`` the kernel between a new bag and the training bags. **The ridge
parameter is scaled by the number of bags**: ``alpha=λ`` here equals
``sklearn.kernel_ridge.KernelRidge(kernel="precomputed", alpha=λ * T)`` on the same
Gram matrix (and centred targets when ``fit_intercept=True``). Classification
regresses one-hot targets and decodes by argmax (paper 000 §2.5, Remark 10).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import scipy.linalg
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin, clone
from sklearn.utils.validation import check_is_fitted

from .._random import check_generator
from ..bags import BagValidationError, as_bags
from ..kernels import batch_invariant_matmul, get_kernel, random_fourier_features
from ..representations.base import BagRepresentation, Embedding, FeatureEmbedding
from ..representations.sliced import SlicedWasserstein
from ..selection import DEFAULT_ALPHA_GRID, as_grid, gamma_grid, ridge_selection_scores
from ._domain import DomainCheckMixin

__all__ = ["DistributionRidge", "DistributionRidgeClassifier"]

# The median heuristic of the random-feature path looks at this many bags at most.
_MEDIAN_BAGS = 1000


class _DistributionKernelRidge(DomainCheckMixin, BaseEstimator):
    """Shared fit/predict of :class:`DistributionRidge` and its classifier.

    Subclasses define ``_targets(y, n_bags)``, which validates the targets and
    returns them as a ``(T, n_outputs)`` float matrix.
    """

    def __init__(
        self,
        representation: BagRepresentation | None = None,
        kernel: str = "gaussian",
        gamma: float | ArrayLike | None = None,
        alpha: float | ArrayLike | None = None,
        kernel_params: dict[str, Any] | None = None,
        fit_intercept: bool = True,
        selection: Literal["loo", "gcv"] = "loo",
        n_components: int | None = None,
        random_state: Any = None,
    ):
        self.representation = representation
        self.kernel = kernel
        self.gamma = gamma
        self.alpha = alpha
        self.kernel_params = kernel_params
        self.fit_intercept = fit_intercept
        self.selection = selection
        self.n_components = n_components
        self.random_state = random_state

    # ------------------------------------------------------------------ helpers
    def unfitted_representation(self) -> BagRepresentation:
        """The representation :meth:`fit` would fit (the estimator's seed filled in)."""
        if self.representation is None:
            return SlicedWasserstein(random_state=self.random_state)
        rep = clone(self.representation)
        params = rep.get_params(deep=False)
        if "random_state" in params and params["random_state"] is None:
            rep.set_params(random_state=self.random_state)
        return rep

    def _fit(self, X: Any, y: ArrayLike) -> _DistributionKernelRidge:
        if self.selection not in ("loo", "gcv"):
            raise ValueError(f"selection must be 'loo' or 'gcv', got {self.selection!r}")
        bags = as_bags(X)
        if len(bags) < 2:
            raise BagValidationError([f"need at least 2 training bags, got {len(bags)}"])
        rep = self.unfitted_representation().fit(bags)
        return self._fit_embedded(rep, rep.embed(bags), y)

    def fit_embedded(
        self, representation: BagRepresentation, embedding: Embedding, y: ArrayLike
    ) -> _DistributionKernelRidge:
        """Fit on bags already embedded by ``representation`` (fitted).

        For training that featurises bags where they are read (:mod:`core.streaming`):
        with ``representation = self.unfitted_representation()`` fitted as :meth:`fit`
        would fit it, the model is the one :meth:`fit` gives on the same bags.
        """
        check_is_fitted(representation)
        if len(embedding) < 2:
            raise BagValidationError([f"need at least 2 training bags, got {len(embedding)}"])
        return self._fit_embedded(representation, embedding, y)

    def _fit_embedded(
        self, rep: BagRepresentation, emb: Embedding, y: ArrayLike
    ) -> _DistributionKernelRidge:
        T = len(emb)
        Y = self._targets(y, T)
        kern = get_kernel(self.kernel, self.kernel_params)
        if not kern.has_gamma and self.gamma is not None:
            raise ValueError("the linear kernel has no gamma; leave gamma=None")
        self.representation_ = rep
        self.kernel_ = kern
        self.n_features_in_ = rep.n_features_in_
        self.intercept_ = Y.mean(axis=0) if self.fit_intercept else np.zeros(Y.shape[1])
        Yc = Y - self.intercept_
        alphas = as_grid(self.alpha, DEFAULT_ALPHA_GRID, "alpha")

        if self.n_components is not None:
            # Random Fourier features of the embeddings (paper 001 eq. 7): a primal model
            # whose cost is linear in the number of bags.
            if kern.name != "gaussian" or not isinstance(emb, FeatureEmbedding):
                raise ValueError(
                    "n_components (random features of the embeddings) needs kernel='gaussian' "
                    "and a representation with explicit features"
                )
            if int(self.n_components) != self.n_components or self.n_components < 2:
                raise ValueError(f"n_components must be an integer >= 2, got {self.n_components!r}")
            self.primal_ = True
            rng = check_generator(self.random_state)
            half = int(self.n_components) // 2
            F = emb.features
            if emb.geometry == "euclidean":
                self.rff_base_ = rng.standard_normal((half, F.shape[1]))
            else:
                self.rff_base_ = rng.standard_cauchy((half, F.shape[1]))
            self.rff_geometry_ = emb.geometry
            sample = (
                emb
                if T <= _MEDIAN_BAGS
                else FeatureEmbedding(F[rng.choice(T, _MEDIAN_BAGS, replace=False)], emb.geometry)
            )
            gammas = as_grid(self.gamma, gamma_grid(sample.sq_distances(), kern), "gamma")
            scores = np.full((gammas.size, alphas.size), np.nan)
            if gammas.size * alphas.size > 1:
                for gi, g in enumerate(gammas):
                    scores[gi] = _primal_scores(
                        self._rff(F, g), Y, alphas, self.fit_intercept, self.selection
                    )
                gi, ai = _argmin_prefer_smooth(scores)
            else:
                gi, ai = 0, 0
            self.gamma_ = float(gammas[gi])
            self.alpha_ = float(alphas[ai])
            self.coef_ = _primal_solve(self._rff(F, self.gamma_), Yc, self.alpha_ * T)
            self.train_embedding_ = None
        elif (
            kern.name == "linear"
            and isinstance(emb, FeatureEmbedding)
            and emb.geometry == "euclidean"
            and emb.features.shape[1] < T
        ):
            # Explicit features narrower than the number of bags: solve in feature space.
            self.primal_ = True
            F = emb.features
            gammas = np.array([np.nan])
            scores = np.full((1, alphas.size), np.nan)
            if alphas.size > 1:
                scores[0] = _primal_scores(F, Y, alphas, self.fit_intercept, self.selection)
            best = int(np.argmin(scores[0])) if alphas.size > 1 else 0
            self.gamma_ = None
            self.alpha_ = float(alphas[best])
            self.coef_ = _primal_solve(F, Yc, self.alpha_ * T)
            self.train_embedding_ = None
        else:
            self.primal_ = False
            base = emb.inner() if kern.uses_inner_product else emb.sq_distances()
            if kern.has_gamma:
                gammas = as_grid(self.gamma, gamma_grid(base, kern), "gamma")
            else:
                gammas = np.array([np.nan])
            scores = np.full((gammas.size, alphas.size), np.nan)
            if gammas.size * alphas.size > 1:
                for gi, g in enumerate(gammas):
                    vals, vecs = np.linalg.eigh(kern(base, None if np.isnan(g) else g))
                    scores[gi] = ridge_selection_scores(
                        vals,
                        vecs,
                        Y,
                        alphas,
                        fit_intercept=self.fit_intercept,
                        criterion=self.selection,
                    )
                gi, ai = _argmin_prefer_smooth(scores)
            else:
                gi, ai = 0, 0
            self.gamma_ = None if np.isnan(gammas[gi]) else float(gammas[gi])
            self.alpha_ = float(alphas[ai])
            K = kern(base, self.gamma_)
            K[np.diag_indices_from(K)] += self.alpha_ * T
            self.dual_coef_ = _spd_solve(K, Yc)
            self.train_embedding_ = emb
        self.selection_ = {
            "criterion": self.selection,
            "gamma": gammas,
            "alpha": alphas,
            "score": scores,
        }
        self._fit_domain(emb)
        return self

    def _rff(self, F: NDArray[np.float64], gamma: float) -> NDArray[np.float64]:
        """``z(φ)`` with ``z(a)ᵀz(b) ≈ exp(-γ D²(a, b))``: Gaussian frequencies of variance
        ``2γ`` for Euclidean embeddings, Cauchy of scale ``γ`` for ℓ1 ones (SW_1)."""
        scale = np.sqrt(2.0 * gamma) if self.rff_geometry_ == "euclidean" else gamma
        return random_fourier_features(F, self.rff_base_ * scale)

    def feature_map(self, X: Any) -> NDArray[np.float64]:
        """The explicit features the primal model uses for bags ``X``."""
        check_is_fitted(self, "intercept_")
        if not self.primal_:
            raise TypeError("a kernel (dual) model has no explicit feature map")
        return self._primal_features(self.representation_.embed(X))

    def _primal_features(self, emb: Embedding) -> NDArray[np.float64]:
        assert isinstance(emb, FeatureEmbedding)
        if self.n_components is not None:
            return self._rff(emb.features, self.gamma_)
        return emb.features

    def _decision(self, X: Any) -> NDArray[np.float64]:
        check_is_fitted(self, "intercept_")
        return self._decision_embedded(self._embedding(X))

    def _decision_embedded(self, emb: Embedding) -> NDArray[np.float64]:
        check_is_fitted(self, "intercept_")
        if self.primal_:
            return batch_invariant_matmul(self._primal_features(emb), self.coef_) + self.intercept_
        return batch_invariant_matmul(self.kernel_matrix(emb), self.dual_coef_) + self.intercept_

    def kernel_matrix(self, X: Any | Embedding) -> NDArray[np.float64]:
        """Kernel values between bags ``X`` and the training bags, ``(n_bags, T)``."""
        check_is_fitted(self, "intercept_")
        if self.primal_:
            raise TypeError("a primal (linear, explicit-feature) model keeps no training bags")
        emb = X if isinstance(X, Embedding) else self.representation_.embed(X)
        train = self.train_embedding_
        base = emb.inner(train) if self.kernel_.uses_inner_product else emb.sq_distances(train)
        return self.kernel_(base, self.gamma_)


def _argmin_prefer_smooth(scores: NDArray[np.float64]) -> tuple[int, int]:
    """Index of the smallest score; ties go to the largest ``λ`` then smallest ``γ``."""
    if not np.isfinite(scores).any():
        raise FloatingPointError(
            "every (gamma, alpha) pair interpolates the training targets exactly, so the "
            "leave-one-out error is undefined; give larger alpha values"
        )
    flipped = scores[:, ::-1]
    gi, ai = np.unravel_index(int(np.argmin(flipped)), flipped.shape)
    return int(gi), int(scores.shape[1] - 1 - ai)


def _primal_scores(
    F: NDArray[np.float64],
    Y: NDArray[np.float64],
    alphas: NDArray[np.float64],
    fit_intercept: bool,
    criterion: str,
) -> NDArray[np.float64]:
    """LOO/GCV of ridge on explicit features, from one thin SVD (``K = F Fᵀ``)."""
    U, sv, _ = np.linalg.svd(F, full_matrices=False)
    return ridge_selection_scores(
        sv**2, U, Y, alphas, fit_intercept=fit_intercept, criterion=criterion
    )


def _primal_solve(
    F: NDArray[np.float64], Yc: NDArray[np.float64], ridge: float
) -> NDArray[np.float64]:
    """``(FᵀF + ridge I)⁻¹ Fᵀ Y``: the primal twin of ``(FFᵀ + ridge I)⁻¹ Y``."""
    A = F.T @ F
    A[np.diag_indices_from(A)] += ridge
    return _spd_solve(A, F.T @ Yc)


def _spd_solve(A: NDArray[np.float64], B: NDArray[np.float64]) -> NDArray[np.float64]:
    """Solve ``A x = B`` for symmetric positive (semi)definite ``A`` (Cholesky first)."""
    try:
        return scipy.linalg.solve(A, B, assume_a="pos")
    except (np.linalg.LinAlgError, scipy.linalg.LinAlgError):
        return scipy.linalg.solve(A, B, assume_a="sym")


def _check_lengths(y: NDArray[Any], n_bags: int) -> None:
    if y.shape[0] != n_bags:
        raise BagValidationError([f"got {y.shape[0]} target(s) for {n_bags} bag(s)"])


class DistributionRidge(RegressorMixin, _DistributionKernelRidge):
    """Kernel ridge regression from bags to real values (one or several outputs).

    Parameters
    ----------
    representation : BagRepresentation or None, default=None
        How bags are compared: :class:`~core.SlicedWasserstein` (default, ``p=2``),
        :class:`~core.MeanEmbedding`, ... It is cloned and fitted in :meth:`fit`.
    kernel : str, default="gaussian"
        Kernel on the representation's Hilbertian distance (see :mod:`core.kernels`
        for every name and its convention). ``"gaussian"`` is ``exp(-γ D²)``, positive
        definite for every representation: ``exp(-γ SW_2²)``, ``exp(-γ SW_1)`` or
        ``exp(-γ MMD²)``.
    gamma : float, array-like or None, default=None
        Kernel scale. ``None``: search 13 values over ±3 decades around the median
        heuristic; an array: search that grid; a float: use it.
    alpha : float, array-like or None, default=None
        Ridge ``λ`` in the papers' scaling ``(K + λ T I)``. ``None``: search
        ``logspace(-8, 2, 25)`` (paper 000 App. F); an array: search it.
    kernel_params : dict or None
        Extra kernel parameters (``beta``, ``theta``, ``alpha``, ``degree``,
        ``coef0``).
    fit_intercept : bool, default=True
        Subtract the training mean of the targets (the papers do not; with
        ``False`` the model is exactly theirs).
    selection : {"loo", "gcv"}, default="loo"
        Closed-form criterion for the search: exact leave-one-bag-out error or GCV,
        both from one eigendecomposition per ``γ`` and one distance matrix for all.
    n_components : int or None, default=None
        Random Fourier features of the embeddings (paper 001 eq. 7): the Gaussian
        kernel ``exp(-γ D²)`` is replaced by ``z(φ(P))ᵀz(φ(Q))`` with ``n_components``
        features and the model is fitted in the primal, in time linear in the number of
        bags (representations with explicit features only).
    random_state : int, Generator or None
        Seeds the default representation (or a given one whose own ``random_state``
        is ``None``) and the random features.

    Attributes
    ----------
    representation_ : BagRepresentation
        The fitted representation (its random draws are part of the model).
    gamma_, alpha_ : float
        Selected values (``gamma_`` is ``None`` for the linear kernel).
    dual_coef_ : ndarray of shape (T, n_outputs)
        ``(K + λT I)⁻¹ (y - intercept_)``; absent for primal models.
    coef_ : ndarray of shape (n_features, n_outputs)
        Primal weights, when the kernel is linear and explicit features are narrower
        than the number of bags.
    intercept_ : ndarray of shape (n_outputs,)
    selection_ : dict
        ``gamma`` and ``alpha`` grids and the ``score`` matrix (mean squared LOO or
        GCV error, shape ``(n_gamma, n_alpha)``; NaN when nothing was searched).

    References
    ----------
    Meunier, Pontil, Ciliberto, ICML 2022, eq. 5; Szabó, Gretton, Póczos,
    Sriperumbudur, AISTATS 2015, eq. 3.
    """

    def _targets(self, y: ArrayLike, n_bags: int) -> NDArray[np.float64]:
        Y = np.asarray(y, dtype=np.float64)
        if Y.ndim not in (1, 2):
            raise BagValidationError([f"targets must be 1-D or 2-D, got shape {Y.shape}"])
        _check_lengths(Y, n_bags)
        bad = ~np.isfinite(Y.reshape(n_bags, -1)).all(axis=1)
        if bad.any():
            raise BagValidationError(
                [f"target of bag {int(t)} is not finite" for t in np.flatnonzero(bad)]
            )
        self.y_ndim_ = Y.ndim
        return Y.reshape(n_bags, -1)

    def fit(self, X: Any, y: ArrayLike) -> DistributionRidge:
        """Fit on bags ``X`` (a :class:`~core.Bags` or a list of 2-D arrays) and targets ``y``."""
        return self._fit(X, y)

    def predict(self, X: Any) -> NDArray[np.float64]:
        """Predicted values, shape ``(n_bags,)`` or ``(n_bags, n_outputs)``; ``X`` may be
        bags or their embedding by ``representation_``."""
        check_is_fitted(self, "intercept_")
        return self.predict_embedded(self._embedding(X))

    def predict_embedded(self, embedding: Embedding) -> NDArray[np.float64]:
        """:meth:`predict` for bags already embedded by ``representation_``."""
        out = self._decision_embedded(embedding)
        return out[:, 0] if self.y_ndim_ == 1 else out


class DistributionRidgeClassifier(ClassifierMixin, _DistributionKernelRidge):
    """Classification of bags by kernel ridge on one-hot targets, decoded by argmax.

    Same parameters and attributes as :class:`DistributionRidge`; the search
    criterion is the squared error on the one-hot targets (the surrogate the model
    minimises, calibrated for argmax decoding, paper 000 Remark 10).

    Attributes
    ----------
    classes_ : ndarray of shape (n_classes,)
    """

    def _targets(self, y: ArrayLike, n_bags: int) -> NDArray[np.float64]:
        y = np.asarray(y)
        if y.ndim != 1:
            raise BagValidationError([f"class labels must be 1-D, got shape {y.shape}"])
        _check_lengths(y, n_bags)
        self.classes_, codes = np.unique(y, return_inverse=True)
        if self.classes_.size < 2:
            raise BagValidationError([f"need at least 2 classes, got only {self.classes_[0]!r}"])
        Y = np.zeros((n_bags, self.classes_.size))
        Y[np.arange(n_bags), codes] = 1.0
        return Y

    def fit(self, X: Any, y: ArrayLike) -> DistributionRidgeClassifier:
        """Fit on bags ``X`` and class labels ``y``."""
        return self._fit(X, y)

    def decision_function(self, X: Any) -> NDArray[np.float64]:
        """Regression scores per class, ``(n_bags, n_classes)``; for two classes the
        difference ``score(classes_[1]) - score(classes_[0])``, shape ``(n_bags,)``."""
        scores = self._decision(X)
        if self.classes_.size == 2:
            return scores[:, 1] - scores[:, 0]
        return scores

    def predict(self, X: Any) -> NDArray[Any]:
        """The class with the largest score for each bag (``X``: bags or their embedding)."""
        check_is_fitted(self, "intercept_")
        return self.predict_embedded(self._embedding(X))

    def predict_embedded(self, embedding: Embedding) -> NDArray[Any]:
        """:meth:`predict` for bags already embedded by ``representation_``."""
        return self.classes_[np.argmax(self._decision_embedded(embedding), axis=1)]
