"""Sliced-Wasserstein quantile embedding (paper 000, Meunier, Pontil & Ciliberto 2022).

For directions ``θ_1..θ_M`` uniform on the sphere and quantile levels ``t_1..t_N`` in
``(0, 1)``, drawn once in ``fit`` and shared by every bag, a bag ``P`` is mapped to

    Φ(P)[m, ℓ] = (M N)^(-1/p) · F⁻¹_{θ_m # P}(t_ℓ)          (paper 000 eq. 15)

where ``F⁻¹_{θ#P}`` is the (generalised) quantile function of the projections
``⟨x, θ⟩`` of the bag's points. Then ``‖Φ(P) - Φ(Q)‖_p^p`` is the Monte Carlo estimate
of ``SW_p(P, Q)^p``: the Euclidean distance of two feature vectors *is* the ``SW_2``
estimate (``p=2``), the ℓ1 distance *is* the ``SW_1`` estimate (``p=1``).

Also here: :func:`wasserstein_1d` and :func:`sliced_wasserstein_distance`, the exact
one-dimensional transport cost on the merged quantile grid (paper 000 §2.1), used as
the reference against which the embedding is tested.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._random import check_generator
from ..bags import Bags
from ..blas import one_thread
from .base import BagRepresentation, FeatureEmbedding, n_threads_for

__all__ = [
    "SlicedWasserstein",
    "sliced_wasserstein_distance",
    "uniform_directions",
    "wasserstein_1d",
]

# Projections of one bag are computed in blocks of directions of at most this many
# float64 entries (8 MiB), so a bag of 10^6 points never needs M × 10^6 at once. The
# blocks depend only on the bag's size, never on the batch it came in or the number
# of threads, so a bag's features are bit-for-bit the same however it is sent.
_PROJECTION_BLOCK_ENTRIES = 1 << 20


def uniform_directions(
    n_directions: int, dim: int, random_state: Any = None
) -> NDArray[np.float64]:
    """``n_directions`` i.i.d. directions uniform on the unit sphere ``S^{dim-1}``.

    Normalised standard Gaussian vectors, shape ``(n_directions, dim)``.
    """
    rng = check_generator(random_state)
    g = rng.standard_normal((n_directions, dim))
    norms = np.linalg.norm(g, axis=1, keepdims=True)
    # A zero Gaussian vector has probability zero; redraw rather than divide by it.
    while (norms == 0).any():  # pragma: no cover
        bad = norms[:, 0] == 0
        g[bad] = rng.standard_normal((int(bad.sum()), dim))
        norms = np.linalg.norm(g, axis=1, keepdims=True)
    return g / norms


def _rowwise_searchsorted(
    edges: NDArray[np.float64], queries: NDArray[np.float64], side: Literal["left", "right"]
) -> NDArray[np.int64]:
    """``np.searchsorted`` applied row by row, vectorised.

    ``edges`` (R, n) has sorted rows and ``queries`` (R, k); both lie in ``[0, 1]``, so
    shifting row ``r`` by ``2r`` makes one flat sorted array without mixing rows.
    """
    R, n = edges.shape
    shift = 2.0 * np.arange(R)[:, None]
    flat = np.searchsorted((edges + shift).ravel(), (queries + shift).ravel(), side=side)
    return flat.reshape(queries.shape) - n * np.arange(R)[:, None]


def _sorted_with_cumweights(
    values: NDArray[np.float64], weights: NDArray[np.float64] | None
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Sort each row of ``values`` (R, n); return sorted rows and cumulative weights."""
    R, n = values.shape
    if weights is None:
        cum = np.broadcast_to(np.arange(1, n + 1) / n, (R, n))
        return np.sort(values, axis=1), cum
    order = np.argsort(values, axis=1, kind="stable")
    cum = np.cumsum(weights[order], axis=1)
    cum /= cum[:, -1:]
    return np.take_along_axis(values, order, axis=1), cum


