"""The validation study's TOML file: the samples, their reference results, the limits.

A validation file (see ``examples/yeast_dose/validate.toml``) has these tables; paths
are relative to the file::

    [data]         the samples and their reference results, as in a training
                   configuration: files (glob or list), labels (CSV) + file_column +
                   label_column for one reference result per sample (a value for a
                   regressor, a class for a classifier), or cell_label_files /
                   cell_label_column for the reference gate of every cell (per-cell
                   models); label_map; sample_column (a sample id in the labels table)
    [labels]       unassigned: the reference label of cells no population claims
    [statistics]   confidence (default 0.95), error_ratio (Deming's lambda, the
                   model's error variance over the reference's, default 1),
                   interval ("wilson" or "exact", default "wilson")
    [acceptance]   the limits, each [low, high]: bias, limits_of_agreement, ratio_bias
                   (ratio scale), slope, intercept (Deming and Passing–Bablok), r,
                   concordance, sensitivity, specificity, ppv, npv, kappa
                   (proportions as fractions, e.g. [0.95, 1.0])
    [precision]    replicates: a CSV naming each replicate's specimen (file_column,
                   specimen_column, run_column: default "file", "specimen", "run";
                   the run column is optional)
    [report]       laboratory, title, method (the reference method's name): shown in
                   the report's heading

Every file of ``[data]`` must have a reference result; a file without one is an error,
never silently left out.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..hashing import bytes_sha256
from .qualitative import INTERVALS

__all__ = ["ACCEPTANCE_KEYS", "ValidationConfig", "load_validation_config"]

#: The limits ``[acceptance]`` may set, and what each judges.
ACCEPTANCE_KEYS: dict[str, str] = {
    "bias": "Bland–Altman bias (model − reference)",
    "limits_of_agreement": "both 95 % limits of agreement",
    "ratio_bias": "Bland–Altman bias on the ratio scale (model / reference)",
    "slope": "regression slope (Deming and Passing–Bablok)",
    "intercept": "regression intercept (Deming and Passing–Bablok)",
    "r": "Pearson correlation",
    "concordance": "overall concordance",
    "sensitivity": "sensitivity of every class",
    "specificity": "specificity of every class",
    "ppv": "positive predictive value of every class",
    "npv": "negative predictive value of every class",
    "kappa": "Cohen's kappa",
}
_TABLES = {"data", "labels", "statistics", "acceptance", "precision", "report"}


@dataclass(frozen=True)
class ValidationConfig:
    """A validation file, read and checked.

    Attributes
    ----------
    path : Path
    sha256 : str
        Of the bytes read (the study names the file it read, not one changed since).
    data : dict
        The ``[data]`` (and ``[labels]``) tables in the form training reads them
        (:func:`core.training.read_data`), with ``_base`` set.
    confidence, error_ratio : float
    interval : {"wilson", "exact"}
    acceptance : dict of str to (float, float)
    replicates : dict or None
        ``path``, ``file_column``, ``specimen_column``, ``run_column``.
    report : dict of str to str
    """

    path: Path
    sha256: str
    data: dict[str, Any]
    confidence: float = 0.95
    error_ratio: float = 1.0
    interval: str = "wilson"
    acceptance: dict[str, tuple[float, float]] = field(default_factory=dict)
    replicates: dict[str, Any] | None = None
    report: dict[str, str] = field(default_factory=dict)


def _number(table: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"[{table}] {key} must be a number, got {value!r}")
    return float(value)


def _limits(table: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    unknown = set(table) - set(ACCEPTANCE_KEYS)
    if unknown:
        raise ConfigError(
            f"[acceptance] unknown key(s) {sorted(unknown)}; expected some of "
            f"{sorted(ACCEPTANCE_KEYS)}"
        )
    out = {}
    for key, value in table.items():
        if not (isinstance(value, list) and len(value) == 2):
            raise ConfigError(f"[acceptance] {key} must be [low, high], got {value!r}")
        low, high = (_number("acceptance", key, v) for v in value)
        if not low <= high:
            raise ConfigError(f"[acceptance] {key}: low {low} is above high {high}")
        out[key] = (low, high)
    return out


def load_validation_config(path: str | Path) -> ValidationConfig:
    """Read and check a validation file.

    Raises
    ------
    ConfigError
        The file cannot be read, is not TOML, or a table or value is wrong (the
        message names it).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        doc = tomllib.loads(raw.decode())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from exc
    unknown = set(doc) - _TABLES
    if unknown:
        raise ConfigError(
            f"{path}: unknown table(s) {sorted(unknown)}; expected some of {sorted(_TABLES)}"
        )
    if "data" not in doc or "files" not in doc["data"]:
        raise ConfigError(f"{path}: missing [data] table with files and their reference results")
    base = str(path.resolve().parent)
    data = {"data": dict(doc["data"]), "_base": base}
    if "labels" in doc:
        data["labels"] = dict(doc["labels"])
    st = dict(doc.get("statistics", {}))
    unknown = set(st) - {"confidence", "error_ratio", "interval"}
    if unknown:
        raise ConfigError(f"[statistics] unknown key(s) {sorted(unknown)}")
    confidence = _number("statistics", "confidence", st.get("confidence", 0.95))
    if not 0.5 <= confidence < 1.0:
        raise ConfigError(f"[statistics] confidence must be in [0.5, 1), got {confidence}")
    error_ratio = _number("statistics", "error_ratio", st.get("error_ratio", 1.0))
    if not error_ratio > 0:
        raise ConfigError(f"[statistics] error_ratio must be > 0, got {error_ratio}")
    interval = st.get("interval", "wilson")
    if interval not in INTERVALS:
        raise ConfigError(f"[statistics] interval must be one of {INTERVALS}, got {interval!r}")
    replicates = None
    if "precision" in doc:
        pr = dict(doc["precision"])
        unknown = set(pr) - {"replicates", "file_column", "specimen_column", "run_column"}
        if unknown or "replicates" not in pr:
            raise ConfigError(
                "[precision] needs replicates (a CSV) and at most file_column, "
                "specimen_column, run_column"
            )
        replicates = {
            "path": Path(base) / pr["replicates"],
            "file_column": pr.get("file_column", "file"),
            "specimen_column": pr.get("specimen_column", "specimen"),
            "run_column": pr.get("run_column", "run"),
        }
    report = {str(k): str(v) for k, v in dict(doc.get("report", {})).items()}
    unknown = set(report) - {"laboratory", "title", "method"}
    if unknown:
        raise ConfigError(
            f"[report] unknown key(s) {sorted(unknown)}; expected laboratory, title, method"
        )
    return ValidationConfig(
        path=path,
        sha256=bytes_sha256(raw),
        data=data,
        confidence=confidence,
        error_ratio=error_ratio,
        interval=str(interval),
        acceptance=_limits(dict(doc.get("acceptance", {}))),
        replicates=replicates,
        report=report,
    )
