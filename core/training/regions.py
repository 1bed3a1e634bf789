"""Where a bag-level model looks: held-out explanations averaged into marker regions.

A reviewer asks of a trained model whether it reads biology or an artefact (debris at
the lowest scatter, doublets at the highest, a compensation error in one channel). For
every training sample, the model of its cross-validation fold (preprocessing fitted on
that fold's training samples, the final model's ``γ`` and ``λ``, so that no search is
repeated) explains it (:func:`core.explain`); each cell's contribution is added to the
region it falls in, per marker: the fifth of that marker's range (quintiles of the fold's
training cells) it lies in. The table is the mean over samples of each region's summed
contribution, per output (the value, or each class's score): large entries show the
regions that carry the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, clone

from ..bags import Bags
from ..io import Preprocessing

__all__ = ["BINS", "held_out_regions"]

#: The regions of each marker: fifths of its training cells.
BINS = ("lowest fifth", "second fifth", "middle fifth", "fourth fifth", "highest fifth")


def held_out_regions(
    final: BaseEstimator,
    raw: Bags,
    y: np.ndarray,
    folds: list[tuple[np.ndarray, np.ndarray]],
    pre_spec: Mapping[str, Any],
    markers: list[str],
) -> dict[str, Any] | None:
    """Mean contribution of each (marker, fifth) region over the held-out samples.

    Returns ``None`` when the model has no explanation (a representation without one).

    Returns
    -------
    dict
        ``outputs``, ``markers``, ``regions`` (:data:`BINS`), ``n_samples``,
        ``method`` (``"exact"`` or ``"influence"``) and ``mean_contribution``, nested
        lists marker × region × output.
    """
    from ..explanations import explain

    params = {}
    if getattr(final, "gamma_", None) is not None and "gamma" in final.get_params():
        params["gamma"] = final.gamma_
    if getattr(final, "alpha_", None) is not None and "alpha" in final.get_params():
        params["alpha"] = final.alpha_
    total: np.ndarray | None = None
    outputs: list[str] = []
    method = "exact"
    n = 0
    for train, val in folds:
        pre = Preprocessing(**pre_spec).fit(raw[train], markers)
        bags_tr, bags_va = pre.apply(raw[train], markers), pre.apply(raw[val], markers)
        # The cut points of each marker's fifths among the fold's training cells.
        edges = np.quantile(bags_tr.points, [0.2, 0.4, 0.6, 0.8], axis=0).T  # (d, 4)
        model = clone(final).set_params(**params).fit(bags_tr, y[train])
        for t in range(len(bags_va)):
            try:
                e = explain(model, bags_va.take(np.array([t])), markers=markers)
            except TypeError:
                return None
            c = e.contributions
            if total is None:
                total = np.zeros((len(markers), len(BINS), c.shape[1]))
                outputs = list(e.outputs)
            if e.method == "influence":
                method = "influence"
            for j in range(len(markers)):
                region = np.searchsorted(edges[j], e.points[:, j], side="right")
                for k in range(c.shape[1]):
                    total[j, :, k] += np.bincount(region, weights=c[:, k], minlength=len(BINS))
            n += 1
    if total is None or n == 0:
        return None
    return {
        "outputs": outputs,
        "markers": list(markers),
        "regions": list(BINS),
        "n_samples": n,
        "method": method,
        "mean_contribution": (total / n).tolist(),
    }