def wasserstein_1d(
    u_values: ArrayLike,
    v_values: ArrayLike,
    u_weights: ArrayLike | None = None,
    v_weights: ArrayLike | None = None,
    p: float = 1.0,
) -> NDArray[np.float64]:
    """Exact ``W_p^p`` between one-dimensional empirical measures, column by column.

    ``W_p^p = ∫_0^1 |F_u⁻¹(t) - F_v⁻¹(t)|^p dt``: both quantile functions are step
    functions, so the integrand is constant on the cells of the merged grid of
    cumulative weights, and the integral is a finite sum (paper 000 §2.1). Sizes and
    weights may differ.

    Parameters
    ----------
    u_values : array-like of shape (n,) or (n, k)
    v_values : array-like of shape (m,) or (m, k)
        ``k`` independent pairs of samples (for instance ``k`` projections).
    u_weights, v_weights : array-like of shape (n,) / (m,), optional
        Non-negative weights (normalised here); uniform if omitted.
    p : float, default=1
        Ground cost exponent, ``p >= 1``.

    Returns
    -------
    ndarray of shape (k,) or float
        ``W_p^p`` for each column (not its ``p``-th root).
    """
    u = np.asarray(u_values, dtype=np.float64)
    v = np.asarray(v_values, dtype=np.float64)
    scalar = u.ndim == 1
    if scalar:
        u, v = u[:, None], v[:, None]
    if u.shape[1] != v.shape[1]:
        raise ValueError(f"column counts differ: {u.shape[1]} vs {v.shape[1]}")
    uw = None if u_weights is None else np.asarray(u_weights, dtype=np.float64)
    vw = None if v_weights is None else np.asarray(v_weights, dtype=np.float64)
    us, cu = _sorted_with_cumweights(u.T, uw)
    vs, cv = _sorted_with_cumweights(v.T, vw)
    grid = np.sort(np.concatenate([cu, cv], axis=1), axis=1)
    grid[:, -1] = 1.0
    lengths = np.diff(grid, axis=1, prepend=0.0)
    # On the cell (a, b] the quantile function equals the first sorted value whose
    # cumulative weight reaches b.
    iu = np.minimum(_rowwise_searchsorted(cu, grid, "left"), us.shape[1] - 1)
    iv = np.minimum(_rowwise_searchsorted(cv, grid, "left"), vs.shape[1] - 1)
    diff = np.abs(np.take_along_axis(us, iu, axis=1) - np.take_along_axis(vs, iv, axis=1))
    out = np.sum(lengths * diff**p, axis=1)
    return float(out[0]) if scalar else out


def sliced_wasserstein_distance(
    X: ArrayLike,
    Y: ArrayLike,
    *,
    p: float = 2.0,
    n_directions: int = 100,
    directions: ArrayLike | None = None,
    x_weights: ArrayLike | None = None,
    y_weights: ArrayLike | None = None,
    random_state: Any = None,
) -> float:
    """Sliced Wasserstein distance with an exact inner (quantile) integral.

    ``SW_p(P, Q) = (1/M Σ_m W_p^p(θ_m # P, θ_m # Q))^(1/p)`` (paper 000 eq. 22) where
    each one-dimensional ``W_p^p`` is computed exactly by :func:`wasserstein_1d`; only
    the directions are sampled. This is the reference for :class:`SlicedWasserstein`.

    Parameters
    ----------
    X : array-like of shape (n, d)
    Y : array-like of shape (m, d)
    p : float, default=2
    n_directions : int, default=100
        Number of random directions (ignored when ``directions`` is given).
    directions : array-like of shape (M, d), optional
        Unit directions to use, e.g. those of a fitted :class:`SlicedWasserstein`.
    x_weights, y_weights : array-like, optional
        Point weights of each bag.
    random_state : int, Generator or None
        Seed for the directions.

    Returns
    -------
    float
        ``SW_p`` (the ``p``-th root taken).
    """
    X = np.asarray(X, dtype=np.float64)
    Y = np.asarray(Y, dtype=np.float64)
    if X.ndim != 2 or Y.ndim != 2 or X.shape[1] != Y.shape[1]:
        raise ValueError(f"X and Y must be 2-D with the same columns, got {X.shape} and {Y.shape}")
    if directions is None:
        theta = uniform_directions(n_directions, X.shape[1], random_state)
    else:
        theta = np.asarray(directions, dtype=np.float64)
    w = wasserstein_1d(X @ theta.T, Y @ theta.T, x_weights, y_weights, p=p)
    return float(np.mean(w) ** (1.0 / p))


