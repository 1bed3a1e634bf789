"""Kernel mean embeddings of bags: exact (blocked), random Fourier, Nyström.

The mean embedding of a bag ``P̂ = Σ_i c_i δ_{x_i}`` under a point kernel ``k`` is
``μ_P = Σ_i c_i k(·, x_i)``; inner products and distances between embeddings are

    ⟨μ_P, μ_Q⟩ = Σ_i Σ_j c_i c'_j k(x_i, x'_j)          (the set kernel)
    MMD²(P, Q) = ⟨μ_P, μ_P⟩ + ⟨μ_Q, μ_Q⟩ - 2 ⟨μ_P, μ_Q⟩   (the plug-in V-statistic)

(paper 003 §2 steps 1-2; paper 000 §2.6). ``method="exact"`` computes these sums by
blocks of points, so the point Gram of all points never exists in memory (its cost
stays quadratic in the bag sizes). ``"rff"`` and ``"nystroem"`` give explicit feature
vectors ``Σ_i c_i z(x_i)`` whose inner products approximate the set kernel, linear in
the number of points.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from scipy.spatial.distance import pdist

from .._random import check_generator
from ..bags import Bags
from ..hashing import points_sha256
from ..kernels import (
    POINT_KERNELS,
    batch_invariant_matmul,
    point_kernel,
    random_fourier_features,
    random_fourier_frequencies,
)
from ..scopes import scoped_store
from .base import BagRepresentation, Embedding, FeatureEmbedding
from .set_kernel import set_kernel_gram

__all__ = ["MeanEmbedding", "SetKernelEmbedding", "set_kernel_gram"]

# Random-feature and Nyström chunks hold at most this many float64 entries (8 MiB).
_BLOCK_ENTRIES = 1 << 20
# The median heuristic looks at pairwise distances of at most this many points.
_MEDIAN_SUBSAMPLE = 2000


def _self_terms(
    bags: Bags,
    kernel: str,
    bandwidth: float,
    n_jobs: int | None = None,
    point_sums: NDArray[np.float64] | None = None,
) -> NDArray[np.float64]:
    """``⟨μ_t, μ_t⟩`` for every bag, each computed from that bag alone (so it never
    depends on which other bags came with it); ``point_sums`` (n_points,) receives each
    bag's own mean embedding at its points."""
    out = np.empty(len(bags))
    for t in range(len(bags)):
        lo, hi = int(bags.offsets[t]), int(bags.offsets[t + 1])
        sums = None if point_sums is None else point_sums[lo:hi, None]
        G = set_kernel_gram(
            bags[t : t + 1], None, kernel, bandwidth, n_jobs=n_jobs, point_sums=sums
        )
        out[t] = float(G[0, 0])
    return out


