"""Model cards: what a model is for, what it learned from, how well it did, in Markdown.

A card follows Mitchell et al. (2019, "Model Cards for Model Reporting", FAT*): intended
use and its limits (from the training configuration's ``[model]`` table:
``description``, ``intended_use``, ``limitations``), the training data (files, bags,
cells, the data's sha256), the evaluation (cross-validated metrics, probability
calibration, hyperparameters at a grid edge), and what is needed to reproduce and audit
it (panel, preprocessing, estimator, library versions, created). ``bagserve train``
writes it as ``card.md`` in the artifact (hashed with the rest); for an artifact
without one, :func:`render_card` makes it from the manifest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["render_card"]

#: Metrics shown in the card's table (the others stay in report/metrics.json).
#: What each out-of-domain policy (:mod:`core.policy`) does, for the card's readers.
_POLICY_TEXT = {
    "flag": "Out-of-domain policy `flag`: such answers are released as final, flagged.",
    "preliminary": "Out-of-domain policy `preliminary`: such answers are released as "
    "preliminary, for a person to confirm.",
    "withhold": "Out-of-domain policy `withhold`: such answers carry no value, only why.",
}
#: The product's intended use, stated on every card whatever the configuration says.
_PRODUCT_USE = (
    "bagserve models are for research use only, unless a laboratory validates the model "
    "as its own test for the use above (`bagserve validate`: a method comparison on "
    "samples it was not trained on, signed by the laboratory director)."
)
_CALIBRATION_TEXT = {
    "cv+": "conformal CV+ (the hyperparameter search repeated inside every calibration fold)",
    "jackknife+": "conformal jackknife+ (closed-form leave-one-out residuals)",
}
_SHOWN = ("scheme", "n_folds", "accuracy", "macro_f1", "rmse", "mae", "r2", "spearman")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_card(
    metadata: Mapping[str, Any],
    *,
    estimator: str,
    kind: str,
    created: str | None = None,
    sha256: str | None = None,
    libraries: Mapping[str, str] | None = None,
) -> str:
    """The Markdown model card of a model from its manifest's metadata.

    Parameters
    ----------
    metadata : mapping
        The manifest's ``metadata`` (name, version, description, config, panel,
        preprocessing, metrics, training data, ...); missing parts are left out.
    estimator, kind : str
        The estimator's class and what it answers.
    created, sha256 : str, optional
        When the artifact was written and its manifest's sha256.
    libraries : mapping, optional
        Library versions recorded at training.
    """
    lines = _about(metadata, estimator, kind)
    lines += _training_data(metadata)
    lines += _evaluation(metadata)
    lines += _provenance(created, sha256, libraries)
    return "\n".join(lines) + "\n"


def _about(metadata: Mapping[str, Any], estimator: str, kind: str) -> list[str]:
    """The card's title, description, intended use, limitations, out-of-domain policy
    and the model section (estimator, panel, preprocessing, coding)."""
    config = metadata.get("config") or {}
    model_cfg = config.get("model", {}) if isinstance(config, Mapping) else {}
    name = metadata.get("name") or model_cfg.get("name") or "model"
    version = metadata.get("version") or model_cfg.get("version") or "?"
    lines = [f"# Model card: {name} / {version}", ""]
    description = metadata.get("description") or model_cfg.get("description")
    if description:
        lines += [str(description), ""]
    lines += ["## Intended use", ""]
    lines += [
        str(
            model_cfg.get("intended_use")
            or "Not stated in the training configuration (`[model] intended_use`)."
        ),
        "",
    ]
    lines += [_PRODUCT_USE, ""]
    if model_cfg.get("limitations"):
        lines += ["## Limitations", "", str(model_cfg["limitations"]), ""]
    policy = (metadata.get("serving") or {}).get("out_of_domain", "preliminary")
    lines += [
        "Every answer carries an applicability-domain report: a bag unlike the training "
        "bags is flagged `out_of_range` and should not be trusted without review. "
        + _POLICY_TEXT.get(str(policy), f"Out-of-domain policy: `{policy}`."),
        "",
        "## Model",
        "",
        f"- Estimator: `{estimator}` ({kind})",
    ]
    panel = metadata.get("panel") or {}
    if panel.get("markers"):
        lines.append(f"- Panel: {', '.join(f'`{m}`' for m in panel['markers'])}")
    pre = metadata.get("preprocessing") or {}
    if pre:
        comp = pre.get("compensation", "none")
        comp_text = comp if isinstance(comp, str) else f"matrix from {comp.get('source')}"
        lines.append(
            f"- Preprocessing: compensation {comp_text}; transform {pre.get('transform')}; "
            f"scaling {pre.get('scale')}"
        )
    coding = metadata.get("fhir")
    if coding:
        unit = f", unit `{coding['unit']}` (UCUM)" if coding.get("unit") else ""
        lines.append(
            f"- Reported as: `{coding['system']}` code `{coding['code']}`"
            + (f" ({coding['display']})" if coding.get("display") else "")
            + unit
        )
    return lines


def _training_data(metadata: Mapping[str, Any]) -> list[str]:
    """The training data section: files or bags, labels, data sha256, subjects."""
    lines: list[str] = []
    lines += ["", "## Training data", ""]
    files = metadata.get("training_files") or []
    bags = metadata.get("training_bags") or []
    if files:
        lines.append(
            f"- {len(files)} file(s): {', '.join(files[:8])}" + (" ..." if len(files) > 8 else "")
        )
    elif bags:
        lines.append(f"- {len(bags)} bag(s)")
    if metadata.get("label_level"):
        lines.append(f"- Labels: one per {metadata['label_level']}")
    if metadata.get("training_data_sha256"):
        lines.append(f"- Data sha256: `{metadata['training_data_sha256']}`")
    grouping = metadata.get("grouping") or {}
    if grouping.get("by") == "groups":
        lines.append(
            f"- Subjects: {grouping.get('n_groups')} (`{grouping.get('table')}`, column "
            f"`{grouping.get('column')}`; up to {grouping.get('bags_per_group_max')} bags "
            "each): folds, calibration and the domain check leave whole subjects out"
        )
    elif grouping:
        repeats = grouping.get("suspected_repeats") or {}
        lines.append(
            "- Subjects: not given; every bag counts as a subject of its own"
            + (
                f" (the file names suggest repeated subjects: {', '.join(list(repeats)[:5])}; "
                "the metrics and intervals below may be optimistic)"
                if repeats
                else ""
            )
        )
    return lines


def _evaluation(metadata: Mapping[str, Any]) -> list[str]:
    """The cross-validated metrics, calibration, new batches, hyperparameters and the
    grid edges still unresolved."""
    lines: list[str] = []
    metrics = metadata.get("metrics") or {}
    shown = {k: metrics[k] for k in _SHOWN if k in metrics}
    if shown:
        lines += ["", "## Evaluation (cross-validated)", ""]
        lines += ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
        lines += ["| " + " | ".join(_fmt(v) for v in shown.values()) + " |", ""]
    other = {k: v for k, v in metrics.items() if k not in shown and isinstance(v, int | float)}
    for k, v in other.items():
        lines.append(f"- {k}: {_fmt(v)}")
    agreement = metrics.get("frequency_agreement")
    if isinstance(agreement, dict):
        worst = agreement.get("worst_pair") or {}
        lines += [
            "- Population frequencies, predicted − true percent per sample "
            "(cross-validated, Bland–Altman bias and 95 % limits of agreement): "
            + "; ".join(
                f"`{a['class']}` {_fmt(a['bias'])} [{_fmt(a['lower'])}, {_fmt(a['upper'])}]"
                for a in agreement.get("per_class") or []
            )
            + f"; furthest: `{worst.get('file')}` / `{worst.get('class')}` "
            f"({_fmt(worst.get('difference'))} points)",
            f"- Weakest class: `{agreement['weakest_class']['class']}` (recall "
            f"{_fmt(agreement['weakest_class']['recall'])}); weakest sample: "
            f"`{agreement['weakest_sample']['file']}` (accuracy "
            f"{_fmt(agreement['weakest_sample']['accuracy'])})",
        ]
    cal = metadata.get("calibration")
    if isinstance(cal, dict):
        lines.append(
            "- Intervals: "
            + _CALIBRATION_TEXT.get(str(cal.get("method")), str(cal.get("method")))
            + (" by leave-subject-out" if cal.get("groups") else "")
            + ("; widened with the domain score" if cal.get("scaling") == "domain" else "")
        )
    new = metadata.get("new_batches")
    if isinstance(new, dict) and "cell_model" in new:
        lines += _calibrate_then_label_lines(new)
    elif isinstance(new, dict):
        # Models of the design before issue 44 (core.estimators.transfer.legacy).
        primary = _PRIMARY_TEXT.get(str(new.get("primary")))
        if primary:
            lines.append(f"- Samples like the training samples: answered by {primary}")
        lines.append(_new_batch_line(new))
    control = metadata.get("reference_control")
    if isinstance(control, dict):
        lines.append(
            f"- New batches: mapped onto the training batch by their reference control "
            f"(the training control `{control.get('file')}`, sha256 "
            f"`{str(control.get('sha256'))[:12]}…`; `--control` names a batch's own)"
        )
    calibration = metadata.get("probability_calibration")
    if calibration:
        lines.append(
            f"- Class probabilities: temperature {_fmt(calibration['temperature'])} "
            f"({calibration.get('method', '')}; {calibration.get('cells')} cells)"
        )
    chosen = metadata.get("chosen_params") or {}
    if chosen:
        lines.append(
            "- Hyperparameters: " + ", ".join(f"{k} = {_fmt(v)}" for k, v in chosen.items())
        )
    # Only an edge that widening did not resolve is worth a reader's attention.
    edges = [e for e in metadata.get("grid_edges") or [] if e.get("still_on_edge", True)]
    if edges:
        lines.append(
            f"- {len(edges)} hyperparameter(s) still at the edge of their grid (the best "
            "value may lie beyond it): " + ", ".join(str(e.get("parameter")) for e in edges)
        )
    return lines


def _provenance(
    created: str | None, sha256: str | None, libraries: Mapping[str, str] | None
) -> list[str]:
    """When, which manifest, which libraries."""
    lines: list[str] = []
    lines += ["", "## Provenance", ""]
    if created:
        lines.append(f"- Created: {created}")
    if sha256:
        lines.append(f"- Manifest sha256: `{sha256}`")
    if libraries:
        lines.append("- Libraries: " + ", ".join(f"{k} {v}" for k, v in sorted(libraries.items())))
    return lines


#: Each calibration and cell model of a per-cell model, as the card says them.
_CALIBRATE_TEXT = {
    "control": "its batch's reference control (quantile map onto the training control)",
    "landmarks": "its own populations where they show an instrument effect (the "
    "per-marker scale and shift that fit it best to the training populations)",
    "standardise": "its own mean and standard deviation per marker",
    "none": "nothing (the cells as measured)",
}
_CELL_MODEL_TEXT = {
    "linear": "a pooled linear model",
    "kernel": "the marginal-transfer kernel (cell and sample context)",
    "trees": "gradient-boosted trees",
}


def _calibrate_then_label_lines(new: Mapping[str, Any]) -> list[str]:
    """The card's lines on how a per-cell model calibrates and labels a sample."""
    how, without = new.get("calibration"), new.get("calibration_without_control")
    model = _CELL_MODEL_TEXT.get(str(new.get("cell_model")), str(new.get("cell_model")))
    score = new.get("fold_score")
    lines = [
        f"- Every sample: calibrated to the training batch by "
        f"{_CALIBRATE_TEXT.get(str(how), str(how))}, then every cell labelled by {model}"
        + (f"; chosen on {new['folds']}" if new.get("folds") else "")
        + (f" (fold accuracy {_fmt(score)})" if isinstance(score, float) and score >= 0 else "")
    ]
    if without and without != how:
        lines.append(
            "- A sample whose batch's control is not given: calibrated by "
            + _CALIBRATE_TEXT.get(str(without), str(without))
        )
    threshold = new.get("reject_threshold")
    if isinstance(threshold, float):
        lines.append(
            f"- Rest label: also a cell whose best population score is below {_fmt(threshold)}"
        )
    return lines


