"""The kernel ridge machinery both bag-level ridge estimators share (:mod:`.ridge`).

:class:`DistributionKernelRidge` fits ``f̂(P) = k_Pᵀ (K + λ T I)⁻¹ y`` on embedded bags
(the search and solve of :mod:`._ridge_fit`, the held-out models of
:mod:`._ridge_calibration`), predicts its decision values, its leave-one-bag-out
decisions at new bags (in chunks that bound memory) and its explanations; the public
estimators add their targets, predictions, intervals and sets.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, clone
from sklearn.exceptions import NotFittedError
from sklearn.utils.validation import check_is_fitted

from ..bags import BagValidationError, as_bags
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

__all__ = ["DistributionKernelRidge", "check_lengths"]

# Held-out predictions at new bags are (bags × T × outputs): bags are taken in chunks
# of at most this many elements (8 MB per temporary) to bound memory.
_LOO_CHUNK_ELEMENTS = 1 << 20
# ... and at most this many bags, whose embedding (10⁴ features per bag for the default
# sliced-Wasserstein map) is the other large temporary.
_LOO_CHUNK_BAGS = 256


class DistributionKernelRidge(DomainCheckMixin, BaseEstimator):
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

    def _fit(self, X: Any, y: ArrayLike, groups: ArrayLike | None) -> DistributionKernelRidge:
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
    ) -> DistributionKernelRidge:
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
    ) -> DistributionKernelRidge:
        # The T x T distances (or Gram) are computed once for the whole fit: the design
        # and the domain check's calibration both read them, and for the exact mean
        # embedding they are most of the fit's cost.
        with emb.reusing_products():
            return self._fit_reusing(rep, emb, y, groups)

    def _fit_reusing(
        self, rep: BagRepresentation, emb: Embedding, y: ArrayLike, groups: ArrayLike | None
    ) -> DistributionKernelRidge:
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


def check_lengths(y: NDArray[Any], n_bags: int) -> None:
    if y.shape[0] != n_bags:
        raise BagValidationError([f"got {y.shape[0]} target(s) for {n_bags} bag(s)"])
