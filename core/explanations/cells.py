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

Cost: each explanation forms each cell's features (or kernel block, or projections
and sort) once, as the prediction does; where the gradient is known only after the
embedding, a second pass evaluates the cells against it without forming the features
again (a cosine per random frequency, a kernel row per Nyström landmark, a table
lookup per direction). Temporaries are chunked to a few MiB per ``10^5`` cells, but
for the exact mean embedding's per-cell sums (at most :data:`_POINT_SUMS_BYTES`).
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
from ..representations.density import DensityFeatures
from ..representations.grids import cosine_basis_inner, smoothed_at
from ..representations.mean import MeanEmbedding, SetKernelEmbedding
from ..representations.sliced import SlicedWasserstein, _sorted_with_cumweights, _work_units
from .head import Head

__all__ = ["cell_contributions"]

# Temporaries of one chunk hold at most this many float64 entries (8 MiB).
_BLOCK = 1 << 20
# The exact mean embedding's per-cell sums (n cells x T training bags) kept from the
# prediction's own products up to this size (64 MiB: 10^5 cells and 80 bags).
_POINT_SUMS_BYTES = 1 << 26
# Bins of the grid on which cells are placed among a direction's quantiles: about 10^3
# of 10^5 cells share a bin with a quantile (and are searched) at 2^14.
_BINS = 1 << 14

HeadAt = Callable[[Embedding], Head]


