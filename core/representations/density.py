"""Density random features for Hellinger, Jensen-Shannon, total variation and L2 (paper 001).

Sutherland, Oliva, Póczos & Schneider, "Linear-time learning on distributions with
approximate kernel embeddings". A homogeneous density distance
``d²(p, q) = ∫ κ(p(x), q(x)) dx`` with κ of negative type has (Fuglede) the form

    κ(x, y) = ∫_{λ≥0} |x^{½+iλ} - y^{½+iλ}|² dμ(λ)                          (eq. 3)

so with ``g_λ(x) = √Z c_λ (x^{½+iλ} - 1)`` (``c_λ = (-½+iλ)/(½+iλ)``, ``|c_λ| = 1``) and
``λ_1..λ_M ~ μ/Z``, projecting ``g_λ(p(·))`` on an orthonormal basis of ``L²([0,1]^ℓ)``
gives vectors ``A(p)`` with ``‖A(p) - A(q)‖² ≈ d²(p, q)`` (eq. 5-6). The measures, with
the two errors of the paper's Table 1 corrected (digest 001 §2.1):

=============  ===========================================  =========  ==========
divergence     ``dμ(λ)``                                    ``Z``      ``d²``
=============  ===========================================  =========  ==========
hellinger      ``½ δ(λ = 0)``                                ``½``      ``H² = ½∫(√p-√q)²``
js             ``dλ / (cosh(πλ)(1 + 4λ²))``                 ``ln2/2``  ``JS`` (nats)
tv             ``(2/π) dλ / (1 + 4λ²)``                     ``½``      ``TV = ½∫|p-q|``
=============  ===========================================  =========  ==========

``"l2"`` uses the sample means of the basis functions (``∫(p-q)²``, no density estimate).
Densities are estimated per bag with a Gaussian KDE at integration points shared by all
bags; the basis is the tensor cosine basis ``φ_0 = 1, φ_k(x) = √2 cos(πkx)``. For groups
of up to three markers the KDE is computed by linear binning on a grid of spacing at most
``h/4`` (:mod:`.grids`), a separable Gaussian convolution and multilinear interpolation at the
integration points (errors ``O((Δ/h)²)``, well under the KDE's own variance; Wand 1994),
which makes its cost linear in the points instead of ``points × integration points``.

The number of basis functions grows as ``n_basis^ℓ``: beyond a few dimensions the
features are computed on subspaces of the markers (by default every pair) and
concatenated, which estimates the average of the divergences of the 2-D marginals.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from .._random import check_generator
from ..bags import Bags, subsample_bags
from ..kernels import squared_euclidean_distances
from .base import BagRepresentation, FeatureEmbedding
from .grids import binned_kde, cosine_basis

__all__ = ["DensityFeatures", "HistogramEmbedding", "lambda_measure", "sample_lambdas"]

Z = {"hellinger": 0.5, "js": math.log(2.0) / 2.0, "tv": 0.5}
#: Beyond this many basis functions per group, ``subspaces="auto"`` uses marker pairs.
MAX_FULL_BASIS = 1000
#: Binned KDE: grid spacing at most bandwidth / BIN_RESOLUTION, and at most this many
#: nodes per axis for a group of k markers (beyond that, the exact KDE).
BIN_RESOLUTION = 4
MAX_GRID_NODES = {1: 4096, 2: 256, 3: 64}


def lambda_measure(divergence: str, lam: NDArray[np.float64]) -> NDArray[np.float64]:
    """Density of ``μ`` on ``λ > 0`` (JS, TV; Hellinger is a point mass at 0)."""
    lam = np.asarray(lam, dtype=np.float64)
    if divergence == "js":
        # 1/cosh(πλ) written to stay finite for large λ.
        e = np.exp(-np.pi * np.abs(lam))
        return 2.0 * e / (1.0 + e * e) / (1.0 + 4.0 * lam**2)
    if divergence == "tv":
        return (2.0 / np.pi) / (1.0 + 4.0 * lam**2)
    raise ValueError(f"{divergence!r} has no density on λ > 0")


def sample_lambdas(divergence: str, n: int, rng: np.random.Generator) -> NDArray[np.float64]:
    """``n`` draws from ``μ/Z`` (digest 001 §2.2).

    TV: ``λ = ½ tan(πU/2)``, a half-Cauchy of scale ½. JS: rejection from the
    half-hyperbolic-secant ``λ = (2/π) artanh(tan(πU/4))`` with acceptance
    ``1/(1 + 4λ²)`` (rate ln 2). Hellinger: ``λ = 0``.
    """
    if divergence == "hellinger":
        return np.zeros(n)
    if divergence == "tv":
        return 0.5 * np.tan(np.pi * rng.uniform(size=n) / 2.0)
    if divergence == "js":
        out = np.empty(0)
        while out.size < n:
            u = rng.uniform(size=2 * (n - out.size) + 16)
            lam = (2.0 / np.pi) * np.arctanh(np.tan(np.pi * u / 4.0))
            keep = rng.uniform(size=u.size) < 1.0 / (1.0 + 4.0 * lam**2)
            out = np.concatenate([out, lam[keep]])
        return out[:n]
    raise ValueError(f"unknown divergence {divergence!r}")


def g_lambda(
    density: NDArray[np.float64], lambdas: NDArray[np.float64], divergence: str
) -> NDArray[np.complex128]:
    """``g_λ(p) = √Z c_λ (p^{½+iλ} - 1)`` for every λ (rows) and density value (columns).

    ``0^{½+iλ}`` is taken as 0 (digest 001 §2.2).
    """
    p = np.maximum(np.asarray(density, dtype=np.float64), 0.0)
    logp = np.log(np.where(p > 0, p, 1.0))
    phase = lambdas[..., :, None] * logp[..., None, :]
    power = np.sqrt(p)[..., None, :] * np.exp(1j * phase)
    c = (-0.5 + 1j * lambdas) / (0.5 + 1j * lambdas)
    return math.sqrt(Z[divergence]) * c[:, None] * (power - 1.0)


class DensityFeatures(BagRepresentation):
    """Linear-time embeddings whose squared distance estimates a density divergence.

    Parameters
    ----------
    divergence : {"hellinger", "js", "tv", "l2"}, default="hellinger"
        ``D² ≈ H²``, ``JS`` (nats), ``TV`` (= ½∫|p-q|) or ``∫(p-q)²``.
    n_lambda : int, default=5
        ``M``, draws of λ (ignored for Hellinger and L2).
    n_basis : int, default=10
        Cosine functions per dimension (``|V| = n_basis^k`` per subspace of k markers).
    bandwidth : float, "cv" or "scott", default="cv"
        KDE bandwidth in the unit-cube coordinates. ``"cv"``: likelihood
        cross-validation on the training bags (each bag's KDE from half of its points,
        scored by the log-density of the other half, summed over bags and groups), over
        Scott's value times ``2^(-k/2)``, ``k = -1..8``; ``"scott"``: Scott's rule, which
        oversmooths multimodal samples such as cytometry populations.
    n_integration : int, default=2000
        Monte Carlo points ``u ~ U[0,1]^k``, drawn in ``fit`` and shared by every bag.
    subspaces : "auto", "full", "pairs", "marginals" or list of tuples of int
        Which groups of markers get a density: all markers at once (``"full"``), every
        pair, each marker alone, or explicit index tuples. ``"auto"``: ``"full"`` when
        ``n_basis^d <= 1000``, else ``"pairs"``. Groups' features are concatenated and
        scaled so that ``D²`` is the mean of the groups' divergences.
    max_points : int or None, default=2000
        KDE from at most this many points of a bag (seeded, order-independent subsample).
    max_memory : int, default=2 GiB
        Refuse settings whose features for the training bags would exceed this many bytes.
    kde : {"auto", "binned", "exact"}, default="auto"
        How the KDE is evaluated at the integration points: ``"binned"`` (linear binning,
        a grid convolution and interpolation; linear in the points; groups of at most 3
        markers), ``"exact"`` (every point against every integration point), or
        ``"auto"``: binned where the grid fits (spacing ≤ h/4), exact otherwise.
    random_state : int, Generator or None

    Attributes
    ----------
    low_, span_ : ndarray of shape (d,)
        The scaler into ``[0,1]^d`` learned from the training bags (test bags clipped).
    groups_ : list of tuple of int
    lambdas_ : ndarray of shape (M,)
    points_ : list of ndarray
        Integration points of each group.
    bandwidth_ : float

    References
    ----------
    Sutherland, Oliva, Póczos, Schneider. "Linear-time learning on distributions with
    approximate kernel embeddings", AAAI 2016, eq. 3-7.
    """

    def __init__(
        self,
        divergence: Literal["hellinger", "js", "tv", "l2"] = "hellinger",
        n_lambda: int = 5,
        n_basis: int = 10,
        bandwidth: float | Literal["cv", "scott"] = "cv",
        n_integration: int = 2000,
        subspaces: Any = "auto",
        max_points: int | None = 2000,
        max_memory: int = 2 * 2**30,
        kde: Literal["auto", "binned", "exact"] = "auto",
        random_state: Any = None,
    ):
        self.divergence = divergence
        self.n_lambda = n_lambda
        self.n_basis = n_basis
        self.bandwidth = bandwidth
        self.n_integration = n_integration
        self.subspaces = subspaces
        self.max_points = max_points
        self.max_memory = max_memory
        self.kde = kde
        self.random_state = random_state

    # ------------------------------------------------------------------ fitting
    def _groups(self, d: int) -> list[tuple[int, ...]]:
        s = self.subspaces
        if s == "auto":
            s = "full" if self.n_basis**d <= MAX_FULL_BASIS else "pairs"
        if s == "full":
            return [tuple(range(d))]
        if s == "pairs":
            return list(itertools.combinations(range(d), 2)) if d > 1 else [(0,)]
        if s == "marginals":
            return [(j,) for j in range(d)]
        groups = [tuple(int(j) for j in g) for g in s]
        bad = [g for g in groups if not g or min(g) < 0 or max(g) >= d]
        if bad:
            raise ValueError(f"subspaces {bad} do not index the {d} markers")
        return groups

    def _width(self, group: tuple[int, ...]) -> int:
        per_lambda = self.n_basis ** len(group)
        if self.divergence == "l2":
            return per_lambda
        if self.divergence == "hellinger":
            return per_lambda  # λ = 0: real, and every draw is the same
        return 2 * int(self.n_lambda) * per_lambda

    def data_dependence(self) -> str | None:
        return "its grid range and KDE bandwidth come from the training cells"

    def _fit(self, bags: Bags) -> None:
        if self.divergence not in ("hellinger", "js", "tv", "l2"):
            raise ValueError(
                f"divergence must be 'hellinger', 'js', 'tv' or 'l2', got {self.divergence!r}"
            )
        for name in ("n_lambda", "n_basis", "n_integration"):
            v = getattr(self, name)
            if int(v) != v or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.kde not in ("auto", "binned", "exact"):
            raise ValueError(f"kde must be 'auto', 'binned' or 'exact', got {self.kde!r}")
        rng = check_generator(self.random_state)
        d = bags.dim
        self.groups_ = self._groups(d)
        widest = max(len(g) for g in self.groups_)
        if self.kde == "binned" and widest not in MAX_GRID_NODES and self.divergence != "l2":
            raise ValueError(f"kde='binned' needs groups of at most 3 markers, not {widest}")
        width = sum(self._width(g) for g in self.groups_)
        need = width * len(bags) * 8
        if need > self.max_memory:
            raise ValueError(
                f"DensityFeatures would need {need / 2**20:.0f} MiB for {len(bags)} bags "
                f"({width} features each: {len(self.groups_)} group(s) of up to "
                f"{max(len(g) for g in self.groups_)} marker(s), n_basis={self.n_basis}); "
                f"lower n_basis or n_lambda, use subspaces='pairs' or 'marginals', or raise "
                f"max_memory={self.max_memory}"
            )
        pts = bags.points
        self.low_ = pts.min(axis=0)
        self.span_ = np.where(np.ptp(pts, axis=0) > 0, np.ptp(pts, axis=0), 1.0)
        # Integration points first: they then do not depend on n_lambda.
        self.points_ = [rng.uniform(size=(int(self.n_integration), len(g))) for g in self.groups_]
        self.lambdas_ = sample_lambdas(
            "hellinger" if self.divergence == "l2" else self.divergence, int(self.n_lambda), rng
        )
        if self.bandwidth in ("cv", "scott", None):
            scaled = self._scale(pts)
            sizes = np.minimum(bags.sizes, self.max_points or np.inf)
            # Scott's rule per group dimension, from the pooled spread of the training cells.
            spread = float(np.mean(scaled.std(axis=0)))
            k = max(len(g) for g in self.groups_)
            self.bandwidth_ = float(np.median(spread * sizes ** (-1.0 / (k + 4))))
            if self.bandwidth != "scott" and self.divergence != "l2":
                candidates = self.bandwidth_ * 2.0 ** (-np.arange(-1, 9) / 2.0)
                h_cv, n_half = self._likelihood_cv(bags, candidates, rng)
                # Chosen for KDEs of n_half points; the features use up to max_points,
                # and the optimal bandwidth scales as n^(-1/(k+4)).
                self.bandwidth_ = h_cv * (n_half / float(np.median(sizes))) ** (1.0 / (k + 4))
        else:
            if not self.bandwidth > 0:
                raise ValueError(
                    f"bandwidth must be positive, 'cv' or 'scott', got {self.bandwidth!r}"
                )
            self.bandwidth_ = float(self.bandwidth)

    def _likelihood_cv(
        self, bags: Bags, candidates: NDArray[np.float64], rng: np.random.Generator
    ) -> tuple[float, int]:
        """Likelihood cross-validation of the KDE bandwidth.

        Returns the candidate with the largest held-out log-likelihood, and the median
        number of points of the KDEs it was chosen for. Up to 20 training bags and 5
        groups (seeded draws), at most 1,000 points per bag split in two random halves:
        the KDE of one half scores the other. The Gaussian KDE leaks mass past the unit
        cube's faces alike for every candidate.
        """
        n_bags = min(len(bags), 20)
        chosen = np.sort(rng.choice(len(bags), n_bags, replace=False))
        groups = [self.groups_[i] for i in rng.permutation(len(self.groups_))[:5]]
        score = np.zeros(candidates.size)
        halves = []
        for b in chosen:
            x = np.clip(self._scale(bags[int(b)]), 0.0, 1.0)
            x = x[rng.permutation(x.shape[0])[:1000]]
            half = x.shape[0] // 2
            if half < 2:
                continue
            halves.append(half)
            for g in groups:
                cols = list(g)
                sq = squared_euclidean_distances(x[half:, cols], x[:half, cols])
                for c, h in enumerate(candidates):
                    dens = np.exp(-sq / (2.0 * h * h)).mean(axis=1)
                    dens *= (2.0 * math.pi * h * h) ** (-len(cols) / 2.0)
                    score[c] += np.log(np.maximum(dens, 1e-300)).sum()
        return float(candidates[int(np.argmax(score))]), int(np.median(halves or [1]))

    def _scale(self, pts: NDArray[np.float64]) -> NDArray[np.float64]:
        return (pts - self.low_) / self.span_

    def clipped_counts(self, X: Any) -> NDArray[np.int64]:
        """Points of each bag outside the training range (clipped into ``[0, 1]``)."""
        bags = self._validated_bags(X)
        s = self._scale(bags.points)
        outside = ((s < 0) | (s > 1)).any(axis=1)
        return np.add.reduceat(outside.astype(np.int64), bags.offsets[:-1])

    # ---------------------------------------------------------------- features
    def features_from_densities(
        self, densities: NDArray[np.float64], group: int = 0
    ) -> NDArray[np.float64]:
        """``A(p)`` from density values at the group's integration points, shape (B, W).

        Exposed so that exact densities can be checked against closed forms.
        """
        u = self.points_[group]
        phi = cosine_basis(u, int(self.n_basis))
        n_e = u.shape[0]
        if self.divergence == "hellinger":
            g = math.sqrt(Z["hellinger"]) * -(np.sqrt(np.maximum(densities, 0.0)) - 1.0)
            return (g @ phi) / n_e
        M = self.lambdas_.size
        B = densities.shape[0]
        a = np.empty((B, M, phi.shape[1]), dtype=np.complex128)
        # A few λ at a time bounds the (B, λ, n_e) complex block.
        step = max(1, (1 << 22) // max(1, B * n_e))
        for m0 in range(0, M, step):
            G = g_lambda(densities, self.lambdas_[m0 : m0 + step], self.divergence)
            a[:, m0 : m0 + step] = (G.reshape(-1, n_e) @ phi).reshape(B, -1, phi.shape[1]) / n_e
        return np.concatenate([a.real.reshape(B, -1), a.imag.reshape(B, -1)], axis=1) / math.sqrt(M)

    def embed(self, X: Any) -> FeatureEmbedding:
        return FeatureEmbedding(self.transform(X), "euclidean")

    def transform(self, X: Any) -> NDArray[np.float64]:
        """Features of every bag, shape ``(n_bags, n_output_features_)``."""
        bags = self._validated_bags(X)
        return self.features_with_densities(subsample_bags(bags, self.max_points, 0))[0]

    def features_with_densities(
        self, bags: Bags
    ) -> tuple[NDArray[np.float64], list[NDArray[np.float64] | None], NDArray[np.float64]]:
        """Features of bags already subsampled to ``max_points``, per group the KDEs at
        its integration points they were made of (``None`` for ``l2``), and the points
        scaled into ``[0, 1]^d``: an explanation reuses them instead of computing
        them again."""
        scaled = np.clip(self._scale(bags.points), 0.0, 1.0)
        w = bags.point_weights()
        parts = []
        densities: list[NDArray[np.float64] | None] = []
        for gi, group in enumerate(self.groups_):
            cols = list(group)
            if self.divergence == "l2":
                basis = cosine_basis(scaled[:, cols], int(self.n_basis)) * w[:, None]
                parts.append(np.add.reduceat(basis, bags.offsets[:-1], axis=0))
                densities.append(None)
                continue
            dens = self._kde(scaled[:, cols], w, bags.offsets, self.points_[gi])
            parts.append(self.features_from_densities(dens, gi))
            densities.append(dens)
        out = np.concatenate(parts, axis=1)
        return out / math.sqrt(len(self.groups_)), densities, scaled

    def _grid_nodes(self, k: int) -> int | None:
        """Nodes per axis of the binned KDE for a group of ``k`` markers, or None (exact)."""
        if self.kde == "exact" or k not in MAX_GRID_NODES:
            return None
        nodes = math.ceil(BIN_RESOLUTION / self.bandwidth_) + 1
        if nodes > MAX_GRID_NODES[k] and self.kde == "auto":
            return None
        return max(3, min(nodes, MAX_GRID_NODES[k]))

    def _kde(
        self,
        pts: NDArray[np.float64],
        w: NDArray[np.float64],
        offsets: NDArray[np.int64],
        u: NDArray[np.float64],
    ) -> NDArray[np.float64]:
        """KDE of every bag at the integration points ``u``, shape (B, n_e)."""
        h = self.bandwidth_
        nodes = self._grid_nodes(pts.shape[1])
        if nodes is not None:
            return binned_kde(pts, w, offsets, u, h, nodes)
        B = offsets.size - 1
        dens = np.empty((B, u.shape[0]))
        norm = (2.0 * math.pi * h * h) ** (-pts.shape[1] / 2.0)
        for t in range(B):
            lo, hi = int(offsets[t]), int(offsets[t + 1])
            sq = squared_euclidean_distances(u, pts[lo:hi])
            dens[t] = norm * (np.exp(-sq / (2.0 * h * h)) @ w[lo:hi])
        return dens

    @property
    def n_output_features_(self) -> int:
        return sum(self._width(g) for g in self.groups_)


class HistogramEmbedding(BagRepresentation):
    """Hellinger or total variation between histograms on a shared grid (paper 000 App. G).

    Low dimension only (``bins^d`` cells). Hellinger: features ``√α / √2`` so that
    ``D² = ½‖√α - √β‖² = d_H²``. TV: features ``α/2`` with ℓ1 geometry so that
    ``D² = ½‖α - β‖₁ = d_TV`` (``√d_TV`` is Hilbertian).

    Parameters
    ----------
    divergence : {"hellinger", "tv"}
    bins : int, default=10
        Bins per dimension, on the training range (test points clipped into it).
    """

    def __init__(self, divergence: Literal["hellinger", "tv"] = "hellinger", bins: int = 10):
        self.divergence = divergence
        self.bins = bins

    def data_dependence(self) -> str | None:
        return "its bin edges span the range of the training cells"

    def _fit(self, bags: Bags) -> None:
        if self.divergence not in ("hellinger", "tv"):
            raise ValueError(f"divergence must be 'hellinger' or 'tv', got {self.divergence!r}")
        if self.bins**bags.dim > 10**6:
            raise ValueError(
                f"{self.bins}^{bags.dim} histogram cells is too many: use DensityFeatures"
            )
        self.low_ = bags.points.min(axis=0)
        self.span_ = np.where(np.ptp(bags.points, axis=0) > 0, np.ptp(bags.points, axis=0), 1.0)

    def embed(self, X: Any) -> FeatureEmbedding:
        return FeatureEmbedding(
            self.transform(X), "euclidean" if self.divergence == "hellinger" else "l1"
        )

    def transform(self, X: Any) -> NDArray[np.float64]:
        bags = self._validated_bags(X)
        idx = np.clip(
            ((bags.points - self.low_) / self.span_ * self.bins).astype(np.int64), 0, self.bins - 1
        )
        cell = np.ravel_multi_index(idx.T, (self.bins,) * bags.dim)
        n_cells = self.bins**bags.dim
        flat = bags.bag_index() * n_cells + cell
        hist = np.bincount(flat, weights=bags.point_weights(), minlength=len(bags) * n_cells)
        hist = hist.reshape(len(bags), n_cells)
        if self.divergence == "hellinger":
            return np.sqrt(hist) / math.sqrt(2.0)
        return hist / 2.0
