"""Method-comparison regression: Deming, Passing–Bablok, and the correlation.

Both regressions fit :math:`y = a + b x` of the model's results ``y`` on the reference
method's ``x`` allowing for error in **both** (ordinary least squares, which assumes
an exact ``x``, biases the slope towards zero). A slope of 1 and an intercept of 0
mean no proportional and no constant difference (CLSI EP09, 3rd ed., 2018).

Deming regression
-----------------
With :math:`\\lambda = \\sigma^2_{\\varepsilon_y} / \\sigma^2_{\\varepsilon_x}`, the
ratio of the two methods' error variances (1: equal errors, orthogonal regression),
and the sample moments :math:`s_{xx}, s_{yy}, s_{xy}` (Deming 1943; Linnet 1990):

.. math::

    b = \\frac{s_{yy} - \\lambda s_{xx}
        + \\sqrt{(s_{yy} - \\lambda s_{xx})^2 + 4 \\lambda s_{xy}^2}}{2 s_{xy}},
    \\qquad a = \\bar y - b \\bar x .

Its confidence intervals are Linnet's jackknife: with :math:`\\theta_{(-i)}` the
estimate without sample ``i``, the pseudo-values
:math:`p_i = n\\theta - (n-1)\\theta_{(-i)}` give
:math:`\\operatorname{SE}(\\theta) = \\operatorname{sd}(p)/\\sqrt n`, and the interval
is :math:`\\theta \\pm t_{n-1,\\,1-\\alpha/2}\\operatorname{SE}(\\theta)`.

Passing–Bablok regression
-------------------------
Non-parametric, robust to outliers, no assumption on the error distributions
(Passing & Bablok 1983). Of the :math:`n(n-1)/2` pairwise slopes
:math:`S_{ij} = (y_j - y_i)/(x_j - x_i)`, those of identical points (0/0) and those
equal to −1 are left out; ``K`` is the number below −1. The slope is the median of
the ``N`` others shifted by ``K`` (so that it estimates the slope of both axes'
errors alike): :math:`b = S_{((N+1)/2 + K)}` for odd ``N``, the mean of
:math:`S_{(N/2 + K)}` and :math:`S_{(N/2 + 1 + K)}` for even ``N`` (sorted, 1-based).
The intercept is :math:`a = \\operatorname{median}(y_i - b x_i)`. With
:math:`C = z_{1-\\alpha/2}\\sqrt{n(n-1)(2n+5)/18}`, :math:`M_1 = \\lfloor (N - C)/2
\\rceil` and :math:`M_2 = N - M_1 + 1`, the slope's interval is
:math:`[S_{(M_1 + K)}, S_{(M_2 + K)}]` and the intercept's is
:math:`[\\operatorname{median}(y - b_U x), \\operatorname{median}(y - b_L x)]`.
A vertical pair (same ``x``, different ``y``) counts as :math:`+\\infty`: its sign
would otherwise depend on the order of the two samples.

References
----------
Deming WE. Statistical adjustment of data. Wiley, 1943.

Linnet K. Estimation of the linear relationship between the measurements of two
methods with proportional errors. Stat Med 1990; 9:1463–1473.

Linnet K. Evaluation of regression procedures for methods comparison studies.
Clin Chem 1993; 39:424–432.

Passing H, Bablok W. A new biometrical procedure for testing the equality of
measurements from two different analytical methods. J Clin Chem Clin Biochem 1983;
21:709–720.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats

__all__ = ["Correlation", "LineFit", "correlation", "deming", "passing_bablok"]


@dataclass(frozen=True)
class LineFit:
    """A fitted line ``y = intercept + slope * x`` with confidence intervals.

    Attributes
    ----------
    method : {"deming", "passing-bablok"}
    n : int
    slope, slope_ci : float, (float, float)
    intercept, intercept_ci : float, (float, float)
    confidence : float
    error_ratio : float or None
        Deming's :math:`\\lambda` (error variance of y over that of x).
    """

    method: str
    n: int
    slope: float
    slope_ci: tuple[float, float]
    intercept: float
    intercept_ci: tuple[float, float]
    confidence: float
    error_ratio: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "n": self.n,
            "slope": self.slope,
            "slope_ci": list(self.slope_ci),
            "intercept": self.intercept,
            "intercept_ci": list(self.intercept_ci),
            "confidence": self.confidence,
            "error_ratio": self.error_ratio,
        }


@dataclass(frozen=True)
class Correlation:
    """Pearson's r with its Fisher-z confidence interval (NaN bounds below 4 pairs)."""

    n: int
    r: float
    r_ci: tuple[float, float]
    confidence: float

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "r": self.r, "r_ci": list(self.r_ci), "confidence": self.confidence}


