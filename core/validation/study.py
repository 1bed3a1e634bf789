"""The validation study: a saved model run as served on samples with reference results,
compared with them, judged against the acceptance limits.

:func:`validate` reads each sample file once (its sha256 is of the bytes decoded),
aligns it with the model's panel and compensation, and predicts with one BLAS thread
through :class:`~core.runtime.ModelRuntime`, which applies the model's out-of-domain
policy: the path ``bagserve predict`` and the service take, so the results compared
are the ones a laboratory would receive. It returns the study as one JSON-able
document; :mod:`.outputs` writes it as ``validation.json``, ``validation.html`` and
``per_sample.csv``, each built from that document alone.

What is compared depends on the model (:class:`~core.results.ModelKind`):

* regressors and conditional models: the value of each sample against its reference
  value (quantitative: Bland–Altman, Deming, Passing–Bablok, correlation);
* bag classifiers: the class of each sample against its reference class
  (qualitative: concordance, sensitivity, specificity, PPV, NPV, kappa);
* per-cell classifiers: each population's percent of the sample's cells against the
  reference gates' (quantitative, one analysis per population), and the label of
  every cell against its reference gate (qualitative: over all cells, and per sample).

A sample the model declined (withheld by its policy, or outside its applicability
domain) is counted and listed, and every analysis is given twice: on all samples and
without the declined ones. A sample the model was trained on (matched by the sha256
of its file or its cells) is refused: agreement on it says nothing about new samples.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, DataError
from ..hashing import file_sha256, json_sha256
from ..policy import WITHHELD, bag_warnings
from .acceptance import judge, overall
from .agreement import bland_altman, proportional_trend
from .config import ValidationConfig, load_validation_config
from .precision import MISSING_REPLICATES, precision
from .qualitative import qualitative_agreement
from .regression import correlation, deming, passing_bablok

__all__ = ["PER_SAMPLE_COLUMNS", "SCHEMA", "TrainingSampleError", "validate"]

SCHEMA = "bagserve-validation/1"
#: The fields of a per-sample row, in the order every output shows them (a model's
#: kind fills some of them).
PER_SAMPLE_COLUMNS = (
    "sample",
    "file",
    "sha256",
    "measurand",
    "reference",
    "model",
    "difference",
    "agrees",
    "cell_concordance",
    "status",
    "out_of_domain",
    "domain_score",
    "declined",
)
#: The two analysis sets every statistic is given for.
SETS = ("all", "without_declined")


class TrainingSampleError(DataError):
    """A validation sample is one the model was trained on."""


def validate(model: str | Path | Any, data: str | Path | ValidationConfig) -> dict[str, Any]:
    """Validate a saved model against reference results, as a laboratory director signs.

    Parameters
    ----------
    model : path or ModelRuntime
        The saved model's directory, or its runtime already open.
    data : path or ValidationConfig
        The validation file (:mod:`core.validation.config`).

    Returns
    -------
    dict
        The study (schema ``bagserve-validation/1``): ``model``, ``data`` (files and
        sha256), ``software``, ``created``, ``samples`` (counts and the declined
        ones), ``per_sample`` rows, ``quantitative`` and ``qualitative`` analyses
        per set (``all``, ``without_declined``), ``precision``, ``acceptance`` rows
        and the ``verdict``.

    Raises
    ------
    ConfigError
        The validation file is wrong, or a limit applies to nothing this model gives.
    DataError
        A file cannot be read, lacks a reference result or a marker, or was a
        training sample (:class:`TrainingSampleError`).
    """
    from .. import __version__
    from ..results import ModelKind
    from ..runtime import ModelRuntime

    runtime = model if isinstance(model, ModelRuntime) else ModelRuntime.open(model)
    config = data if isinstance(data, ValidationConfig) else load_validation_config(data)
    info = runtime.info
    kind = info.kind
    if kind is ModelKind.CELL and not info.classifies:
        raise ConfigError(
            "validate compares per-cell classifiers and bag-level models; a per-cell "
            "regressor is not supported"
        )
    cfg = config.data
    files, names, digests, references, result, seen = _predicted_references(runtime, cfg)
    status = np.array([result.status_of(i) for i in range(result.n_bags)])
    domain = result.domain
    out_of_domain = (
        np.zeros(len(names), bool) if domain is None else np.asarray(domain.out_of_range, bool)
    )
    declined = (status == WITHHELD) | out_of_domain
    warnings = bag_warnings(result, names)
    base_rows = [
        {
            "sample": names[i],
            "file": Path(files[i]).name,
            "sha256": digests[i],
            "status": str(status[i]),
            "out_of_domain": bool(out_of_domain[i]),
            "domain_score": None if domain is None else float(domain.score[i]),
            "declined": bool(declined[i]),
        }
        for i in range(len(names))
    ]
    quantitative = qualitative = None
    if kind is ModelKind.CELL:
        per_sample, quant_input, qual_input = _cell_results(result, references, base_rows)
    elif info.classifies:
        per_sample, quant_input, qual_input = _class_results(result, references.y, base_rows)
    else:
        per_sample, quant_input, qual_input = _value_results(result, references.y, info, base_rows)
    if quant_input is not None:
        quantitative = {s: _quantitative(quant_input, declined, s, config) for s in SETS}
    if qual_input is not None:
        qualitative = {s: _qualitative(qual_input, declined, s, config) for s in SETS}
    meta = info.metadata
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "title": config.report.get("title", "Method comparison: model against reference method"),
        "laboratory": config.report.get("laboratory"),
        "reference_method": config.report.get("method", "the laboratory's reference method"),
        "created": dt.datetime.now(dt.UTC)
        .replace(microsecond=0)
        .isoformat()
        .replace("+00:00", "Z"),
        "software": {"bagserve": __version__},
        "model": _model_section(info, kind, meta),
        "data": {
            "validation_file": {"name": config.path.name, "sha256": config.sha256},
            "tables": _tables(cfg, config),
            "files": [
                {"sample": r["sample"], "file": r["file"], "sha256": r["sha256"]} for r in base_rows
            ],
        },
        "training_overlap": "none"
        if seen is not None
        else "unknown (the model records no training samples)",
        "samples": {
            "n": len(names),
            "n_declined": int(declined.sum()),
            "n_withheld": int((status == WITHHELD).sum()),
            "n_out_of_domain": int(out_of_domain.sum()),
            "declined": [
                {
                    **{k: r[k] for k in ("sample", "status", "out_of_domain", "domain_score")},
                    "warnings": warnings[i],
                }
                for i, r in enumerate(base_rows)
                if r["declined"]
            ],
        },
        "statistics": {
            "confidence": config.confidence,
            "error_ratio": config.error_ratio,
            "interval": config.interval,
        },
        "per_sample": per_sample,
        "quantitative": quantitative,
        "qualitative": qualitative,
        "precision": _precision(config, quant_input, files),
    }
    rows = judge(config.acceptance, quantitative, qualitative)
    doc["acceptance"] = rows
    doc["verdict"] = overall(rows)
    doc = _json_values(doc)
    # The digest the printed page shows, so that a signed printout names its JSON.
    doc["sha256"] = json_sha256(doc, exclude=("sha256",))
    return doc


def _predicted_references(
    runtime: Any, cfg: Mapping[str, Any]
) -> tuple[list[str], list[str], list[str], Any, Any, Any]:
    """The validation files read (each once), predicted as served and checked against
    their reference results and the model's training samples: (files, names, sha256s,
    references, the prediction, which were training samples or None)."""
    from ..blas import one_thread
    from ..io import read_file
    from ..training.data import bag_fingerprints, bag_names, read_data, training_overlap

    info = runtime.info
    configured = _configured_files(cfg)
    references = read_data(cfg, panel=info.panel, compensation=info.preprocessing.compensation)
    if references.y is None:
        raise ConfigError(
            "[data] gives no reference results (labels, cell_label_files or cell_label_column)"
        )
    files = [str(f) for f in references.files]
    missing = sorted({Path(f).name for f in configured} - {Path(f).name for f in files})
    if missing:
        raise DataError(f"[data] {len(missing)} file(s) have no reference result: {missing[:10]}")
    names = bag_names(cfg, files)
    samples, digests = map(list, zip(*(read_file(f) for f in files), strict=True))
    with one_thread():
        bags = runtime.align(samples)
        result = runtime.predict(bags)
    if not np.array_equal(np.asarray(bags.sizes), np.asarray(references.bags.sizes)):
        raise DataError(
            "the reference labels do not match the cells of the files (row counts differ)"
        )
    seen = training_overlap(
        info.metadata, bag_fingerprints(names, digests, [bags[t] for t in range(len(bags))])
    )
    if seen is not None and seen.any():
        trained = [n for n, s in zip(names, seen, strict=True) if s]
        raise TrainingSampleError(
            f"{len(trained)} of {len(names)} validation sample(s) were used to train this model "
            f"(matched by sha256): {trained[:10]}; validate on samples it did not see"
        )
    return files, names, digests, references, result, seen


def _model_section(info: Any, kind: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The study's ``model``: what was validated, by whom it was signed, its policy."""
    from ..signing import signature_key_sha256

    config_model = (
        (meta.get("config") or {}).get("model", {})
        if isinstance(meta.get("config"), Mapping)
        else {}
    )
    return {
        "name": meta.get("name"),
        "version": meta.get("version"),
        "sha256": info.sha256,
        "estimator": info.estimator,
        "kind": str(kind),
        "signer_key_sha256": signature_key_sha256(info.path) or None,
        "out_of_domain_policy": info.out_of_domain_policy,
        "intended_use": config_model.get("intended_use"),
    }


