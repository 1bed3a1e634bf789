"""Calibrate a new batch, then a pooled LDA: the two baselines issue 44 sets against
marginal transfer on a new instrument batch.

* ``landmarks + LDA``: an LDA on the training cells as they are; each new sample is
  mapped, marker by marker, by the scale and shift that bring its populations' means
  onto the training populations' means (least squares weighted by the populations'
  cell counts, the rest label left out), its populations named by that LDA; five
  rounds from the identity, each labelling the sample as the last map left it. The
  issue's description of the strongest row on a real two-batch cohort.
* ``CytoNorm + LDA``: CytoNorm's idea without its clustering (Van Gassen et al.,
  Cytometry A 2020): a reference control measured in every batch; per marker, a
  monotone spline through the new batch's control quantiles and the training batch's
  control quantiles at the same levels (101 levels from 0.1 % to 99.9 %; Fritsch–
  Carlson monotone cubic, scipy's ``PchipInterpolator``, as CytoNorm's
  ``splinefun(method = "monoH.FC")``; linear beyond the end levels), applied to every
  sample of the new batch; the same LDA. ``cytonormpy`` was not used: it installs
  FlowSOM's Python port and its own readers for a spline of a few lines.

Both map every marker by an increasing function, so the order of a sample's cells on
each marker is kept.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.interpolate import PchipInterpolator
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

__all__ = ["cytonorm_then_lda", "landmarks_then_lda", "quantile_spline"]

#: Quantile levels of the CytoNorm baseline's spline.
LEVELS = np.linspace(0.001, 0.999, 101)
#: Rounds of label-then-map of the landmark baseline.
ROUNDS = 5


def _population_means(
    x: NDArray[np.float64], labels: NDArray[Any], populations: NDArray[Any]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Per population: its cells' mean per marker and its cell count (0 when absent)."""
    one_hot = labels[:, None] == populations[None, :]
    counts = one_hot.sum(axis=0).astype(np.float64)
    means = (one_hot.T @ x) / np.maximum(counts, 1.0)[:, None]
    return means, counts


def _affine(
    source: NDArray[np.float64], target: NDArray[np.float64], weights: NDArray[np.float64]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Per marker ``(a, b)`` minimising ``Σ_k w_k (a s_k + b - t_k)²``; a shift alone
    where the populations do not spread a marker or the fitted scale is not positive
    (the map must stay increasing)."""
    w = weights / weights.sum()
    ms, mt = w @ source, w @ target
    var = w @ (source - ms) ** 2
    cov = w @ ((source - ms) * (target - mt))
    ok = (var > 1e-12) & (cov > 0) & (np.count_nonzero(weights) >= 2)
    a = np.where(ok, cov / np.where(ok, var, 1.0), 1.0)
    return a, mt - a * ms


def landmarks_then_lda(
    train: Sequence[NDArray[np.float64]],
    y_train: Sequence[NDArray[Any]],
    test: Sequence[NDArray[np.float64]],
    rest: Any = None,
) -> tuple[list[NDArray[Any]], float]:
    """Every test sample's predicted labels, and the fit time (LDA and the reference
    landmarks; the maps are part of predicting)."""
    t0 = time.perf_counter()
    x, y = np.vstack(train), np.concatenate(y_train)
    lda = LinearDiscriminantAnalysis().fit(x, y)
    populations = np.array([c for c in lda.classes_ if c != rest])
    reference, _ = _population_means(x, y, populations)
    fit = time.perf_counter() - t0
    out = []
    for sample in test:
        a, b = np.ones(sample.shape[1]), np.zeros(sample.shape[1])
        for _ in range(ROUNDS):
            means, counts = _population_means(sample, lda.predict(sample * a + b), populations)
            present = counts > 0
            if not present.any():
                break
            a, b = _affine(means[present], reference[present], counts[present])
        out.append(lda.predict(sample * a + b))
    return out, fit


def quantile_spline(
    control: NDArray[np.float64], goal: NDArray[np.float64]
) -> list[PchipInterpolator]:
    """Per marker, the increasing map taking ``control``'s quantiles at :data:`LEVELS`
    to ``goal``'s (knots where the control's quantiles tie are merged)."""
    src, dst = np.quantile(control, LEVELS, axis=0), np.quantile(goal, LEVELS, axis=0)
    maps = []
    for j in range(control.shape[1]):
        keep = np.concatenate([[True], np.diff(src[:, j]) > 1e-12])
        maps.append(PchipInterpolator(src[keep, j], np.maximum.accumulate(dst[keep, j])))
    return maps


def _apply(maps: list[PchipInterpolator], x: NDArray[np.float64]) -> NDArray[np.float64]:
    out = np.empty_like(x)
    for j, f in enumerate(maps):
        lo, hi = f.x[0], f.x[-1]
        col = f(np.clip(x[:, j], lo, hi))
        # Beyond the end levels: the secant slope of the outer knots, increasing.
        s_lo = (f(f.x[1]) - f(lo)) / (f.x[1] - lo) if f.x.size > 1 else 1.0
        s_hi = (f(hi) - f(f.x[-2])) / (hi - f.x[-2]) if f.x.size > 1 else 1.0
        col = np.where(x[:, j] < lo, f(lo) + s_lo * (x[:, j] - lo), col)
        out[:, j] = np.where(x[:, j] > hi, f(hi) + s_hi * (x[:, j] - hi), col)
    return out


def cytonorm_then_lda(
    train: Sequence[NDArray[np.float64]],
    y_train: Sequence[NDArray[Any]],
    test: Sequence[NDArray[np.float64]],
    train_control: NDArray[np.float64],
    test_control: NDArray[np.float64],
) -> tuple[list[NDArray[Any]], float]:
    """Every test sample's predicted labels after the test batch's control spline,
    and the fit time (LDA and the spline)."""
    t0 = time.perf_counter()
    lda = LinearDiscriminantAnalysis().fit(np.vstack(train), np.concatenate(y_train))
    maps = quantile_spline(test_control, train_control)
    fit = time.perf_counter() - t0
    return [lda.predict(_apply(maps, s)) for s in test], fit
