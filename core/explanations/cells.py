"""Per-cell contributions for each representation, given the model's :class:`Head`.

Two kinds of answer, by what the model is in the bag's measure ``P = Σ_x w_x δ_x``:

* **exact** — the representation is linear in the measure (mean embeddings with exact,
  random-feature or Nyström maps; density features with ``divergence="l2"``) and the
  model is linear in the embedding (a linear kernel on a Euclidean embedding, a primal
  linear ridge). Then ``f(P) = b + Σ_x w_x ⟨φ(x), ∇f⟩``, and cell ``x`` contributes
  ``c_x = w_x ⟨φ(x), ∇f⟩``: ``b + Σ_x c_x`` *is* the prediction.
* **influence** — otherwise (a Gaussian kernel on ``SW``, ``MMD`` or a density
  divergence; the sliced-Wasserstein quantiles, which are not linear in the measure).
  Cell ``x`` contributes ``c_x = w_x IF(x)`` with ``IF(x) = d/dε f((1-ε)P + ε δ_x)`` at
  ``ε = 0``, the derivative of the model along the empirical measure towards the cell
  (the influence function; Hampel 1974). ``Σ_x c_x = 0`` up to the quantile grid, and
  removing a set ``S`` of cells moves the prediction by about
  ``-(n / (n - |S|)) Σ_{x∈S} c_x`` (first order in ``|S|/n``). A cell's ``c_x`` is the
  change of the prediction, to first order, if that cell's weight were taken from the
  rest of the sample: positive cells pull the answer up.

The sliced-Wasserstein quantile ``q_t`` of the projection ``u = ⟨θ, x⟩`` has influence
``(t - 1{u ≤ q_t}) / p(q_t)`` (the quantile's influence function); the density
``p(q_t)`` is estimated by the difference quotient of the bag's own quantile function,
``(Q(t+δ) - Q(t-δ)) / 2δ`` with ``δ = n^(-1/3)`` (Siddiqui 1960; Bloch and Gastwirth
1968; the ``n^(-1/3)`` rate of Hall and Sheather 1988), one-sided at the ends.

Everything is chunked so that no temporary exceeds a few MiB per ``10^5`` cells.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..bags import Bags, subsample_rows
from ..kernels import point_kernel
from ..representations.base import Embedding, FeatureEmbedding
from ..representations.density import DensityFeatures, binned_kde, cosine_basis
from ..representations.mean import MeanEmbedding, SetKernelEmbedding
from ..representations.sliced import SlicedWasserstein, _sorted_with_cumweights, _work_units
from .head import Head

__all__ = ["cell_contributions"]

# Temporaries of one chunk hold at most this many float64 entries (8 MiB).
_BLOCK = 1 << 20
# Bins of the grid on which cells are placed among a direction's quantiles: about 10^3
# of 10^5 cells share a bin with a quantile (and are searched) at 2^14.
_BINS = 1 << 14
# Grid weights of the cells kept from the density features' KDEs, at most (64 MiB):
# 10^5 cells in six pairs of markers take 38 MiB.
_BIN_BYTES = 1 << 26
# The gathers of the sliced-Wasserstein influence work on chunks of this many entries
# (2 MiB), which stay in the cache.
_PASS2_ENTRIES = 1 << 18

HeadAt = Callable[[Embedding], Head]


def _chunks(n: int, width: int) -> range:
    return range(0, n, max(1, _BLOCK // max(1, width)))


# --------------------------------------------------------------- linear in the measure
def _from_cell_values(
    values: Callable[[int, int], NDArray[np.float64]],
    n: int,
    width: int,
    w: NDArray[np.float64],
    head: Head,
) -> tuple[NDArray[np.float64], bool]:
    """Contributions from ``v_x = ⟨φ(x), ∇f⟩`` (``values(lo, hi)`` gives a chunk)."""
    v = np.empty((n, head.value.size))
    for lo in _chunks(n, width):
        hi = min(n, lo + max(1, _BLOCK // max(1, width)))
        v[lo:hi] = values(lo, hi)
    if head.linear:
        return w[:, None] * v, True
    mean = w @ v  # ⟨Φ(P), ∇f⟩: the embedding is the w-mean of the φ(x)
    return w[:, None] * (v - mean[None, :]), False


def _mean_features(
    rep: MeanEmbedding, bag: Bags, head_at: HeadAt
) -> tuple[NDArray[np.float64], bool, Head]:
    emb = rep.embed(bag)
    head = head_at(emb)
    pts = bag.points
    width = emb.features.shape[1]
    G = head.gradient
    assert G is not None

    def values(lo: int, hi: int) -> NDArray[np.float64]:
        return rep._point_features(pts[lo:hi]) @ G

    c, exact = _from_cell_values(values, pts.shape[0], width, bag.point_weights(), head)
    return c, exact, head


def _set_kernel(
    rep: MeanEmbedding, bag: Bags, head_at: HeadAt
) -> tuple[NDArray[np.float64], bool, Head]:
    """Exact mean embedding: the gradient ``h = Σ_i β_i μ_i + β_P μ_P`` at each cell."""
    emb = rep.embed(bag)
    assert isinstance(emb, SetKernelEmbedding)
    head = head_at(emb)
    train = head.train
    assert train is not None and head.train_coef is not None and head.self_coef is not None
    tb = train.bags
    tw = tb.point_weights()
    starts = tb.offsets[:-1]
    pts, w = bag.points, bag.point_weights()
    uses_self = bool(np.any(head.self_coef != 0))
    width = tb.n_points + (pts.shape[0] if uses_self else 0)

    def values(lo: int, hi: int) -> NDArray[np.float64]:
        K = point_kernel(pts[lo:hi], tb.points, rep.kernel, rep.bandwidth_)
        K *= tw[None, :]
        mu_train = np.add.reduceat(K, starts, axis=1)  # μ_i(x), (chunk, T)
        h = mu_train @ head.train_coef
        if uses_self:
            mu_self = point_kernel(pts[lo:hi], pts, rep.kernel, rep.bandwidth_) @ w
            h += mu_self[:, None] * head.self_coef[None, :]
        return h

    c, exact = _from_cell_values(values, pts.shape[0], width, w, head)
    return c, exact, head


# ----------------------------------------------------------------- sliced Wasserstein
def _quantile_index(
    cum: NDArray[np.float64] | None, n: int, levels: NDArray[np.float64]
) -> NDArray[np.int64]:
    """Index in the sorted projections of the quantile at ``levels`` (rows, L), by the
    embedding's rule (:class:`~core.SlicedWasserstein`)."""
    if cum is None:
        return np.minimum((levels * n).astype(np.int64), n - 1)
    edges = np.empty_like(cum)
    edges[:, 0] = 0.0
    edges[:, 1:] = cum[:, :-1]
    out = np.empty(levels.shape, dtype=np.int64)
    for r in range(cum.shape[0]):  # one searchsorted per direction (rows, not points)
        out[r] = np.searchsorted(edges[r], levels[r], side="right") - 1
    return np.clip(out, 0, n - 1)