def _json_values(value: Any) -> Any:
    """The document in JSON's values: a statistic that is not a finite number (an
    interval open at one end, a correlation of constant results) becomes null."""
    if isinstance(value, Mapping):
        return {str(k): _json_values(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_values(v) for v in value]
    if isinstance(value, float | np.floating):
        return float(value) if np.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def _configured_files(cfg: Mapping[str, Any]) -> list[Path]:
    from ..training.config import resolve_path

    return resolve_path(Path(cfg["_base"]), cfg["data"]["files"])


def _tables(cfg: Mapping[str, Any], config: ValidationConfig) -> list[dict[str, str]]:
    """The reference and replicate tables the study read, with their sha256."""
    base = Path(cfg["_base"])
    paths = [base / cfg["data"][k] for k in ("labels",) if cfg["data"].get(k)]
    if config.replicates is not None:
        paths.append(Path(config.replicates["path"]))
    return [{"name": p.name, "sha256": file_sha256(p)} for p in paths]


# A quantitative input: per measurand, (reference, model) arrays over the samples.
Measurands = dict[str, tuple[np.ndarray, np.ndarray]]
# A qualitative input: (reference, model) labels, the sample of each label, the classes,
# and the samples' names when each sample has many labels (its cells).
Labels = tuple[np.ndarray, np.ndarray, np.ndarray, list[str], list[str] | None]


def _value_results(
    result: Any, y: np.ndarray, info: Any, rows: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], Measurands, None]:
    model = np.asarray(result.estimate, dtype=np.float64)
    if model.ndim > 1 and model.shape[1] != 1:
        raise ConfigError(
            f"validate compares one result per sample; this model gives {model.shape[1]}"
        )
    model = model.reshape(-1)
    try:
        reference = np.asarray(y, dtype=np.float64)
    except ValueError as exc:
        raise DataError(
            f"[data] reference results must be numbers for a regressor ({exc})"
        ) from exc
    name = str(info.metadata.get("name") or "result")
    out = [
        {
            **r,
            "measurand": name,
            "reference": float(reference[i]),
            "model": float(model[i]),
            "difference": float(model[i] - reference[i]),
        }
        for i, r in enumerate(rows)
    ]
    return out, {name: (reference, model)}, None


