"""Kernel ridge regression and classification on bags (papers 000 and 003).

The model is ``f̂(P) = k_Pᵀ (K + λ T I)⁻¹ y`` (paper 000 eq. 5 / Prop. 12, paper 003
eq. 3): ``K`` the Gram matrix of a kernel on distributions over the ``T`` training
bags, ``k_P`` the kernel between a new bag and the training bags. **The ridge
parameter is scaled by the number of bags**: ``alpha=λ`` here equals
``sklearn.kernel_ridge.KernelRidge(kernel="precomputed", alpha=λ * T)`` on the same
Gram matrix (and centred targets when ``fit_intercept=True``). Classification
regresses one-hot targets and decodes by argmax (paper 000 §2.5, Remark 10).

With the effective ridge ``λT`` held fixed the model is a linear smoother, so its
``T`` leave-one-bag-out refits are available in closed form, at the training bags (the
selection criterion, :func:`core.selection.ridge_selection_scores`) and at new bags
(one extra ``T``-vector per bag). That gives jackknife+ prediction intervals
(:meth:`DistributionRidge.predict_interval`), prediction sets
(:meth:`DistributionRidgeClassifier.predict_set`) and probabilities calibrated on
out-of-sample scores (:meth:`DistributionRidgeClassifier.predict_proba`), without a
single refit; see :meth:`_DistributionKernelRidge._fit_loo` for the algebra.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import scipy.linalg
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin, clone
from sklearn.exceptions import NotFittedError
from sklearn.utils.validation import check_is_fitted

from .._random import check_generator
from ..bags import BagValidationError, as_bags
from ..conformal import (
    check_coverage,
    fit_temperature,
    jackknife_plus_interval,
    jackknife_plus_set,
    softmax,
)
from ..kernels import batch_invariant_matmul, get_kernel, random_fourier_features
from ..representations.base import BagRepresentation, Embedding, FeatureEmbedding
from ..representations.sliced import SlicedWasserstein
from ..selection import DEFAULT_ALPHA_GRID, as_grid, gamma_grid, ridge_selection_scores
from ._domain import DomainCheckMixin

__all__ = ["DistributionRidge", "DistributionRidgeClassifier"]

# The median heuristic of the random-feature path looks at this many bags at most.
_MEDIAN_BAGS = 1000
# Leave-one-out predictions at new bags are (bags × T × outputs): bags are taken in
# chunks of at most this many elements (8 MB per temporary) to bound memory.
_LOO_CHUNK_ELEMENTS = 1 << 20
# ... and at most this many bags, whose embedding (10⁴ features per bag for the default
# sliced-Wasserstein map) is the other large temporary.
_LOO_CHUNK_BAGS = 256


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
            Z = self._rff(F, self.gamma_)
            self.coef_ = _primal_solve(Z, Yc, self.alpha_ * T)
            self.train_embedding_ = None
            self._fit_loo(Y, primal_features=Z)
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
            self._fit_loo(Y, primal_features=F)
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
            self._fit_loo(Y, regularised_gram=K)
        self.selection_ = {
            "criterion": self.selection,
            "gamma": gammas,
            "alpha": alphas,
            "score": scores,
        }
        self._fit_domain(emb)
        self._fit_calibration(Y)
        return self

    def _fit_loo(
        self,
        Y: NDArray[np.float64],
        *,
        regularised_gram: NDArray[np.float64] | None = None,
        primal_features: NDArray[np.float64] | None = None,
    ) -> None:
        """Closed-form leave-one-bag-out state for conformal prediction.

        Kernel ridge with the effective ridge ``ρ = λT`` held fixed is a linear
        smoother: ``μ̂(x) = c + w(x)ᵀ(y - c·1)`` with weights ``w(x) = (K + ρI)⁻¹ k_x``
        (dual) or ``w(x) = Φ(ΦᵀΦ + ρI)⁻¹ φ(x)`` (primal; ``K = ΦΦᵀ``) and ``c`` the
        intercept (the training mean, or 0).

        *Refit = full fit on imputed targets.* For any targets ``v``, the fit on the
        ``T - 1`` bags other than ``i`` equals the fit on all ``T`` bags with ``v_i``
        replaced by that refit's own prediction at bag ``i``, ``ṽ_i = loo_i(v)``: the
        refit minimises the other ``T - 1`` squared errors plus the ridge penalty and
        makes the ``i``-th error zero, so it minimises the ``T``-bag objective too, whose
        minimiser is unique. Hence, with ``H = K(K + ρI)⁻¹`` the hat matrix and
        ``h_i = H_ii``,

            refit_{-i}(x; v) = w(x)ᵀv - w_i(x)·(v_i - ṽ_i),
            v_i - ṽ_i = (v - Hv)_i / (1 - h_i).

        *Intercept.* With ``fit_intercept=True`` the refit centres on the mean of the
        remaining targets, ``c_{-i} = c + d_i`` with ``d_i = (c - y_i)/(T - 1)``, i.e.
        it is ``c_{-i} + refit_{-i}(x; y - c_{-i}·1)``. Writing ``s(x) = w(x)ᵀ1`` and
        ``e_i = (v - Hv)_i / (1 - h_i)`` for ``v = y - c_{-i}·1``, linearity gives

            μ̂_{-i}(x) = μ̂(x) - w_i(x)·e_i + (1 - s(x))·d_i,

        and at ``x = x_i`` this is ``y_i - e_i``: ``e_i`` is exactly the signed
        leave-one-out residual ``y_i - μ̂_{-i}(x_i)`` (the one
        :func:`core.selection.ridge_selection_scores` averages). Without an intercept
        ``d_i = 0`` and ``e_i = (y - Hy)_i / (1 - h_i)``.

        Stored (plain arrays, saved with the model): ``loo_smoother_`` ``S`` of shape
        ``(p, T)`` with ``w(x)ᵀ = z(x)ᵀS`` for the design row ``z(x)`` the prediction
        already computes (``S = (K + ρI)⁻¹``, ``z = k_x``; primal ``S = (ΦᵀΦ + ρI)⁻¹Φᵀ``,
        ``z = φ(x)``), ``loo_residuals_`` ``e`` and ``loo_intercept_shift_`` ``d``,
        both ``(T, n_outputs)``.
        """
        T = Y.shape[0]
        ridge = self.alpha_ * T
        if regularised_gram is not None:
            # A = (K + ρI)⁻¹: I - H = ρA, so (v - Hv)_i / (1 - h_i) = (Av)_i / A_ii
            # without the cancellation of forming 1 - h_i.
            A = _spd_solve(regularised_gram, np.eye(T))
            A = 0.5 * (A + A.T)  # exactly symmetric, as the true inverse is
            smoother = A
            resid_y, resid_1, one_minus_h = A @ Y, A.sum(axis=1), np.diag(A).copy()
        else:
            Z = primal_features
            assert Z is not None
            G = Z.T @ Z
            G[np.diag_indices_from(G)] += ridge
            smoother = _spd_solve(G, np.ascontiguousarray(Z.T))
            # H = Z S: residuals v - Hv and leverages h_i = z_iᵀ S_{:,i}.
            resid_y = Y - Z @ (smoother @ Y)
            resid_1 = 1.0 - Z @ smoother.sum(axis=1)
            one_minus_h = 1.0 - np.einsum("ij,ji->i", Z, smoother)
        if self.fit_intercept:
            shift = (self.intercept_[None, :] - Y) / (T - 1)
            c_minus = self.intercept_[None, :] + shift
            resid = resid_y - c_minus * resid_1[:, None]
        else:
            shift = np.zeros_like(Y)
            resid = resid_y
        # 0 ≤ h_i < 1 for ρ > 0; a leverage that rounds to 1 or above (interpolation, or
        # cancellation in the primal 1 - h_i) leaves the residual undefined. It becomes
        # inf/NaN, which the conformal methods refuse; fitting and predict() go on.
        one_minus_h = np.where(one_minus_h > 0.0, one_minus_h, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            self.loo_residuals_ = resid / one_minus_h[:, None]
        self.loo_intercept_shift_ = shift
        self.loo_smoother_ = np.ascontiguousarray(smoother)

    def _fit_calibration(self, Y: NDArray[np.float64]) -> None:
        """Hook for state fitted from the leave-one-out residuals (classifier)."""

    def _check_loo(self) -> None:
        check_is_fitted(self, "intercept_")
        if not hasattr(self, "loo_smoother_"):
            raise NotFittedError(
                "this model carries no leave-one-out state (fitted by an older bagserve); "
                "refit it to get prediction intervals, sets or probabilities"
            )
        if not np.all(np.isfinite(self.loo_residuals_)):
            raise FloatingPointError(
                "the leave-one-out residuals are undefined because the model interpolates "
                f"its training targets (alpha_={self.alpha_:g}); refit with a larger alpha"
            )

    def _design(self, emb: Embedding) -> NDArray[np.float64]:
        """The row ``z(x)`` each prediction is linear in: ``k_x`` or ``φ(x)``."""
        if self.primal_:
            return self._primal_features(emb)
        return self.kernel_matrix(emb)

    def _loo_decision(self, X: Any) -> NDArray[np.float64]:
        """Decision values of the ``T`` leave-one-bag-out models at bags ``X`` (or their
        embedding), shape ``(n_bags, T, n_outputs)`` (see :meth:`_fit_loo`)."""
        self._check_loo()
        return np.concatenate([loo for _, loo in self._loo_chunks(X)], axis=0)

    def _loo_chunks(self, X: Any) -> Iterator[tuple[slice, NDArray[np.float64]]]:
        """Yield ``(slice, μ̂_{-i}(x) for the bags of the slice)`` chunk by chunk.

        ``X`` is bags, or their embedding by ``representation_`` (the runtime embeds a
        request once for the prediction, its interval and its domain check). Chunks
        bound the ``(bags, T, outputs)`` block and the chunk's embedding; every product
        is row-wise (:func:`~core.kernels.batch_invariant_matmul`), so a bag's result
        does not depend on the chunking or on the other bags of the request.
        """
        T, k = self.loo_residuals_.shape
        step = max(1, min(_LOO_CHUNK_BAGS, _LOO_CHUNK_ELEMENTS // (T * k)))
        if isinstance(X, Embedding):
            n = len(X)
            if not isinstance(X, FeatureEmbedding):
                step = max(n, 1)  # point-based embeddings are not sliced: one chunk
        else:
            X = as_bags(X)
            n = len(X)
        for lo in range(0, n, step):
            part = slice(lo, min(lo + step, n))
            if step >= n:
                emb = X if isinstance(X, Embedding) else self.representation_.embed(X)
            elif isinstance(X, FeatureEmbedding):
                emb = FeatureEmbedding(X.features[part], X.geometry)
            else:
                emb = self.representation_.embed(X.take(np.arange(part.start, part.stop)))
            z = self._design(emb)
            coef = self.coef_ if self.primal_ else self.dual_coef_
            # The same products as _decision_embedded, so μ̂(x) is predict()'s value.
            mu = batch_invariant_matmul(z, coef) + self.intercept_
            w = batch_invariant_matmul(z, self.loo_smoother_)
            loo = mu[:, None, :] - w[:, :, None] * self.loo_residuals_[None, :, :]
            loo += (1.0 - w.sum(axis=1))[:, None, None] * self.loo_intercept_shift_[None, :, :]
            yield part, loo

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
        if self.kernel_.uses_inner_product:
            return self.kernel_(emb.inner(train), self.gamma_)
        return self.kernel_(self._sq_to_training(emb, train), self.gamma_)


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
    loo_smoother_ : ndarray of shape (T, T) or (n_features, T)
        ``S`` with smoother weights ``w(P)ᵀ = z(P)ᵀ S`` at a new bag (``z = k_P``:
        ``S = (K + λT I)⁻¹``; primal ``z = φ(P)``: ``S = (ΦᵀΦ + λT I)⁻¹Φᵀ``).
    loo_residuals_ : ndarray of shape (T, n_outputs)
        Signed leave-one-bag-out residuals ``y_i - μ̂_{-i}(P_i)``, exact for fixed
        ``γ`` and ``λT`` (their mean square is the selection's LOO score).
    loo_intercept_shift_ : ndarray of shape (T, n_outputs)
        ``c_{-i} - c = (c - y_i)/(T - 1)``: how the intercept moves when bag ``i`` is
        left out (zeros with ``fit_intercept=False``).

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

    def loo_predict(self, X: Any) -> NDArray[np.float64]:
        """Predictions at bags ``X`` of the ``T`` leave-one-bag-out models, without refits.

        ``μ̂_{-i}(x)`` is the model fitted, with the same representation, ``γ`` and
        effective ridge ``λT``, on every training bag but the ``i``-th; in closed form
        ``μ̂_{-i}(x) = μ̂(x) - w_i(x)·e_i + (1 - Σ_j w_j(x))·d_i`` with ``w(x)`` the
        smoother weights, ``e_i`` the leave-one-out residual and ``d_i`` the change of
        the intercept (see :meth:`_fit_loo`).

        Returns
        -------
        ndarray of shape (n_bags, T) or (n_bags, T, n_outputs)
            Column ``i`` is the model without training bag ``i``.
        """
        loo = self._loo_decision(X)
        return loo[:, :, 0] if self.y_ndim_ == 1 else loo

    def predict_interval(self, X: Any, coverage: float = 0.9) -> NDArray[np.float64]:
        r"""Jackknife+ prediction intervals from the closed-form leave-one-bag-out models.

        Barber, Candès, Ramdas, Tibshirani, "Predictive inference with the jackknife+",
        Ann. Statist. 49(1), 2021, eq. (6): with ``α = 1 - coverage``, ``R_i = |y_i -
        μ̂_{-i}(P_i)|`` the leave-one-bag-out residuals and ``μ̂_{-i}(P)`` the
        leave-one-out models at a new bag ``P``,

        .. math::

            \hat C_α(P) = \big[\, \hat q^-_{α}\{μ̂_{-i}(P) - R_i\}_{i=1}^T,\;
                            \hat q^+_{α}\{μ̂_{-i}(P) + R_i\}_{i=1}^T \big],

        where ``q̂⁻_α`` is the ``⌊α(T+1)⌋``-th smallest and ``q̂⁺_α`` the
        ``⌈(1-α)(T+1)⌉``-th smallest of the ``T`` values. For exchangeable (bag, target)
        pairs the coverage is at least ``1 - 2α`` (their Theorem 1) and in practice close
        to ``1 - α``. The leave-one-out models are exact refits with the
        representation, ``γ`` and the effective ridge ``λT`` held fixed
        (:meth:`loo_predict`): each new bag costs one extra ``T``-vector, no refit.

        The theory treats the representation, ``γ`` and ``λ`` as fixed; here they were
        chosen on all ``T`` bags by the same leave-one-out error, a mild reuse of the
        data (the benchmark ``bench/bench_conformal.py`` measures the coverage).

        Parameters
        ----------
        X : Bags, list of 2-D arrays, or their Embedding by ``representation_``
        coverage : float in (0, 1), default=0.9
            Target coverage ``1 - α``. With fewer than ``1/α - 1`` training bags the
            intervals are ``(-inf, inf)``.

        Returns
        -------
        ndarray of shape (n_bags, 2), or (n_bags, n_outputs, 2) for 2-D targets
            Lower and upper ends. For several outputs each output gets its own
            jackknife+ interval (marginal coverage per output, not joint).

        Raises
        ------
        FloatingPointError
            The model interpolates its targets (leverage 1): leave-one-out residuals are
            undefined.
        """
        coverage = check_coverage(coverage)
        self._check_loo()
        parts = [
            jackknife_plus_interval(loo, self.loo_residuals_, coverage)
            for _, loo in self._loo_chunks(X)
        ]
        out = np.concatenate(parts, axis=0)
        return out[:, 0, :] if self.y_ndim_ == 1 else out


class DistributionRidgeClassifier(ClassifierMixin, _DistributionKernelRidge):
    """Classification of bags by kernel ridge on one-hot targets, decoded by argmax.

    Same parameters and attributes as :class:`DistributionRidge`; the search
    criterion is the squared error on the one-hot targets (the surrogate the model
    minimises, calibrated for argmax decoding, paper 000 Remark 10).

    Attributes
    ----------
    classes_ : ndarray of shape (n_classes,)
    loo_nonconformity_ : ndarray of shape (T,)
        ``1 -`` the leave-one-bag-out score of each training bag's own class
        (:meth:`predict_set`).
    proba_scale_ : float
        Inverse temperature of :meth:`predict_proba`, fitted on the leave-one-out
        scores.
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

    def _fit_calibration(self, Y: NDArray[np.float64]) -> None:
        # Leave-one-out scores of the training bags: out-of-sample scores for free.
        codes = np.argmax(Y, axis=1)
        loo_scores = Y - self.loo_residuals_
        # Nonconformity of a bag under its own leave-one-out model: 1 - score of its
        # true class, which is the one-hot residual of that class.
        self.loo_nonconformity_ = self.loo_residuals_[np.arange(Y.shape[0]), codes].copy()
        if np.all(np.isfinite(loo_scores)):
            self.proba_scale_ = fit_temperature(loo_scores, codes)
        else:  # interpolation: no out-of-sample scores to calibrate on
            self.proba_scale_ = np.nan

    def predict_proba(self, X: Any) -> NDArray[np.float64]:
        """Class probabilities calibrated on the leave-one-bag-out scores.

        ``p(c | P) = softmax(a·s(P))_c`` with ``s(P)`` the one-hot ridge scores of all
        classes and ``a > 0`` one inverse temperature, fitted once by minimising the
        cross-entropy of the *leave-one-out* scores of the training bags to Platt's
        out-of-sample targets (Platt 1999, "Probabilistic outputs for support vector
        machines and comparisons to regularized likelihood methods"; temperature
        scaling, Guo, Pleiss, Sun, Weinberger, "On calibration of modern neural
        networks", ICML 2017). The leave-one-out scores are exact refits in closed form,
        so no bags are set aside for calibration; see
        :func:`core.conformal.fit_temperature`.

        Returns
        -------
        ndarray of shape (n_bags, n_classes)
            Rows sum to 1; columns follow ``classes_``. A positive slope keeps each
            row's order, so ``argmax`` is :meth:`predict`'s class (barring scores that
            differ only in their last bit).
        """
        check_is_fitted(self, "intercept_")
        self._check_loo()
        emb = X if isinstance(X, Embedding) else self.representation_.embed(X)
        return softmax(self.proba_scale_ * self._decision_embedded(emb))

    def predict_set(self, X: Any, coverage: float = 0.9) -> NDArray[np.bool_]:
        r"""Jackknife+ prediction sets from the closed-form leave-one-bag-out models.

        The nonconformity of label ``c`` for bag ``P`` under a model ``f`` is
        ``E(P, c; f) = 1 - f_c(P)``, one minus the one-hot ridge score of ``c`` (the
        "least ambiguous" score of Sadinle, Lei, Wasserman, JASA 2019, with the ridge
        score as the probability estimate, paper 000 Remark 10). With ``E_i = E(P_i,
        y_i; f_{-i})`` the leave-one-out score of each training bag and ``f_{-i}`` the
        leave-one-out models at ``P``, the set is (Romano, Sesia, Candès, "Classification
        with valid and adaptive coverage", NeurIPS 2020, §3, with one bag per fold;
        Barber et al. 2021)

        .. math::

            \hat C_α(P) = \Big\{ c : \sum_{i=1}^T \mathbb 1\big[E_i < E(P, c;
            f_{-i})\big] < (1-α)(T+1) \Big\},

        with coverage ``≥ 1 - 2α`` for exchangeable bags and close to ``1 - α`` in
        practice. If all leave-one-out models agreed it would keep the labels whose
        score is at most the ``⌈(T+1)(1-α)⌉/T`` empirical quantile of the ``E_i``
        (split conformal). Costs one extra ``T``-vector per bag, no refit.

        Parameters
        ----------
        X : Bags, list of 2-D arrays, or their Embedding by ``representation_``
        coverage : float in (0, 1), default=0.9

        Returns
        -------
        ndarray of bool, shape (n_bags, n_classes)
            ``True`` where ``classes_[j]`` is in the bag's set (:meth:`set_labels`
            turns it into label lists). A set can be empty when no class conforms;
            every class is in every set when ``T < 1/α - 1``.
        """
        coverage = check_coverage(coverage)
        self._check_loo()
        parts = [
            jackknife_plus_set(1.0 - loo, self.loo_nonconformity_, coverage)
            for _, loo in self._loo_chunks(X)
        ]
        return np.concatenate(parts, axis=0)

    def set_labels(self, sets: NDArray[np.bool_]) -> list[NDArray[Any]]:
        """The class labels of each row of a :meth:`predict_set` mask."""
        sets = np.asarray(sets, dtype=bool)
        return [self.classes_[row] for row in sets]
