"""The unit cube's tools for density features: the tensor cosine basis and Gaussian
KDEs binned on a grid.

:func:`cosine_basis` is the orthonormal basis ``φ_0 = 1, φ_k(x) = √2 cos(πkx)`` of
``L²([0,1])`` in tensor form; :func:`cosine_basis_inner` its products with a vector
without forming it. :func:`binned_kde` evaluates Gaussian KDEs by linear binning on a
grid, a separable convolution and multilinear interpolation (Wand 1994), linear in the
points; :func:`smoothed_at` reads one smoothed measure at many points.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "BLOCK_FLOATS",
    "LinearBins",
    "binned_kde",
    "cosine_basis",
    "cosine_basis_inner",
    "linear_bins",
    "smoothed_at",
]

#: Bound on the floats of one block of binned grids (bags x grid cells).
BLOCK_FLOATS = 1 << 22


def cosine_basis(u: NDArray[np.float64], n_basis: int) -> NDArray[np.float64]:
    """Tensor cosine basis at points ``u`` (n, k) in ``[0,1]^k``: shape (n, n_basis^k)."""
    k = np.arange(n_basis)
    one_d = np.where(k == 0, 1.0, math.sqrt(2.0)) * np.cos(np.pi * u[:, :, None] * k)  # (n, k, B)
    out = one_d[:, 0, :]
    for j in range(1, u.shape[1]):
        out = (out[:, :, None] * one_d[:, j, None, :]).reshape(u.shape[0], -1)
    return out


def cosine_basis_inner(
    u: NDArray[np.float64], n_basis: int, g: NDArray[np.float64]
) -> NDArray[np.float64]:
    """``cosine_basis(u, n_basis) @ g`` without the ``(n, n_basis^k)`` basis: the tensor
    basis is contracted one axis at a time, so the cost per point is ``n_basis^k``
    multiply-adds on one small product instead of forming and reading every basis
    function. ``g`` has shape (n_basis^k, c); the result (n, c), equal to the product
    to rounding."""
    n, k = u.shape
    c = g.shape[1]
    # cos(jπu) by the Chebyshev recurrence T_j = 2 cos(πu) T_{j-1} - T_{j-2}: one
    # cosine per point and axis instead of n_basis (error about j ulp).
    T = np.empty((n_basis, n, k))  # T[j] = cos(jπu), contiguous per j
    T[0] = 1.0
    if n_basis > 1:
        np.cos(np.pi * u, out=T[1])
        twice = 2.0 * T[1]
    for j in range(2, n_basis):
        np.multiply(twice, T[j - 1], out=T[j])
        T[j] -= T[j - 2]
    T[1:] *= math.sqrt(2.0)
    # Axis 0 by a product: (n, B) @ (B, B^(k-1) c); then each further axis by a
    # weighted sum over its B entries.
    acc = T[:, :, 0].T @ g.reshape(n_basis, -1)
    for j in range(1, k):
        acc = acc.reshape(n, n_basis, -1)
        acc = np.einsum("nbr,bn->nr", acc, T[:, :, j])
    return acc.reshape(n, c)


#: Per corner of the grid cell around each point, the node and its weight.
LinearBins = tuple[list[NDArray[np.int64]], list[NDArray[np.float64]]]


def linear_bins(x: NDArray[np.float64], n_nodes: int) -> LinearBins:
    """Cells and weights of the ``2^k`` grid nodes around each point of ``x`` (n, k) in [0,1]^k.

    The nodes are ``j / (n_nodes - 1)``; the weights are the multilinear (tensor hat)
    weights, so they sum to one per point.
    """
    pos = x * (n_nodes - 1)
    lo = np.minimum(np.floor(pos).astype(np.int64), n_nodes - 2)
    frac = pos - lo
    k = x.shape[1]
    cells, weights = [], []
    for corner in itertools.product((0, 1), repeat=k):
        c = np.asarray(corner)
        idx = lo + c
        cells.append(np.ravel_multi_index(idx.T, (n_nodes,) * k))
        weights.append(np.prod(np.where(c == 1, frac, 1.0 - frac), axis=1))
    return cells, weights


def _smoothing(n_nodes: int, bandwidth: float) -> NDArray[np.float64]:
    """The one-dimensional Gaussian kernel between the grid's nodes (it factorises)."""
    nodes = np.linspace(0.0, 1.0, n_nodes)
    smooth = np.exp(-((nodes[:, None] - nodes[None, :]) ** 2) / (2.0 * bandwidth**2))
    smooth *= (2.0 * math.pi * bandwidth**2) ** -0.5
    return smooth


