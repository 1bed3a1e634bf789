"""The one table of answers: the columns of every CSV door, and its rows.

``Accept: text/csv`` on a predict route, ``bagserve predict --format csv`` and
``bagserve batch`` write the same table: the same columns, in the same order, built
here. The columns are decided by the model (its kind, classes and outputs, as
:meth:`~bagserve.core.artifact_info.ArtifactInfo.describe` gives them, also to a remote
client) and by the request (:class:`~.options.PredictOptions`) before any bag is
predicted, never by a bag's answer: a withheld bag, whose answer has no value, or a
failed file cannot shift the columns of the bags after it.

``id``, then the values (by kind, below), then the trust columns of every row:
``status`` (``final``, ``preliminary``, ``withheld``, or ``failed`` for a file that
could not be predicted), ``out_of_range``, ``domain_score``, ``withheld_reason``,
``input_sha256``, ``model_sha256``, ``warnings``, ``error``.

* regression: ``prediction`` (``prediction_0``... for several outputs); with an
  interval ``interval_lo``, ``interval_hi``;
* classification: ``prediction``, ``score_<class>`` per class, ``p_<class>`` per class
  (calibrated models), ``set`` with an interval's coverage (the conformal set,
  classes joined by ``|``);
* conditional: ``prediction`` (the mean), ``q_<level>`` per quantile asked,
  ``p_gt_<t>`` per threshold asked, then the interval;
* per-cell, one row per cell (``cells=true``): ``cell``, ``label``, and ``p_<class>``
  with ``probabilities=true``;
* per-cell, one row per bag (``cells=false``, and ``bagserve batch``): ``n_cells``,
  then ``count_<class>`` and ``percent_<class>`` per class (``unassigned`` added when
  asked and the model has no rest class), then ``mean_probability_<class>`` (models
  with calibrated probabilities, without ``unassigned``).

A withheld bag's value cells are empty and ``withheld_reason`` says why; a failed
file's are empty and ``error`` says why.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from bagserve.core.artifact_info import ArtifactInfo
from bagserve.core.io.spreadsheet import SafeWriter
from bagserve.core.policy import bag_warnings
from bagserve.core.results import (
    CellPrediction,
    ClassificationPrediction,
    ConditionalPrediction,
    ModelKind,
    Prediction,
)

from .options import PredictOptions

__all__ = ["FAILED", "TRUST_COLUMNS", "TableLayout", "csv_bytes", "level_names"]

#: The columns every row ends with.
TRUST_COLUMNS = (
    "status",
    "out_of_range",
    "domain_score",
    "withheld_reason",
    "input_sha256",
    "model_sha256",
    "warnings",
    "error",
)
#: The status of a file that could not be predicted (``bagserve batch``).
FAILED = "failed"
#: The label of cells far from every population (per-cell classifiers, on request):
#: the estimators' own (``transfer.open_set.UNASSIGNED``), restated so that laying out a
#: table does not import them (tests/test_tables.py checks the two agree).
UNASSIGNED = "unassigned"


def level_names(values: Iterable[float]) -> list[str]:
    """Quantile levels and thresholds as they name columns and JSON keys (``0.05``)."""
    return [f"{v:g}" for v in values]


@dataclass(frozen=True)
class TableLayout:
    """The columns of a model's answers to one kind of request.

    Build it with :meth:`of`; every field follows from the model and the request.
    """

    kind: ModelKind
    classes: tuple[str, ...] = ()
    n_outputs: int = 1
    interval: bool = False
    sets: bool = False
    probabilities: bool = False
    mean_probabilities: bool = False
    cells: bool = False
    levels: tuple[str, ...] = ()
    thresholds: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: Mapping[str, Any], options: PredictOptions) -> TableLayout:
        """The layout of ``model``'s answers to a request asking ``options``.

        Parameters
        ----------
        model : mapping
            The model as :meth:`~bagserve.core.artifact_info.ArtifactInfo.describe` (and
            ``GET /v1/models/{name}``) gives it: ``kind``, ``classes``, ``n_outputs``,
            ``calibrated``, ``cell_probabilities``.
        options : PredictOptions
            What the request asks, already checked against the model (an interval
            only where the model gives one).
        """
        kind = ModelKind(model["kind"])
        classes = tuple(str(c) for c in model.get("classes") or ())
        asked_interval = options.coverage is not None
        if kind is ModelKind.CELL:
            added = options.unassigned is not None and classes and UNASSIGNED not in classes
            return cls(
                kind,
                classes + ((UNASSIGNED,) if added else ()),
                cells=options.cells,
                probabilities=options.cells and options.probabilities,
                mean_probabilities=bool(classes)
                and bool(model.get("cell_probabilities"))
                and not added,
            )
        if kind is ModelKind.CLASSIFICATION:
            return cls(
                kind,
                classes,
                sets=asked_interval,
                probabilities=bool(model.get("calibrated")),
            )
        return cls(
            kind,
            n_outputs=int(model.get("n_outputs") or 1),
            interval=asked_interval,
            levels=tuple(level_names(options.quantiles)),
            thresholds=tuple(level_names(options.exceed)),
        )

    @property
    def values(self) -> list[str]:
        """The value columns, between ``id`` and the trust columns."""
        if self.kind is ModelKind.CELL:
            if self.cells:
                probs = [f"p_{c}" for c in self.classes] if self.probabilities else []
                return ["cell", "label", *probs]
            return [
                "n_cells",
                *(f"count_{c}" for c in self.classes),
                *(f"percent_{c}" for c in self.classes),
                *(f"mean_probability_{c}" for c in self.classes if self.mean_probabilities),
            ]
        if self.kind is ModelKind.CLASSIFICATION:
            return [
                "prediction",
                *(f"score_{c}" for c in self.classes),
                *(f"p_{c}" for c in self.classes if self.probabilities),
                *(["set"] if self.sets else []),
            ]
        if self.kind is ModelKind.CONDITIONAL:
            head = ["prediction", *(f"q_{v}" for v in self.levels)]
            head += [f"p_gt_{t}" for t in self.thresholds]
        elif self.n_outputs > 1:
            head = [f"prediction_{j}" for j in range(self.n_outputs)]
        else:
            head = ["prediction"]
        return head + (["interval_lo", "interval_hi"] if self.interval else [])

    @property
    def columns(self) -> list[str]:
        """Every column, in order."""
        return ["id", *self.values, *TRUST_COLUMNS]

    def failed(
        self, bag_id: str, error: str, *, input_sha256: str = "", model_sha256: str = ""
    ) -> list[Any]:
        """The row of a file that could not be predicted: ``status`` ``failed``, its
        value cells empty, ``error`` saying why (``input_sha256``: of the bytes tried,
        none for a file refused unread; ``model_sha256``: the model that tried)."""
        trust = {
            "status": FAILED,
            "input_sha256": input_sha256,
            "model_sha256": model_sha256,
            "error": error,
        }
        return [bag_id, *[""] * len(self.values), *(trust.get(c, "") for c in TRUST_COLUMNS)]

    def rows(
        self,
        result: Prediction,
        ids: Sequence[str],
        info: ArtifactInfo,
        *,
        inputs: Sequence[str] | None = None,
    ) -> Iterator[list[Any]]:
        """The rows of a typed answer: one per bag, or one per cell (``cells``).

        Raises
        ------
        ValueError
            The answer does not have this layout's classes, quantiles, thresholds,
            outputs, interval or set: a bug, never written as a shifted row.
        """
        self._check(result)
        warnings = bag_warnings(result, ids)
        domain = result.domain
        for i, bag_id in enumerate(ids):
            released = result.released(i)
            trust = [
                result.status_of(i),
                "" if domain is None else int(bool(domain.out_of_range[i])),
                "" if domain is None else float(domain.score[i]),
                "" if released or domain is None else info.withheld_reason(domain, i),
                "" if inputs is None else inputs[i],
                info.sha256,
                " | ".join(warnings[i]),
                "",
            ]
            if not released:
                yield [bag_id, *[""] * len(self.values), *trust]
                continue
            for values in _values(result, self, i):
                yield [bag_id, *values, *trust]

    def _check(self, result: Prediction) -> None:
        """Refuse an answer whose values would not fit this layout's columns."""
        kind = ModelKind(result.kind)
        if kind is not self.kind:
            raise ValueError(f"a {kind} answer in a table laid out for {self.kind} answers")
        classes = getattr(result, "classes", None)
        found = () if classes is None else tuple(str(c) for c in classes.tolist())
        problems = []
        if found != self.classes:
            problems.append(f"classes {list(found)} (the table's: {list(self.classes)})")
        problems += _misfits(result, self)
        if problems:
            raise ValueError(
                "the answer does not fit its table's columns: it has " + "; ".join(problems)
            )


