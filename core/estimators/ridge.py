"""Kernel ridge regression and classification on bags (papers 000 and 003).

The model is ``f̂(P) = k_Pᵀ (K + λ T I)⁻¹ y`` (paper 000 eq. 5 / Prop. 12, paper 003
eq. 3): ``K`` the Gram matrix of a kernel on distributions over the ``T`` training
bags, ``k_P`` the kernel between a new bag and the training bags. **The ridge
parameter is scaled by the number of bags**: ``alpha=λ`` here equals
``sklearn.kernel_ridge.KernelRidge(kernel="precomputed", alpha=λ * T)`` on the same
Gram matrix (and centred targets when ``fit_intercept=True``). Classification
regresses one-hot targets and decodes by argmax (paper 000 §2.5, Remark 10).

``γ`` and ``λ`` are chosen in closed form by the leave-one-bag-out error, or by the
leave-one-*group*-out error when ``fit(..., groups=)`` names the subject (patient,
donor) of each bag: bags of one subject must not vouch for each other
(:mod:`._ridge_fit`). Prediction intervals (:meth:`DistributionRidge.predict_interval`),
prediction sets (:meth:`DistributionRidgeClassifier.predict_set`) and probabilities
calibrated on out-of-sample scores (:meth:`DistributionRidgeClassifier.predict_proba`)
come from held-out models: jackknife+ in closed form when nothing was searched, CV+
with the search repeated in each fold otherwise, whole groups held out together, the
residuals scaled by the distance to the training bags (:mod:`._ridge_calibration`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin, clone
from sklearn.exceptions import NotFittedError
from sklearn.utils.validation import check_is_fitted

from ..bags import BagValidationError, as_bags
from ..conformal import (
    check_coverage,
    fit_temperature,
    jackknife_plus_interval,
    jackknife_plus_set,
    softmax,
)
from ..kernels import batch_invariant_matmul, get_kernel
from ..representations.base import BagRepresentation, Embedding, FeatureEmbedding
from ..representations.sliced import SlicedWasserstein
from ..selection import DEFAULT_ALPHA_GRID, GroupBlocks
from ._domain import DomainCheckMixin
from ._grid_choices import GridChoice, ridge_choices, warn_grid_edges
from ._params import Constraint, IntegerAtLeast, OneOf, validate_params
from ._ridge_calibration import (
    CALIBRATIONS,
    calibration_predictions,
    closed_form_state,
    cv_plus_state,
    interval_scales,
)
from ._ridge_fit import RidgeDesign

if TYPE_CHECKING:
    from ..explanations import Explanation

__all__ = ["DistributionRidge", "DistributionRidgeClassifier"]

# Held-out predictions at new bags are (bags × T × outputs): bags are taken in chunks
# of at most this many elements (8 MB per temporary) to bound memory.
_LOO_CHUNK_ELEMENTS = 1 << 20
# ... and at most this many bags, whose embedding (10⁴ features per bag for the default
# sliced-Wasserstein map) is the other large temporary.
_LOO_CHUNK_BAGS = 256


class _DistributionKernelRidge(DomainCheckMixin, BaseEstimator):
    """Shared fit/predict of :class:`DistributionRidge` and its classifier.

    Subclasses define ``_targets(y, n_bags)``, which validates the targets and
    returns them as a ``(T, n_outputs)`` float matrix.
    """

    #: What each hyperparameter may be, checked by ``fit`` (:mod:`._params`).
    _parameter_constraints: ClassVar[dict[str, Constraint]] = {
        "selection": OneOf(("loo", "gcv"), "'loo' or 'gcv'"),
        "calibration": OneOf(CALIBRATIONS, f"one of {CALIBRATIONS}"),
        "interval_scaling": OneOf(("domain", "none"), "'domain' or 'none'"),
        "calibration_folds": IntegerAtLeast(2),
    }

    def __init__(
        self,
        representation: BagRepresentation | None = None,
        *,
        kernel: str = "gaussian",
        gamma: float | ArrayLike | None = None,
        alpha: float | ArrayLike | None = None,
        kernel_params: dict[str, Any] | None = None,
        fit_intercept: bool = True,
        selection: Literal["loo", "gcv"] = "loo",
        n_components: int | None = None,
        calibration: Literal["auto", "jackknife+", "cv+"] = "auto",
        calibration_folds: int = 10,
        interval_scaling: Literal["domain", "none"] = "domain",
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
        self.calibration = calibration
        self.calibration_folds = calibration_folds
        self.interval_scaling = interval_scaling
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

    def _fit(self, X: Any, y: ArrayLike, groups: ArrayLike | None) -> _DistributionKernelRidge:
        bags = as_bags(X)
        if len(bags) < 2:
            raise BagValidationError([f"need at least 2 training bags, got {len(bags)}"])
        validate_params(self)
        rep = self.unfitted_representation().fit(bags)
        return self._fit_embedded(rep, rep.embed(bags), y, groups)

    def fit_embedded(
        self,
        representation: BagRepresentation,
        embedding: Embedding,
        y: ArrayLike,
        groups: ArrayLike | None = None,
    ) -> _DistributionKernelRidge:
        """Fit on bags already embedded by ``representation`` (fitted).

        For training that featurises bags where they are read (:mod:`core.streaming`):
        with ``representation = self.unfitted_representation()`` fitted as :meth:`fit`
        would fit it, the model is the one :meth:`fit` gives on the same bags.
        """
        check_is_fitted(representation)
        if len(embedding) < 2:
            raise BagValidationError([f"need at least 2 training bags, got {len(embedding)}"])
        validate_params(self)
        return self._fit_embedded(representation, embedding, y, groups)

    def _groups(self, groups: ArrayLike | None, T: int) -> GroupBlocks | None:
        """The groups as blocks (None without groups); 2 groups at least."""
        if groups is None:
            return None
        g = np.asarray(groups)
        if g.shape != (T,):
            raise BagValidationError([f"got {g.size} group label(s) for {T} bag(s)"])
        blocks = GroupBlocks(g)
        if blocks.n_groups < 2:
            raise BagValidationError(
                ["groups: every bag is in one group; leaving a group out needs at least 2"]
            )
        if self.selection == "gcv" and not blocks.singletons:
            raise ValueError(
                "selection='gcv' cannot leave groups out; use selection='loo' with groups"
            )
        return blocks

    def _fit_embedded(
        self, rep: BagRepresentation, emb: Embedding, y: ArrayLike, groups: ArrayLike | None
    ) -> _DistributionKernelRidge:
        # The T x T distances (or Gram) are computed once for the whole fit: the design
        # and the domain check's calibration both read them, and for the exact mean
        # embedding they are most of the fit's cost.
        with emb.reusing_products():
            return self._fit_reusing(rep, emb, y, groups)

    def _fit_reusing(
        self, rep: BagRepresentation, emb: Embedding, y: ArrayLike, groups: ArrayLike | None
    ) -> _DistributionKernelRidge:
        T = len(emb)
        Y = self._targets(y, T)
        blocks = self._groups(groups, T)
        kern = get_kernel(self.kernel, self.kernel_params)
        if not kern.has_gamma and self.gamma is not None:
            raise ValueError("the linear kernel has no gamma; leave gamma=None")
        self.representation_ = rep
        self.kernel_ = kern
        self.n_features_in_ = rep.n_features_in_
        design = RidgeDesign(emb, kern, self.n_components, self.random_state)
        fit_params = {
            "gamma": self.gamma,
            "alpha": self.alpha,
            "default_alphas": DEFAULT_ALPHA_GRID,
            "fit_intercept": self.fit_intercept,
            "criterion": self.selection,
        }
        fit = design.fit(np.arange(T), Y, groups=blocks, **fit_params)
        self.primal_ = design.primal
        self.gamma_ = fit.gamma
        self.alpha_ = fit.alpha
        self.intercept_ = fit.intercept
        if design.kind == "rff":
            self.rff_base_ = design.rff_base
            self.rff_geometry_ = design.geometry
        if design.primal:
            self.coef_ = fit.coef
            self.train_embedding_ = None
        else:
            self.dual_coef_ = fit.coef
            self.train_embedding_ = emb
        self.selection_ = {
            "criterion": self.selection if blocks is None else "leave-one-group-out",
            "gamma": fit.gammas if design.kind != "linear" else np.array([np.nan]),
            "alpha": fit.alphas,
            "score": fit.scores,
        }
        self.calibration_groups_ = None if blocks is None else blocks.codes
        self._fit_domain(emb, None if blocks is None else blocks.codes)
        mode = self.calibration
        if mode == "auto":
            mode = "cv+" if fit.searched else "jackknife+"
        self.calibration_ = mode
        # The closed-form leave-one-out state: jackknife+'s calibration, and the
        # out-of-sample scores a classifier's probabilities are fitted on; a CV+
        # regressor needs neither.
        closed = (
            closed_form_state(design, fit, Y, self.fit_intercept, blocks)
            if mode == "jackknife+" or self._fits_on_loo_scores
            else None
        )
        if mode == "cv+":
            state = cv_plus_state(
                design,
                Y,
                self.calibration_groups_,
                n_folds=self.calibration_folds,
                random_state=self.random_state,
                fit_params=fit_params,
            )
        else:
            assert closed is not None
            state = closed
        for name, value in state.items():
            setattr(self, name, value)
        if self._fits_on_loo_scores:
            # Probabilities are calibrated on the leave-one-out scores of the model's
            # own γ and λ, which behave as the model does; coverage (sets, intervals)
            # rests on the calibration models above.
            assert closed is not None
            self._fit_calibration(Y, closed["loo_residuals_"])
        warn_grid_edges(self)
        return self

    def grid_choices(self) -> list[GridChoice]:
        """``γ`` and ``λ`` where they were chosen from a grid (see
        :mod:`._grid_choices`)."""
        return ridge_choices(self)

    #: Whether :meth:`_fit_calibration` fits state on the closed-form leave-one-out
    #: residuals (the classifier's probabilities and sets).
    _fits_on_loo_scores = False

    def _fit_calibration(self, Y: NDArray[np.float64], loo_residuals: NDArray[np.float64]) -> None:
        """Hook for state fitted from the out-of-sample residuals (classifier)."""

    def _calibration_residuals(self) -> NDArray[np.float64]:
        """``y_i - μ̂_{m(i)}(x_i)`` under each training bag's calibration model."""
        if getattr(self, "calibration_", "jackknife+") == "cv+":
            return self.cv_residuals_
        return self.loo_residuals_

    def _check_loo(self) -> None:
        check_is_fitted(self, "intercept_")
        if not (hasattr(self, "loo_smoother_") or hasattr(self, "cv_residuals_")):
            raise NotFittedError(
                "this model carries no leave-one-out state (fitted by an older bagserve); "
                "refit it to get prediction intervals, sets or probabilities"
            )
        if not np.all(np.isfinite(self._calibration_residuals())):
            raise FloatingPointError(
                "the leave-one-out residuals are undefined because the model interpolates "
                f"its training targets (alpha_={self.alpha_:g}); refit with a larger alpha"
            )

    def _design(self, emb: Embedding) -> NDArray[np.float64]:
        """The row ``z(x)`` each prediction is linear in: ``k_x`` or ``φ(x)``."""
        if self.primal_:
            return self._primal_features(emb)
        return self.kernel_matrix(emb)

    def _design_for(self, emb: Embedding, gamma: float | None) -> NDArray[np.float64]:
        """Design rows of ``emb`` for another ``γ`` (a calibration fold's model)."""
        if self.primal_:
            assert isinstance(emb, FeatureEmbedding)
            if self.n_components is not None:
                return self._rff(emb.features, float(gamma))  # type: ignore[arg-type]
            return emb.features
        train = self.train_embedding_
        if self.kernel_.uses_inner_product:
            return self.kernel_(emb.inner(train), gamma)
        return self.kernel_(self._sq_to_training(emb, train), gamma)

    def _loo_decision(self, X: Any) -> NDArray[np.float64]:
        """Decision values of the ``T`` calibration models at bags ``X`` (or their
        embedding), shape ``(n_bags, T, n_outputs)``."""
        self._check_loo()
        return np.concatenate([loo for _, loo, _ in self._loo_chunks(X)], axis=0)

    def _loo_chunks(
        self, X: Any, domain_scores: NDArray[np.float64] | None = None
    ) -> Iterator[tuple[slice, NDArray[np.float64], NDArray[np.float64] | None]]:
        """Yield ``(slice, μ̂_{m(i)}(x), domain scores)`` for the bags of each slice.

        ``X`` is bags, or their embedding by ``representation_`` (the runtime embeds a
        request once for the prediction, its interval and its domain check, and passes
        that check's ``domain_scores`` rather than having them computed again). Chunks
        bound the ``(bags, T, outputs)`` block and the chunk's embedding; every product
        is row-wise (:func:`~core.kernels.batch_invariant_matmul`), so a bag's result
        does not depend on the chunking or on the other bags of the request.
        """
        T, k = self._calibration_residuals().shape
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
            loo = calibration_predictions(self, z, mu, lambda g, e=emb: self._design_for(e, g))
            scores = None
            if self.interval_scaling == "domain":
                scores = (
                    self.domain_check(emb).score if domain_scores is None else domain_scores[part]
                )
            yield part, loo, scores

    def _scaled(
        self, scores: NDArray[np.float64] | None
    ) -> tuple[NDArray[np.float64] | None, NDArray[np.float64] | None]:
        return interval_scales(self, scores)

    def _rff(self, F: NDArray[np.float64], gamma: float) -> NDArray[np.float64]:
        """``z(φ)`` with ``z(a)ᵀz(b) ≈ exp(-γ D²(a, b))``: Gaussian frequencies of variance
        ``2γ`` for Euclidean embeddings, Cauchy of scale ``γ`` for ℓ1 ones (SW_1)."""
        from ..kernels import random_fourier_features

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

    def explain(self, bag: Any, *, markers: ArrayLike | None = None) -> Explanation:
        """Per-cell contributions to this model's prediction for one bag
        (:func:`core.explanations.explain`)."""
        from ..explanations import explain

        return explain(self, bag, markers=markers)

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
    calibration : {"auto", "jackknife+", "cv+"}, default="auto"
        The held-out models behind intervals, sets and calibrated probabilities
        (:mod:`._ridge_calibration`): ``"jackknife+"``, the leave-one-bag-out (or
        leave-one-group-out) models in closed form with ``γ`` and ``λT`` fixed;
        ``"cv+"``, ``calibration_folds`` folds each fitted with the whole search
        repeated, so that the calibration accounts for the choice of ``γ`` and ``λ``;
        ``"auto"``: CV+ when something is searched, jackknife+ otherwise.
    calibration_folds : int, default=10
        Folds of the CV+ calibration (whole groups per fold; at most one per group).
    interval_scaling : {"domain", "none"}, default="domain"
        ``"domain"``: conformal residuals scaled by ``max(1, domain score)``
        (:mod:`core.domain`), so that a bag far from the training bags gets a wider
        interval or set; ``"none"``: plain jackknife+/CV+ residuals.
    random_state : int, Generator or None
        Seeds the default representation (or a given one whose own ``random_state``
        is ``None``), the random features and the calibration folds.

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
    calibration_ : {"jackknife+", "cv+"}
        The calibration used.
    calibration_groups_ : ndarray of int, shape (T,), or None
        The group of each training bag (``fit(..., groups=)``), as codes.
    loo_smoother_ : ndarray of shape (T, T) or (n_features, T)
        Jackknife+: ``S`` with smoother weights ``w(P)ᵀ = z(P)ᵀ S`` at a new bag (``z =
        k_P``: ``S = (K + λT I)⁻¹``; primal ``z = φ(P)``: ``S = (ΦᵀΦ + λT I)⁻¹Φᵀ``).
    loo_residuals_ : ndarray of shape (T, n_outputs)
        Jackknife+: signed leave-one-bag-out (leave-one-group-out) residuals ``y_i -
        μ̂_{-i}(P_i)``, exact for fixed ``γ`` and ``λT``.
    loo_intercept_shift_ : ndarray of shape (T, n_outputs)
        Jackknife+: ``c_{-i} - c``, how the intercept moves when bag ``i`` (its group)
        is left out (zeros with ``fit_intercept=False``).
    cv_fold_, cv_gamma_, cv_alpha_, cv_coef_, cv_intercept_, cv_residuals_ : ndarray
        CV+: each bag's fold, each fold model's ``γ``, ``λ``, coefficients and
        intercept, and the out-of-fold residuals.

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

    def fit(self, X: Any, y: ArrayLike, groups: ArrayLike | None = None) -> DistributionRidge:
        """Fit on bags ``X`` (a :class:`~core.Bags` or a list of 2-D arrays) and targets ``y``.

        ``groups`` (one label per bag: the subject, patient or donor) makes the search,
        the calibration and the domain check leave whole groups out: several bags of
        one subject (time points, replicate tubes) otherwise vouch for each other.
        """
        return self._fit(X, y, groups)

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
        """Predictions at bags ``X`` of the ``T`` calibration models, without refits.

        Jackknife+: ``μ̂_{-i}(x)`` is the model fitted, with the same representation,
        ``γ`` and effective ridge ``λT``, on every training bag but the ``i``-th (every
        bag outside ``i``'s group with groups); in closed form ``μ̂_{-i}(x) = μ̂(x) -
        w_i(x)·e_i + (1 - Σ_j w_j(x))·d_i`` (see
        :func:`~._ridge_calibration.closed_form_state`). CV+: the model of ``i``'s fold.

        Returns
        -------
        ndarray of shape (n_bags, T) or (n_bags, T, n_outputs)
            Column ``i`` is the model that did not see training bag ``i``.
        """
        loo = self._loo_decision(X)
        return loo[:, :, 0] if self.y_ndim_ == 1 else loo

    def predict_interval(
        self,
        X: Any,
        coverage: float = 0.9,
        *,
        domain_scores: NDArray[np.float64] | None = None,
    ) -> NDArray[np.float64]:
        r"""Conformal prediction intervals from the calibration models (jackknife+ or CV+).

        Barber, Candès, Ramdas, Tibshirani, "Predictive inference with the jackknife+",
        Ann. Statist. 49(1), 2021, eq. (6) and (9): with ``α = 1 - coverage``, ``R_i =
        |y_i - μ̂_{m(i)}(P_i)|`` the held-out residuals, ``μ̂_{m(i)}`` the model that did
        not see bag ``i`` (its leave-one-out model, or its CV+ fold's model) and ``σ``
        the interval scale,

        .. math::

            \hat C_α(P) = \big[\, \hat q^-_{α}\{μ̂_{m(i)}(P) - σ(P) R_i/σ_i\},\;
                            \hat q^+_{α}\{μ̂_{m(i)}(P) + σ(P) R_i/σ_i\} \big],

        ``q̂⁻_α`` the ``⌊α(T+1)⌋``-th smallest and ``q̂⁺_α`` the ``⌈(1-α)(T+1)⌉``-th
        smallest of the ``T`` values. ``σ = max(1, domain score)`` with
        ``interval_scaling="domain"`` (the training bags' scores leave them and their
        group out), 1 otherwise. For exchangeable (bag, target) pairs (subjects, with
        groups) the coverage is at least ``1 - 2α`` and in practice close to ``1 - α``;
        with CV+ (``calibration="auto"`` whenever ``γ`` or ``λ`` is searched) this
        holds for the whole procedure, search included. ``bench/bench_conformal.py``
        measures it.

        Parameters
        ----------
        X : Bags, list of 2-D arrays, or their Embedding by ``representation_``
        coverage : float in (0, 1), default=0.9
            Target coverage ``1 - α``. With fewer than ``1/α - 1`` training bags the
            intervals are ``(-inf, inf)``.
        domain_scores : ndarray of shape (n_bags,), optional
            The bags' domain scores (:meth:`domain_check`) when the caller has them
            already; computed here otherwise.

        Returns
        -------
        ndarray of shape (n_bags, 2), or (n_bags, n_outputs, 2) for 2-D targets
            Lower and upper ends. For several outputs each output gets its own
            interval (marginal coverage per output, not joint).

        Raises
        ------
        FloatingPointError
            The model interpolates its targets (leverage 1): leave-one-out residuals are
            undefined.
        """
        coverage = check_coverage(coverage)
        self._check_loo()
        residuals = self._calibration_residuals()
        parts = []
        for _, loo, scores in self._loo_chunks(X, domain_scores):
            new_scale, train_scale = self._scaled(scores)
            parts.append(
                jackknife_plus_interval(
                    loo, residuals, coverage, scale=new_scale, train_scale=train_scale
                )
            )
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

    def fit(
        self, X: Any, y: ArrayLike, groups: ArrayLike | None = None
    ) -> DistributionRidgeClassifier:
        """Fit on bags ``X`` and class labels ``y`` (``groups``: see
        :meth:`DistributionRidge.fit`)."""
        return self._fit(X, y, groups)

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

    _fits_on_loo_scores = True

    def _fit_calibration(self, Y: NDArray[np.float64], loo_residuals: NDArray[np.float64]) -> None:
        codes = np.argmax(Y, axis=1)
        # Nonconformity of a bag under its calibration model: 1 - score of its true
        # class, which is the one-hot residual of that class.
        residuals = self._calibration_residuals()
        self.loo_nonconformity_ = residuals[np.arange(Y.shape[0]), codes].copy()
        # Leave-one-out scores of the training bags: out-of-sample scores for free.
        loo_scores = Y - loo_residuals
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

    def predict_set(
        self,
        X: Any,
        coverage: float = 0.9,
        *,
        domain_scores: NDArray[np.float64] | None = None,
    ) -> NDArray[np.bool_]:
        r"""Conformal prediction sets from the calibration models (jackknife+ or CV+).

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
        practice. ``f_{-i}`` is the model that did not see bag ``i`` (closed-form
        leave-one-out or leave-one-group-out, or its CV+ fold's model: see
        :meth:`DistributionRidge.predict_interval`), and with
        ``interval_scaling="domain"`` both sides of the comparison are divided by their
        bag's ``σ = max(1, domain score)``: a bag far from the training bags gets a
        larger set. If all leave-one-out models agreed it would keep the labels whose
        score is at most the ``⌈(T+1)(1-α)⌉/T`` empirical quantile of the ``E_i``
        (split conformal). Costs one extra ``T``-vector per bag, no refit.

        Parameters
        ----------
        X : Bags, list of 2-D arrays, or their Embedding by ``representation_``
        coverage : float in (0, 1), default=0.9
        domain_scores : ndarray of shape (n_bags,), optional
            The bags' domain scores (:meth:`domain_check`) when the caller has them
            already; computed here otherwise.

        Returns
        -------
        ndarray of bool, shape (n_bags, n_classes)
            ``True`` where ``classes_[j]`` is in the bag's set (:meth:`set_labels`
            turns it into label lists). A set can be empty when no class conforms;
            every class is in every set when ``T < 1/α - 1``.
        """
        coverage = check_coverage(coverage)
        self._check_loo()
        parts = []
        for _, loo, scores in self._loo_chunks(X, domain_scores):
            new_scale, train_scale = self._scaled(scores)
            parts.append(
                jackknife_plus_set(
                    1.0 - loo,
                    self.loo_nonconformity_,
                    coverage,
                    scale=new_scale,
                    train_scale=train_scale,
                )
            )
        return np.concatenate(parts, axis=0)

    def set_labels(self, sets: NDArray[np.bool_]) -> list[NDArray[Any]]:
        """The class labels of each row of a :meth:`predict_set` mask."""
        sets = np.asarray(sets, dtype=bool)
        return [self.classes_[row] for row in sets]