def _class_results(
    result: Any, y: np.ndarray, rows: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], None, Labels]:
    classes = [str(c) for c in np.asarray(result.classes).tolist()]
    reference = _label_keys(y)
    model = np.asarray(result.estimate).astype(str)
    unknown = sorted(set(reference.tolist()) - set(classes))
    if unknown:
        raise DataError(
            f"reference class(es) {unknown[:10]} are none of the model's classes {classes}"
        )
    out = [
        {
            **r,
            "reference": str(reference[i]),
            "model": str(model[i]),
            "agrees": bool(reference[i] == model[i]),
        }
        for i, r in enumerate(rows)
    ]
    return out, None, (reference, model, np.arange(len(rows)), classes, None)


def _cell_results(
    result: Any, references: Any, rows: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], Measurands, Labels]:
    classes = [str(c) for c in np.asarray(result.classes).tolist()]
    reference = _label_keys(references.y)
    model = np.asarray(result.labels).astype(str)
    unknown = sorted(set(reference.tolist()) - set(classes))
    if unknown:
        raise DataError(
            f"reference label(s) {unknown[:10]} are none of the model's populations {classes}; "
            "map them with [data] label_map or [labels] unassigned"
        )
    sizes = np.asarray(result.sizes)
    bag = np.repeat(np.arange(sizes.size), sizes)
    k = len(classes)
    found, inverse = np.unique(reference, return_inverse=True)
    ref_code = np.array([classes.index(c) for c in found.tolist()], dtype=np.int64)[inverse]
    ref_counts = np.bincount(bag * k + ref_code, minlength=sizes.size * k).reshape(sizes.size, k)
    model_counts = np.asarray(result.counts)
    total = np.maximum(sizes, 1)[:, None]
    ref_pct, model_pct = 100.0 * ref_counts / total, 100.0 * model_counts / total
    agree = np.bincount(bag, weights=(reference == model).astype(float), minlength=sizes.size)
    out = []
    for i, r in enumerate(rows):
        for c, name in enumerate(classes):
            out.append(
                {
                    **r,
                    "measurand": f"{name} (% of cells)",
                    "reference": float(ref_pct[i, c]),
                    "model": float(model_pct[i, c]),
                    "difference": float(model_pct[i, c] - ref_pct[i, c]),
                    "cell_concordance": float(agree[i] / max(int(sizes[i]), 1)),
                }
            )
    measurands = {
        f"{name} (% of cells)": (ref_pct[:, c], model_pct[:, c]) for c, name in enumerate(classes)
    }
    names = [r["sample"] for r in rows]
    return out, measurands, (reference, model, bag, classes, names)