def _smoothed_grids(
    cells: list[NDArray[np.int64]],
    cw: list[NDArray[np.float64]],
    weights: NDArray[np.float64],
    rows: NDArray[np.int64],
    n_grids: int,
    n_nodes: int,
    k: int,
    smooth: NDArray[np.float64],
) -> NDArray[np.float64]:
    """Linear binning of weighted points into ``n_grids`` grids (``rows``: each point's
    grid times the cells per grid), then the separable Gaussian smoothing;
    shape (n_grids, n_nodes^k)."""
    n_cells = n_nodes**k
    grid = np.zeros(n_grids * n_cells)
    for c, w in zip(cells, cw, strict=True):
        grid += np.bincount(rows + c, weights=weights * w, minlength=grid.size)
    grid = grid.reshape((n_grids,) + (n_nodes,) * k)
    # The Gaussian factorises over axes: one matrix product per axis.
    for axis in range(1, k + 1):
        grid = np.moveaxis(np.tensordot(grid, smooth, axes=([axis], [0])), -1, axis)
    return grid.reshape(n_grids, n_cells)


def binned_kde(
    points: NDArray[np.float64],
    weights: NDArray[np.float64],
    offsets: NDArray[np.int64],
    at: NDArray[np.float64],
    bandwidth: float,
    n_nodes: int,
) -> NDArray[np.float64]:
    """Gaussian KDEs of several bags at the points ``at``, by linear binning (Wand 1994).

    Parameters
    ----------
    points : ndarray of shape (n, k)
        Stacked points of the bags, in ``[0, 1]^k``.
    weights : ndarray of shape (n,)
        Per-point weights, summing to one within each bag.
    offsets : ndarray of shape (B + 1,)
    at : ndarray of shape (m, k)
        Evaluation points in ``[0, 1]^k``.
    bandwidth : float
    n_nodes : int
        Grid nodes per axis (spacing ``1 / (n_nodes - 1)``).

    Returns
    -------
    ndarray of shape (B, m)
    """
    k = points.shape[1]
    B = offsets.size - 1
    n_cells = n_nodes**k
    smooth = _smoothing(n_nodes, bandwidth)
    at_cells, at_weights = linear_bins(at, n_nodes)
    bag_of_point = np.repeat(np.arange(B), np.diff(offsets))
    out = np.empty((B, at.shape[0]))
    step = max(1, BLOCK_FLOATS // n_cells)
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        lo, hi = int(offsets[b0]), int(offsets[b1])
        cells, cw = linear_bins(points[lo:hi], n_nodes)
        rows = (bag_of_point[lo:hi] - b0) * n_cells
        flat = _smoothed_grids(cells, cw, weights[lo:hi], rows, b1 - b0, n_nodes, k, smooth)
        out[b0:b1] = sum(flat[:, c] * w for c, w in zip(at_cells, at_weights, strict=True))
    return out


def smoothed_at(
    points: NDArray[np.float64],
    weights: NDArray[np.float64],
    at: NDArray[np.float64],
    bandwidth: float,
    n_nodes: int,
) -> NDArray[np.float64]:
    """``Σ_i weights_i K_h(at - points_i)`` at many points ``at`` (m, k), for one set of
    ``points`` (n, k) (signed weights allowed), binned as :func:`binned_kde` is.

    For ``m`` much larger than ``n`` (a smoothed measure on a few integration points
    read at every cell of a sample): the grid is read at ``at`` by multilinear
    interpolation a chunk of points at a time, so that nothing of size ``m`` but the
    result is formed (:func:`linear_bins` would keep ``2^k`` index and weight arrays).
    """
    k = points.shape[1]
    smooth = _smoothing(n_nodes, bandwidth)
    cells, cw = linear_bins(points, n_nodes)
    rows = np.zeros(points.shape[0], dtype=np.int64)
    flat = _smoothed_grids(cells, cw, weights, rows, 1, n_nodes, k, smooth)[0]
    corners = list(itertools.product((0, 1), repeat=k))
    # Offset of each corner from the cell's first node in the flat grid.
    shifts = [sum(c[j] * n_nodes ** (k - 1 - j) for j in range(k)) for c in corners]
    m = at.shape[0]
    out = np.empty(m)
    step = 1 << 14  # the chunk's temporaries stay in the cache
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        pos = at[lo:hi] * (n_nodes - 1)
        # As linear_bins places the points: first node and fraction, per axis.
        base = np.minimum(np.floor(pos), n_nodes - 2.0)
        frac = pos - base
        rest = 1.0 - frac
        # The first node's flat index, in floating point (exact: small integers).
        first_f = base[:, 0].copy()
        for j in range(1, k):
            first_f *= n_nodes
            first_f += base[:, j]
        first = first_f.astype(np.intp)
        acc = out[lo:hi]
        acc[:] = 0.0
        for c, shift in zip(corners, shifts, strict=True):
            w = np.take(flat, first + shift)
            for j in range(k):
                w *= frac[:, j] if c[j] else rest[:, j]
            acc += w
    return out
