"""Agreement of qualitative results: concordance, sensitivity, specificity, PPV, NPV,
Cohen's kappa, with confidence intervals, and the confusion matrix.

CLSI EP12 (3rd ed., 2023, "Evaluation of Qualitative, Binary Output Examination
Performance") compares a candidate's results with a reference in a 2×2 table: for a
class taken as "positive", with ``TP``, ``FP``, ``FN``, ``TN`` the counts,

.. math::

    \\text{sensitivity} = \\frac{TP}{TP + FN},\\quad
    \\text{specificity} = \\frac{TN}{TN + FP},\\quad
    \\text{PPV} = \\frac{TP}{TP + FP},\\quad
    \\text{NPV} = \\frac{TN}{TN + FN},

and the overall concordance (percent agreement) is the diagonal of the confusion
matrix over its total. With several classes each class is the positive one in turn
(one against the rest).

Each proportion :math:`\\hat p = k/n` gets the Wilson score interval EP12 recommends
(Wilson 1927; Newcombe 1998, method 3), with :math:`z = z_{1-\\alpha/2}`:

.. math::

    \\frac{\\hat p + \\frac{z^2}{2n} \\pm z\\sqrt{\\frac{\\hat p(1-\\hat p)}{n}
    + \\frac{z^2}{4n^2}}}{1 + \\frac{z^2}{n}},

or the exact Clopper–Pearson interval (Clopper & Pearson 1934): the beta quantiles
:math:`B(\\alpha/2; k, n-k+1)` and :math:`B(1-\\alpha/2; k+1, n-k)`.

Cohen's kappa (Cohen 1960) corrects the observed agreement :math:`p_o` for the
agreement expected by chance from the margins, :math:`p_e = \\sum_c p_{c\\cdot}
p_{\\cdot c}`: :math:`\\kappa = (p_o - p_e)/(1 - p_e)`, with Cohen's large-sample
:math:`\\operatorname{SE} = \\sqrt{p_o(1-p_o)/(n(1-p_e)^2)}` for its interval.

References
----------
Wilson EB. Probable inference, the law of succession, and statistical inference.
J Am Stat Assoc 1927; 22:209–212.

Newcombe RG. Two-sided confidence intervals for the single proportion: comparison of
seven methods. Stat Med 1998; 17:857–872.

Clopper CJ, Pearson ES. The use of confidence or fiducial limits illustrated in the
case of the binomial. Biometrika 1934; 26:404–413.

Cohen J. A coefficient of agreement for nominal scales. Educ Psychol Meas 1960;
20:37–46.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats

__all__ = ["INTERVALS", "confusion", "kappa", "proportion", "qualitative_agreement"]

INTERVALS = ("wilson", "exact")


def proportion(
    k: ArrayLike, n: ArrayLike, *, method: str = "wilson", confidence: float = 0.95
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Proportions ``k/n`` with their confidence intervals, elementwise.

    Parameters
    ----------
    k, n : array-like of int
        Successes and trials; ``0 <= k <= n``. Where ``n == 0`` every output is NaN.
    method : {"wilson", "exact"}, default="wilson"
    confidence : float, default=0.95

    Returns
    -------
    (estimate, lower, upper) : three arrays of the broadcast shape
    """
    if method not in INTERVALS:
        raise ValueError(f"interval must be one of {INTERVALS}, got {method!r}")
    k = np.asarray(k, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    if np.any(k < 0) or np.any(k > n):
        raise ValueError("proportions need 0 <= k <= n")
    alpha = 1.0 - confidence
    empty = n == 0
    safe_n = np.where(empty, 1.0, n)
    p = k / safe_n
    if method == "wilson":
        z = float(stats.norm.ppf(1.0 - alpha / 2.0))
        z2 = z * z
        centre = (p + z2 / (2 * safe_n)) / (1 + z2 / safe_n)
        half = z * np.sqrt(p * (1 - p) / safe_n + z2 / (4 * safe_n**2)) / (1 + z2 / safe_n)
        lo, hi = np.clip(centre - half, 0.0, 1.0), np.clip(centre + half, 0.0, 1.0)
    else:
        with np.errstate(invalid="ignore"):
            lo = np.where(k == 0, 0.0, stats.beta.ppf(alpha / 2.0, k, safe_n - k + 1))
            hi = np.where(k == safe_n, 1.0, stats.beta.ppf(1.0 - alpha / 2.0, k + 1, safe_n - k))
    nan = np.full(np.shape(p), np.nan)
    return (np.where(empty, nan, p), np.where(empty, nan, lo), np.where(empty, nan, hi))


def confusion(reference: ArrayLike, model: ArrayLike, classes: Sequence[Any]) -> NDArray[np.int64]:
    """The confusion matrix: rows the reference's classes, columns the model's, in the
    order of ``classes``; a result outside ``classes`` is an error."""
    ref = np.asarray(reference).astype(str)
    mod = np.asarray(model).astype(str)
    names = np.asarray([str(c) for c in classes])
    order = np.argsort(names)
    for what, v in (("reference", ref), ("model", mod)):
        unknown = np.setdiff1d(v, names)
        if unknown.size:
            raise ValueError(
                f"{what} result(s) {unknown[:5].tolist()} are none of the classes {names.tolist()}"
            )
    r = order[np.searchsorted(names[order], ref)]
    m = order[np.searchsorted(names[order], mod)]
    k = names.size
    return np.bincount(r * k + m, minlength=k * k).reshape(k, k).astype(np.int64)


def kappa(matrix: ArrayLike, *, confidence: float = 0.95) -> dict[str, float]:
    """Cohen's kappa of a confusion matrix, with Cohen's large-sample interval.

    Returns
    -------
    dict
        ``kappa``, ``kappa_ci`` (lower, upper), ``observed`` (:math:`p_o`),
        ``expected`` (:math:`p_e`); NaN where undefined (no results, or
        :math:`p_e = 1`: every result in one class).
    """
    c = np.asarray(matrix, dtype=np.float64)
    n = c.sum()
    nan = float("nan")
    if n == 0:
        return {"kappa": nan, "kappa_ci": [nan, nan], "observed": nan, "expected": nan}
    po = float(np.trace(c) / n)
    pe = float((c.sum(axis=1) @ c.sum(axis=0)) / (n * n))
    if pe >= 1.0:
        return {"kappa": nan, "kappa_ci": [nan, nan], "observed": po, "expected": pe}
    k = (po - pe) / (1.0 - pe)
    se = np.sqrt(po * (1.0 - po) / (n * (1.0 - pe) ** 2))
    z = float(stats.norm.ppf(0.5 + confidence / 2.0))
    return {
        "kappa": float(k),
        "kappa_ci": [float(k - z * se), float(k + z * se)],
        "observed": po,
        "expected": pe,
    }


def qualitative_agreement(
    reference: ArrayLike,
    model: ArrayLike,
    classes: Sequence[Any],
    *,
    interval: str = "wilson",
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Everything EP12 asks of a qualitative comparison, for every class at once.

    Parameters
    ----------
    reference, model : array-like of shape (n,)
        The reference's and the model's class of each result.
    classes : sequence
        Every class, in the order of the matrix.
    interval : {"wilson", "exact"}, default="wilson"
    confidence : float, default=0.95

    Returns
    -------
    dict
        ``n``; ``classes``; ``confusion`` (list of rows, reference × model);
        ``concordance`` ``{"k", "n", "estimate", "ci"}``; ``kappa`` (see
        :func:`kappa`); ``per_class``: per class ``tp``, ``fp``, ``fn``, ``tn`` and
        ``sensitivity``, ``specificity``, ``ppv``, ``npv`` as ``{"k", "n",
        "estimate", "ci"}``; ``interval`` and ``confidence``.
    """
    matrix = confusion(reference, model, classes)
    n = int(matrix.sum())
    tp = np.diag(matrix)
    fp = matrix.sum(axis=0) - tp
    fn = matrix.sum(axis=1) - tp
    tn = n - tp - fp - fn
    ks = np.stack([tp, tn, tp, tn])
    ns = np.stack([tp + fn, tn + fp, tp + fp, tn + fn])
    est, lo, hi = proportion(ks, ns, method=interval, confidence=confidence)
    names = ("sensitivity", "specificity", "ppv", "npv")
    per_class = []
    for c, name in enumerate(classes):
        row: dict[str, Any] = {
            "class": str(name),
            "tp": int(tp[c]),
            "fp": int(fp[c]),
            "fn": int(fn[c]),
            "tn": int(tn[c]),
        }
        for m, what in enumerate(names):
            row[what] = _share(ks[m, c], ns[m, c], est[m, c], lo[m, c], hi[m, c])
        per_class.append(row)
    ce, cl, ch = proportion(int(tp.sum()), n, method=interval, confidence=confidence)
    return {
        "n": n,
        "classes": [str(c) for c in classes],
        "confusion": matrix.tolist(),
        "concordance": _share(int(tp.sum()), n, ce, cl, ch),
        "kappa": kappa(matrix, confidence=confidence),
        "per_class": per_class,
        "interval": interval,
        "confidence": float(confidence),
    }


def _share(k: Any, n: Any, est: Any, lo: Any, hi: Any) -> dict[str, Any]:
    return {"k": int(k), "n": int(n), "estimate": float(est), "ci": [float(lo), float(hi)]}