def _count_below(u: NDArray[np.float64], q: NDArray[np.float64], out: NDArray[Any]) -> None:
    """``out[x] = #{ℓ: q_ℓ < u_x}`` for every cell, exactly; ``q`` sorted (a direction's
    quantiles), ``out`` of an unsigned type that holds ``q.size + 1``.

    ``np.searchsorted`` of 10^5 unsorted cells costs several sorts (a mispredicted
    branch per step); instead each value gets a bin on a fine uniform grid over
    ``[q_0, q_last]`` by a monotone map (a multiply-add, a clip, a truncation: each
    step is monotone in floating point), so ``bin(u) < bin(q_ℓ)`` implies ``u < q_ℓ``
    and ``bin(u) > bin(q_ℓ)`` implies ``u > q_ℓ``: a table per bin gives the count of
    every cell outside the few bins holding a quantile, and those few cells are
    searched exactly.
    """
    lo, hi = float(q[0]), float(q[-1])
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scale = _BINS / (hi - lo) if hi > lo else math.inf
        shift = 1.0 - lo * scale  # q_0 falls in bin 1; bins 0 and _BINS + 2 the rest
    if not (math.isfinite(scale) and math.isfinite(shift)):
        # One value, or a spread too small for a grid (subnormal): search them all.
        out[:] = np.searchsorted(q, u, side="left")
        return

    def bins(x: NDArray[np.float64]) -> NDArray[np.intp]:
        z = x * scale
        z += shift
        np.clip(z, 0.0, _BINS + 2.0, out=z)
        return z.astype(np.intp)

    bq = bins(q)  # sorted, as q is
    # table[b] = #{ℓ: bq_ℓ < b}: j on the bins (bq_{j-1}, bq_j].
    runs = np.diff(bq, prepend=-1, append=_BINS + 2)
    table = np.repeat(np.arange(q.size + 1, dtype=out.dtype), runs)
    tie = q.size + 1  # a bin holding a quantile: its cells are searched
    table[bq] = tie
    np.take(table, bins(u), out=out, mode="clip")  # in range: "clip" spares a buffer
    tied = np.flatnonzero(out == tie)
    out[tied] = np.searchsorted(q, u[tied], side="left")


