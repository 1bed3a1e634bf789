"""The training configuration: a TOML file, read, checked, and its estimator built.

A configuration (see ``examples/``) has these tables; paths are relative to the file::

    [model]          name, version, output (directory of models; default "models"),
                     description, intended_use, limitations (the model card, card.md)
    [data]           files (glob or list), labels (CSV table) + file_column + label_column
                     for one label per bag, or cell_label_column / cell_label_files for
                     one label per cell; batches (CSV: file_column + batch_column,
                     default "batch"; per-cell models are then cross-validated
                     leave-one-batch-out and choose their fallback for new batches
                     that way); groups (CSV: file_column + group_column, default
                     "group": the subject, patient or donor of each file; the folds,
                     the estimator's own search and calibration and the domain check
                     then leave whole subjects out); n_jobs (parallel reading);
                     control (per-cell models: the training batch's reference
                     control file, one tube of one material measured in every
                     batch; a new batch's control then maps its samples onto the
                     training batch, see ``MarginalTransferClassifier.fit``)
    [labels]         unassigned: the label (after ``label_map``) of cells no
                     population claims (e.g. the ungated ones); they are answered
                     as ``"unassigned"``, their own row everywhere, and the model
                     may add cells no population claims to them (per-cell
                     classifiers; see ``MarginalTransferClassifier(unassigned=)``)
    [panel]          markers (names, in model order), aliases (name -> other names)
    [preprocessing]  compensation ("none" | "file" | a spillover CSV), transform
                     ("none" | "arcsinh" | "log" | "logicle" | "hyperlog"), cofactor,
                     T, W, M, A (logicle/hyperlog), markers (per-marker overrides of
                     these), scale ("none" | "standard"), max_points, seed; see
                     :mod:`core.io.preprocessing`
    [estimator]      class and parameters; nested tables with a "class" key build the
                     representation / embedding
    [search]         optional grid: parameter name -> list of values; widen_edges
                     (default true, see :mod:`core.training.edges`)
    [cv]             n_splits (default 5), repeats (default 1), seed
    [compute]        streaming (read bags a few at a time), scheduler (a Dask scheduler
                     address); see :mod:`core.streaming`
    [fhir]           optional: the code system, code, unit, class codings and reference
                     range of the model's output in FHIR answers; see
                     :mod:`core.fhir_coding`
    [serving]        out_of_domain ("flag" | "preliminary" | "withhold", default
                     "preliminary"): what every answer does for a bag outside the
                     applicability domain; see :mod:`core.policy`

This module reads the file (:func:`load_config`), builds the estimator
(:func:`build_estimator`) and checks the tables that need no data: ``[preprocessing]
compensation``, ``[panel]``, ``[fhir]``, ``[serving]`` and ``[compute]``. The data
tables are read by :mod:`core.training.data` and :mod:`core.training.groups`, ``[search]``
by :mod:`core.training.search`, ``[cv]`` by :mod:`core.training.folds`.
"""

from __future__ import annotations

import glob
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sklearn.base import BaseEstimator

from ..errors import ConfigError
from ..estimators import (
    DistributionRidge,
    DistributionRidgeClassifier,
    MarginalTransferClassifier,
    MarginalTransferRegressor,
)
from ..estimators.transfer.open_set import UNASSIGNED
from ..fhir_coding import OutputCoding
from ..io import Compensation, Panel
from ..policy import DEFAULT_POLICY, POLICIES
from ..representations import DensityFeatures, HistogramEmbedding, MeanEmbedding, SlicedWasserstein

ESTIMATORS: dict[str, type[BaseEstimator]] = {
    cls.__name__: cls
    for cls in (
        DistributionRidge,
        DistributionRidgeClassifier,
        MarginalTransferClassifier,
        MarginalTransferRegressor,
        SlicedWasserstein,
        MeanEmbedding,
        DensityFeatures,
        HistogramEmbedding,
    )
}
CELL_LEVEL = (MarginalTransferClassifier, MarginalTransferRegressor)


def load_config(
    path: str | Path, required: tuple[str, ...] = ("data", "estimator")
) -> dict[str, Any]:
    """The configuration at ``path``, its tables checked by name, with ``_base`` (its
    directory) added; ``required`` names the tables it must have (evaluation reads
    ``[data]`` alone)."""
    path = Path(path)
    try:
        config = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from exc
    known = {
        "model",
        "data",
        "panel",
        "labels",
        "preprocessing",
        "estimator",
        "search",
        "cv",
        "compute",
        "fhir",
        "serving",
    }
    unknown = set(config) - known
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {sorted(unknown)}; expected {sorted(known)}")
    for table in required:
        if table not in config:
            raise ConfigError(f"{path}: missing [{table}] table")
    config["_base"] = str(path.resolve().parent)
    return config


