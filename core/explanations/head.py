"""The model seen from one bag's embedding: its value and its gradient there.

Every bag-level model of the core predicts through the embedding ``Φ(P)`` of the bag:
``f(P) = b + Σ_i a_i κ(s(Φ(P), Φ_i))`` (kernel ridge, its classifier and conditional
mean embeddings: ``s`` a squared distance or an inner product to training bag ``i``),
``f(P) = b + Φ(P)ᵀ W`` (a primal linear ridge), or ``f(P) = b + z(Φ(P))ᵀ W`` with ``z``
random Fourier features of the embedding. :class:`Head` holds what the explanation
needs of that: the gradient ``∇_Φ f`` at the bag, and whether ``f`` is linear in ``Φ``
(then ``f(P) = b + Φ(P)ᵀ ∇_Φ f`` exactly, and a representation linear in the measure
makes the explanation an exact sum over cells).

For the exact mean embedding the gradient lives in the point kernel's RKHS and is kept
as coefficients on the training bags' embeddings and on the bag's own,
``h = Σ_i β_i μ_i + β_P μ_P``, so that it can be evaluated at any cell without a
feature vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..kernels import DistanceKernel, batch_invariant_matmul
from ..representations.base import Embedding, FeatureEmbedding
from ..representations.mean import SetKernelEmbedding

__all__ = ["Head", "head_of", "kernel_derivative"]

# Training bags are taken this many at a time where a (bags x features) block is formed
# (the l1 geometry's signs): 256 x 10^4 features is 20 MB.
_TRAIN_CHUNK = 256
# Relative step of the central difference for kernels without a closed-form derivative.
_FD_STEP = 1e-6


@dataclass
class Head:
    """A fitted model's dependence on one bag's embedding.

    Attributes
    ----------
    value : ndarray of shape (k,)
        The model's outputs at the bag (regression values or per-class scores).
    intercept : ndarray of shape (k,)
        ``b``, the part of the output no bag moves.
    linear : bool
        ``f`` is linear in the embedding: ``value = intercept + ⟨Φ, gradient⟩``.
    gradient : ndarray of shape (D, k) or None
        ``∇_Φ f`` for explicit embeddings.
    train_coef : ndarray of shape (T, k) or None
        Exact mean embedding: ``β_i``, the gradient's coefficients on the training
        bags' embeddings ``μ_i``.
    self_coef : ndarray of shape (k,) or None
        Exact mean embedding: ``β_P``, its coefficient on the bag's own embedding.
    train : SetKernelEmbedding or None
        Exact mean embedding: the training bags the coefficients refer to.
    """

    value: NDArray[np.float64]
    intercept: NDArray[np.float64]
    linear: bool
    gradient: NDArray[np.float64] | None = None
    train_coef: NDArray[np.float64] | None = None
    self_coef: NDArray[np.float64] | None = None
    train: SetKernelEmbedding | None = None


def kernel_derivative(
    kernel: DistanceKernel, base: NDArray[np.float64], gamma: float | None
) -> NDArray[np.float64]:
    """``κ'(s)`` at every base value ``s`` (squared distance or inner product).

    Closed forms for the Gaussian and linear kernels; for the others a central
    difference of relative step 1e-6 (error about 1e-12 relative for smooth kernels;
    kernels of ``√s`` have no derivative at ``s = 0``, where the difference is one-sided).
    """
    if kernel.name == "gaussian":
        assert gamma is not None
        return -gamma * np.exp(-gamma * base)
    if kernel.name == "linear":
        return np.ones_like(base)
    h = _FD_STEP * np.maximum(np.abs(base), 1e-3)
    lo = base - h
    if not kernel.uses_inner_product:  # squared distances are >= 0
        lo = np.maximum(lo, 0.0)
    return (kernel(base + h, gamma) - kernel(lo, gamma)) / (base + h - lo)


def _base_gradient(
    phi: NDArray[np.float64],
    train: FeatureEmbedding,
    beta: NDArray[np.float64],
    uses_inner: bool,
) -> NDArray[np.float64]:
    """``Σ_i β_i ∂s(Φ, Φ_i)/∂Φ`` for an explicit embedding, shape (D, k)."""
    F = train.features
    if train.geometry == "euclidean":
        if uses_inner:  # s = ⟨Φ, Φ_i⟩
            return F.T @ beta
        # s = ‖Φ - Φ_i‖²: ∂s/∂Φ = 2(Φ - Φ_i)
        return 2.0 * (phi[:, None] * beta.sum(axis=0)[None, :] - F.T @ beta)
    # ℓ1 geometry: s = ‖Φ - Φ_i‖₁, or ½(‖Φ‖₁ + ‖Φ_i‖₁ - ‖Φ - Φ_i‖₁) as inner product.
    grad = np.zeros((phi.size, beta.shape[1]))
    for lo in range(0, F.shape[0], _TRAIN_CHUNK):
        signs = np.sign(phi[None, :] - F[lo : lo + _TRAIN_CHUNK])
        grad += signs.T @ beta[lo : lo + _TRAIN_CHUNK]
    if uses_inner:
        return 0.5 * (np.sign(phi)[:, None] * beta.sum(axis=0)[None, :] - grad)
    return grad


def _dual_head(
    emb: Embedding,
    train: Embedding,
    kernel: DistanceKernel,
    gamma: float | None,
    coef: NDArray[np.float64],
    intercept: NDArray[np.float64],
    base: NDArray[np.float64],
) -> Head:
    """``f = b + Σ_i a_i κ(s_i)`` with ``base`` the row ``s_i`` of the bag, (T,)."""
    value = intercept + batch_invariant_matmul(kernel(base[None, :], gamma), coef)[0]
    beta = kernel_derivative(kernel, base, gamma)[:, None] * coef  # a_i κ'(s_i), (T, k)
    linear = kernel.name == "linear" and getattr(train, "geometry", "euclidean") == "euclidean"
    if isinstance(emb, FeatureEmbedding):
        assert isinstance(train, FeatureEmbedding)
        grad = _base_gradient(emb.features[0], train, beta, kernel.uses_inner_product)
        return Head(value, intercept, linear, gradient=grad)
    assert isinstance(train, SetKernelEmbedding)
    if kernel.uses_inner_product:  # s_i = ⟨μ_P, μ_i⟩
        zeros = np.zeros(coef.shape[1])
        return Head(value, intercept, linear, train_coef=beta, self_coef=zeros, train=train)
    # s_i = ‖μ_P - μ_i‖²: ∂s_i/∂μ_P = 2(μ_P - μ_i)
    return Head(
        value,
        intercept,
        False,
        train_coef=-2.0 * beta,
        self_coef=2.0 * beta.sum(axis=0),
        train=train,
    )


def _ridge_head(model: Any, emb: Embedding) -> Head:
    intercept = np.asarray(model.intercept_, dtype=np.float64)
    if model.primal_:
        assert isinstance(emb, FeatureEmbedding)
        phi = emb.features[0]
        coef = np.asarray(model.coef_, dtype=np.float64)
        if model.n_components is None:
            value = intercept + batch_invariant_matmul(emb.features, coef)[0]
            return Head(value, intercept, True, gradient=coef)
        # z(Φ) = [cos(ΩΦ), sin(ΩΦ)]/√m (kernels.random_fourier_features), Ω the scaled base.
        scale = np.sqrt(2.0 * model.gamma_) if model.rff_geometry_ == "euclidean" else model.gamma_
        omega = model.rff_base_ * scale
        value = intercept + batch_invariant_matmul(model._primal_features(emb), coef)[0]
        proj = omega @ phi
        m = proj.size
        dz = -np.sin(proj)[:, None] * coef[:m] + np.cos(proj)[:, None] * coef[m:]
        return Head(value, intercept, False, gradient=omega.T @ dz / np.sqrt(m))
    train = model.train_embedding_
    kern = model.kernel_
    base = emb.inner(train)[0] if kern.uses_inner_product else emb.sq_distances(train)[0]
    coef = np.asarray(model.dual_coef_, dtype=np.float64)
    return _dual_head(emb, train, kern, model.gamma_, coef, intercept, base)


def _cme_head(model: Any, emb: Embedding) -> Head:
    train = model.train_embedding_
    dual = model.dual_
    if model.support_.size < len(train) and isinstance(train, FeatureEmbedding):
        train = FeatureEmbedding(train.features[model.support_], train.geometry)
        dual = dual[model.support_]
    coef = np.asarray(dual @ model.y_train_, dtype=np.float64)
    kern = model.kernel_
    base = emb.inner(train)[0] if kern.uses_inner_product else emb.sq_distances(train)[0]
    return _dual_head(emb, train, kern, model.gamma_, coef, np.zeros(coef.shape[1]), base)


def head_of(model: Any, emb: Embedding) -> Head:
    """The :class:`Head` of a fitted bag-level model at the one bag embedded in ``emb``."""
    if len(emb) != 1:
        raise ValueError(f"a head is taken at one bag, got {len(emb)}")
    # Read off the fitted state, not the class: the estimators import this package
    # (their ``explain`` methods), so it must not import them back. A conditional mean
    # embedding is the one bag-level model with dual weights over its training outputs.
    if hasattr(model, "dual_") and hasattr(model, "y_train_"):
        return _cme_head(model, emb)
    return _ridge_head(model, emb)