def _interval(result: Prediction, layout: TableLayout, i: int) -> list[Any]:
    """Bag ``i``'s interval cells, where the layout has them."""
    return result.interval[i].tolist() if layout.interval and result.interval is not None else []


@functools.singledispatch
def _values(result: Prediction, layout: TableLayout, i: int) -> Iterator[list[Any]]:
    """The value cells of released bag ``i``'s rows, by the kind of the result: here
    one row, the estimate (one cell per output) and the interval."""
    yield np.atleast_1d(result.estimate[i]).tolist() + _interval(result, layout, i)


@_values.register
def _(result: ConditionalPrediction, layout: TableLayout, i: int) -> Iterator[list[Any]]:
    out = [result.mean[i].item(), *result.quantiles[i].tolist()]
    yield out + result.exceedance[i].tolist() + _interval(result, layout, i)


@_values.register
def _(result: ClassificationPrediction, layout: TableLayout, i: int) -> Iterator[list[Any]]:
    out = [result.labels[i].item(), *result.scores[i].tolist()]
    if layout.probabilities and result.probabilities is not None:
        out += result.probabilities[i].tolist()
    if layout.sets:
        out.append("|".join(str(c) for c in result.set_of(i)))
    yield out


@_values.register
def _(result: CellPrediction, layout: TableLayout, i: int) -> Iterator[list[Any]]:
    if layout.cells:
        # One row per cell: its index, its label and (asked for) its probabilities.
        labels = result.labels_of(i).tolist()
        p = result.probabilities_of(i) if layout.probabilities else None
        if p is None:
            for j, label in enumerate(labels):
                yield [j, label]
            return
        for j, (label, row) in enumerate(zip(labels, p.tolist(), strict=True)):
            yield [j, label, *row]
        return
    out: list[Any] = [int(result.sizes[i])]
    if result.counts is not None:
        counts = result.counts[i]
        total = max(int(counts.sum()), 1)
        out += counts.tolist()
        out += (100.0 * counts / total).tolist()
        if layout.mean_probabilities and result.mean_probabilities is not None:
            out += result.mean_probabilities[i].tolist()
    yield out