def _pairs(x: ArrayLike, y: ArrayLike, minimum: int) -> tuple[NDArray[np.float64], ...]:
    xa = np.asarray(x, dtype=np.float64)
    ya = np.asarray(y, dtype=np.float64)
    if xa.ndim != 1 or xa.shape != ya.shape:
        raise ValueError(
            f"paired results must be two 1-D arrays of one length, got {xa.shape}, {ya.shape}"
        )
    if xa.size < minimum:
        raise ValueError(f"needs at least {minimum} paired results, got {xa.size}")
    if not (np.all(np.isfinite(xa)) and np.all(np.isfinite(ya))):
        raise ValueError("paired results must be finite numbers")
    return xa, ya


def _deming_slopes(
    sxx: NDArray[np.float64], syy: NDArray[np.float64], sxy: NDArray[np.float64], lam: float
) -> NDArray[np.float64]:
    """Deming's slope for arrays of moments (one per leave-one-out sample)."""
    u = syy - lam * sxx
    with np.errstate(divide="ignore", invalid="ignore"):
        return (u + np.sqrt(u * u + 4.0 * lam * sxy * sxy)) / (2.0 * sxy)


def deming(
    reference: ArrayLike,
    model: ArrayLike,
    *,
    error_ratio: float = 1.0,
    confidence: float = 0.95,
) -> LineFit:
    """Deming regression of ``model`` on ``reference`` with jackknife intervals.

    Parameters
    ----------
    reference, model : array-like of shape (n,)
        Paired results, ``n >= 3``.
    error_ratio : float, default=1.0
        :math:`\\lambda`, the model's error variance over the reference's.
    confidence : float, default=0.95

    Returns
    -------
    LineFit

    Raises
    ------
    ValueError
        Fewer than three pairs, a non-finite value, ``error_ratio <= 0``, or results
        without covariance (the slope is undefined).
    """
    x, y = _pairs(reference, model, 3)
    if not (np.isfinite(error_ratio) and error_ratio > 0):
        raise ValueError(f"error_ratio must be a positive number, got {error_ratio!r}")
    n = x.size
    # Centred once, so that the leave-one-out moments below do not cancel.
    xc, yc = x - x.mean(), y - y.mean()
    sx, sy = xc.sum(), yc.sum()
    sxx_all, syy_all, sxy_all = xc @ xc, yc @ yc, xc @ yc
    if sxy_all == 0.0:
        raise ValueError("the results do not co-vary: the Deming slope is undefined")
    m = n - 1
    # Moments without sample i, for every i at once.
    mx, my = (sx - xc) / m, (sy - yc) / m
    sxx = (sxx_all - xc * xc) - m * mx * mx
    syy = (syy_all - yc * yc) - m * my * my
    sxy = (sxy_all - xc * yc) - m * mx * my
    slope = float(
        _deming_slopes(np.array([sxx_all]), np.array([syy_all]), np.array([sxy_all]), error_ratio)[
            0
        ]
    )
    intercept = float(y.mean() - slope * x.mean())
    loo_slope = _deming_slopes(sxx, syy, sxy, error_ratio)
    loo_intercept = (my + y.mean()) - loo_slope * (mx + x.mean())
    t = float(stats.t.ppf(0.5 + confidence / 2.0, n - 1))

    def interval(theta: float, loo: NDArray[np.float64]) -> tuple[float, float]:
        pseudo = n * theta - (n - 1) * loo
        se = float(pseudo.std(ddof=1) / np.sqrt(n))
        return (theta - t * se, theta + t * se)

    return LineFit(
        method="deming",
        n=int(n),
        slope=slope,
        slope_ci=interval(slope, loo_slope),
        intercept=intercept,
        intercept_ci=interval(intercept, loo_intercept),
        confidence=float(confidence),
        error_ratio=float(error_ratio),
    )


