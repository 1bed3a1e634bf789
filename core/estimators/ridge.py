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

from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import ClassifierMixin, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from ..bags import BagValidationError
from ..conformal import (
    check_coverage,
    fit_temperature,
    jackknife_plus_interval,
    jackknife_plus_set,
    softmax,
)
from ..representations.base import Embedding
from ._ridge_base import DistributionKernelRidge, check_lengths

if TYPE_CHECKING:
    pass

__all__ = ["DistributionRidge", "DistributionRidgeClassifier"]


class DistributionRidge(RegressorMixin, DistributionKernelRidge):
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
        check_lengths(Y, n_bags)
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


class DistributionRidgeClassifier(ClassifierMixin, DistributionKernelRidge):
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
        check_lengths(y, n_bags)
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
