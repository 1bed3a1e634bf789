"""Conditional mean embeddings as vector-valued kernel ridge regression (paper 002).

Grünewälder, Lever, Baldassarre, Patterson, Gretton & Pontil, "Conditional mean
embeddings as regressors" (ICML 2012). With an input kernel ``K`` (on points, or on bags
through any representation of the core) and an output kernel ``L``, the estimate of the
embedding of ``P(Y | X = x)`` is

    μ̂(x) = Σ_i β_i(x) L(y_i, ·),    β(x) = (K + λ n I)⁻¹ k_x                (eq. 1)

the minimiser of ``Σ_i ‖L(y_i, ·) - μ(x_i)‖²_L + λ n ‖μ‖²_Γ`` (eq. 9, **with the ridge
scaled by n**, as in Song et al. and as :class:`~core.DistributionRidge` scales by the
number of bags; ``alpha_scaling="sum"`` gives the unscaled ``(K + λ I)`` of eq. 9).
Expectations ``E[h(Y) | x] ≈ Σ_i β_i(x) h(y_i)`` need no sampling; with ``h(y) = y``
this is kernel ridge regression (the conditional mean does not depend on ``L``).

Distributional answers (CDF, quantiles, exceedance) use the positive part of the
weights, renormalised: ``w_i = max(β_i, 0) / Σ_j max(β_j, 0)``. The raw weights need
not be non-negative nor sum to one (digest 002 §2.2); the positive part is the
discrete distribution on the training outputs closest to the estimate that is a
distribution, so its CDF is monotone and in ``[0, 1]`` and its quantiles are training
outputs. :meth:`expectation` keeps the raw weights.

``alpha=None`` picks ``λ`` (and ``gamma`` when a grid is given) by the paper's
cross-validation criterion (§3.2), ``Σ_t ‖μ̂(x_t) - L(y_t, ·)‖²_L`` over held-out
points, in matrix form: with ``B = (K_tr + λ n I)⁻¹ K_tr,val`` it is
``tr(Bᵀ L_tr B) - 2 tr(Bᵀ L_tr,val) + Σ_t L(y_t, y_t)``, computed from one
eigendecomposition of ``K_tr`` per fold and ``γ`` for the whole ``λ`` grid.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import scipy.linalg
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, RegressorMixin, clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils.validation import check_is_fitted

from ..bags import as_bags
from ..kernels import get_kernel
from ..representations.base import BagRepresentation, Embedding, FeatureEmbedding
from ..representations.sliced import _rowwise_searchsorted
from ..selection import CME_ALPHA_GRID, as_grid, group_folds, median_heuristic_gamma
from ._cholesky import incomplete_cholesky
from ._domain import DomainCheckMixin
from ._grid_choices import GridChoice, cme_choices, warn_grid_edges
from ._params import Constraint, OneOf, validate_params

if TYPE_CHECKING:
    from ..explanations import Explanation

__all__ = ["ConditionalMeanEmbedding", "incomplete_cholesky"]


def _positive_part(B: NDArray[np.float64]) -> NDArray[np.float64]:
    """Rows of ``max(B, 0)`` renormalised to sum to one; uniform where nothing is positive."""
    w = np.maximum(B, 0.0)
    total = w.sum(axis=1, keepdims=True)
    uniform = np.full_like(w, 1.0 / w.shape[1])
    return np.where(total > 0, w / np.where(total > 0, total, 1.0), uniform)


def _outputs(Y: ArrayLike) -> NDArray[np.float64]:
    Y = np.asarray(Y, dtype=np.float64)
    if Y.ndim == 1:
        Y = Y[:, None]
    if Y.ndim != 2 or Y.shape[0] == 0:
        raise ValueError(f"outputs must be a non-empty 1-D or 2-D array, got shape {Y.shape}")
    if not np.isfinite(Y).all():
        raise ValueError("outputs contain NaN or infinite values")
    return Y


class ConditionalMeanEmbedding(DomainCheckMixin, RegressorMixin, BaseEstimator):
    """Conditional distribution of an output given a point or a bag, as an embedding.

    Parameters
    ----------
    representation : BagRepresentation or None, default=None
        ``None``: inputs are points, rows of a 2-D array, compared by their Euclidean
        distance. Otherwise inputs are bags, compared through this representation
        (cloned and fitted in :meth:`fit`), e.g. :class:`~core.SlicedWasserstein`.
    kernel : str, default="gaussian"
        Input kernel on the (squared) distances or inner products (:mod:`core.kernels`).
    gamma : float, array-like or None, default=None
        Input kernel scale. ``None``: the median heuristic; an array: a grid searched by
        the cross-validation criterion together with ``alpha``.
    output_kernel : str, default="gaussian"
        Output kernel ``L`` on the outputs' Euclidean distances. The loss is measured in
        its norm, so its scale is not searched: values of the criterion are not
        comparable across output kernels (digest 002 §2.3).
    output_gamma : float or None, default=None
        Output kernel scale; ``None``: the median heuristic on the training outputs.
    alpha : float, array-like or None, default=None
        Ridge ``λ``. ``None``: search ``logspace(-7, 1, 17)`` by ``n_folds``-fold
        cross-validation of the paper's loss; an array: search it; a float: use it.
    alpha_scaling : {"n", "sum"}, default="n"
        ``"n"``: ``(K + λ n I)`` (paper eq. 1, Song et al.); ``"sum"``: ``(K + λ I)``
        (eq. 9). The same estimator with ``λ`` rescaled.
    kernel_params, output_kernel_params : dict or None
        Extra kernel parameters (see :func:`core.get_kernel`).
    n_folds : int, default=5
    random_state : int, Generator or None
        Seeds the folds and the representation.

    Attributes
    ----------
    alpha_, gamma_, output_gamma_ : float
    y_train_ : ndarray of shape (n, p)
    dual_ : ndarray of shape (n, n) or None
        ``M`` with ``β(x) = Mᵀ k_x``: ``(K + λ n I)⁻¹`` for the dense estimate, the
        sparse matrix after :meth:`sparsify`.
    support_ : ndarray of int
        Training inputs with a non-zero row of ``M``: the only ones a query is compared
        with.
    cv_scores_ : ndarray of shape (n_gamma, n_alpha)
        Mean held-out loss per point (``nan`` when nothing was searched).

    References
    ----------
    Grünewälder et al., "Conditional mean embeddings as regressors", ICML 2012, eq. 1,
    9, 16-17 and Algorithm 1 (with the corrections of digest 002 §2.4).
    """

    #: What each hyperparameter may be, checked by ``fit`` (:mod:`._params`).
    _parameter_constraints: ClassVar[dict[str, Constraint]] = {
        "alpha_scaling": OneOf(("n", "sum"), "'n' or 'sum'"),
    }

    def __init__(
        self,
        representation: BagRepresentation | None = None,
        *,
        kernel: str = "gaussian",
        gamma: float | ArrayLike | None = None,
        output_kernel: str = "gaussian",
        output_gamma: float | None = None,
        alpha: float | ArrayLike | None = None,
        alpha_scaling: Literal["n", "sum"] = "n",
        kernel_params: dict[str, Any] | None = None,
        output_kernel_params: dict[str, Any] | None = None,
        n_folds: int = 5,
        random_state: Any = None,
    ):
        self.representation = representation
        self.kernel = kernel
        self.gamma = gamma
        self.output_kernel = output_kernel
        self.output_gamma = output_gamma
        self.alpha = alpha
        self.alpha_scaling = alpha_scaling
        self.kernel_params = kernel_params
        self.output_kernel_params = output_kernel_params
        self.n_folds = n_folds
        self.random_state = random_state

    # ------------------------------------------------------------------ inputs
    def _embed(self, X: Any, fit: bool = False) -> Embedding:
        if self.representation is None:
            pts = np.asarray(X, dtype=np.float64)
            if pts.ndim == 1:
                pts = pts[:, None]
            if pts.ndim != 2 or pts.shape[0] == 0:
                raise ValueError(
                    f"inputs must be a 2-D array of points (or give a representation for "
                    f"bags), got shape {pts.shape}"
                )
            if not np.isfinite(pts).all():
                raise ValueError("inputs contain NaN or infinite values")
            if not fit and pts.shape[1] != self.n_features_in_:
                raise ValueError(
                    f"inputs have {pts.shape[1]} feature(s), the model takes {self.n_features_in_}"
                )
            return FeatureEmbedding(pts, "euclidean")
        if fit:
            rep = clone(self.representation)
            if "random_state" in rep.get_params(deep=False) and rep.random_state is None:
                rep.set_params(random_state=self.random_state)
            bags = as_bags(X)
            self.representation_ = rep.fit(bags)
            self.n_features_in_ = bags.dim
        return self.representation_.embed(X)

    def _base(self, emb: Embedding, other: Embedding | None = None) -> NDArray[np.float64]:
        if self.kernel_.uses_inner_product:
            return emb.inner(other)
        return emb.sq_distances(other)

    def _output_base(
        self, A: NDArray[np.float64], B: NDArray[np.float64] | None = None
    ) -> NDArray[np.float64]:
        a, b = (
            FeatureEmbedding(A, "euclidean"),
            None if B is None else FeatureEmbedding(B, "euclidean"),
        )
        return a.inner(b) if self.output_kernel_.uses_inner_product else a.sq_distances(b)

    def _ridge(self, alpha: float, n: int) -> float:
        return alpha * n if self.alpha_scaling == "n" else alpha

    # --------------------------------------------------------------------- fit
    def fit(
        self, X: Any, Y: ArrayLike, groups: ArrayLike | None = None
    ) -> ConditionalMeanEmbedding:
        """Fit on inputs ``X`` (points or bags) and outputs ``Y`` (n,) or (n, p).

        ``groups`` (one label per input: the subject of each bag) keeps each group's
        inputs in one cross-validation fold and leaves whole groups out of the domain
        check's calibration: a subject's other bags must not vouch for it.
        """
        validate_params(self)
        self.kernel_ = get_kernel(self.kernel, self.kernel_params)
        self.output_kernel_ = get_kernel(self.output_kernel, self.output_kernel_params)
        emb = self._embed(X, fit=True)
        # The n x n distances (or Gram) are computed once for the whole fit: the model
        # and the domain check's calibration both read them.
        with emb.reusing_products():
            return self._fit_embedded(emb, Y, groups)

    def _fit_embedded(
        self, emb: Embedding, Y: ArrayLike, groups: ArrayLike | None
    ) -> ConditionalMeanEmbedding:
        Yt = _outputs(Y)
        n = len(emb)
        if Yt.shape[0] != n:
            raise ValueError(f"got {Yt.shape[0]} output(s) for {n} input(s)")
        codes = None
        if groups is not None:
            g = np.asarray(groups)
            if g.shape != (n,):
                raise ValueError(f"got {g.size} group label(s) for {n} input(s)")
            codes = np.unique(g, return_inverse=True)[1]
            if codes.max() < 1:
                raise ValueError("groups: every input is in one group; need at least 2")
        if self.representation is None:
            self.n_features_in_ = emb.features.shape[1]  # type: ignore[attr-defined]
        self.y_train_ = Yt
        self.n_outputs_ = Yt.shape[1]
        base = self._base(emb)
        out_base = self._output_base(Yt)
        k, ok = self.kernel_, self.output_kernel_
        self.output_gamma_ = (
            None
            if not ok.has_gamma
            else float(self.output_gamma)
            if self.output_gamma is not None
            else median_heuristic_gamma(out_base, ok)
        )
        L = ok(out_base, self.output_gamma_)
        if k.has_gamma:
            g0 = median_heuristic_gamma(base, k)
            gammas = as_grid(self.gamma, np.array([g0]), "gamma")
        else:
            gammas = np.array([np.nan])
        alphas = as_grid(self.alpha, CME_ALPHA_GRID, "alpha")
        self.cv_scores_ = np.full((gammas.size, alphas.size), np.nan)
        if gammas.size * alphas.size > 1:
            if n < 2 * self.n_folds:
                raise ValueError(
                    f"cross-validation with {self.n_folds} folds needs at least "
                    f"{2 * self.n_folds} training inputs, got {n}; give alpha and gamma"
                )
            folds = group_folds(codes, n, int(self.n_folds), self.random_state)
            for gi, g in enumerate(gammas):
                K = k(base, None if np.isnan(g) else float(g))
                self.cv_scores_[gi] = self._cv_losses(K, L, alphas, folds)
            flat = int(np.nanargmin(self.cv_scores_))
            gi, ai = np.unravel_index(flat, self.cv_scores_.shape)
        else:
            gi, ai = 0, 0
        self.gamma_ = None if np.isnan(gammas[gi]) else float(gammas[gi])
        self.alpha_ = float(alphas[ai])
        K = k(base, self.gamma_)
        A = K.copy()
        A[np.diag_indices_from(A)] += self._ridge(self.alpha_, n)
        self.dual_ = scipy.linalg.solve(A, np.eye(n), assume_a="pos")
        self.dual_ = 0.5 * (self.dual_ + self.dual_.T)
        self.support_ = np.arange(n)
        self.is_dense_ = True
        self.train_embedding_ = emb
        # K and L are recomputed if sparsify/restrict need them: not kept alive here.
        self._gram_cache = None
        self._fit_domain(emb, codes)
        warn_grid_edges(self)
        return self

    def grid_choices(self) -> list[GridChoice]:
        """``γ`` and ``λ`` where they were chosen from a grid (see :mod:`._grid_choices`)."""
        return cme_choices(self)

    def _embedding(self, X: Any) -> Embedding:
        return X if isinstance(X, Embedding) else self._embed(X)

    def _cv_losses(
        self,
        K: NDArray[np.float64],
        L: NDArray[np.float64],
        alphas: NDArray[np.float64],
        folds: NDArray[np.int64],
    ) -> NDArray[np.float64]:
        """Mean held-out loss ``‖μ̂(x_t) - L(y_t, ·)‖²`` per point, for every ``λ``
        (``folds``: each input's fold, whole groups together)."""
        n = K.shape[0]
        total = np.zeros(alphas.size)
        for f in np.unique(folds):
            val = np.flatnonzero(folds == f)
            tr = np.flatnonzero(folds != f)
            s, V = np.linalg.eigh(K[np.ix_(tr, tr)])
            P = V.T @ K[np.ix_(tr, val)]  # (n_tr, T)
            M = V.T @ L[np.ix_(tr, tr)] @ V
            R = V.T @ L[np.ix_(tr, val)]
            const = float(np.trace(L[np.ix_(val, val)]))
            for a, alpha in enumerate(alphas):
                C = P / (np.maximum(s, 0.0) + self._ridge(float(alpha), tr.size))[:, None]
                total[a] += np.sum(C * (M @ C)) - 2.0 * np.sum(C * R) + const
        return total / n

    # ----------------------------------------------------------------- queries
    def kernel_matrix(self, X: Any) -> NDArray[np.float64]:
        """Input kernel between ``X`` and the training inputs, ``(q, n)``."""
        check_is_fitted(self, "dual_")
        emb = X if isinstance(X, Embedding) else self._embed(X)
        train = self.train_embedding_
        if self.kernel_.uses_inner_product:
            return self.kernel_(emb.inner(train), self.gamma_)
        return self.kernel_(self._sq_to_training(emb, train), self.gamma_)

    def explain(self, bag: Any, *, markers: ArrayLike | None = None) -> Explanation:
        """Per-cell contributions to the conditional mean ``E[Y | P]`` for one bag
        (:func:`core.explanations.explain`; the model needs a bag ``representation``)."""
        from ..explanations import explain

        return explain(self, bag, markers=markers)

    def weights(self, X: Any) -> NDArray[np.float64]:
        """``β(x)`` for every query, shape ``(q, n)``: ``μ̂(x) = Σ_i β_i(x) L(y_i, ·)``."""
        check_is_fitted(self, "dual_")
        emb = X if isinstance(X, Embedding) else self._embed(X)
        train = self.train_embedding_
        if self.support_.size < len(train) and isinstance(train, FeatureEmbedding):
            # Only the support's inputs are compared with the query.
            sub = FeatureEmbedding(train.features[self.support_], train.geometry)
            Kq = self.kernel_(self._base(emb, sub), self.gamma_)
            return Kq @ self.dual_[self.support_]
        return self.kernel_matrix(emb) @ self.dual_

    def expectation(
        self, X: Any, h: Callable[[NDArray[np.float64]], ArrayLike] | ArrayLike
    ) -> NDArray[np.float64]:
        """``E[h(Y) | x] ≈ Σ_i β_i(x) h(y_i)`` with the raw weights.

        ``h`` is a function of the training outputs ``(n, p)`` or its values at them,
        ``(n,)`` or ``(n, k)``. Exact for ``h`` in the output RKHS (paper Thm 3.1);
        for other ``h`` an estimate.
        """
        values = h(self.y_train_) if callable(h) else h
        values = np.asarray(values, dtype=np.float64)
        if values.shape[0] != self.y_train_.shape[0]:
            raise ValueError(
                f"h has {values.shape[0]} value(s) for {self.y_train_.shape[0]} training outputs"
            )
        return self.weights(X) @ values

    def predict(self, X: Any) -> NDArray[np.float64]:
        """The conditional mean ``E[Y | x]`` (kernel ridge regression)."""
        out = self.expectation(X, self.y_train_)
        return out[:, 0] if self.n_outputs_ == 1 else out

    def distribution_weights(self, X: Any) -> NDArray[np.float64]:
        """Positive part of ``β(x)``, renormalised: a distribution on the training outputs.

        A query whose weights are all non-positive (far from every training input) gets
        the uniform distribution, the marginal of the training outputs.
        """
        return _positive_part(self.weights(X))

    def _scalar_outputs(self) -> NDArray[np.float64]:
        if self.n_outputs_ != 1:
            raise ValueError(
                f"CDF, quantiles and exceedance need a scalar output; this model has "
                f"{self.n_outputs_}"
            )
        return self.y_train_[:, 0]

    def _cdf(self, P: NDArray[np.float64], thresholds: ArrayLike) -> NDArray[np.float64]:
        y = self._scalar_outputs()
        t = np.atleast_1d(np.asarray(thresholds, dtype=np.float64))
        return P @ (y[:, None] <= t[None, :]).astype(np.float64)

    def _quantiles(self, P: NDArray[np.float64], levels: ArrayLike) -> NDArray[np.float64]:
        y = self._scalar_outputs()
        q = np.atleast_1d(np.asarray(levels, dtype=np.float64))
        if np.any((q < 0) | (q > 1)):
            raise ValueError(f"quantile levels must lie in [0, 1], got {levels!r}")
        order = np.argsort(y, kind="stable")
        cum = np.cumsum(P[:, order], axis=1)
        # Count of cumulative weights below each level (a level reached up to rounding
        # counts as reached), row by row without a (queries, n, levels) array.
        wanted = np.broadcast_to(q - 1e-12, (P.shape[0], q.size))
        idx = _rowwise_searchsorted(cum, wanted, "left")
        return y[order][np.minimum(idx, y.size - 1)]

    def cdf(self, X: Any, thresholds: ArrayLike) -> NDArray[np.float64]:
        """``P(Y ≤ t | x)`` for every query and threshold, shape ``(q, n_thresholds)``."""
        return self._cdf(self.distribution_weights(X), thresholds)

    def exceedance(self, X: Any, thresholds: ArrayLike) -> NDArray[np.float64]:
        """``P(Y > t | x)``, shape ``(q, n_thresholds)``."""
        return 1.0 - self.cdf(X, thresholds)

    def quantiles(self, X: Any, levels: ArrayLike) -> NDArray[np.float64]:
        """Conditional quantiles ``inf{y : F(y | x) ≥ level}``, shape ``(q, n_levels)``.

        Quantiles of the weighted training outputs, so always training output values.
        """
        return self._quantiles(self.distribution_weights(X), levels)

    def summary(
        self, X: Any, quantiles: ArrayLike = (), exceed: ArrayLike = ()
    ) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
        """Mean, quantiles and exceedance probabilities from one computation of ``β(x)``.

        Equal to ``predict``, ``quantiles`` and ``exceedance`` called one by one (which
        embed the queries and evaluate the kernel each time); shapes ``(q,)`` or
        ``(q, p)``, ``(q, n_levels)`` and ``(q, n_thresholds)``.
        """
        B = self.weights(X)
        mean = B @ self.y_train_
        mean = mean[:, 0] if self.n_outputs_ == 1 else mean
        levels = np.atleast_1d(np.asarray(quantiles, dtype=np.float64))
        thresholds = np.atleast_1d(np.asarray(exceed, dtype=np.float64))
        if not levels.size and not thresholds.size:
            empty = np.empty((B.shape[0], 0))
            return mean, empty, empty
        P = _positive_part(B)
        Q = self._quantiles(P, levels) if levels.size else np.empty((B.shape[0], 0))
        E = 1.0 - self._cdf(P, thresholds) if thresholds.size else np.empty((B.shape[0], 0))
        return mean, Q, E

    def loss(self, X: Any, Y: ArrayLike) -> NDArray[np.float64]:
        """Per-query ``‖μ̂(x_t) - L(y_t, ·)‖²_L`` (the paper's surrogate loss, eq. 7)."""
        Yq = _outputs(Y)
        if Yq.shape[1] != self.n_outputs_:
            raise ValueError(
                f"outputs have {Yq.shape[1]} column(s), the model has {self.n_outputs_}"
            )
        B = self.weights(X)
        L = self.output_kernel_(self._output_base(self.y_train_), self.output_gamma_)
        cross = self.output_kernel_(self._output_base(Yq, self.y_train_), self.output_gamma_)
        # L(y_t, y_t): from ‖y_t‖² for inner-product kernels, from D² = 0 otherwise.
        own = (
            np.einsum("ij,ij->i", Yq, Yq)
            if self.output_kernel_.uses_inner_product
            else np.zeros(Yq.shape[0])
        )
        diag = self.output_kernel_(own[:, None], self.output_gamma_)[:, 0]
        return np.einsum("ij,jk,ik->i", B, L, B) - 2.0 * np.einsum("ij,ij->i", B, cross) + diag

    def score(self, X: Any, Y: ArrayLike, sample_weight: Any = None) -> float:
        """Minus the mean surrogate loss: larger is better, for ``GridSearchCV``."""
        return -float(np.mean(self.loss(X, Y)))

    # ---------------------------------------------------------------- sparsity
    def _grams(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        cache = getattr(self, "_gram_cache", None)
        if cache is None:
            emb = self.train_embedding_
            K = self.kernel_(self._base(emb), self.gamma_)
            L = self.output_kernel_(self._output_base(self.y_train_), self.output_gamma_)
            cache = (K, L)
            self._gram_cache = cache
        return cache

    def _dense_dual(self) -> NDArray[np.float64]:
        """``W = (K + λ n I)⁻¹``: the fitted ``dual_`` itself unless it was sparsified."""
        if getattr(self, "is_dense_", False):
            return self.dual_
        K, _ = self._grams()
        A = K.copy()
        A[np.diag_indices_from(A)] += self._ridge(self.alpha_, K.shape[0])
        W = scipy.linalg.solve(A, np.eye(K.shape[0]), assume_a="pos")
        return 0.5 * (W + W.T)

    def distance_to_dense(self) -> float:
        """``‖μ_M - μ̂‖²_Γ = tr((M - W)ᵀ K (M - W) L)`` (paper eq. 16, squared)."""
        K, L = self._grams()
        D = self.dual_ - self._dense_dual()
        return float(np.sum((K @ D) * (D @ L)))

    def sparsify(
        self, gamma: float, *, max_iter: int = 5000, tol: float = 1e-6
    ) -> ConditionalMeanEmbedding:
        """A sparse approximation of this (dense) embedding (paper §5, Algorithm 1).

        Minimises ``½ tr((M - W)ᵀ K (M - W) L) + γ ‖M‖₁`` by monotone FISTA (Beck &
        Teboulle 2009), with the corrections of digest 002 §2.4: gradient
        ``K (M - W) L``, step ``1 / (‖K‖₂ ‖L‖₂)``, threshold ``γ × step``, momentum on
        ``Z_{t+1} - Z_t``. Stops when the KKT residual (``|G_ij| ≤ γ`` where
        ``M_ij = 0``, ``G_ij = -γ sign(M_ij)`` elsewhere) is below ``tol`` times
        ``max |K W L|``, or after ``max_iter`` iterations. Returns a copy whose
        :attr:`dual_` is ``M``; ``γ = 0`` returns the dense solution.
        """
        check_is_fitted(self, "dual_")
        if not gamma >= 0:
            raise ValueError(f"gamma must be >= 0, got {gamma!r}")
        K, L = self._grams()
        W = self._dense_dual()
        out = clone(self)
        out.__dict__.update({k: v for k, v in self.__dict__.items() if k.endswith("_")})
        out._gram_cache = (K, L)
        if gamma == 0:
            out.dual_, out.support_, out.is_dense_ = W, np.arange(W.shape[0]), True
            out.sparse_info_ = {"gamma": 0.0, "iterations": 0, "kkt": 0.0, "objective": [0.0]}
            return out
        step = 1.0 / (np.linalg.norm(K, 2) * np.linalg.norm(L, 2))
        scale = float(np.abs(K @ W @ L).max())

        def objective(M: NDArray[np.float64]) -> float:
            D = M - W
            return 0.5 * float(np.sum((K @ D) * (D @ L))) + gamma * float(np.abs(M).sum())

        def grad(M: NDArray[np.float64]) -> NDArray[np.float64]:
            return K @ (M - W) @ L

        def kkt(M: NDArray[np.float64]) -> float:
            G = grad(M)
            zero = M == 0
            viol = np.where(
                zero, np.maximum(np.abs(G) - gamma, 0.0), np.abs(G + gamma * np.sign(M))
            )
            return float(viol.max()) / scale

        M = np.zeros_like(W)
        Q = M.copy()
        theta = 1.0
        history = [objective(M)]
        residual = kkt(M)
        it = 0
        while it < max_iter and residual > tol:
            it += 1
            Z = Q - step * grad(Q)
            Z = np.sign(Z) * np.maximum(np.abs(Z) - gamma * step, 0.0)
            fz = objective(Z)
            # Monotone FISTA: keep the better of the prox point and the last iterate.
            M_next = Z if fz <= history[-1] else M
            theta_next = 0.5 * (1.0 + np.sqrt(1.0 + 4.0 * theta * theta))
            Q = (
                M_next
                + (theta / theta_next) * (Z - M_next)
                + ((theta - 1.0) / theta_next) * (M_next - M)
            )
            M, theta = M_next, theta_next
            history.append(min(fz, history[-1]))
            residual = kkt(M)
        if residual > tol:
            warnings.warn(
                f"sparsify(gamma={gamma:g}) stopped after {max_iter} iterations with a "
                f"relative KKT residual of {residual:.2g} > tol={tol:g}; a small alpha makes "
                "W ill-conditioned and FISTA slow: raise max_iter or alpha",
                ConvergenceWarning,
                stacklevel=2,
            )
        out.dual_, out.is_dense_ = M, False
        out.support_ = np.flatnonzero(np.abs(M).sum(axis=1) > 0)
        out.sparse_info_ = {
            "gamma": float(gamma),
            "iterations": it,
            "kkt": residual,
            "objective": history,
        }
        return out

    def restrict(self, rows: ArrayLike) -> ConditionalMeanEmbedding:
        """The closest embedding (in ``‖·‖_Γ``) that uses only the training inputs ``rows``.

        ``M_S = K_SS⁻¹ K_S· W`` on the rows ``S``, zero elsewhere: the projection of the
        dense solution, independent of ``L``. With the pivots of
        :func:`incomplete_cholesky` this is the paper's baseline.
        """
        check_is_fitted(self, "dual_")
        S = np.unique(np.asarray(rows, dtype=np.int64))
        K, L = self._grams()
        W = self._dense_dual()
        M = np.zeros_like(W)
        Kss = K[np.ix_(S, S)] + 1e-10 * np.trace(K) / K.shape[0] * np.eye(S.size)
        M[S] = scipy.linalg.solve(Kss, K[S] @ W, assume_a="pos")
        out = clone(self)
        out.__dict__.update({k: v for k, v in self.__dict__.items() if k.endswith("_")})
        out._gram_cache = (K, L)
        out.dual_, out.support_, out.is_dense_ = M, S, False
        return out
