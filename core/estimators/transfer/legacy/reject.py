"""The rest class of a loaded model of the design before issue 44: cells no population
claims.

A model fitted with a rest label (``unassigned=``) and a reject threshold
(``reject_threshold_``) gives a cell to the rest class when its best score among the
populations (the rest class excluded) falls below the threshold. The scores are the
one-vs-rest ridge codes ``±1``, whose least-squares target is ``2 P(k | x) - 1``: the
threshold ``θ`` reads as a posterior ``(1 + θ) / 2``.

Cells far from the population they were given are reported on request by
:func:`~core.estimators.transfer.open_set.far_from_populations`, the one rule of both
designs.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ..open_set import far_from_populations

__all__ = ["far_from_populations", "reject_scores"]


def _per_class(scores: NDArray[np.float64]) -> NDArray[np.float64]:
    """Scores as one column per class (two classes: ``[-s, s]``)."""
    return np.hstack([-scores, scores]) if scores.shape[1] == 1 else scores


def reject_scores(
    scores: NDArray[np.float64], rest: int, threshold: float | None
) -> NDArray[np.float64]:
    """``scores`` with every point whose best population score is below ``threshold``
    given to the rest class ``rest`` (a column index into the per-class scores).

    The returned scores keep their shape and decode to the rest class where the rule
    fires (its score is raised above every other); elsewhere they are unchanged.
    ``threshold=None`` is the rule switched off.
    """
    if threshold is None:
        return scores
    per = _per_class(scores)
    others = np.delete(per, rest, axis=1)
    fire = others.max(axis=1) < threshold
    if not fire.any():
        return scores
    out = scores.copy()
    if scores.shape[1] == 1:
        # Two classes: the one margin decides; push it to the rest class's side.
        sign = 1.0 if rest == 1 else -1.0
        out[fire, 0] = sign * (np.abs(scores[fire, 0]) + 1.0)
    else:
        out[fire, rest] = per[fire].max(axis=1) + 1.0
    return out