class SlicedWasserstein(BagRepresentation):
    """Sliced-Wasserstein quantile embedding of bags (paper 000 eq. 15, Algorithm 1).

    Maps each bag to ``M · N`` numbers, the quantiles at ``N`` levels of the bag's
    projections on ``M`` directions, scaled by ``(M N)^(-1/p)`` so that the ℓ_p distance
    between two feature vectors is the ``SW_p`` estimate between the bags. Both the
    directions and the levels are drawn once in :meth:`fit` and shared by every bag,
    training and test alike, so Gram matrices are exactly positive definite for the
    Gaussian kernel (on ``SW_2²``, and on ``SW_1`` for ``p=1``).

    Cost per bag of ``n`` points in ``R^d``: ``O(M n d)`` to project plus
    ``O(M n log n)`` to sort, linear in the bag size up to the log; bags of any size,
    weighted or not.

    Parameters
    ----------
    p : {1, 2}, default=2
        Order of the sliced Wasserstein distance. ``p=2``: Euclidean geometry
        (``D² = SW_2²``). ``p=1``: ℓ1 geometry (``D² = SW_1``, since ``√SW_1`` is the
        Hilbertian distance, paper 000 Prop. 6).
    n_directions : int, default=100
        ``M``, directions uniform on the sphere (normalised Gaussians).
    n_levels : int, default=100
        ``N``, quantile levels in ``(0, 1)``. Ignored when ``paired=True``.
    levels : {"random", "midpoint"}, default="random"
        ``"random"``: i.i.d. uniform levels as in the paper. ``"midpoint"``: the fixed
        grid ``(ℓ - ½)/N``, a deterministic quadrature with lower variance; with
        ``N = n`` it reproduces the sorted-matching ``W_p`` of bags of ``n`` points
        exactly.
    paired : bool, default=False
        One level per direction (``M`` features instead of ``M · N``), as in the
        authors' GMM script (``true_rf=True``).
    n_jobs : int or None, default=None
        Threads used to project and sort (``None``: 1; ``-1``: all cores). numpy's
        sort releases the GIL, so threads scale on the sort, which dominates.
    random_state : int, Generator or None
        Seed for the directions and levels.

    Attributes
    ----------
    directions_ : ndarray of shape (M, d)
    levels_ : ndarray of shape (N,) (or (M,) when ``paired``)
    n_features_in_ : int
        Dimension ``d`` of the points.

    References
    ----------
    Meunier, Pontil, Ciliberto. "Distribution Regression with Sliced Wasserstein
    Kernels", ICML 2022, eq. 15 and Algorithm 1.
    """

    def __init__(
        self,
        p: int = 2,
        n_directions: int = 100,
        n_levels: int = 100,
        levels: Literal["random", "midpoint"] = "random",
        paired: bool = False,
        n_jobs: int | None = None,
        random_state: Any = None,
    ):
        self.p = p
        self.n_directions = n_directions
        self.n_levels = n_levels
        self.levels = levels
        self.paired = paired
        self.n_jobs = n_jobs
        self.random_state = random_state

    # ------------------------------------------------------------------ fitting
    def _check_params(self) -> None:
        if self.p not in (1, 2):
            raise ValueError(f"p must be 1 or 2, got {self.p!r}")
        for name in ("n_directions", "n_levels"):
            value = getattr(self, name)
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.levels not in ("random", "midpoint"):
            raise ValueError(f"levels must be 'random' or 'midpoint', got {self.levels!r}")

    def data_dependence(self) -> str | None:
        return None  # directions and levels are random draws

    def _fit(self, bags: Bags) -> None:
        self._check_params()
        rng = check_generator(self.random_state)
        M = int(self.n_directions)
        N = M if self.paired else int(self.n_levels)
        self.directions_ = uniform_directions(M, bags.dim, rng)
        if self.levels == "random":
            # Uniform on the open interval; sorted so features read as quantile curves.
            t = rng.uniform(0.0, 1.0, size=N)
            self.levels_ = t if self.paired else np.sort(t)
        else:
            self.levels_ = (np.arange(N) + 0.5) / N
            if self.paired:
                self.levels_ = self.levels_[rng.permutation(N)]

    @property
    def n_output_features_(self) -> int:
        """Length of each feature vector: ``M`` when paired, else ``M · N``."""
        M = self.directions_.shape[0]
        return M if self.paired else M * self.levels_.shape[0]

    # ---------------------------------------------------------------- embedding
    def embed(self, X: Any) -> FeatureEmbedding:
        """Quantile features of ``X`` as a :class:`FeatureEmbedding` (ℓ_p geometry)."""
        return FeatureEmbedding(self.transform(X), "euclidean" if self.p == 2 else "l1")

    def transform(self, X: Any) -> NDArray[np.float64]:
        """Quantile features, shape ``(n_bags, M·N)`` (or ``(n_bags, M)`` when paired).

        Feature ``m·N + ℓ`` is the ``t_ℓ`` quantile along direction ``θ_m``, times
        ``(M N)^(-1/p)``.
        """
        bags = self._validated_bags(X)
        theta = self.directions_
        M = theta.shape[0]
        out = np.empty((len(bags), self.n_output_features_))
        tasks = list(_work_units(bags, M))
        worker = self._unit_worker(bags, out)
        n_threads = min(n_threads_for(self.n_jobs), len(tasks))
        if n_threads == 1:
            for task in tasks:
                worker(task)
        else:
            # One BLAS thread per worker thread: the projections are small GEMMs.
            with one_thread(), ThreadPoolExecutor(n_threads) as pool:
                # list() re-raises the first exception of any unit.
                list(pool.map(worker, tasks))
        out *= float(self.n_output_features_) ** (-1.0 / self.p)
        return out

    def _unit_worker(
        self, bags: Bags, out: NDArray[np.float64]
    ) -> Callable[[tuple[int, int, int]], None]:
        theta = self.directions_
        t = self.levels_
        N = t.shape[0]
        points, offsets, weights = bags.points, bags.offsets, bags.weights
        paired = self.paired

        def run(task: tuple[int, int, int]) -> None:
            b, m0, m1 = task
            lo, hi = offsets[b], offsets[b + 1]
            n = int(hi - lo)
            # (directions, points) layout: the sort runs along contiguous rows.
            proj = theta[m0:m1] @ points[lo:hi].T
            rows = np.arange(m1 - m0)
            if weights is None:
                proj.sort(axis=1)
                # F⁻¹(t) = x_(k) for t in [(k-1)/n, k/n): index floor(t n).
                idx = np.minimum((t * n).astype(np.int64), n - 1)
                vals = proj[rows, idx[m0:m1]] if paired else proj[:, idx]
            else:
                vals_sorted, cum = _sorted_with_cumweights(proj, weights[lo:hi])
                # Left edges of each point's weight interval: the largest edge <= t.
                edges = np.empty_like(cum)
                edges[:, 0] = 0.0
                edges[:, 1:] = cum[:, :-1]
                q = t[m0:m1, None] if paired else np.broadcast_to(t, (m1 - m0, N))
                idx = np.clip(_rowwise_searchsorted(edges, q, "right") - 1, 0, n - 1)
                vals = np.take_along_axis(vals_sorted, idx, axis=1)
                if paired:
                    vals = vals[:, 0]
            if paired:
                out[b, m0:m1] = vals
            else:
                out[b, m0 * N : m1 * N] = vals.ravel()

        return run


def _work_units(bags: Bags, n_directions: int) -> Iterable[tuple[int, int, int]]:
    """(bag, first direction, end direction) blocks bounding the projection size.

    Large bags get several equal blocks of directions, which threads share.
    """
    for b, n in enumerate(bags.sizes):
        step = max(1, min(n_directions, _PROJECTION_BLOCK_ENTRIES // int(n)))
        n_blocks = -(-n_directions // step)
        step = -(-n_directions // n_blocks)
        for m0 in range(0, n_directions, step):
            yield b, m0, min(n_directions, m0 + step)