def build_estimator(spec: Mapping[str, Any], where: str = "estimator") -> BaseEstimator:
    """Instantiate ``spec["class"]`` (a core estimator) with the other keys as parameters."""
    spec = dict(spec)
    name = spec.pop("class", None)
    if name not in ESTIMATORS:
        raise ConfigError(f"[{where}] class must be one of {sorted(ESTIMATORS)}, got {name!r}")
    params = {
        k: build_estimator(v, f"{where}.{k}") if isinstance(v, Mapping) and "class" in v else v
        for k, v in spec.items()
    }
    cls = ESTIMATORS[name]
    allowed = set(cls().get_params(deep=False))
    bad = set(params) - allowed
    if bad:
        raise ConfigError(
            f"[{where}] {name} has no parameter(s) {sorted(bad)}; allowed: {sorted(allowed)}"
        )
    return cls(**params)


def config_rest_label(config: Mapping[str, Any]) -> str | None:
    """``[labels] unassigned``: the data's label of cells no population claims, or None."""
    table = dict(config.get("labels", {}))
    unknown = set(table) - {"unassigned"}
    if unknown:
        raise ConfigError(f"[labels] unknown key(s) {sorted(unknown)}; expected unassigned")
    rest = table.get("unassigned")
    if rest is not None and not isinstance(rest, str | int):
        raise ConfigError(f"[labels] unassigned must be a label (a string), got {rest!r}")
    return None if rest is None else str(rest)


def with_rest_label(config: Mapping[str, Any], estimator: BaseEstimator) -> BaseEstimator:
    """The estimator told which class is the rest class (``[labels] unassigned``): its
    cells are labelled :data:`UNASSIGNED` when the data are read."""
    if config_rest_label(config) is None:
        return estimator
    params = estimator.get_params(deep=False)
    if "unassigned" not in params:
        raise ConfigError(
            f"[labels] unassigned: {type(estimator).__name__} labels no cells; only "
            "per-cell classifiers (MarginalTransferClassifier) have a rest class"
        )
    if params["unassigned"] not in (None, UNASSIGNED):
        raise ConfigError(
            "[labels] unassigned and [estimator] unassigned both name the rest class: "
            "give it once, in [labels]"
        )
    return estimator.set_params(unassigned=UNASSIGNED)


def resolve_path(base: Path, value: str | list[str]) -> list[Path]:
    patterns = [value] if isinstance(value, str) else list(value)
    out: list[Path] = []
    for pat in patterns:
        full = pat if Path(pat).is_absolute() else str(base / pat)
        matches = sorted(glob.glob(full))
        if not matches:
            raise ConfigError(f"[data] files: nothing matches {pat!r}")
        out += [Path(m) for m in matches]
    return out


def config_compensation(config: Mapping[str, Any]) -> Compensation:
    """``[preprocessing] compensation``, a spillover CSV read relative to the config."""
    value = config.get("preprocessing", {}).get("compensation")
    try:
        return Compensation.from_config(value, config["_base"])
    except ValueError as exc:  # DataError included: the CSV names itself
        raise ConfigError(f"[preprocessing] compensation: {exc}") from exc


def config_panel(config: Mapping[str, Any]) -> Panel | None:
    """The ``[panel]`` table, or None when the data's first file sets the panel."""
    if "panel" not in config:
        return None
    return Panel(tuple(config["panel"]["markers"]), dict(config["panel"].get("aliases", {})))


def output_coding(config: Mapping[str, Any], classes: Any = None) -> dict[str, Any] | None:
    """The checked ``[fhir]`` table as stored in the manifest, or None without one.

    Checked before training (keys, URIs, codes, units) and again with the model's
    ``classes`` once fitted: the class labels are known only then (``[data] label_map``
    leaves unlisted labels as they are)."""
    spec = config.get("fhir")
    if spec is None:
        return None
    return OutputCoding.from_config(spec, classes=classes).to_json()


def serving_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The checked ``[serving]`` table as stored in the manifest."""
    table = dict(config.get("serving", {}))
    unknown = set(table) - {"out_of_domain"}
    if unknown:
        raise ConfigError(f"[serving] unknown key(s) {sorted(unknown)}; expected out_of_domain")
    policy = table.get("out_of_domain", DEFAULT_POLICY)
    if policy not in POLICIES:
        raise ConfigError(
            f"[serving] out_of_domain must be one of {list(POLICIES)}, got {policy!r}"
        )
    return {"out_of_domain": policy}


def compute_options(
    config: Mapping[str, Any], scheduler: Any, streaming: bool | None
) -> tuple[Any, bool]:
    """``[compute]`` (``scheduler``, ``streaming``) with the caller's overrides.

    A scheduler from the caller (an address or a ``dask.distributed.Client``) wins over
    the configuration's; any scheduler means streaming.
    """
    compute = dict(config.get("compute", {}))
    unknown = set(compute) - {"scheduler", "streaming"}
    if unknown:
        raise ConfigError(
            f"[compute] unknown key(s) {sorted(unknown)}; expected scheduler, streaming"
        )
    if scheduler is None:
        scheduler = compute.get("scheduler")
        if scheduler is not None and not isinstance(scheduler, str):
            raise ConfigError(f"[compute] scheduler must be an address string, got {scheduler!r}")
    stream = streaming if streaming is not None else compute.get("streaming", False)
    if not isinstance(stream, bool):
        raise ConfigError(f"[compute] streaming must be true or false, got {stream!r}")
    return scheduler, stream or scheduler is not None
