"""The MMD calibration of the design before issue 44 (``calibration_ == "mmd"``).

A per-marker monotone piecewise-linear map through knots at the sample's own quantiles,
followed by an affine map of all markers, fitted by gradient steps (Adam) on the
maximum mean discrepancy between the mapped sample and reference cells kept at fit
(the calibration idea of DeepCyTOF, Li et al., *Bioinformatics* 33, 2017, without a
network: MMD with a sum of Gaussian kernels, Gretton et al., *JMLR* 13, 2012, eq. 3).
It starts at the quantile map and moves only where the joint distribution shows more
than the marginals do.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ...._random import check_generator
from ....bags import QUANTILE_LEVELS
from ....kernels import squared_euclidean_distances
from ....representations.mean import _median_distance

__all__ = ["mmd_map"]

#: Points of the sample and of the reference the MMD is estimated on.
MMD_POINTS = 800
#: Gradient steps (Adam) and their size, in units of the reference's marker sd.
MMD_STEPS = 150
MMD_STEP_SIZE = 0.02
#: Bandwidths of the Gaussian kernels summed in the MMD, times the median distance.
MMD_BANDWIDTHS = (0.5, 1.0, 2.0)


def _hat_weights(x: NDArray[np.float64], knots: NDArray[np.float64]) -> NDArray[np.float64]:
    """Interpolation weights of ``x`` on increasing ``knots`` (shape ``(n, K)``),
    continued linearly past the outer knots."""
    k = knots.size
    pos = np.clip(np.searchsorted(knots, x) - 1, 0, k - 2)
    t = (x - knots[pos]) / (knots[pos + 1] - knots[pos])
    w = np.zeros((x.size, k))
    rows = np.arange(x.size)
    w[rows, pos] = 1.0 - t
    w[rows, pos + 1] = t
    return w


def _gradient_weights(sq: NDArray[np.float64], h2: NDArray[np.float64]) -> NDArray[np.float64]:
    """``Σ_h exp(-d² / (2 h²)) / h²`` of squared distances ``sq``: the weights of the
    MMD's gradient for a sum of Gaussian kernels of bandwidths ``√h2``."""
    # In place, in two buffers: the step's cost is these passes over an n x n matrix
    # (half the time of fresh arrays for each operation; the same bits, as
    # -a / b == a / -b and 0 + x == x).
    out = np.empty_like(sq)
    term = np.empty_like(sq)
    for i, h in enumerate(h2):
        dst = out if i == 0 else term
        np.divide(sq, -2.0 * h, out=dst)
        np.exp(dst, out=dst)
        np.divide(dst, h, out=dst)
        if i:
            out += term
    return out


def _knot_values(first: NDArray[np.float64], steps: NDArray[np.float64]) -> NDArray[np.float64]:
    """Knot values per marker: the first one plus the positive increments ``exp(steps)``
    (so the map stays monotone)."""
    return first[None, :] + np.vstack([np.zeros(first.size), np.cumsum(np.exp(steps), axis=0)])


def mmd_map(
    sample: NDArray[np.float64],
    reference: NDArray[np.float64],
    random_state: int = 0,
    levels: NDArray[np.float64] = QUANTILE_LEVELS,
) -> NDArray[np.float64]:
    """``sample`` mapped onto ``reference`` by a monotone per-marker map and an affine
    part, fitted on the MMD (see the module docstring).

    Parameters
    ----------
    sample, reference : ndarray of shape (n, d), (m, d)
    random_state : int
        Seed of the points the MMD is estimated on.
    levels : ndarray
        Quantile levels of the knots.

    Returns
    -------
    ndarray of shape (n, d)
        Every cell of ``sample``, mapped.
    """
    rng = check_generator(random_state)
    d = sample.shape[1]
    centre, scale = reference.mean(axis=0), reference.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    x = (sample - centre) / scale
    ref = (reference - centre) / scale
    knots = np.quantile(x, levels, axis=0)
    knots = np.maximum.accumulate(knots + 1e-9 * np.arange(levels.size)[:, None], axis=0)
    target = np.quantile(ref, levels, axis=0)
    first = target[0].copy()
    steps = np.log(np.maximum(np.diff(target, axis=0), 1e-6))
    A, c = np.eye(d), np.zeros(d)
    pick = rng.choice(x.shape[0], min(MMD_POINTS, x.shape[0]), replace=False)
    rpick = rng.choice(ref.shape[0], min(MMD_POINTS, ref.shape[0]), replace=False)
    xs, rs = x[pick], ref[rpick]
    weights = [_hat_weights(xs[:, j], knots[:, j]) for j in range(d)]
    med = _median_distance(rs, "gaussian", rng)
    h2 = (np.asarray(MMD_BANDWIDTHS) * max(med, 1e-6)) ** 2
    rs_sqnorms = np.einsum("ij,ij->i", rs, rs)
    params = [first, steps, A, c]
    m1 = [np.zeros_like(p) for p in params]
    m2 = [np.zeros_like(p) for p in params]
    n, m = xs.shape[0], rs.shape[0]
    for it in range(1, MMD_STEPS + 1):
        values = _knot_values(first, steps)
        marg = np.column_stack([weights[j] @ values[:, j] for j in range(d)])
        y = marg @ A.T + c
        kyy = _gradient_weights(squared_euclidean_distances(y), h2)
        kyr = _gradient_weights(squared_euclidean_distances(y, rs, B_sqnorms=rs_sqnorms), h2)
        # d MMD² / d y_i: the pull of the reference minus the push of the sample itself.
        g_y = (-2.0 / n**2) * (y * kyy.sum(axis=1)[:, None] - kyy @ y) + (2.0 / (n * m)) * (
            y * kyr.sum(axis=1)[:, None] - kyr @ rs
        )
        g_marg = g_y @ A
        g_A = g_y.T @ marg
        g_c = g_y.sum(axis=0)
        g_values = np.column_stack([weights[j].T @ g_marg[:, j] for j in range(d)])
        g_first = g_values.sum(axis=0)
        # Each increment moves every knot value after it.
        g_steps = np.exp(steps) * np.cumsum(g_values[::-1], axis=0)[::-1][1:]
        for p, g, a, b in zip(params, (g_first, g_steps, g_A, g_c), m1, m2, strict=True):
            a *= 0.9
            a += 0.1 * g
            b *= 0.999
            b += 0.001 * g * g
            p -= MMD_STEP_SIZE * (a / (1 - 0.9**it)) / (np.sqrt(b / (1 - 0.999**it)) + 1e-12)
    values = _knot_values(first, steps)
    out = np.column_stack([_hat_weights(x[:, j], knots[:, j]) @ values[:, j] for j in range(d)])
    return (out @ A.T + c) * scale + centre