class SetKernelEmbedding(Embedding):
    """Exact mean embeddings, kept as the bags themselves plus the point kernel.

    Inner products are set-kernel values and squared distances are V-statistic
    ``MMD²``, both computed by :func:`set_kernel_gram`. Training bags must be kept to
    predict, so models using it store their training points.
    """

    #: With :meth:`keep_point_sums`: the mean embeddings at each point of these bags.
    #: Class-level defaults, so that a saved model's embedding carries neither.
    point_sums: dict[str, NDArray[np.float64]] | None = None
    _point_sums_bytes = 0

    def __init__(self, bags: Bags, kernel: str, bandwidth: float, n_jobs: int | None = None):
        self.bags = bags
        self.kernel = kernel
        self.bandwidth = float(bandwidth)
        self.n_jobs = n_jobs
        self._self: NDArray[np.float64] | None = None

    def __len__(self) -> int:
        return len(self.bags)

    def keep_point_sums(self, max_bytes: int) -> None:
        """From now on the products also keep, per point ``x`` of these bags, the mean
        embeddings at ``x`` they sum: ``point_sums["self"]`` (n_points,), the point's
        own bag's (with the self terms), and ``point_sums["other"]`` (n_points, m),
        the first ``m`` other bags' (with :meth:`inner` against ``other``: as many as
        ``max_bytes`` holds, all of them when it can). An explanation then makes a
        second pass over the others alone, if any."""
        self.point_sums = {}
        self._point_sums_bytes = int(max_bytes)

    def self_inner(self) -> NDArray[np.float64]:
        """``⟨μ_t, μ_t⟩`` for each bag (cached)."""
        if self._self is None:
            sums = None
            if self.point_sums is not None:
                sums = self.point_sums["self"] = np.zeros(self.bags.n_points)
            self._self = _self_terms(self.bags, self.kernel, self.bandwidth, self.n_jobs, sums)
        return self._self

    def _other(self, other: Embedding | None) -> SetKernelEmbedding | None:
        if other is None:
            return None
        if not isinstance(other, SetKernelEmbedding) or (other.kernel, other.bandwidth) != (
            self.kernel,
            self.bandwidth,
        ):
            raise TypeError("both embeddings must come from the same fitted representation")
        return other

    def inner(self, other: Embedding | None = None) -> NDArray[np.float64]:
        o = self._other(other)
        if o is None:
            return self._reused("inner", self._gram)
        sums = None
        if self.point_sums is not None:
            kept = min(len(o), self._point_sums_bytes // (8 * max(1, self.bags.n_points)))
            sums = self.point_sums["other"] = np.zeros((self.bags.n_points, kept))
        # One new bag at a time: its values never depend on the other bags sent with it.
        rows = []
        for t in range(len(self.bags)):
            lo, hi = int(self.bags.offsets[t]), int(self.bags.offsets[t + 1])
            rows.append(
                set_kernel_gram(
                    self.bags[t : t + 1],
                    o.bags,
                    self.kernel,
                    self.bandwidth,
                    n_jobs=self.n_jobs,
                    point_sums=None if sums is None else sums[lo:hi],
                )
            )
        return np.vstack(rows)

    def _gram(self) -> NDArray[np.float64]:
        """The set-kernel Gram among these bags; its diagonal becomes the self terms."""
        G = set_kernel_gram(self.bags, None, self.kernel, self.bandwidth, n_jobs=self.n_jobs)
        if self._self is None:
            self._self = np.diag(G).copy()
        return G

    def sq_distances(self, other: Embedding | None = None) -> NDArray[np.float64]:
        o = self._other(other)
        if o is None:
            # From the Gram ``inner()`` keeps too: a linear-kernel fit's design and its
            # domain check then share one set-kernel Gram.
            return self._reused("sq", lambda: self._sq_distances(None))
        return self._sq_distances(o)

    def _sq_distances(self, o: SetKernelEmbedding | None) -> NDArray[np.float64]:
        G = self.inner(o)
        s_self = self.self_inner()
        s_other = s_self if o is None else o.self_inner()
        D = s_self[:, None] + s_other[None, :] - 2.0 * G
        np.maximum(D, 0.0, out=D)
        if o is None:
            np.fill_diagonal(D, 0.0)
        return D


#: The medians kept within :func:`sharing_median_distances`, by their inputs' key.
_MEDIANS: ContextVar[dict[tuple[Any, ...], tuple[float, Any]] | None] = ContextVar(
    "median_distances", default=None
)


def sharing_median_distances() -> AbstractContextManager[None]:
    """Within the block, the median heuristic of the same points, kernel and generator
    state is computed once: a fit that asks for it again (its search, then its final
    fit; an embedding's bandwidth, then the same embedding refitted) gets the value
    computed first, and the generator is left in the state the computation left it,
    so every later draw is the one it would have been. Nested blocks share the
    outermost one's values; they are dropped when it ends."""
    return scoped_store(_MEDIANS)


def _median_distance(points: NDArray[np.float64], kernel: str, rng: np.random.Generator) -> float:
    """Median pairwise distance (Euclidean, or ℓ1 for the Laplace kernel) of a subsample
    drawn with ``rng``; once per inputs within :func:`sharing_median_distances`."""
    kept = _MEDIANS.get()
    if kept is None:
        return _computed_median_distance(points, kernel, rng)
    key = (points_sha256(points), points.shape, kernel, repr(rng.bit_generator.state))
    if key not in kept:
        value = _computed_median_distance(points, kernel, rng)
        kept[key] = (value, rng.bit_generator.state)
    value, state = kept[key]
    rng.bit_generator.state = state
    return value


def _computed_median_distance(
    points: NDArray[np.float64], kernel: str, rng: np.random.Generator
) -> float:
    """:func:`_median_distance` itself: a distance matrix of at most
    ``_MEDIAN_SUBSAMPLE`` points."""
    if points.shape[0] > _MEDIAN_SUBSAMPLE:
        points = points[rng.choice(points.shape[0], _MEDIAN_SUBSAMPLE, replace=False)]
    d = pdist(points, metric="cityblock" if kernel == "laplace" else "euclidean")
    # The median of the positive distances, as np.median(d[d > 0]) gives it, with
    # neither the copies nor the sort: distances are never negative, so the zeros come
    # first and the positive ones' middle ranks are shifted by their count. One rank
    # is selected in place; the one below it is the largest value before it (numpy's
    # selection of two ranks at once took ten times as long).
    zeros = d.size - np.count_nonzero(d)
    positive = d.size - zeros
    if positive == 0:
        return 1.0
    hi = zeros + positive // 2
    d.partition(hi)
    if positive % 2:
        return float(d[hi])
    return float(np.mean(np.array([d[:hi].max(), d[hi]])))


class MeanEmbedding(BagRepresentation):
    """Kernel mean embedding of bags, exact or with explicit random features.

    Parameters
    ----------
    kernel : {"gaussian", "laplace"}, default="gaussian"
        Point kernel: ``exp(-‖x - y‖² / (2σ²))`` or ``exp(-‖x - y‖₁ / σ)``.
    bandwidth : float or None, default=None
        ``σ``. ``None``: the median heuristic, the median pairwise distance between
        (up to 2000 subsampled) training points.
    method : {"exact", "rff", "nystroem"}, default="exact"
        ``"exact"``: set-kernel sums computed by blocks (no feature vector; cost
        quadratic in the bag sizes, memory bounded). ``"rff"``: random Fourier
        features ``[cos(Wx), sin(Wx)] / √(D/2)`` averaged over each bag
        (Rahimi & Recht). ``"nystroem"``: ``k(x, L) Λ^{-1/2} U^T`` on ``D`` landmarks
        drawn from the training points, averaged over each bag.
    n_components : int, default=1000
        Feature length ``D`` for ``"rff"`` (rounded down to even) and ``"nystroem"``.
    n_jobs : int or None, default=None
        Threads for the exact method's blocks (``None``: 1; ``-1``: all cores).
    random_state : int, Generator or None
        Seed for frequencies, landmarks and the median-heuristic subsample.

    Attributes
    ----------
    bandwidth_ : float
    frequencies_ : ndarray of shape (D/2, d)
        ``"rff"`` only.
    landmarks_ : ndarray of shape (D, d), normalization_ : ndarray of shape (D, r)
        ``"nystroem"`` only (``r`` ≤ ``D`` retained eigen-directions).

    References
    ----------
    Szabó, Gretton, Póczos, Sriperumbudur. "Two-stage sampled learning theory on
    distributions", AISTATS 2015 (set kernel, MMD). Rahimi & Recht, NIPS 2007.
    Williams & Seeger, NIPS 2001 (Nyström).
    """

    def __init__(
        self,
        kernel: Literal["gaussian", "laplace"] = "gaussian",
        bandwidth: float | None = None,
        method: Literal["exact", "rff", "nystroem"] = "exact",
        n_components: int = 1000,
        n_jobs: int | None = None,
        random_state: Any = None,
    ):
        self.kernel = kernel
        self.bandwidth = bandwidth
        self.method = method
        self.n_components = n_components
        self.n_jobs = n_jobs
        self.random_state = random_state

    def data_dependence(self) -> str | None:
        if self.method == "exact":
            return "method='exact' keeps every training cell; use method='rff'"
        if self.method == "nystroem":
            return "the Nyström landmarks are training cells; use method='rff'"
        if self.bandwidth is None:
            return "bandwidth=None is the median heuristic over the training cells; set it"
        return None

    def _fit(self, bags: Bags) -> None:
        if self.kernel not in POINT_KERNELS:
            raise ValueError(f"kernel must be one of {POINT_KERNELS}, got {self.kernel!r}")
        if self.method not in ("exact", "rff", "nystroem"):
            raise ValueError(f"method must be 'exact', 'rff' or 'nystroem', got {self.method!r}")
        if self.method != "exact" and (
            int(self.n_components) != self.n_components or self.n_components < 2
        ):
            raise ValueError(f"n_components must be an integer >= 2, got {self.n_components!r}")
        rng = check_generator(self.random_state)
        if self.bandwidth is None:
            self.bandwidth_ = _median_distance(bags.points, self.kernel, rng)
        elif not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0, got {self.bandwidth!r}")
        else:
            self.bandwidth_ = float(self.bandwidth)
        d = bags.dim
        if self.method == "rff":
            self.frequencies_ = random_fourier_frequencies(
                self.kernel, self.bandwidth_, int(self.n_components) // 2, d, rng
            )
        elif self.method == "nystroem":
            m = min(int(self.n_components), bags.n_points)
            self.landmarks_ = bags.points[rng.choice(bags.n_points, m, replace=False)].copy()
            Kmm = point_kernel(self.landmarks_, self.landmarks_, self.kernel, self.bandwidth_)
            vals, vecs = np.linalg.eigh(Kmm)
            # Drop numerically null directions: a pseudo-inverse square root.
            keep = vals > vals.max() * 1e-12
            self.normalization_ = vecs[:, keep] / np.sqrt(vals[keep])

    def embed(self, X: Any) -> Embedding:
        """Exact set-kernel embedding, or explicit mean feature vectors."""
        bags = self._validated_bags(X)
        if self.method == "exact":
            return SetKernelEmbedding(bags, self.kernel, self.bandwidth_, self.n_jobs)
        return FeatureEmbedding(self._mean_features(bags), "euclidean")

    @property
    def n_output_features_(self) -> int:
        """Length ``D`` of the feature vectors (``"rff"`` and ``"nystroem"``)."""
        if self.method == "rff":
            return 2 * self.frequencies_.shape[0]
        if self.method == "nystroem":
            return self.normalization_.shape[1]
        raise AttributeError("the exact mean embedding has no feature vector")

    def _point_features(self, pts: NDArray[np.float64]) -> NDArray[np.float64]:
        if self.method == "rff":
            return random_fourier_features(pts, self.frequencies_)
        return (
            point_kernel(pts, self.landmarks_, self.kernel, self.bandwidth_) @ self.normalization_
        )

    def feature_inner(
        self, pts: NDArray[np.float64], g: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        """``⟨φ(x), g_k⟩`` at every point ``x``, shape (n, k), for ``g`` of shape (D, k).

        Cheaper than the features themselves: a Nyström map is ``k(x, L) A``, so this
        is ``k(x, L) (A g)`` without the ``n × D × r`` product; with one column, random
        Fourier features give ``Σ_j (a_j cos θ_j + b_j sin θ_j) = Σ_j r_j cos(θ_j - ψ_j)``
        (``θ = Wx``), one cosine per frequency instead of a cosine and a sine.
        Chunked like the embedding.
        """
        g = np.asarray(g, dtype=np.float64)
        if self.method == "exact":
            raise TypeError("the exact mean embedding has no feature vector")
        n, k = pts.shape[0], g.shape[1]
        out = np.empty((n, k))
        if self.method == "nystroem":
            folded = self.normalization_ @ g
            chunk = max(1, _BLOCK_ENTRIES // self.landmarks_.shape[0])
            for c0 in range(0, n, chunk):
                c1 = min(n, c0 + chunk)
                K = point_kernel(pts[c0:c1], self.landmarks_, self.kernel, self.bandwidth_)
                out[c0:c1] = K @ folded
            return out
        m = self.frequencies_.shape[0]
        chunk = max(1, _BLOCK_ENTRIES // (2 * m))
        if k != 1:
            for c0 in range(0, n, chunk):
                c1 = min(n, c0 + chunk)
                out[c0:c1] = random_fourier_features(pts[c0:c1], self.frequencies_) @ g
            return out
        a, b = g[:m, 0], g[m:, 0]
        radius = np.hypot(a, b) / np.sqrt(m)
        phase = np.arctan2(b, a)
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            theta = batch_invariant_matmul(pts[c0:c1], self.frequencies_.T, 256)
            theta -= phase
            np.cos(theta, out=theta)
            out[c0:c1, 0] = theta @ radius
        return out

    def _mean_features(
        self,
        bags: Bags,
        visit: Callable[[int, int, NDArray[np.float64]], None] | None = None,
    ) -> NDArray[np.float64]:
        """Mean feature vectors; ``visit(c0, c1, z)`` sees each chunk's point features
        ``z`` of points ``c0:c1`` (an explanation's one pass over the cells)."""
        width = self.n_output_features_
        if self.method == "rff":
            chunk = max(1, _BLOCK_ENTRIES // width)
        else:
            chunk = max(1, _BLOCK_ENTRIES // self.landmarks_.shape[0])
        out = np.zeros((len(bags), width))
        w = bags.point_weights()
        # Bag by bag, in chunks counted from the bag's first point: a bag's features
        # never depend on the bags around it.
        for t in range(len(bags)):
            lo, hi = int(bags.offsets[t]), int(bags.offsets[t + 1])
            for c0 in range(lo, hi, chunk):
                c1 = min(hi, c0 + chunk)
                z = self._point_features(bags.points[c0:c1])
                out[t] += w[c0:c1] @ z
                if visit is not None:
                    visit(c0, c1, z)
        return out
