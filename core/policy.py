"""What every answer does for a bag outside the model's applicability domain.

A model's out-of-domain policy is chosen when it is trained (``[serving]
out_of_domain`` in the configuration), stored in its manifest, and applied by the
runtime (:mod:`core.runtime`) to every prediction, which then carries a status per
bag. Every door (JSON, CSV, NPY, ``/v2``, FHIR, the console, jobs, the command line)
shows that status and acts on it the same way; none decides it again:

* ``"flag"``: the answer is released as **final**, flagged out of range. For research
  use, where a reviewer reads every flag anyway.
* ``"preliminary"`` (the default): the answer is released as **preliminary**: a
  laboratory information system files it as not yet verified, and a person must
  confirm it before it is reported.
* ``"withhold"``: the value, its interval and its set are **withheld**; the answer says
  why (the domain score and the threshold it passed) and names the nearest training
  samples, so that the sample can be reviewed or measured again.

A bag inside the domain is always final.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

# The status vocabulary belongs to the answers (core/results.py); the policy picks
# among it.
from .results import FINAL, PRELIMINARY, STATUSES, WITHHELD, Prediction

__all__ = [
    "DEFAULT_POLICY",
    "FINAL",
    "POLICIES",
    "PRELIMINARY",
    "STATUSES",
    "WITHHELD",
    "bag_warnings",
    "review_warnings",
    "statuses",
    "withheld_reason",
]

POLICIES = ("flag", "preliminary", "withhold")
DEFAULT_POLICY = "preliminary"
_OUT_OF_RANGE = {"flag": FINAL, "preliminary": PRELIMINARY, "withhold": WITHHELD}


def statuses(policy: str, out_of_range: ArrayLike | None, n_bags: int) -> NDArray[Any]:
    """The status of each bag's answer under ``policy``.

    Parameters
    ----------
    policy : {"flag", "preliminary", "withhold"}
    out_of_range : array-like of bool, shape (n_bags,), or None
        The domain check's flags; ``None`` for a model without a domain check (every
        answer final).
    n_bags : int

    Returns
    -------
    ndarray of str, shape (n_bags,)
        ``"final"``, ``"preliminary"`` or ``"withheld"`` per bag.
    """
    if policy not in POLICIES:
        raise ValueError(f"out-of-domain policy must be one of {POLICIES}, got {policy!r}")
    out = np.full(n_bags, FINAL, dtype=f"<U{len(PRELIMINARY)}")
    if out_of_range is not None:
        out[np.asarray(out_of_range, dtype=bool)] = _OUT_OF_RANGE[policy]
    return out


def withheld_reason(score: float, threshold: float | None) -> str:
    """Why a bag's answer was withheld, in words for the report."""
    above = f" (the model's threshold is {threshold:.4g})" if threshold is not None else ""
    return (
        f"withheld: the sample lies outside the model's applicability domain, domain score "
        f"{score:.4g}{above}; the model's out-of-domain policy withholds such answers: "
        "review the sample or measure it again"
    )


def review_warnings(result: Prediction, ids: Sequence[str]) -> list[str]:
    """What should change a reviewer's reading of the answers, one line each: bags
    outside the applicability domain, then cells clipped into the training range
    (:func:`bag_warnings`, all bags' lines of each kind together).

    Routine facts about the input (channels the model does not use, compensation
    applied) are notes, not warnings: a warning shown on every sample teaches its
    readers to skip warnings.
    """
    per_bag = [_bag_warnings(result, ids, i) for i in range(len(ids))]
    return [w for kind in (0, 1) for lines in per_bag for w in lines[kind]]


def bag_warnings(result: Prediction, ids: Sequence[str]) -> list[list[str]]:
    """:func:`review_warnings` bag by bag: the lines about each bag (a table's row)."""
    return [[w for lines in _bag_warnings(result, ids, i) for w in lines] for i in range(len(ids))]


def _bag_warnings(result: Prediction, ids: Sequence[str], i: int) -> tuple[list[str], list[str]]:
    """Bag ``i``'s warning lines: (outside the domain, cells clipped)."""
    domain: list[str] = []
    clipped: list[str] = []
    bag_id = ids[i]
    if result.domain is not None and bool(result.domain.out_of_range[i]):
        score = float(result.domain.score[i])
        domain.append(
            f"bag {bag_id!r} lies outside the model's applicability domain (domain "
            f"score {score:.3g}; the training bags score about 1): the answer is "
            f"{result.status_of(i)}; do not trust it without review"
        )
    if result.clipped is not None:
        n, size = int(result.clipped[i]), int(result.sizes[i])
        if n:
            clipped.append(
                f"bag {bag_id!r}: {n} of {size} cell(s) lie outside the model's "
                "training range and were clipped into it"
            )
    return domain, clipped