@functools.singledispatch
def _misfits(result: Prediction, layout: TableLayout) -> list[str]:
    """What of ``result`` (its kind already the layout's) does not fit the layout's
    columns, by the kind of the result: here a regression's interval and outputs."""
    return _estimate_misfits(result, layout)


def _estimate_misfits(result: Prediction, layout: TableLayout) -> list[str]:
    """A bag-level value's misfits: its interval and its number of outputs."""
    problems = []
    if (result.interval is not None) != layout.interval:
        problems.append("no interval" if layout.interval else "an interval")
    width = 1 if result.estimate.ndim == 1 else result.estimate.shape[1]
    if width != layout.n_outputs:
        problems.append(f"{width} outputs (the table's: {layout.n_outputs})")
    return problems


@_misfits.register
def _(result: ConditionalPrediction, layout: TableLayout) -> list[str]:
    problems = []
    levels = tuple(level_names(result.levels.tolist()))
    thresholds = tuple(level_names(result.thresholds.tolist()))
    if (levels, thresholds) != (layout.levels, layout.thresholds):
        problems.append(f"quantiles {levels} and thresholds {thresholds}")
    return problems + _estimate_misfits(result, layout)


@_misfits.register
def _(result: ClassificationPrediction, layout: TableLayout) -> list[str]:
    problems = []
    if (result.sets is not None) != layout.sets:
        problems.append("no prediction set" if layout.sets else "a prediction set")
    if (result.probabilities is not None) != layout.probabilities:
        problems.append("no class probabilities" if layout.probabilities else "class probabilities")
    return problems


@_misfits.register
def _(result: CellPrediction, layout: TableLayout) -> list[str]:
    problems = []
    if layout.cells and (result.probabilities is not None) != layout.probabilities:
        problems.append("no cell probabilities" if layout.probabilities else "cell probabilities")
    means = result.mean_probabilities is not None
    if not layout.cells and layout.classes and means != layout.mean_probabilities:
        problems.append(
            "no mean probabilities" if layout.mean_probabilities else "mean probabilities"
        )
    return problems


def csv_bytes(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> bytes:
    """The table as CSV (formula-safe cells, ``\\n`` line ends), header first."""
    buf = io.StringIO()
    writer = SafeWriter(buf, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows(rows)
    return buf.getvalue().encode()