#: What answers a sample out of range, by ``fallback`` of the card's ``new_batches``.
_FALLBACK_TEXT = {
    "boosted trees": "gradient-boosted trees",
    "own kernel": "the model's own kernel",
    "pooled linear": "a pooled linear model",
    "blend": "the average of a pooled linear model and the model's own kernel",
}


#: What answers a sample in range where the model's capacity choice did not leave its
#: kernel alone, by ``primary`` of the card's ``new_batches``.
_PRIMARY_TEXT = {
    "blend": f"{_FALLBACK_TEXT['blend']} (its folds did not show the kernel clearly better)",
    "pooled linear": (
        f"{_FALLBACK_TEXT['pooled linear']} (its folds showed it clearly better than the kernel)"
    ),
}


def _new_batch_line(new: Mapping[str, Any]) -> str:
    """The card's line on samples unlike the training samples (per-cell models)."""
    fallback = new.get("fallback")
    if fallback:
        cv = new.get("fallback_cv")
        error = new.get("fallback_cv_error")
        text = (
            "- Samples unlike the training samples (another batch or instrument): "
            f"answered by {_FALLBACK_TEXT.get(str(fallback), str(fallback))} on "
            "per-sample standardised cells"
            + (f", chosen on {cv} folds" if cv else "")
            + (f" (fold error {_fmt(error)})" if isinstance(error, float) else "")
        )
    elif new.get("normalise") == "standard":
        text = (
            "- Samples unlike the training samples (another batch or instrument): "
            "answered by the model itself, which standardises every sample's cells"
        )
    else:
        text = (
            "- Samples unlike the training samples: answered by the model itself (it has "
            "no invariant fallback), flagged out of range"
        )
    how = new.get("calibration")
    if how == "landmarks":
        text += (
            "; a sample whose populations sit beyond the training ones is first shifted "
            "onto their centres (landmarks)"
        )
    elif how not in (None, "none"):
        text += f"; such samples are first calibrated to the training samples ({how})"
    return text
