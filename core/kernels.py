"""Point kernels, pairwise distances, and kernels on distances between distributions.

Two levels of kernels appear in distribution regression:

* **point kernels** ``k(x, x')`` on ``R^d``, used inside mean embeddings
  (:func:`point_kernel`);
* **kernels on distributions** ``K(P, Q) = κ(D(P, Q))``, a function of a *Hilbertian*
  distance ``D`` between two bags (:class:`DistanceKernel`). Every representation in
  :mod:`core.representations` reports ``D²`` directly: ``SW_2²`` for sliced Wasserstein
  with ``p=2``, ``SW_1`` for ``p=1`` (because ``√SW_1`` is Hilbertian, paper 000
  Prop. 6), ``MMD²`` for mean embeddings.

Conventions (one rule for every radial kernel)
----------------------------------------------
``gamma`` multiplies ``D`` raised to the kernel's natural power ``q`` (attribute
:attr:`DistanceKernel.power`), so the median heuristic is always
``gamma_0 = 1 / median(D)^q``:

=====================  ==========================================  ======  =========================
name                   ``K`` as a function of ``D`` and ``γ``        ``q``   paper 003 Table 1 / 5
=====================  ==========================================  ======  =========================
``gaussian``           ``exp(-γ D²)``                               2       K_G, ``γ = 1/(2θ²)``
``laplace``            ``exp(-γ D)`` (alias ``exponential``)        1       K_e, ``γ = 1/(2θ²)``
``power_exponential``  ``exp(-γ D^(2β))``, ``0 < β ≤ 1``            2β      paper 000 §2.4
``cauchy``             ``1 / (1 + γ D²)``                           2       K_C, ``γ = 1/θ²``
``student``            ``1 / (1 + γ D^θ)``, ``0 < θ ≤ 2``           θ       K_t, ``γ = 1``
``imq``                ``1 / sqrt(1 + γ D²)``                       2       K_i × θ, ``γ = 1/θ²``
``matern32``           ``(1 + √3 γD) exp(-√3 γD)``                  1       K_M,3/2, ``γ = 1/θ``
``matern52``           ``(1 + √5 γD + 5(γD)²/3) exp(-√5 γD)``       1       K_M,5/2, ``γ = 1/θ``
``rational_quadratic`` ``(1 + γ D² / a)^(-a)``, ``a > 0``           2       K_r (``a=1``, ``γ=1/θ``)
``linear``             ``⟨φ(P), φ(Q)⟩``                             --      linear K (set kernel)
``polynomial``         ``(γ ⟨φ(P), φ(Q)⟩ + c)^m``, ``c ≥ 0``         --      k_p
=====================  ==========================================  ======  =========================

Paper 003's inverse multiquadric ``1/sqrt(D² + θ²)`` is ours divided by ``θ``; we
normalise so that ``K(P, P) = 1`` for every radial kernel (a constant factor only
rescales the ridge parameter). All radial kernels above are scale mixtures of
Gaussians in ``D`` (completely monotone in ``D²``), hence positive definite for any
Hilbertian ``D`` (Schoenberg; paper 000 Prop. 13; paper 003 supplement Table 3).
For sliced Wasserstein with ``p=1``, ``gaussian`` is therefore ``exp(-γ SW_1)``: the
paper's "Gaussian SW1 kernel", which is positive definite, and *not*
``exp(-γ SW_1²)``, which is not.

``linear`` and ``polynomial`` use the inner product of the representation: the
feature inner product for explicit features, the set kernel for exact mean
embeddings, and ``½(D(P,0)² + D(Q,0)² - D(P,Q)²)`` with the zero feature vector as the
origin for sliced Wasserstein with ``p = 1`` (paper 000 §2.4).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.spatial.distance import cdist

__all__ = [
    "DISTANCE_KERNELS",
    "DistanceKernel",
    "batch_invariant_matmul",
    "cityblock_distances",
    "get_kernel",
    "point_kernel",
    "random_fourier_features",
    "random_fourier_frequencies",
    "squared_euclidean_distances",
]

# Blocks of pairwise computations stay below this many float64 entries (64 MiB).
_BLOCK_ENTRIES = 1 << 23


# --------------------------------------------------------------------------- distances
def squared_euclidean_distances(
    A: NDArray[np.float64],
    B: NDArray[np.float64] | None = None,
    *,
    A_sqnorms: NDArray[np.float64] | None = None,
    B_sqnorms: NDArray[np.float64] | None = None,
) -> NDArray[np.float64]:
    """``‖a_i - b_j‖²`` for all rows, as ``‖a‖² + ‖b‖² - 2 a·b`` (one GEMM).

    Round-off negatives are clipped to zero; with ``B=None`` the result is exactly
    symmetric with a zero diagonal.
    """
    A = np.asarray(A, dtype=np.float64)
    sym = B is None
    B = A if sym else np.asarray(B, dtype=np.float64)
    a2 = np.einsum("ij,ij->i", A, A) if A_sqnorms is None else A_sqnorms
    b2 = (a2 if sym else np.einsum("ij,ij->i", B, B)) if B_sqnorms is None else B_sqnorms
    D = A @ B.T
    D *= -2.0
    D += a2[:, None]
    D += b2[None, :]
    np.maximum(D, 0.0, out=D)
    if sym:
        D = 0.5 * (D + D.T)
        np.fill_diagonal(D, 0.0)
    return D


def cityblock_distances(
    A: NDArray[np.float64], B: NDArray[np.float64] | None = None
) -> NDArray[np.float64]:
    """``‖a_i - b_j‖₁`` for all rows, in row blocks of bounded memory."""
    A = np.asarray(A, dtype=np.float64)
    sym = B is None
    B = A if sym else np.asarray(B, dtype=np.float64)
    out = np.empty((A.shape[0], B.shape[0]))
    rows = max(1, _BLOCK_ENTRIES // max(1, B.shape[0]))
    for lo in range(0, A.shape[0], rows):
        out[lo : lo + rows] = cdist(A[lo : lo + rows], B, metric="cityblock")
    if sym:
        out = 0.5 * (out + out.T)
        np.fill_diagonal(out, 0.0)
    return out


#: Rows per block in :func:`batch_invariant_matmul`.
INVARIANT_BLOCK = 16


def batch_invariant_matmul(
    A: NDArray[np.float64], B: NDArray[np.float64], block: int = INVARIANT_BLOCK
) -> NDArray[np.float64]:
    """``A @ B`` where each row of the result depends on its row of ``A`` only.

    BLAS picks its blocking from the matrix shapes, so the same row of ``A`` can give a
    result that differs in the last bits when it comes with other rows. Multiplying
    fixed blocks of :data:`INVARIANT_BLOCK` rows (the last one zero-padded) keeps the
    arithmetic of every row identical, so a bag's prediction never depends on what else
    was in the request (or in which order the cells of a sample came). ``block`` must be
    the same at every call of a given product.
    """
    A = np.asarray(A, dtype=np.float64)
    n = A.shape[0]
    out = np.empty((n, B.shape[1]))
    full = n - n % block
    for lo in range(0, full, block):
        out[lo : lo + block] = A[lo : lo + block] @ B
    if full < n:
        pad = np.zeros((block, A.shape[1]))
        pad[: n - full] = A[full:]
        out[full:] = (pad @ B)[: n - full]
    return out


# --------------------------------------------------------------------------- point kernels
POINT_KERNELS = ("gaussian", "laplace")


def point_kernel(
    X: NDArray[np.float64],
    Y: NDArray[np.float64],
    kernel: str,
    bandwidth: float,
    *,
    X_sqnorms: NDArray[np.float64] | None = None,
    Y_sqnorms: NDArray[np.float64] | None = None,
) -> NDArray[np.float64]:
    """Point kernel matrix ``k(x_i, y_j)``.

    ``gaussian``: ``exp(-‖x - y‖² / (2σ²))``; ``laplace``: ``exp(-‖x - y‖₁ / σ)``
    (the product of one-dimensional Laplace kernels, whose random Fourier features
    are Cauchy distributed). ``σ`` is ``bandwidth``.
    """
    if kernel == "gaussian":
        K = squared_euclidean_distances(X, Y, A_sqnorms=X_sqnorms, B_sqnorms=Y_sqnorms)
        K *= -0.5 / bandwidth**2
    elif kernel == "laplace":
        K = cdist(X, Y, metric="cityblock")
        K *= -1.0 / bandwidth
    else:
        raise ValueError(f"unknown point kernel {kernel!r}; expected one of {POINT_KERNELS}")
    np.exp(K, out=K)
    return K


def random_fourier_frequencies(
    kernel: str, bandwidth: float, n_frequencies: int, dim: int, rng: np.random.Generator
) -> NDArray[np.float64]:
    """Frequencies ``W`` (n_frequencies, dim) of a shift-invariant point kernel.

    Bochner: ``k(x - y) = E_w cos(wᵀ(x - y))`` with ``w`` drawn from the kernel's
    spectral density, ``N(0, σ⁻² I)`` for the Gaussian ``exp(-‖x-y‖²/(2σ²))`` and a
    product of Cauchy laws of scale ``1/σ`` for the Laplace ``exp(-‖x-y‖₁/σ)``
    (Rahimi & Recht, NIPS 2007).
    """
    if kernel == "gaussian":
        return rng.standard_normal((n_frequencies, dim)) / bandwidth
    if kernel == "laplace":
        return rng.standard_cauchy((n_frequencies, dim)) / bandwidth
    raise ValueError(f"unknown point kernel {kernel!r}; expected one of {POINT_KERNELS}")


def random_fourier_features(
    X: NDArray[np.float64], frequencies: NDArray[np.float64], extra_columns: int = 0
) -> NDArray[np.float64]:
    """``z(x) = [cos(Wx), sin(Wx)] / √m`` so that ``z(x)ᵀz(y) ≈ k(x, y)``; shape (n, 2m).

    Each row depends on its point only (:func:`batch_invariant_matmul`).
    ``extra_columns`` > 0 leaves that many columns after ``z`` for the caller to fill
    (uninitialised), so that features side by side need no second copy.
    """
    proj = batch_invariant_matmul(X, frequencies.T, 256)
    m = proj.shape[1]
    z = np.empty((X.shape[0], 2 * m + extra_columns))
    np.cos(proj, out=z[:, :m])
    np.sin(proj, out=z[:, m : 2 * m])
    z[:, : 2 * m] *= 1.0 / np.sqrt(m)
    return z


# --------------------------------------------------------------------------- distance kernels
def _dist(sq: NDArray[np.float64]) -> NDArray[np.float64]:
    return np.sqrt(np.maximum(sq, 0.0))


def _gaussian(sq, gamma, p):
    return np.exp(-gamma * sq)


def _laplace(sq, gamma, p):
    return np.exp(-gamma * _dist(sq))


def _power_exponential(sq, gamma, p):
    return np.exp(-gamma * np.maximum(sq, 0.0) ** p["beta"])


def _cauchy(sq, gamma, p):
    return 1.0 / (1.0 + gamma * sq)


def _student(sq, gamma, p):
    return 1.0 / (1.0 + gamma * _dist(sq) ** p["theta"])


def _imq(sq, gamma, p):
    return 1.0 / np.sqrt(1.0 + gamma * sq)


def _matern32(sq, gamma, p):
    r = np.sqrt(3.0) * gamma * _dist(sq)
    return (1.0 + r) * np.exp(-r)


def _matern52(sq, gamma, p):
    r = np.sqrt(5.0) * gamma * _dist(sq)
    return (1.0 + r + r * r / 3.0) * np.exp(-r)


def _rational_quadratic(sq, gamma, p):
    a = p["alpha"]
    return (1.0 + gamma * sq / a) ** (-a)


def _linear(inner, gamma, p):
    return inner.copy()


def _polynomial(inner, gamma, p):
    return (gamma * inner + p["coef0"]) ** p["degree"]


def _check_beta(p):
    if not 0.0 < p["beta"] <= 1.0:
        raise ValueError(
            f"power_exponential needs 0 < beta <= 1 to be positive definite, got {p['beta']}"
        )


def _check_theta(p):
    if not 0.0 < p["theta"] <= 2.0:
        raise ValueError(
            f"student kernel 1/(1 + gamma D^theta) is positive definite only for "
            f"0 < theta <= 2 (paper 003 Table 1), got theta={p['theta']}"
        )


def _check_rq(p):
    if not p["alpha"] > 0:
        raise ValueError(f"rational_quadratic needs alpha > 0, got {p['alpha']}")


def _check_poly(p):
    if int(p["degree"]) != p["degree"] or p["degree"] < 1:
        raise ValueError(f"polynomial degree must be a positive integer, got {p['degree']}")
    if p["coef0"] < 0:
        raise ValueError(
            f"polynomial coef0 must be >= 0 to stay positive definite, got {p['coef0']}"
        )


@dataclass(frozen=True)
class _KernelSpec:
    function: Callable[[NDArray[np.float64], float, Mapping[str, Any]], NDArray[np.float64]]
    uses_inner_product: bool
    power: Callable[[Mapping[str, Any]], float] | None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    check: Callable[[Mapping[str, Any]], None] | None = None


def _const(q: float) -> Callable[[Mapping[str, Any]], float]:
    return lambda p: q


DISTANCE_KERNELS: dict[str, _KernelSpec] = {
    "gaussian": _KernelSpec(_gaussian, False, _const(2.0)),
    "laplace": _KernelSpec(_laplace, False, _const(1.0)),
    "power_exponential": _KernelSpec(
        _power_exponential, False, lambda p: 2.0 * p["beta"], {"beta": 0.5}, _check_beta
    ),
    "cauchy": _KernelSpec(_cauchy, False, _const(2.0)),
    "student": _KernelSpec(_student, False, lambda p: p["theta"], {"theta": 1.0}, _check_theta),
    "imq": _KernelSpec(_imq, False, _const(2.0)),
    "matern32": _KernelSpec(_matern32, False, _const(1.0)),
    "matern52": _KernelSpec(_matern52, False, _const(1.0)),
    "rational_quadratic": _KernelSpec(
        _rational_quadratic, False, _const(2.0), {"alpha": 1.0}, _check_rq
    ),
    "linear": _KernelSpec(_linear, True, None),
    "polynomial": _KernelSpec(_polynomial, True, None, {"degree": 2, "coef0": 1.0}, _check_poly),
}
_ALIASES = {"exponential": "laplace", "rbf": "gaussian", "inverse_multiquadric": "imq"}


@dataclass(frozen=True)
class DistanceKernel:
    """A kernel on distributions, bound to its extra parameters.

    Call it on the matrix it needs: squared Hilbertian distances ``D²`` for radial
    kernels, inner products for ``linear`` and ``polynomial``
    (:attr:`uses_inner_product`).

    Attributes
    ----------
    name : str
        Canonical name (aliases resolved).
    params : dict
        Extra parameters with defaults filled in (``beta``, ``theta``, ``alpha``,
        ``degree``, ``coef0``).
    """

    name: str
    params: Mapping[str, Any]

    @property
    def _spec(self) -> _KernelSpec:
        return DISTANCE_KERNELS[self.name]

    @property
    def uses_inner_product(self) -> bool:
        """True for ``linear`` and ``polynomial`` (functions of inner products)."""
        return self._spec.uses_inner_product

    @property
    def has_gamma(self) -> bool:
        """False only for ``linear``, which has no scale parameter."""
        return self.name != "linear"

    @property
    def power(self) -> float | None:
        """``q`` such that ``γ`` multiplies ``D**q`` (``None`` for inner-product kernels)."""
        return None if self._spec.power is None else float(self._spec.power(self.params))

    def __call__(self, base: NDArray[np.float64], gamma: float | None) -> NDArray[np.float64]:
        """Evaluate on ``D²`` (radial kernels) or inner products (``linear``/``polynomial``)."""
        if self.has_gamma and (gamma is None or not gamma > 0):
            raise ValueError(f"kernel {self.name!r} needs gamma > 0, got {gamma}")
        return self._spec.function(base, gamma, self.params)


def get_kernel(
    name: str | DistanceKernel, params: Mapping[str, Any] | None = None
) -> DistanceKernel:
    """Resolve a kernel name (or alias) and validate its parameters.

    Raises
    ------
    ValueError
        For an unknown name, unknown parameters, or parameters outside the range where
        the kernel is positive definite (e.g. ``student`` with ``theta > 2``).
    """
    if isinstance(name, DistanceKernel):
        return name
    canonical = _ALIASES.get(name, name)
    if canonical not in DISTANCE_KERNELS:
        known = sorted([*DISTANCE_KERNELS, *_ALIASES])
        raise ValueError(f"unknown kernel {name!r}; expected one of {known}")
    spec = DISTANCE_KERNELS[canonical]
    given = dict(params or {})
    unknown = set(given) - set(spec.defaults)
    if unknown:
        allowed = sorted(spec.defaults) or "none"
        raise ValueError(
            f"kernel {canonical!r} got unknown parameter(s) {sorted(unknown)}; allowed: {allowed}"
        )
    merged = {**spec.defaults, **given}
    if spec.check is not None:
        spec.check(merged)
    return DistanceKernel(canonical, merged)
