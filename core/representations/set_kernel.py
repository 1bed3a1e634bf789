"""The set kernel between bags, by blocks of points: ``⟨μ_a, μ_b⟩ = Σ_i Σ_j c_i c'_j
k(x_i, x'_j)`` for all bag pairs (paper 003 §2, steps 1-2), without the point Gram of
all points in memory (:func:`set_kernel_gram`). The exact mean embedding
(:mod:`.mean`) is built on it.
"""

from __future__ import annotations

import itertools
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.spatial.distance import cdist

from ..bags import Bags
from ..blas import one_thread
from .base import n_threads_for as _n_threads

__all__ = ["set_kernel_gram"]

# Point-kernel blocks of the exact Gram hold at most this many float64 entries (2 MiB,
# 256 x 1024 points): a block is written by the GEMM, then read and written by the exp,
# then read by the reduction, and at this size those passes stay in the caches. On this
# 2-core machine 256 x 1024 blocks were as fast as 1024 x 1024 ones or up to 15 % faster
# in the same runs, the more so under load.
_GRAM_BLOCK_ENTRIES = 1 << 18


def _chunk_bounds(n_points: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(n_points, lo + chunk)) for lo in range(0, n_points, chunk)]


def _segments_in(
    offsets: NDArray[np.int64], lo: int, hi: int
) -> tuple[int, int, NDArray[np.int64]]:
    """Bags overlapping points ``[lo, hi)``: first bag, end bag, local segment starts."""
    b0 = int(np.searchsorted(offsets, lo, side="right") - 1)
    b1 = int(np.searchsorted(offsets, hi, side="left"))
    starts = np.maximum(offsets[b0:b1], lo) - lo
    return b0, b1, starts


def _column_sums(
    K: NDArray[np.float64],
    starts: NDArray[np.int64],
    w: NDArray[np.float64],
    inv_sizes: NDArray[np.float64],
    weighted: bool,
) -> NDArray[np.float64]:
    """``Σ_x w_x K[x, y]`` over the rows ``x`` of each bag (rows from ``starts``), per
    column ``y``: (columns, bags), the weights ``w`` or ``1 / size`` (``inv_sizes``)."""
    if starts.size == 1:
        # The rows of one bag (an explained sample's own): a matrix-vector product; a
        # reduction down the columns takes ten times as long on a 512 x 512 block.
        row_w = w if weighted else np.full(K.shape[0], inv_sizes[0])
        return (row_w @ K)[:, None]
    if weighted:
        return np.add.reduceat(K * w[:, None], starts, axis=0).T
    return np.add.reduceat(K, starts, axis=0).T * inv_sizes


def _fits(point_sums: NDArray[np.float64], A: Bags, B: Bags) -> bool:
    return (
        point_sums.ndim == 2
        and point_sums.shape[0] == A.n_points
        and (point_sums.shape[1] <= len(B))
    )


def _add_kept(
    point_sums: NDArray[np.float64], r0: int, r1: int, b0: int, sums: NDArray[np.float64]
) -> None:
    """Add ``sums`` (rows ``r0:r1``, bags from ``b0``) into ``point_sums``, for the
    bags it keeps (its first ``point_sums.shape[1]``)."""
    top = min(b0 + sums.shape[1], point_sums.shape[1])
    if b0 < top:
        point_sums[r0:r1, b0:top] += sums[:, : top - b0]


