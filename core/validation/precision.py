"""Precision from replicates: repeatability and within-laboratory SD and CV.

Where the same specimen was measured more than once, the spread of the model's
results over those replicates is its imprecision (CLSI EP05-A3, 2014, "Evaluation of
Precision of Quantitative Measurement Procedures"). Per specimen, with its replicates
grouped by run (day, batch) as a one-way analysis of variance:

.. math::

    s_r^2 = MS_{\\text{within}}, \\qquad
    s_{\\text{run}}^2 = \\max\\left(0, \\frac{MS_{\\text{between}} - MS_{\\text{within}}}
    {n_0}\\right), \\qquad s_{WL} = \\sqrt{s_r^2 + s_{\\text{run}}^2},

where :math:`n_0 = (N - \\sum_j n_j^2 / N)/(J - 1)` is the (unbalanced) mean run size
of :math:`J` runs with :math:`n_j` replicates each. ``s_r`` is the repeatability
(within-run) SD, ``s_WL`` the within-laboratory SD; each CV is the SD over the
specimen's mean, in percent. Without runs every replicate counts as one run: the
repeatability is the SD of the replicates, and the within-laboratory SD cannot be
separated from it (reported as missing).

EP05's full design is 20 days × 2 runs × 2 replicates per level; fewer replicates give
wide uncertainty, which the report states with the counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["MISSING_REPLICATES", "precision"]

#: What the report says when the data name no replicates.
MISSING_REPLICATES = (
    "The data name no replicates. To estimate precision (CLSI EP05), measure some "
    "specimens more than once (EP05: 20 days x 2 runs x 2 replicates per level) and give "
    "[precision] replicates = a CSV with the columns file, specimen and (optionally) run "
    "for those files."
)


def precision(
    values: ArrayLike, specimens: Sequence[str], runs: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Repeatability and within-laboratory SD and CV per specimen measured twice or more.

    Parameters
    ----------
    values : array-like of shape (n,)
        The model's results.
    specimens : sequence of str, length n
        The specimen each result was measured on.
    runs : sequence of str, length n, optional
        The run (day, batch) of each result.

    Returns
    -------
    list of dict
        Per specimen with at least two results: ``specimen``, ``n``, ``n_runs``,
        ``mean``, ``sd_repeatability``, ``cv_repeatability`` (percent),
        ``sd_within_lab`` and ``cv_within_lab`` (``None`` without at least two runs).
    """
    v = np.asarray(values, dtype=np.float64)
    spec = np.asarray([str(s) for s in specimens])
    # Without runs every replicate of a specimen is in one run.
    run = np.asarray([str(r) for r in runs]) if runs is not None else np.full(spec.shape, "")
    if v.shape != spec.shape or v.shape != run.shape:
        raise ValueError("values, specimens and runs must have one length")
    rows: list[dict[str, Any]] = []
    for name in sorted(set(spec.tolist())):
        at = spec == name
        x = v[at]
        if x.size < 2:
            continue
        _, groups = np.unique(run[at], return_inverse=True)
        j = int(groups.max()) + 1
        sizes = np.bincount(groups).astype(np.float64)
        means = np.bincount(groups, weights=x) / sizes
        within_ss = float(np.sum((x - means[groups]) ** 2))
        within_df = x.size - j
        mean = float(x.mean())
        # One result per run leaves no within-run spread to estimate.
        sd_r = float(np.sqrt(within_ss / within_df)) if within_df > 0 else float("nan")
        sd_wl: float | None = None
        if runs is not None and j >= 2 and within_df > 0:
            between_ms = float(np.sum(sizes * (means - mean) ** 2) / (j - 1))
            n0 = (x.size - float(np.sum(sizes**2)) / x.size) / (j - 1)
            s_run2 = max(0.0, (between_ms - within_ss / within_df) / n0)
            sd_wl = float(np.sqrt(sd_r**2 + s_run2))
        rows.append(
            {
                "specimen": name,
                "n": int(x.size),
                "n_runs": j if runs is not None else None,
                "mean": mean,
                "sd_repeatability": sd_r,
                "cv_repeatability": _cv(sd_r, mean),
                "sd_within_lab": sd_wl,
                "cv_within_lab": None if sd_wl is None else _cv(sd_wl, mean),
            }
        )
    return rows


def _cv(sd: float, mean: float) -> float | None:
    return None if mean == 0 or not np.isfinite(sd) else float(100.0 * sd / abs(mean))