def _order_statistic(values: NDArray[np.float64], k: int) -> float:
    """The k-th smallest (1-based) of sorted ``values``; ±inf beyond either end."""
    if k < 1:
        return float("-inf")
    if k > values.size:
        return float("inf")
    return float(values[k - 1])


def passing_bablok(reference: ArrayLike, model: ArrayLike, *, confidence: float = 0.95) -> LineFit:
    """Passing–Bablok regression of ``model`` on ``reference``.

    Every pairwise slope is formed at once (``n(n-1)/2`` of them: about 100 MB of
    memory for 5,000 samples).

    Parameters
    ----------
    reference, model : array-like of shape (n,)
        Paired results, ``n >= 3``.
    confidence : float, default=0.95

    Returns
    -------
    LineFit

    Raises
    ------
    ValueError
        Fewer than three pairs, a non-finite value, no usable slope (every pair
        identical) or an infinite one (the method assumes positively related results).
    """
    x, y = _pairs(reference, model, 3)
    n = x.size
    i, j = np.triu_indices(n, k=1)
    dx, dy = x[j] - x[i], y[j] - y[i]
    usable = ~((dx == 0) & (dy == 0))
    dx, dy = dx[usable], dy[usable]
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(dx == 0, np.inf, dy / np.where(dx == 0, 1.0, dx))
    s = np.sort(s[s != -1.0])
    big_n = s.size
    if big_n == 0:
        raise ValueError(
            "every pair of results is identical: the Passing–Bablok slope is undefined"
        )
    k = int(np.count_nonzero(s < -1.0))
    if big_n % 2:
        slope = _order_statistic(s, (big_n + 1) // 2 + k)
    else:
        slope = 0.5 * (
            _order_statistic(s, big_n // 2 + k) + _order_statistic(s, big_n // 2 + 1 + k)
        )
    if not np.isfinite(slope):
        raise ValueError(
            "the Passing–Bablok slope is not finite (vertical pairs dominate): the method "
            "assumes positively related results"
        )
    c = float(stats.norm.ppf(0.5 + confidence / 2.0)) * np.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    m1 = int(np.floor((big_n - c) / 2.0 + 0.5))
    m2 = big_n - m1 + 1
    lo, hi = _order_statistic(s, m1 + k), _order_statistic(s, m2 + k)
    intercept = float(np.median(y - slope * x))
    # The paper's [median(y - b_U x), median(y - b_L x)], ordered: for results below
    # zero the two swap.
    ends = sorted((_intercept_at(x, y, hi), _intercept_at(x, y, lo)))

    return LineFit(
        method="passing-bablok",
        n=int(n),
        slope=slope,
        slope_ci=(lo, hi),
        intercept=intercept,
        intercept_ci=(ends[0], ends[1]),
        confidence=float(confidence),
    )


def _intercept_at(x: NDArray[np.float64], y: NDArray[np.float64], b: float) -> float:
    """The Passing–Bablok intercept for slope ``b``; unbounded for an unbounded slope."""
    if np.isfinite(b):
        return float(np.median(y - b * x))
    return float("-inf") if b > 0 else float("inf")


def correlation(reference: ArrayLike, model: ArrayLike, *, confidence: float = 0.95) -> Correlation:
    """Pearson's correlation coefficient with the Fisher-z interval
    :math:`\\tanh(\\operatorname{atanh} r \\pm z_{1-\\alpha/2}/\\sqrt{n-3})`.

    A high r says the range of the samples is wide compared with the scatter, not
    that the methods agree (Bland & Altman 1986): it is reported beside them, never
    instead.
    """
    x, y = _pairs(reference, model, 2)
    n = x.size
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        nan = float("nan")
        return Correlation(n=int(n), r=nan, r_ci=(nan, nan), confidence=float(confidence))
    r = float(np.corrcoef(x, y)[0, 1])
    if n < 4 or abs(r) >= 1.0:
        ci = (float("nan"), float("nan")) if n < 4 else (r, r)
    else:
        half = float(stats.norm.ppf(0.5 + confidence / 2.0)) / np.sqrt(n - 3)
        ci = (float(np.tanh(np.arctanh(r) - half)), float(np.tanh(np.arctanh(r) + half)))
    return Correlation(n=int(n), r=r, r_ci=ci, confidence=float(confidence))