def _kernel_factors(
    A: Bags, B: Bags, kernel: str, bandwidth: float
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Row factors whose products are log-kernel values (Gaussian) or the raw points.

    For the Gaussian kernel, ``[x/σ², -‖x‖²/(2σ²), 1] · [y, 1, -‖y‖²/(2σ²)]`` equals
    ``-‖x - y‖²/(2σ²)``, so one GEMM gives the exponent of a whole block with no extra
    passes over it. Both sides are shifted by the mean of ``A`` (the kernel is
    translation invariant) to keep the cancellation in that sum small.
    """
    center = A.points.mean(axis=0)
    pa, pb = A.points - center, B.points - center
    if kernel != "gaussian":
        return pa, pb
    s2 = bandwidth**2
    na = np.einsum("ij,ij->i", pa, pa) / (2 * s2)
    nb = np.einsum("ij,ij->i", pb, pb) / (2 * s2)
    left = np.hstack([pa / s2, -na[:, None], np.ones((pa.shape[0], 1))])
    right = np.hstack([pb, np.ones((pb.shape[0], 1)), -nb[:, None]])
    return left, right


def _power_steps(ratios: NDArray[np.float64]) -> list[int | None]:
    """How to get each ``E^{r_k}`` from the previous one: squarings, or ``None`` (an exp).

    With a geometric bandwidth grid of ratio ``√2^j`` (Gaussian) the kernel for the next
    bandwidth is the previous one squared ``j`` times, a multiplication instead of an
    ``exp`` per entry.
    """
    steps: list[int | None] = [None]
    for prev, cur in itertools.pairwise(ratios):
        j = float(np.log2(cur / prev))
        n = round(j)
        steps.append(n if abs(j - n) < 1e-9 and 0 <= n <= 8 else None)
    return steps


def _gram_chunks(
    n_rows: int, n_cols: int, block_entries: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """Row and column chunks of the point blocks, and the column chunk's length.

    Short row chunks, column chunks a whole multiple of them (4x where the budget
    allows): every column boundary is then a row boundary, which the symmetric case
    needs to count each point pair exactly once (directly, or as a mirrored block).
    """
    rchunk = max(1, math.isqrt(block_entries) // 2)
    chunk = rchunk * max(1, min(4, block_entries // rchunk**2))
    return _chunk_bounds(n_rows, rchunk), _chunk_bounds(n_cols, chunk), chunk


def set_kernel_gram(
    A: Bags,
    B: Bags | None,
    kernel: str,
    bandwidth: float | ArrayLike,
    *,
    block_entries: int = _GRAM_BLOCK_ENTRIES,
    n_jobs: int | None = None,
    point_sums: NDArray[np.float64] | None = None,
) -> NDArray[np.float64]:
    """Set-kernel Gram ``⟨μ_a, μ_b⟩`` between all bags of ``A`` and ``B``, by blocks.

    Points of both sides are cut into chunks (independently of bag boundaries) so a
    block of the point kernel has at most ``block_entries`` entries (small enough to
    stay in cache). A Gaussian block is one GEMM of factors that carry the points'
    squared norms, computed once per call (:func:`_kernel_factors`), then one ``exp``;
    each block is weighted and reduced to bag pairs with segment sums, and partial bags
    at chunk edges accumulate into the same cells. With ``B=None`` only chunk pairs on
    or above the diagonal are computed and mirrored. ``n_jobs`` threads share the row
    chunks (numpy's ``exp`` and the reductions release the GIL); BLAS is held to one
    thread throughout (:func:`~bagserve.core.blas.one_thread`).

    Several bandwidths cost one pass over the points: each block's distances are
    computed once, and on a geometric grid of ratio ``2^(j/2)`` (Gaussian) or
    ``2^j`` (Laplace) each further kernel is the previous one squared ``j`` times.

    Parameters
    ----------
    A, B : Bags
        ``B=None`` means ``B = A`` (symmetric Gram).
    kernel : {"gaussian", "laplace"}
    bandwidth : float or array-like of float
        ``σ``; a sequence gives one Gram per bandwidth.
    point_sums : ndarray of shape (A.n_points, m), optional
        One bandwidth only: ``μ_b(x) = Σ_{y∈b} w_y k(x, y)`` of the first ``m <= len(B)``
        bags ``b`` of ``B`` at every point ``x`` of ``A`` is added into it, by-products of
        the blocks (an explanation's per-cell values without a second pass over the
        points; ``m < len(B)`` where all of them would not fit its memory).

    Returns
    -------
    ndarray of shape (len(A), len(B)), or (n_bandwidths, len(A), len(B))
    """
    sym = B is None
    B = A if sym else B
    sigmas = np.atleast_1d(np.asarray(bandwidth, dtype=np.float64))
    if point_sums is not None and (sigmas.size != 1 or not _fits(point_sums, A, B)):
        raise ValueError("point_sums takes one bandwidth and shape (A.n_points, m <= len(B))")
    order = np.argsort(-sigmas)  # widest first: smallest exponents, then powers of them
    q = 2.0 if kernel == "gaussian" else 1.0
    ratios = (sigmas[order[0]] / sigmas[order]) ** q
    steps = _power_steps(ratios)
    left, right = _kernel_factors(A, B, kernel, float(sigmas[order[0]]))
    wa, wb = A.point_weights(), B.point_weights()
    inv_a, inv_b = 1.0 / A.sizes, 1.0 / B.sizes
    rows, cols, chunk = _gram_chunks(A.n_points, B.n_points, block_entries)
    # Each column chunk's bags, found once rather than once per row chunk.
    col_segments = [_segments_in(B.offsets, c0, c1) for c0, c1 in cols]
    G = np.zeros((sigmas.size, len(A), len(B)))
    lock = threading.Lock()

    def log_block(r0: int, r1: int, c0: int, c1: int, out: NDArray[np.float64]) -> None:
        if kernel == "gaussian":
            np.matmul(left[r0:r1], right[c0:c1].T, out=out)
        else:
            out[...] = cdist(left[r0:r1], right[c0:c1], metric="cityblock")
            out *= -1.0 / sigmas[order[0]]

    def row_task(bounds: tuple[int, int]) -> None:
        r0, r1 = bounds
        ra0, ra1, rstarts = _segments_in(A.offsets, r0, r1)
        # Buffers reused for every block of this row chunk (no allocation per block).
        n_buf = (r1 - r0) * chunk
        buf_l = np.empty(n_buf)
        buf_k = np.empty(n_buf) if sigmas.size > 1 else buf_l
        buf_w = np.empty(n_buf) if B.is_weighted else None
        for (c0, c1), (cb0, cb1, cstarts) in zip(cols, col_segments, strict=True):
            if sym and c1 <= r0:
                continue  # below the diagonal: the mirror of a block computed elsewhere
            shape = (r1 - r0, c1 - c0)
            size = shape[0] * shape[1]
            L = buf_l[:size].reshape(shape)
            K = buf_k[:size].reshape(shape)
            log_block(r0, r1, c0, c1, L)
            for k, (ratio, step) in enumerate(zip(ratios, steps, strict=True)):
                if step is None:
                    if ratio != 1.0:
                        np.multiply(L, ratio, out=K)
                        np.exp(K, out=K)
                    else:
                        np.exp(L, out=K)
                else:
                    for _ in range(step):
                        np.multiply(K, K, out=K)
                if buf_w is not None:
                    scratch = buf_w[:size].reshape(shape)
                    np.multiply(K, wb[c0:c1], out=scratch)
                    S = np.add.reduceat(scratch, cstarts, axis=1)
                else:
                    # Uniform weights are constant within a bag: scale sums, not the block.
                    S = np.add.reduceat(K, cstarts, axis=1)
                    S *= inv_b[cb0:cb1]
                if point_sums is not None:
                    # μ_b(x) for these rows; a mirrored block gives its columns' too.
                    mirror = None
                    if sym and c0 >= r1:
                        mirror = _column_sums(K, rstarts, wa[r0:r1], inv_a[ra0:ra1], A.is_weighted)
                    with lock:
                        _add_kept(point_sums, r0, r1, cb0, S)
                        if mirror is not None:
                            _add_kept(point_sums, c0, c1, ra0, mirror)
                S *= wa[r0:r1, None]
                part = np.add.reduceat(S, rstarts, axis=0)
                with lock:
                    G[order[k], ra0:ra1, cb0:cb1] += part
                    if sym and c0 >= r1:
                        G[order[k], cb0:cb1, ra0:ra1] += part.T

    n_threads = min(_n_threads(n_jobs), len(rows))
    with one_thread("blas"):
        if n_threads == 1:
            for r in rows:
                row_task(r)
        else:
            with ThreadPoolExecutor(n_threads) as pool:
                list(pool.map(row_task, rows))
    if sym:
        G = 0.5 * (G + G.transpose(0, 2, 1))
    return G if np.ndim(bandwidth) else G[0]
