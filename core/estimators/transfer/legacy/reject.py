"""The open-set outcome of a per-cell classifier: cells no population claims.

A gated sample holds cells no gate claims (debris, doublets, populations the panel
does not resolve: 17-29 % of the FlowCAP-I samples). They are not one population:
modelled as one class they are a heterogeneous mixture that a classifier's boundaries
cut through. With a *rest label* named (``unassigned=``), such cells are a class
during training and, at prediction, a cell also becomes unassigned when no population
claims it with enough confidence: its best score among the populations (the rest class
excluded) falls below a threshold ``θ``.

The scores are the one-vs-rest ridge codes ``±1``, whose least-squares target is
``E[Y_k | x] = 2 P(k | x) - 1``: ``θ`` reads as a posterior ``(1 + θ) / 2`` (for two
classes, the margin of the population over the rest). Which threshold, if any, is
chosen by the model's own folds (:func:`choose_reject`), never assumed: on the
emulated instrument batches of ``bench/bench_new_batch.py`` no reject rule beat the
rest class modelled as a class, and a rule the folds cannot show helping is off.

Without a rest label a cell far from every population can still be reported
unassigned on request (:func:`far_from_populations`): its squared Mahalanobis
distance to the population it was given, under that population's training
covariance, exceeds the χ² quantile of the requested level (a Gaussian description
of each population, which the caller asks for knowingly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ....bags import Bags, BagValidationError
from ..open_set import UNASSIGNED, far_from_populations, population_statistics
from ..trees import class_codes
from .cv import FoldEvaluator, content_digest, one_standard_error_record

__all__ = [
    "REJECT_THRESHOLDS",
    "UNASSIGNED",
    "OpenSetMixin",
    "choose_reject",
    "far_from_populations",
    "population_statistics",
    "reject_scores",
]

#: Thresholds on the best population score the folds choose among (posteriors
#: 0.25, 0.375, 0.5 and 0.625 under the ±1 coding); "off" is tried first.
REJECT_THRESHOLDS = (-0.5, -0.25, 0.0, 0.25)


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


def choose_reject(
    members: list[tuple[FoldEvaluator, dict[str, Any]]],
    answer: Callable[[NDArray[np.float64], NDArray[np.float64]], NDArray[np.float64]] | None,
    rest: int,
    thresholds: tuple[float, ...] = REJECT_THRESHOLDS,
) -> dict[str, Any]:
    """The reject threshold, by the one-standard-error rule with the rule off first.

    Each threshold is scored on the members' own folds at their chosen ``λ``, on the
    answers the model gives (``answer``: its refinement, where it refines), every
    cell counted (the rest class included): the rule must lower the error of all
    cells by more than the folds' noise to be switched on. A model of several members
    counts, fold by fold, as its worst member.

    Returns
    -------
    dict
        ``cv_error`` and ``fold_errors`` per option (``"off"`` and each threshold as a
        string), ``chosen`` (the option's name) and ``threshold`` (a float or None).
    """

    # Every threshold sees the same held-out answers: the refinement (a mixture fitted
    # to each held-out task) runs once per task and answer, not once per threshold.
    answered: dict[str, NDArray[np.float64]] = {}

    def given(points: NDArray[np.float64], scores: NDArray[np.float64]) -> NDArray[np.float64]:
        if answer is None:
            return scores
        key = content_digest(points, scores)
        if key not in answered:
            answered[key] = answer(points, scores)
        return answered[key]

    def transform(theta: float | None):
        def apply(points: NDArray[np.float64], scores: NDArray[np.float64]):
            return reject_scores(given(points, scores), rest, theta)

        return apply

    options: dict[str, float | None] = {"off": None, **{f"{t:g}": t for t in thresholds}}
    per_fold: dict[str, NDArray[np.float64]] = {}
    for name, theta in options.items():
        errs = []
        for ev, best in members:
            other = ev.transformed(transform(theta), best["alpha"])
            other.score(best)
            errs.append(other.fold_errors[FoldEvaluator.key(best)][:, 0])
        per_fold[name] = np.max(errs, axis=0)
    record = one_standard_error_record(per_fold, "one standard error, off first")
    record["threshold"] = options[record["chosen"]]
    return record


class OpenSetMixin:
    """The rest class and the reject threshold of a fitted model (mixed into the
    estimator)."""

    def _rest_code(self) -> int | None:
        """Column of the rest class (``unassigned``) among ``classes_``, or None."""
        if self.unassigned is None or not self._is_classifier:
            return None
        names = self.classes_.tolist()
        # Labels read from files are strings; a number given in Python names "0" too.
        where = [k for k, c in enumerate(names) if c == self.unassigned] or [
            k for k, c in enumerate(names) if str(c) == str(self.unassigned)
        ]
        if not where:
            raise BagValidationError(
                [
                    f"unassigned={self.unassigned!r} names no training label; the labels "
                    f"are {self.classes_.tolist()}"
                ]
            )
        return int(where[0])

    def _fit_open_set(self, tasks: Bags, Y: NDArray[np.float64]) -> None:
        """The open-set state: the rest class's column, the reject threshold (chosen by
        the folds, fixed, or off) and every population's Gaussian description for
        :meth:`far_from_populations`, on the tasks as the model sees them."""
        self.rest_code_ = self._rest_code()
        record = self.selection_.get("reject")
        if record is not None:
            self.reject_threshold_ = record["threshold"]
        elif self.rest_code_ is not None and isinstance(self.reject, int | float):
            self.reject_threshold_ = float(self.reject)
        else:
            self.reject_threshold_ = None
        if not self._is_classifier:
            return
        codes = class_codes(Y)
        self.population_means_, self.population_precisions_ = population_statistics(
            tasks.points, codes, self.classes_.size, self.rest_code_
        )

    def _reject_options(self) -> tuple[float, ...] | None:
        """The thresholds the folds choose among, or None when ``reject`` fixes one."""
        if self.reject == "auto":
            return REJECT_THRESHOLDS
        if self.reject == "off" or isinstance(self.reject, int | float):
            return None
        raise ValueError(f"reject must be 'auto', 'off' or a number, got {self.reject!r}")
