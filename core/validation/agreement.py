"""Bland–Altman agreement of a new method with a reference method.

For paired results ``x`` (reference) and ``y`` (the model) of the same ``n`` samples,
the differences :math:`d_i = y_i - x_i` have mean :math:`\\bar d` (the **bias**) and
standard deviation :math:`s_d`. The **95 % limits of agreement** are
:math:`\\bar d \\pm 1.96\\, s_d`: about 95 % of the differences between the two
methods on a new sample fall between them (Bland & Altman 1986).

Their confidence intervals (Bland & Altman 1986, section 5) use

.. math::

    \\operatorname{SE}(\\bar d) = s_d / \\sqrt n, \\qquad
    \\operatorname{SE}(\\bar d \\pm 1.96\\, s_d) \\approx \\sqrt{3 s_d^2 / n},

each interval being the estimate :math:`\\pm\\, t_{n-1,\\,1-\\alpha/2}` times its SE.

Where the differences grow with the level, the analysis is done on the **ratio
scale** (Bland & Altman 1999, section 3.2): on :math:`\\log y_i - \\log x_i`, the
bias and limits back-transformed into ratios :math:`y/x` (a geometric mean ratio and
its limits), which needs every value positive. :func:`proportional_trend` tells
whether the absolute differences grow with the level (Spearman correlation of
:math:`|d_i|` with :math:`(x_i + y_i)/2`), the usual reason to prefer it.

CLSI EP09 (3rd ed., 2018, "Measurement Procedure Comparison and Bias Estimation
Using Patient Samples") asks for this difference plot and its bias estimate.

References
----------
Bland JM, Altman DG. Statistical methods for assessing agreement between two methods
of clinical measurement. Lancet 1986; i:307–310.

Bland JM, Altman DG. Measuring agreement in method comparison studies. Stat Methods
Med Res 1999; 8:135–160.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

__all__ = ["Agreement", "bland_altman", "proportional_trend"]

#: The multiple of the SD of the differences that bounds 95 % of them (normal).
LOA_Z = 1.96


@dataclass(frozen=True)
class Agreement:
    """Bland–Altman bias and limits of agreement, with their confidence intervals.

    On the ratio scale (``scale == "ratio"``) every value is a ratio model/reference
    (the back-transformed log difference) and ``sd`` is the SD of the log ratios.

    Attributes
    ----------
    scale : {"difference", "ratio"}
    n : int
    bias, bias_ci : float, (float, float)
    sd : float
    lower, lower_ci : float, (float, float)
        The lower 95 % limit of agreement and its confidence interval.
    upper, upper_ci : float, (float, float)
    confidence : float
        The level of the confidence intervals.
    """

    scale: str
    n: int
    bias: float
    bias_ci: tuple[float, float]
    sd: float
    lower: float
    lower_ci: tuple[float, float]
    upper: float
    upper_ci: tuple[float, float]
    confidence: float

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("bias_ci", "lower_ci", "upper_ci"):
            out[key] = list(out[key])
        return out


def bland_altman(
    reference: ArrayLike, model: ArrayLike, *, scale: str = "difference", confidence: float = 0.95
) -> Agreement:
    """Bias and 95 % limits of agreement of ``model`` against ``reference``.

    Parameters
    ----------
    reference, model : array-like of shape (n,)
        Paired results; ``n >= 2``.
    scale : {"difference", "ratio"}, default="difference"
        ``"ratio"``: on the log ratios, back-transformed (every value must be > 0).
    confidence : float, default=0.95
        Level of the intervals of the bias and the limits.

    Returns
    -------
    Agreement

    Raises
    ------
    ValueError
        Fewer than two pairs, lengths differ, a value is not finite, or (ratio scale)
        a value is not positive.
    """
    x = np.asarray(reference, dtype=np.float64)
    y = np.asarray(model, dtype=np.float64)
    _check_pairs(x, y)
    if scale == "ratio":
        if np.any(x <= 0) or np.any(y <= 0):
            raise ValueError("the ratio scale needs every result > 0")
        d = np.log(y) - np.log(x)
    elif scale == "difference":
        d = y - x
    else:
        raise ValueError(f"scale must be 'difference' or 'ratio', got {scale!r}")
    n = d.size
    bias = float(d.mean())
    sd = float(d.std(ddof=1))
    t = float(stats.t.ppf(0.5 + confidence / 2.0, n - 1))
    se_bias = sd / np.sqrt(n)
    se_limit = np.sqrt(3.0 * sd**2 / n)
    lower, upper = bias - LOA_Z * sd, bias + LOA_Z * sd
    out = np.array(
        [
            [bias, bias - t * se_bias, bias + t * se_bias],
            [lower, lower - t * se_limit, lower + t * se_limit],
            [upper, upper - t * se_limit, upper + t * se_limit],
        ]
    )
    if scale == "ratio":
        out = np.exp(out)
    return Agreement(
        scale=scale,
        n=int(n),
        bias=float(out[0, 0]),
        bias_ci=(float(out[0, 1]), float(out[0, 2])),
        sd=sd,
        lower=float(out[1, 0]),
        lower_ci=(float(out[1, 1]), float(out[1, 2])),
        upper=float(out[2, 0]),
        upper_ci=(float(out[2, 1]), float(out[2, 2])),
        confidence=float(confidence),
    )


def proportional_trend(reference: ArrayLike, model: ArrayLike) -> dict[str, float]:
    """Whether the size of the differences grows with the level.

    Spearman's rank correlation of :math:`|y_i - x_i|` with :math:`(x_i + y_i)/2` and
    its two-sided p-value; a positive, significant correlation is the sign that the
    ratio scale describes the agreement better (Bland & Altman 1999, section 3).

    Returns
    -------
    dict
        ``rho`` and ``p_value`` (NaN when fewer than three pairs or no spread).
    """
    x = np.asarray(reference, dtype=np.float64)
    y = np.asarray(model, dtype=np.float64)
    _check_pairs(x, y)
    if x.size < 3 or np.ptp(np.abs(y - x)) == 0 or np.ptp((x + y) / 2) == 0:
        return {"rho": float("nan"), "p_value": float("nan")}
    rho, p = stats.spearmanr(np.abs(y - x), (x + y) / 2.0)
    return {"rho": float(rho), "p_value": float(p)}


def _check_pairs(x: np.ndarray, y: np.ndarray) -> None:
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(
            f"paired results must be two 1-D arrays of one length, got {x.shape}, {y.shape}"
        )
    if x.size < 2:
        raise ValueError(f"agreement needs at least 2 paired results, got {x.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("paired results must be finite numbers")