def _sliced(
    rep: SlicedWasserstein, bag: Bags, head_at: HeadAt
) -> tuple[NDArray[np.float64], bool, Head]:
    theta = rep.directions_
    M, N_lev = theta.shape[0], rep.levels_.shape[0]
    paired = rep.paired
    pts = bag.points
    n = pts.shape[0]
    weights = bag.weights
    w = bag.point_weights()
    # Levels per direction: (M, L) with L = N (shared) or 1 (paired).
    t = rep.levels_[:, None] if paired else np.broadcast_to(rep.levels_, (M, N_lev))
    n_eff = n if weights is None else 1.0 / float(np.sum(w * w))
    delta = n_eff ** (-1.0 / 3.0)
    t_lo, t_hi = np.clip(t - delta, 0.0, 1.0), np.clip(t + delta, 0.0, 1.0)
    features = np.empty((1, rep.n_output_features_))
    q = np.empty(t.shape)
    inv_density = np.empty(t.shape)
    L = t.shape[1]
    # below[m, x]: how many of direction m's quantiles lie strictly below cell x, all a
    # cell's influence depends on (one byte per cell and direction for L < 255).
    below = np.empty((M, n), dtype=np.min_scalar_type(L + 1))
    # Pass 1: the embedding, block by block as SlicedWasserstein.transform computes it
    # (the same products, the same sorted values and the same quantile rule, so the
    # features are its features), the quantile function at t ± δ, and each cell's place
    # among the quantiles (_count_below: no argsort, which costs three sorts).
    for _, m0, m1 in _work_units(bag, M):
        proj = theta[m0:m1] @ pts.T
        if weights is None:
            s, cum = np.sort(proj, axis=1), None
        else:
            s, cum = _sorted_with_cumweights(proj, weights)
        rows = np.arange(m1 - m0)[:, None]
        q[m0:m1] = s[rows, _quantile_index(cum, n, np.ascontiguousarray(t[m0:m1]))]
        upper = s[rows, _quantile_index(cum, n, t_hi[m0:m1])]
        lower = s[rows, _quantile_index(cum, n, t_lo[m0:m1])]
        inv_density[m0:m1] = (upper - lower) / (t_hi[m0:m1] - t_lo[m0:m1])
        features[0, m0 * L : m1 * L] = q[m0:m1].ravel()
        for m in range(m0, m1):  # one direction at a time; vectorised over the cells
            _count_below(proj[m - m0], q[m], below[m])
    features *= float(rep.n_output_features_) ** (-1.0 / rep.p)
    head = head_at(FeatureEmbedding(features, "euclidean" if rep.p == 2 else "l1"))
    G = head.gradient
    assert G is not None
    k = G.shape[1]
    scale = float(rep.n_output_features_) ** (-1.0 / rep.p)
    # a[m, ℓ] = ∂f/∂q_{mℓ} / p(q_{mℓ}); IF_m(x) = Σ_ℓ a t_ℓ - Σ_{ℓ: q ≥ u} a.
    a = G.reshape(M, -1, k) * (scale * inv_density)[:, :, None]
    const = np.einsum("mlk,ml->k", a, t)
    # suffix[m, j] = Σ_{ℓ ≥ j} a[m, ℓ], with a zero row at j = L.
    suffix = np.zeros((M, a.shape[1] + 1, k))
    suffix[:, :-1] = np.cumsum(a[:, ::-1], axis=1)[:, ::-1]
    # Pass 2: IF(x) = const - Σ_m suffix[m, below[m, x]], by chunks of cells small
    # enough for the cache (a gather per direction and cell from the flat table).
    flat = suffix.reshape(-1, k)
    first = (np.arange(M) * (L + 1))[:, None]
    influence = np.empty((n, k))
    step = max(1, _PASS2_ENTRIES // (M * k))
    for lo in range(0, n, step):
        idx = below[:, lo : lo + step].astype(np.intp)
        idx += first
        influence[lo : lo + step] = const - np.take(flat, idx, axis=0).sum(axis=0)
    return w[:, None] * influence, False, head


# ----------------------------------------------------------------- density features
def _density(
    rep: DensityFeatures, bag: Bags, head_at: HeadAt
) -> tuple[NDArray[np.float64], bool, Head]:
    rows = subsample_rows(bag, rep.max_points, 0)  # the cells the features are made of
    # The bag subsample_bags makes of those rows, embedded as transform embeds it; the
    # KDEs of that embedding are the densities the influence is taken at.
    kept = Bags(
        bag.points[rows],
        np.array([0, rows.size]),
        None if bag.weights is None else bag.weights[rows],
        validate=False,
    )
    # The cells' grid weights of the binned KDEs are read again below (the smoothed
    # influence at each cell): kept when they fit _BIN_BYTES, computed twice otherwise.
    n_corners = sum(2 ** len(g) for g in rep.groups_)
    keep_bins = rep.divergence != "l2" and rows.size * n_corners * 16 <= _BIN_BYTES
    features, densities, cell_bins = rep.features_with_densities(kept, keep_bins=keep_bins)
    head = head_at(FeatureEmbedding(features, "euclidean"))
    G = head.gradient
    assert G is not None
    k = G.shape[1]
    pts = np.clip(rep._scale(kept.points), 0.0, 1.0)
    kept_w = kept.point_weights()
    n_groups = len(rep.groups_)
    values = np.zeros((rows.size, k))
    offset = 0
    h = rep.bandwidth_
    for gi, group in enumerate(rep.groups_):
        cols = list(group)
        width = rep._width(group)
        Gg = G[offset : offset + width] / math.sqrt(n_groups)
        offset += width
        if rep.divergence == "l2":
            for lo in _chunks(rows.size, width):
                hi = min(rows.size, lo + max(1, _BLOCK // width))
                values[lo:hi] += cosine_basis(pts[lo:hi, cols], int(rep.n_basis)) @ Gg
            continue
        u = rep.points_[gi]
        n_e = u.shape[0]
        phi = cosine_basis(u, int(rep.n_basis))  # (n_e, B)
        dens = densities[gi]
        assert dens is not None
        dens = dens[0]
        # The square-root derivative is unbounded where the estimate is 0: floor it.
        p = np.maximum(dens, 1e-3)
        if rep.divergence == "hellinger":
            gprime = -math.sqrt(0.5) / (2.0 * np.sqrt(p))  # d/dp of -√Z(√p - 1)
            psi = gprime[:, None] * (phi @ Gg) / n_e  # (n_e, k)
        else:
            lam = rep.lambdas_
            M = lam.size
            Bw = phi.shape[1]
            z = {"js": math.log(2.0) / 2.0, "tv": 0.5}[rep.divergence]
            c = (-0.5 + 1j * lam) / (0.5 + 1j * lam)
            # d/dp of √Z c_λ (p^{½+iλ} - 1), (n_e, M)
            dg = math.sqrt(z) * c[None, :] * (0.5 + 1j * lam[None, :])
            dg = dg * np.exp((-0.5 + 1j * lam[None, :]) * np.log(p)[:, None])
            half = M * Bw
            Gc = (Gg[:half] - 1j * Gg[half:]).reshape(M, Bw, k) / math.sqrt(M)
            proj = np.einsum("eb,mbk->emk", phi, Gc)  # (n_e, M, k)
            psi = np.real(np.einsum("em,emk->ek", dg, proj)) / n_e
        # IF(x) = Σ_u ψ(u) (K_h(u - x) - p(u)): a Gaussian smoothing of the signed
        # measure ψ on the integration points, read at the cells; binned as the
        # model's own KDE is where its grid allows (linear in the cells).
        base = dens @ psi
        nodes = rep._grid_nodes(len(cols))
        if nodes is not None:
            for c in range(k):
                smooth = binned_kde(
                    u, psi[:, c], np.array([0, n_e]), pts[:, cols], h, nodes, at_bins=cell_bins[gi]
                )
                values[:, c] += smooth[0] - base[c]
            continue
        norm = (2.0 * math.pi * h * h) ** (-len(cols) / 2.0)
        for lo in _chunks(rows.size, n_e):
            hi = min(rows.size, lo + max(1, _BLOCK // n_e))
            sq = ((pts[lo:hi, None, cols] - u[None, :, :]) ** 2).sum(axis=2)
            values[lo:hi] += norm * np.exp(-sq / (2.0 * h * h)) @ psi - base[None, :]
    contrib = np.zeros((bag.n_points, k))
    if rep.divergence == "l2":
        if head.linear:
            contrib[rows] = kept_w[:, None] * values
            return contrib, True, head
        values -= (kept_w @ values)[None, :]
    contrib[rows] = kept_w[:, None] * values
    return contrib, False, head


def cell_contributions(
    representation: Any, bag: Bags, head_at: HeadAt
) -> tuple[NDArray[np.float64], bool, Head]:
    """``(contributions (n, k), exact, head)`` for the one bag ``bag``.

    ``head_at`` gives the model's :class:`Head` at an embedding of the bag.
    """
    if isinstance(representation, SlicedWasserstein):
        return _sliced(representation, bag, head_at)
    if isinstance(representation, MeanEmbedding):
        if representation.method == "exact":
            return _set_kernel(representation, bag, head_at)
        return _mean_features(representation, bag, head_at)
    if isinstance(representation, DensityFeatures):
        return _density(representation, bag, head_at)
    raise TypeError(
        f"explanations are not available for {type(representation).__name__}; use "
        "SlicedWasserstein, MeanEmbedding or DensityFeatures"
    )