def _chunks(n: int, width: int) -> range:
    return range(0, n, max(1, _BLOCK // max(1, width)))


# --------------------------------------------------------------- linear in the measure
def _centred(
    v: NDArray[np.float64], w: NDArray[np.float64], head: Head
) -> tuple[NDArray[np.float64], bool]:
    """Contributions from the cells' values ``v_x = ⟨φ(x), ∇f⟩``: ``w_x v_x`` when the
    head is linear (exact), ``w_x (v_x - ⟨Φ(P), ∇f⟩)`` otherwise (the influence)."""
    if head.linear:
        return w[:, None] * v, True
    mean = w @ v  # ⟨Φ(P), ∇f⟩: the embedding is the w-mean of the φ(x)
    return w[:, None] * (v - mean[None, :]), False


def _mean_features(
    rep: MeanEmbedding, bag: Bags, head_at: HeadAt
) -> tuple[NDArray[np.float64], bool, Head]:
    """Random-feature and Nyström mean embeddings.

    A head linear in the embedding has the same gradient everywhere: taken at the
    origin before the embedding is computed, it turns each chunk of point features
    into the cells' values as the embedding is summed (one pass over the cells).
    Otherwise the gradient is known only once the embedding is, and the second pass
    evaluates ``⟨φ(x), ∇f⟩`` without forming ``φ(x)`` (:meth:`MeanEmbedding.feature_inner`).
    """
    pts, w = bag.points, bag.point_weights()
    probe = head_at(FeatureEmbedding(np.zeros((1, rep.n_output_features_)), "euclidean"))
    if probe.linear:
        G = probe.gradient
        assert G is not None
        v = np.empty((pts.shape[0], G.shape[1]))

        def visit(c0: int, c1: int, z: NDArray[np.float64]) -> None:
            v[c0:c1] = z @ G

        emb = FeatureEmbedding(rep._mean_features(bag, visit), "euclidean")
        head = head_at(emb)
        return w[:, None] * v, True, head
    emb = rep.embed(bag)
    head = head_at(emb)
    assert head.gradient is not None
    c, exact = _centred(rep.feature_inner(pts, head.gradient), w, head)
    return c, exact, head


def _set_kernel(
    rep: MeanEmbedding, bag: Bags, head_at: HeadAt
) -> tuple[NDArray[np.float64], bool, Head]:
    """Exact mean embedding: the gradient ``h = Σ_i β_i μ_i + β_P μ_P`` at each cell.

    The prediction's own set-kernel sums give ``μ_P(x)`` and ``μ_i(x)`` at every cell
    (:meth:`SetKernelEmbedding.keep_point_sums`), the latter for as many training bags
    as :data:`_POINT_SUMS_BYTES` holds; a second pass computes the others' by chunks.
    """
    emb = rep.embed(bag)
    assert isinstance(emb, SetKernelEmbedding)
    emb.keep_point_sums(_POINT_SUMS_BYTES)
    head = head_at(emb)
    train = head.train
    assert train is not None and head.train_coef is not None and head.self_coef is not None
    assert emb.point_sums is not None
    pts, w = bag.points, bag.point_weights()
    uses_self = bool(np.any(head.self_coef != 0))
    kept_train = emb.point_sums.get("other", np.zeros((pts.shape[0], 0)))
    kept_self = emb.point_sums.get("self")
    kept = kept_train.shape[1]
    v = kept_train @ head.train_coef[:kept]
    if uses_self and kept_self is None:  # not summed by this prediction: summed here
        kept_self = np.empty(pts.shape[0])
        for lo in _chunks(pts.shape[0], pts.shape[0]):
            hi = min(pts.shape[0], lo + max(1, _BLOCK // pts.shape[0]))
            kept_self[lo:hi] = point_kernel(pts[lo:hi], pts, rep.kernel, rep.bandwidth_) @ w
    if uses_self:
        assert kept_self is not None
        v += kept_self[:, None] * head.self_coef[None, :]
    if kept < len(train):
        # The training bags beyond the budget, by chunks of cells.
        tb = train.bags
        first = int(tb.offsets[kept])
        rest_points = tb.points[first:]
        rest_w = tb.point_weights()[first:]
        starts = tb.offsets[kept:-1] - first
        coef = head.train_coef[kept:]
        for lo in _chunks(pts.shape[0], rest_points.shape[0]):
            hi = min(pts.shape[0], lo + max(1, _BLOCK // max(1, rest_points.shape[0])))
            K = point_kernel(pts[lo:hi], rest_points, rep.kernel, rep.bandwidth_)
            K *= rest_w[None, :]
            v[lo:hi] += np.add.reduceat(K, starts, axis=1) @ coef  # Σ_i β_i μ_i(x)
    c, exact = _centred(v, w, head)
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


def _step_lookup(
    u: NDArray[np.float64],
    q: NDArray[np.float64],
    values: NDArray[np.float64],
    out: NDArray[np.float64],
    scratch: tuple[NDArray[np.float64], NDArray[np.intp]],
    span: tuple[float, float] | None = None,
) -> None:
    """``out[c, x] = values[#{ℓ: q_ℓ < u_x}, c]`` for every cell, exactly: step functions
    of the cell's projection with a step at each of a direction's quantiles ``q``
    (sorted); ``values`` (L + 1, k), ``out`` (k, n); ``scratch`` a float and an index
    buffer of n; ``span`` the smallest and largest ``u``, if known.

    ``np.searchsorted`` of 10^5 unsorted cells costs several sorts (a mispredicted
    branch per step); instead each value gets a bin on a fine uniform grid over
    ``[q_0, q_last]`` by a monotone map (a multiply-add, a truncation, a clip: each
    step is monotone in floating point), so ``bin(u) < bin(q_ℓ)`` implies ``u < q_ℓ``
    and ``bin(u) > bin(q_ℓ)`` implies ``u > q_ℓ``: a table per bin gives the value of
    every cell outside the few bins holding a quantile (marked NaN in the table), and
    those few cells are searched exactly.
    """
    # Python floats: an overflow gives inf, and the checks below catch it.
    lo, hi = float(q[0]), float(q[-1])
    scale = _BINS / (hi - lo) if hi > lo else math.inf
    shift = 1.0 - lo * scale  # q_0 falls in bin 1; bins 0 and _BINS + 2 the rest
    if not (math.isfinite(scale) and math.isfinite(shift)):
        # One value, or a spread too small for a grid (subnormal): search them all.
        out[:] = values[np.searchsorted(q, u, side="left")].T
        return
    z, idx = scratch
    # The truncation to an index is exact and monotone for |z| < 2^62; the take's
    # "clip" mode then puts z < 0 in bin 0 and z > _BINS + 2 in the last. Beyond that
    # (a cell 10^14 quantile ranges out), z is clipped first.
    clip = span is None or not all(abs(float(v) * scale + shift) < 2.0**62 for v in span)
    np.multiply(u, scale, out=z)
    z += shift
    if clip:
        np.clip(z, 0.0, _BINS + 2.0, out=z)
    np.copyto(idx, z, casting="unsafe")  # truncation, as astype
    # The same map for the quantiles: the cells' index is in effect trunc(z) clamped
    # to [0, _BINS + 2] (by the clip, or by the take), so is theirs; sorted, as q is.
    bq = np.clip((q * scale + shift).astype(np.intp), 0, _BINS + 2)
    # table[b] = values[#{ℓ: bq_ℓ < b}]: row j on the bins (bq_{j-1}, bq_j].
    runs = np.diff(bq, prepend=-1, append=_BINS + 2)
    tied = np.empty(0, dtype=np.intp)
    for c in range(values.shape[1]):
        table = np.repeat(values[:, c], runs)
        table[bq] = np.nan  # a bin holding a quantile: its cells are searched
        np.take(table, idx, out=out[c], mode="clip")
        if c == 0:
            tied = np.flatnonzero(np.isnan(out[0]))
            below = np.searchsorted(q, u[tied], side="left")
        out[c, tied] = values[below, c]


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
    span = np.empty((M, 2))  # each direction's smallest and largest projection
    L = t.shape[1]
    # Pass 1: the embedding, block by block as SlicedWasserstein.transform computes it
    # (the same products, sorted in place, the same quantile rule, so the features are
    # its features), and the quantile function at t ± δ.
    for _, m0, m1 in _work_units(bag, M):
        proj = theta[m0:m1] @ pts.T
        if weights is None:
            proj.sort(axis=1)
            s, cum = proj, None
        else:
            s, cum = _sorted_with_cumweights(proj, weights)
        rows = np.arange(m1 - m0)[:, None]
        q[m0:m1] = s[rows, _quantile_index(cum, n, np.ascontiguousarray(t[m0:m1]))]
        upper = s[rows, _quantile_index(cum, n, t_hi[m0:m1])]
        lower = s[rows, _quantile_index(cum, n, t_lo[m0:m1])]
        inv_density[m0:m1] = (upper - lower) / (t_hi[m0:m1] - t_lo[m0:m1])
        span[m0:m1] = s[:, [0, -1]]
        features[0, m0 * L : m1 * L] = q[m0:m1].ravel()
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
    # Pass 2: IF(x) = const - Σ_m suffix[m, #{ℓ: q_mℓ < u_mx}], the projections made
    # again by the same products (so equal to those the quantiles were taken from),
    # each direction's step function read at its cells from a table.
    influence = np.empty((k, n))  # by output: each row contiguous
    influence[:] = const[:, None]
    step = np.empty((k, n))
    scratch = (np.empty(n), np.empty(n, dtype=np.intp))
    for _, m0, m1 in _work_units(bag, M):
        proj = theta[m0:m1] @ pts.T
        for m in range(m0, m1):  # one direction at a time; vectorised over the cells
            _step_lookup(proj[m - m0], q[m], suffix[m], step, scratch, span[m])
            influence -= step
    influence *= w[None, :]
    return influence.T.copy(), False, head


# ----------------------------------------------------------------- density features
def _density(
    rep: DensityFeatures, bag: Bags, head_at: HeadAt
) -> tuple[NDArray[np.float64], bool, Head]:
    whole = rep.max_points is None or bag.n_points <= rep.max_points
    # The cells the features are made of, as subsample_bags keeps them (the bag itself
    # when it is not subsampled: no copy); the KDEs of their embedding are the densities
    # the influence is taken at.
    rows = None if whole else subsample_rows(bag, rep.max_points, 0)
    kept = (
        bag
        if rows is None
        else Bags(
            bag.points[rows],
            np.array([0, rows.size]),
            None if bag.weights is None else bag.weights[rows],
            validate=False,
        )
    )
    n_kept = kept.n_points
    features, densities, scaled = rep.features_with_densities(kept)
    head = head_at(FeatureEmbedding(features, "euclidean"))
    G = head.gradient
    assert G is not None
    k = G.shape[1]
    kept_w = kept.point_weights()
    n_groups = len(rep.groups_)
    values = np.zeros((n_kept, k))
    offset = 0
    h = rep.bandwidth_
    for gi, group in enumerate(rep.groups_):
        cols = list(group)
        width = rep._width(group)
        Gg = G[offset : offset + width] / math.sqrt(n_groups)
        offset += width
        if rep.divergence == "l2":
            step = max(1, _BLOCK // max(1, width * k // int(rep.n_basis)))
            for lo in range(0, n_kept, step):
                hi = min(n_kept, lo + step)
                values[lo:hi] += cosine_basis_inner(scaled[lo:hi, cols], int(rep.n_basis), Gg)
            continue
        u = rep.points_[gi]
        n_e = u.shape[0]
        n_basis = int(rep.n_basis)
        dens = densities[gi]
        assert dens is not None
        dens = dens[0]
        # The square-root derivative is unbounded where the estimate is 0: floor it.
        p = np.maximum(dens, 1e-3)
        if rep.divergence == "hellinger":
            gprime = -math.sqrt(0.5) / (2.0 * np.sqrt(p))  # d/dp of -√Z(√p - 1)
            psi = gprime[:, None] * cosine_basis_inner(u, n_basis, Gg) / n_e  # (n_e, k)
        else:
            lam = rep.lambdas_
            M = lam.size
            Bw = n_basis ** len(cols)
            z = {"js": math.log(2.0) / 2.0, "tv": 0.5}[rep.divergence]
            c = (-0.5 + 1j * lam) / (0.5 + 1j * lam)
            # d/dp of √Z c_λ (p^{½+iλ} - 1), (n_e, M)
            dg = math.sqrt(z) * c[None, :] * (0.5 + 1j * lam[None, :])
            dg = dg * np.exp((-0.5 + 1j * lam[None, :]) * np.log(p)[:, None])
            half = M * Bw
            Gc = (Gg[:half] - 1j * Gg[half:]).reshape(M, Bw, k) / math.sqrt(M)
            # Σ_b φ_b(u) Gc[m, b, k] for every (m, k), (n_e, M, k)
            proj = cosine_basis_inner(u, n_basis, Gc.transpose(1, 0, 2).reshape(Bw, M * k))
            proj = proj.reshape(n_e, M, k)
            psi = np.real(np.einsum("em,emk->ek", dg, proj)) / n_e
        # IF(x) = Σ_u ψ(u) (K_h(u - x) - p(u)): a Gaussian smoothing of the signed
        # measure ψ on the integration points, read at the cells; binned as the
        # model's own KDE is where its grid allows (linear in the cells).
        base = dens @ psi
        nodes = rep._grid_nodes(len(cols))
        if nodes is not None:
            at = scaled[:, cols]
            for c in range(k):
                smooth = smoothed_at(u, psi[:, c], at, h, nodes)
                smooth -= base[c]
                values[:, c] += smooth
            continue
        norm = (2.0 * math.pi * h * h) ** (-len(cols) / 2.0)
        for lo in _chunks(n_kept, n_e):
            hi = min(n_kept, lo + max(1, _BLOCK // n_e))
            sq = ((scaled[lo:hi, None, cols] - u[None, :, :]) ** 2).sum(axis=2)
            values[lo:hi] += norm * np.exp(-sq / (2.0 * h * h)) @ psi - base[None, :]
    exact = rep.divergence == "l2" and head.linear
    if rep.divergence == "l2" and not exact:
        values -= (kept_w @ values)[None, :]  # ⟨Φ(P), ∇f⟩: the w-mean of the cells'
    values *= kept_w[:, None]
    if rows is None:
        return values, exact, head
    contrib = np.zeros((bag.n_points, k))
    contrib[rows] = values
    return contrib, exact, head


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
