"""Evaluating a saved model on new data, on the bags it did not see in training.

Evaluation and the training bags
--------------------------------
The manifest records every training bag (``training_bags``: its name relative to the
configuration, the sha256 of its file and the sha256 of its cells in panel order).
:func:`evaluate` matches the evaluated bags against them and reports metrics on the
unseen bags only, unless asked to include the training bags (their metrics are
optimistic). Models saved before this record existed have an unknown overlap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .. import report
from ..errors import ConfigError, DataError
from ..hashing import file_sha256
from .config import load_config
from .data import bag_fingerprints, bag_names, read_data, training_overlap


class EvaluationOverlapError(DataError):
    """Every evaluated bag was one of the model's training bags: there is nothing
    unseen to evaluate on (``include_training=True`` evaluates on them anyway)."""


def evaluate(
    model_path: str | Path,
    config_path: str | Path,
    *,
    include_training: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Metrics of a saved model on the data of a configuration's [data] table, on the
    bags it did not see in training.

    The evaluated bags are matched with the training bags the manifest records
    (``training_bags``: the sha256 of each file and of its cells), so that training
    bags, on which the model is optimistic, are never reported as if unseen.

    Parameters
    ----------
    model_path : path
        The artifact.
    config_path : path
        A TOML file whose ``[data]`` table names the bags and their labels (a
        training configuration will do; its other tables are not read).
    include_training : bool, default=False
        Report the metrics on every bag, training bags included, and the unseen
        bags' metrics under ``"unseen_only"``. Without it only the unseen bags count.
    progress : bool, default=False
        Show a progress bar while reading.

    Returns
    -------
    dict
        The metrics (``rmse``, ``mae``, ``r2`` or ``accuracy``, ``macro_f1``, ...) of
        the bags ``evaluated_on`` names, and: ``n_bags`` (evaluated bags read),
        ``overlap`` (``"known"`` or ``"unknown"``), ``n_overlapping`` and
        ``overlapping`` (names of the bags that were training bags; ``None`` when
        unknown), ``n_unseen``, ``evaluated_on`` (``"unseen bags only"``,
        ``"all bags, training bags included"``, or ``"all bags, overlap unknown"``),
        ``unseen_only`` (with ``include_training``: ``n_bags`` and the metrics of the
        unseen bags, or ``None`` when there are none), and ``note``, one sentence
        saying what was evaluated.

    Raises
    ------
    EvaluationOverlapError
        Every evaluated bag is a training bag and ``include_training`` is false.
    ConfigError
        The configuration gives no labels.
    """
    from ..runtime import ModelRuntime

    runtime = ModelRuntime.open(model_path)
    # Only [data] is read: a file of the data alone will do, and so does a training
    # configuration (the model's own panel and compensation are used, not its tables).
    config = load_config(config_path, required=("data",))
    data = read_data(
        config,
        panel=runtime.info.panel,
        progress=progress,
        compensation=runtime.info.preprocessing.compensation,
    )
    if data.y is None:
        raise ConfigError("[data] gives no labels to evaluate against")
    classifier = runtime.info.classifies
    y = data.y if classifier else data.y.astype(np.float64)
    pred = runtime.predict(data.bags).estimate
    T = len(data.bags)
    names = bag_names(config, data.files)
    seen = training_overlap(
        runtime.info.metadata,
        bag_fingerprints(
            names, [file_sha256(f) for f in data.files], [data.bags[t] for t in range(T)]
        ),
    )
    if seen is None:
        note = (
            f"the model records no fingerprints of its training bags (saved before they "
            f"were recorded): overlap with the {T} evaluated bag(s) unknown; metrics are "
            "on all of them"
        )
        return {
            **report.metrics(y, pred, classifier),
            "n_bags": T,
            "overlap": "unknown",
            "n_overlapping": None,
            "overlapping": None,
            "n_unseen": None,
            "evaluated_on": "all bags, overlap unknown",
            "note": note,
        }
    overlapping = [n for n, s in zip(names, seen, strict=True) if s]
    unseen = np.flatnonzero(~seen)
    if unseen.size == 0 and not include_training:
        raise EvaluationOverlapError(
            f"all {T} evaluated bag(s) were used to train this model (matched by sha256), "
            "so none is unseen and their metrics would be optimistic; evaluate on other "
            "bags, or pass --include-training (include_training=True) to report them anyway"
        )
    if data.level == "cell":
        # Per-cell labels: a bag's rows are its cells.
        rows = [np.arange(data.bags.offsets[t], data.bags.offsets[t + 1]) for t in unseen]
        keep = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    else:
        keep = unseen
    unseen_metrics = report.metrics(y[keep], pred[keep], classifier) if unseen.size else None
    base = {
        "n_bags": T,
        "overlap": "known",
        "n_overlapping": len(overlapping),
        "overlapping": overlapping,
        "n_unseen": int(unseen.size),
    }
    if include_training:
        unseen_part = (
            f"and on the {unseen.size} unseen bag(s) under unseen_only"
            if unseen.size
            else "and no bag is unseen (unseen_only is null)"
        )
        note = (
            f"{len(overlapping)} of {T} evaluated bag(s) were used to train the model; "
            f"metrics are on all bags, training bags included (optimistic), {unseen_part}"
        )
        return {
            **report.metrics(y, pred, classifier),
            **base,
            "evaluated_on": "all bags, training bags included",
            "unseen_only": None
            if unseen_metrics is None
            else {"n_bags": int(unseen.size), **unseen_metrics},
            "note": note,
        }
    note = (
        f"{len(overlapping)} of {T} evaluated bag(s) were used to train the model and are "
        f"left out; metrics are on the {unseen.size} unseen bag(s) "
        "(--include-training to report all)"
        if overlapping
        else f"none of the {T} evaluated bag(s) was used to train the model"
    )
    assert unseen_metrics is not None
    return {**unseen_metrics, **base, "evaluated_on": "unseen bags only", "note": note}