def _label_keys(y: np.ndarray) -> np.ndarray:
    """Reference labels as the model's classes are written (``1.0`` reads ``"1"``),
    converted once per distinct label, not per cell."""
    from ..training.data import label_key

    found, inverse = np.unique(np.asarray(y), return_inverse=True)
    return np.array([label_key(v) for v in found.tolist()], dtype=str)[inverse.reshape(-1)]


def _attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """A statistic's dictionary, or why it could not be estimated."""
    try:
        value = fn(*args, **kwargs)
    except ValueError as exc:
        return {"not_estimable": str(exc)}
    return value.to_dict() if hasattr(value, "to_dict") else value


def _quantitative(
    measurands: Measurands, declined: np.ndarray, which: str, config: ValidationConfig
) -> list[dict[str, Any]]:
    keep = np.ones(declined.size, bool) if which == "all" else ~declined
    conf = config.confidence
    out = []
    for name, (ref, mod) in measurands.items():
        x, y = ref[keep], mod[keep]
        positive = bool(np.all(x > 0) and np.all(y > 0))
        out.append(
            {
                "measurand": name,
                "n": int(x.size),
                "bland_altman": _attempt(bland_altman, x, y, confidence=conf),
                "ratio": _attempt(bland_altman, x, y, scale="ratio", confidence=conf)
                if positive
                else {"not_estimable": "the ratio scale needs every result > 0"},
                "trend": _attempt(proportional_trend, x, y),
                "deming": _attempt(deming, x, y, error_ratio=config.error_ratio, confidence=conf),
                "passing_bablok": _attempt(passing_bablok, x, y, confidence=conf),
                "correlation": _attempt(correlation, x, y, confidence=conf),
            }
        )
    return out


def _qualitative(
    labels: Labels, declined: np.ndarray, which: str, config: ValidationConfig
) -> dict[str, Any]:
    reference, model, owner, classes, names = labels
    keep = np.ones(reference.size, bool) if which == "all" else ~declined[owner]
    options = {"interval": config.interval, "confidence": config.confidence}
    out = qualitative_agreement(reference[keep], model[keep], classes, **options)
    if names is not None:
        # Per sample (its cells), for the samples of the set: one call per sample, not
        # per cell.
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(len(names) + 1))
        out["per_sample"] = []
        for i, name in enumerate(names):
            if which != "all" and declined[i]:
                continue
            at = order[bounds[i] : bounds[i + 1]]
            one = qualitative_agreement(reference[at], model[at], classes, **options)
            out["per_sample"].append(
                {"sample": name, **{k: one[k] for k in ("n", "concordance", "kappa", "per_class")}}
            )
    return out


def _precision(
    config: ValidationConfig, measurands: Measurands | None, files: Sequence[str]
) -> dict[str, Any]:
    from ..io import read_file_table

    if config.replicates is None:
        return {"rows": [], "note": MISSING_REPLICATES}
    if measurands is None:
        return {
            "rows": [],
            "note": "Precision is estimated for quantitative results; this model's are classes.",
        }
    rep = config.replicates
    names = [Path(f).name for f in files]
    specimen = read_file_table(rep["path"], rep["file_column"], rep["specimen_column"])
    missing = [n for n in names if not specimen.get(n)]
    if missing:
        raise ConfigError(
            f"[precision] {Path(rep['path']).name} names no specimen for {missing[:10]}"
        )
    runs = None
    try:
        table = read_file_table(rep["path"], rep["file_column"], rep["run_column"])
    except DataError:
        table = None  # the run column is optional
    if table is not None:
        runs = [table.get(n, "") for n in names]
    specimens = [specimen[n] for n in names]
    rows = [
        {"measurand": name, **row}
        for name, (_, model) in measurands.items()
        for row in precision(model, specimens, runs)
    ]
    note = (
        None
        if rows
        else "No specimen in the replicates table was measured more than once. "
        + MISSING_REPLICATES
    )
    return {"rows": rows, "note": note}
