"""Solvers behind the marginal-transfer estimators (paper 004 §7).

All solve the weighted, bias-free regularised risk of paper 004 eq. 7,

    min_f  Σ_i c_i ℓ(f(x̃_i), y_i) + λ ‖f‖²,      c_i = 1 / (N n_task(i)),

either on a precomputed kernel matrix over the augmented points ``x̃ = (P, x)``
(exact path) or on explicit features with a Kronecker structure (random features).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import scipy.optimize
from numpy.typing import NDArray

from ....blas import one_thread

__all__ = [
    "TaskStatistics",
    "structured_ridge_path",
    "task_ridge_path",
    "weighted_kernel_ridge",
    "weighted_svm",
    "weighted_svr",
]

# Structured systems up to this size are diagonalised once for all λ; larger ones are
# solved matrix-free by preconditioned conjugate gradients, or in the dual (one unknown
# per point) when there are fewer points than unknowns and at most _DUAL_MAX_POINTS.
_EIGEN_MAX_SIZE = 512
# Points per chunk when per-point features are computed (bounds memory).
_CHUNK_POINTS = 1 << 15
_DUAL_MAX_POINTS = 6000
# One symmetric eigendecomposition costs about ten Cholesky factorisations of the same
# matrix (LAPACK with one thread, 300 to 1500 points, measured on the 2-core machine of
# bench/README.md): the dual factorises once per λ below this many λ, and diagonalises
# once for all of them above.
_DUAL_EIGEN_MIN_LAMBDAS = 10
# Warm restarts of the box QP's L-BFGS-B at most (see _box_qp).
_MAX_QP_RESTARTS = 20


def weighted_kernel_ridge(
    K: NDArray[np.float64], Y: NDArray[np.float64], c: NDArray[np.float64], lam: float
) -> NDArray[np.float64]:
    """Coefficients ``r`` of ``f = K r`` minimising ``Σ c_i (f_i - y_i)² + λ rᵀKr``.

    Stationarity gives ``(K + λ diag(1/c)) r = y``, a symmetric positive definite system.
    """
    A = K.copy()
    A[np.diag_indices_from(A)] += lam / c
    # The factorisation alone: scipy.linalg.solve would also estimate the condition
    # number, which doubles the cost here.
    factor = scipy.linalg.cho_factor(A, overwrite_a=True, check_finite=False)
    return scipy.linalg.cho_solve(factor, Y, check_finite=False)


def _box_qp(
    Q: NDArray[np.float64], q: NDArray[np.float64], upper: NDArray[np.float64], tol: float
) -> NDArray[np.float64]:
    """``min ½ xᵀQx - qᵀx`` subject to ``0 <= x <= upper`` (L-BFGS-B, vectorised).

    Solved in ``u = x / upper ∈ [0, 1]``: the weights ``1/(N n_i)`` make the raw
    variables tiny and the problem badly scaled otherwise.
    """
    Qs = Q * upper[:, None] * upper[None, :]
    qs = q * upper

    def fun(u: NDArray[np.float64]) -> tuple[float, NDArray[np.float64]]:
        Qu = Qs @ u
        return 0.5 * float(u @ Qu) - float(qs @ u), Qu - qs

    u = np.zeros_like(q)
    best = 0.0
    # L-BFGS-B can stop on a relative-reduction test while the projected gradient is
    # still far from zero (seen with scipy 1.17 on one BLAS thread: a 10 % duality
    # gap). A restart drops the stale curvature pairs; it is repeated until a restart
    # no longer lowers the objective.
    for _ in range(_MAX_QP_RESTARTS):
        res = scipy.optimize.minimize(
            fun,
            u,
            jac=True,
            method="L-BFGS-B",
            bounds=[(0.0, 1.0)] * q.shape[0],
            options={"maxiter": 50_000, "ftol": 1e-15, "gtol": tol, "maxcor": 30},
        )
        u = np.clip(res.x, 0.0, 1.0)
        value = fun(u)[0]
        if res.nit <= 1 or best - value <= 1e-13 * max(abs(value), 1e-300):
            break
        best = value
    return u * upper


def weighted_svm(
    K: NDArray[np.float64],
    y: NDArray[np.float64],
    c: NDArray[np.float64],
    lam: float,
    tol: float = 1e-10,
) -> NDArray[np.float64]:
    """Bias-free cost-sensitive SVM (hinge loss) on a precomputed kernel.

    Dual of paper 004 §7.1 with the objective scaled as eq. 7:
    ``max_α Σ α_i - (1/(4λ)) Σ α_i α_j y_i y_j K_ij`` with ``0 <= α_i <= c_i`` and no
    equality constraint (no offset). Returns ``r`` with ``f = K r``,
    ``r = α ∘ y / (2λ)``.
    """
    Q = (y[:, None] * y[None, :]) * K / (2.0 * lam)
    alpha = _box_qp(Q, np.ones_like(y), c, tol)
    return alpha * y / (2.0 * lam)


def weighted_svr(
    K: NDArray[np.float64],
    y: NDArray[np.float64],
    c: NDArray[np.float64],
    lam: float,
    epsilon: float,
    tol: float = 1e-10,
) -> NDArray[np.float64]:
    """Bias-free cost-sensitive ε-insensitive regression on a precomputed kernel.

    Dual: ``max_β Σ y_i β_i - ε Σ |β_i| - (1/(4λ)) βᵀKβ`` with ``|β_i| <= c_i``, solved
    with ``β = β⁺ - β⁻``, both in ``[0, c]``. Returns ``r = β / (2λ)``.
    """
    Kl = K / (2.0 * lam)
    Q = np.block([[Kl, -Kl], [-Kl, Kl]])
    q = np.concatenate([y - epsilon, -y - epsilon])
    beta = _box_qp(Q, q, np.concatenate([c, c]), tol)
    m = y.shape[0]
    return (beta[:m] - beta[m:]) / (2.0 * lam)


def _assemble(S: NDArray[np.float64], A: NDArray[np.float64]) -> NDArray[np.float64]:
    """``Σ_i (s_i s_iᵀ) ⊗ A_i`` as a dense ((r+1)·D)² matrix."""
    a, D = S.shape[1], A.shape[1]
    return np.einsum("ia,ib,ipq->apbq", S, S, A, optimize=True).reshape(a * D, a * D)


def _kronecker_preconditioner(
    S: NDArray[np.float64], A: NDArray[np.float64]
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """What the preconditioner of :func:`_structured_pcg` needs for every ``λ``: the
    eigenbasis ``Q`` of ``SᵀS`` and its eigenvalues ``c`` (``c_a = Σ_i s'_ia²`` with
    ``S' = S Q``), and the eigendecomposition ``E diag(e) Eᵀ`` of ``Ā = Σ_i ‖s_i‖² A_i /
    Σ_i ‖s_i‖²``, so that ``(SᵀS ⊗ Ā + λ I)⁻¹`` is ``(Q ⊗ E) diag(1 / (c_a e_p + λ))
    (Q ⊗ E)ᵀ`` for any ``λ``.

    The system in the basis ``Q`` has diagonal blocks ``Σ_i s'_ia² A_i`` and off-diagonal
    ones ``Σ_i s'_ia s'_ib A_i``; with one feature covariance for all tasks (``A_i = Ā``)
    they are ``c_a Ā`` and zero, and the preconditioner is the system's inverse. ``Ā``
    weighs each task as the diagonal blocks do in sum (``Σ_a s'_ia² = ‖s_i‖²``).
    Against inverting each diagonal block exactly (block Jacobi, one eigendecomposition
    per block), an iteration reads one ``D × D`` matrix instead of ``a``: on the systems
    of the synthetic batches' searches (``a`` = 7 or 8, ``D`` = 137, six ``λ``) the paths
    took 51 iterations on mean instead of 55, in a third less time
    (``bench/README.md``).
    """
    c, Q = np.linalg.eigh(S.T @ S)
    weight = np.einsum("ia,ia->i", S, S)
    mean = np.tensordot(weight / max(float(weight.sum()), 1e-300), A, axes=(0, 0))
    e, E = np.linalg.eigh(mean)
    return Q, np.maximum(c, 0.0), E, np.maximum(e, 0.0)


def _kronecker_inverse(
    preconditioner: tuple[NDArray[np.float64], ...], lam: float, k: int
) -> Callable[[NDArray[np.float64]], NDArray[np.float64]]:
    """``R ↦ (SᵀS ⊗ Ā + λ I)⁻¹ R`` for ``R`` of shape (a, D, k), from
    :func:`_kronecker_preconditioner`'s factors.

    ``E`` acts on all ``a k`` columns at once: one product of ``D × D`` by ``D × a k``
    each way (``a`` products of ``D × k`` took 1.7 times as long).
    """
    basis, c, E, e = preconditioner
    a, D = basis.shape[0], E.shape[0]
    Et = np.ascontiguousarray(E.T)
    shrink = np.repeat((1.0 / (c[:, None] * e[None, :] + lam)).T, k, axis=1)

    def inverse(R: NDArray[np.float64]) -> NDArray[np.float64]:
        # (a, D, k) -> rotated by the basis over a -> (D, a k) for E.
        M = (basis.T @ R.reshape(a, D * k)).reshape(a, D, k).transpose(1, 0, 2).reshape(D, -1)
        M = E @ (shrink * (Et @ M))
        return (basis @ M.reshape(D, a, k).transpose(1, 0, 2).reshape(a, D * k)).reshape(a, D, k)

    return inverse


def _structured_pcg(
    S: NDArray[np.float64],
    A: NDArray[np.float64],
    rhs: NDArray[np.float64],
    lam: float,
    x0: NDArray[np.float64],
    rtol: float = 1e-12,
    preconditioner: tuple[NDArray[np.float64], ...] | None = None,
) -> NDArray[np.float64]:
    """Preconditioned conjugate gradients for ``(Σ_i s_i s_iᵀ ⊗ A_i + λ I) θ = rhs``.

    Unknowns are kept as ``Θ`` of shape (a, D, k), so the product costs ``N D² k``
    and the matrix never exists. Preconditioner: the inverse of ``SᵀS ⊗ Ā + λ I``
    (:func:`_kronecker_preconditioner`, shared along a ``λ`` path), exact when all tasks
    share one feature covariance: the closer the tasks' covariances, the fewer
    iterations.
    """
    pre = preconditioner if preconditioner is not None else _kronecker_preconditioner(S, A)
    precondition = _kronecker_inverse(pre, lam, rhs.shape[2])

    N, a = S.shape
    D, k = A.shape[1], rhs.shape[2]
    St = np.ascontiguousarray(S.T)

    # Plain and batched products: several times faster here than the equivalent einsum.
    def apply(T: NDArray[np.float64]) -> NDArray[np.float64]:
        W = np.matmul(A, (S @ T.reshape(a, D * k)).reshape(N, D, k))
        return (St @ W.reshape(N, D * k)).reshape(a, D, k) + lam * T

    X = x0.copy()
    R = rhs - apply(X)
    Z = precondition(R)
    P = Z.copy()
    rz = np.einsum("apk,apk->k", R, Z)
    target = rtol * np.sqrt(np.einsum("apk,apk->k", rhs, rhs))
    for _ in range(10 * S.shape[1] * A.shape[1]):
        if np.all(np.sqrt(np.einsum("apk,apk->k", R, R)) <= target):
            return X
        Q = apply(P)
        step = rz / np.einsum("apk,apk->k", P, Q)
        X += step * P
        R -= step * Q
        Z = precondition(R)
        rz_new = np.einsum("apk,apk->k", R, Z)
        P = Z + (rz_new / rz) * P
        rz = rz_new
    raise RuntimeError(f"conjugate gradients did not converge for lambda={lam}")


def structured_ridge_path(
    S: NDArray[np.float64],
    A: NDArray[np.float64],
    B: NDArray[np.float64],
    lams: NDArray[np.float64],
    rtol: float = 1e-12,
) -> list[NDArray[np.float64]]:
    """Ridge on features ``φ_ij = s_i ⊗ z_ij`` for every ``λ``, from per-task statistics.

    Solves ``(Σ_i (s_i s_iᵀ) ⊗ A_i + λ I) θ = Σ_i s_i ⊗ b_i`` where
    ``A_i = Σ_j c_ij z_ij z_ijᵀ`` and ``b_i = Σ_j c_ij z_ij y_ijᵀ``: the normal equations
    of the weighted ridge on the joint features, which never need to exist. Small
    systems are diagonalised once for all ``λ``; larger ones are solved by
    preconditioned conjugate gradients (:func:`_structured_pcg`), warm-started along
    the ``λ`` path.

    Parameters
    ----------
    S : ndarray of shape (N, a)
        Task coordinates ``s_i``.
    A : ndarray of shape (N, D, D)
    B : ndarray of shape (N, D, k)
    lams : ndarray of shape (n_lambda,)
    rtol : float, default=1e-12
        Relative residual at which conjugate gradients stop (large systems only).

    Returns
    -------
    list of ndarray of shape (a, D, k)
        ``θ`` for each ``λ``.
    """
    a = S.shape[1]
    D, k = A.shape[1], B.shape[2]
    rhs = np.einsum("ia,ipk->apk", S, B)
    if a * D <= _EIGEN_MAX_SIZE:
        G = _assemble(S, A)
        vals, vecs = np.linalg.eigh(G)
        vals = np.maximum(vals, 0.0)
        proj = vecs.T @ rhs.reshape(a * D, k)
        return [(vecs @ (proj / (vals + lam)[:, None])).reshape(a, D, k) for lam in lams]
    out: dict[int, NDArray[np.float64]] = {}
    x0 = np.zeros_like(rhs)
    # Thousands of small products: BLAS threads only add synchronisation here.
    with one_thread():
        preconditioner = _kronecker_preconditioner(S, A)
        # Largest λ first: the best conditioned system, then warm starts down the path.
        for i in np.argsort(-np.asarray(lams)):
            x0 = _structured_pcg(S, A, rhs, float(lams[i]), x0, rtol, preconditioner)
            out[int(i)] = x0.copy()
    return [out[i] for i in range(len(lams))]


@dataclass
class TaskStatistics:
    """What the ridge on joint features ``s_i ⊗ z_ij`` needs from the points of each task.

    Attributes
    ----------
    A : ndarray of shape (N, D, D)
        ``Σ_j z_ij z_ijᵀ / n_i``.
    B : ndarray of shape (N, D, k)
        ``Σ_j z_ij y_ijᵀ / n_i``.
    Z, Y : list of ndarray, or None
        The per-point features and targets themselves, kept when the tasks hold few
        points (``<= _DUAL_MAX_POINTS``) so that the dual solver can use them.
    done : ndarray of bool, shape (N,), or None
        Which tasks' rows are computed (``None``: all of them).
    """

    A: NDArray[np.float64]
    B: NDArray[np.float64]
    Z: list[NDArray[np.float64] | None] | None = None
    Y: list[NDArray[np.float64] | None] | None = None
    done: NDArray[np.bool_] | None = None


def task_ridge_path(
    S: NDArray[np.float64],
    stats: TaskStatistics,
    tasks: NDArray[np.int64],
    lams: NDArray[np.float64],
    rtol: float = 1e-12,
) -> list[NDArray[np.float64]]:
    """Weighted ridge on joint features over the training ``tasks`` (weights ``1/(N n_i)``).

    The same solution three ways, whichever is cheapest: the primal normal equations
    (:func:`structured_ridge_path`), or — when the tasks hold fewer points than the
    primal has unknowns — the dual, weighted kernel ridge on the product kernel
    ``(s_iᵀ s_j) z_pᵀ z_q`` with ``θ = Σ_i s_i ⊗ Z_iᵀ r_i``.
    """
    N = tasks.size
    a = S.shape[1]
    D = stats.A.shape[1]
    sizes = [] if stats.Z is None else [stats.Z[t].shape[0] for t in tasks]
    M = int(np.sum(sizes))
    if stats.Z is None or a * D <= _EIGEN_MAX_SIZE or a * D <= M or M > _DUAL_MAX_POINTS:
        return structured_ridge_path(S, stats.A[tasks] / N, stats.B[tasks] / N, lams, rtol)
    Z = np.concatenate([stats.Z[t] for t in tasks])
    Y = np.concatenate([stats.Y[t] for t in tasks])
    owner = np.repeat(np.arange(N), sizes)
    Ks = S @ S.T
    K = (Z @ Z.T) * Ks[np.ix_(owner, owner)]
    c = np.repeat(1.0 / (N * np.asarray(sizes, dtype=np.float64)), sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)])[:-1]

    def theta(r: NDArray[np.float64]) -> NDArray[np.float64]:
        per_task = np.add.reduceat(Z[:, :, None] * r[:, None, :], starts, axis=0)  # (N, D, k)
        return np.tensordot(S.T, per_task, axes=(1, 0))

    if len(lams) < _DUAL_EIGEN_MIN_LAMBDAS:
        return [theta(weighted_kernel_ridge(K, Y, c, float(lam))) for lam in lams]
    root = np.sqrt(c)
    vals, vecs = np.linalg.eigh(K * root[:, None] * root[None, :])
    vals = np.maximum(vals, 0.0)
    proj = vecs.T @ (root[:, None] * Y)
    return [theta(root[:, None] * (vecs @ (proj / (vals + lam)[:, None]))) for lam in lams]
