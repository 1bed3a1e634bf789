"""Training reports: cross-validated metrics, PNG plots (matplotlib, no display), and the
sentences that describe a hyperparameter chosen at the edge of its grid."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from html import escape as _escape
from typing import Any

import numpy as np
from sklearn.metrics import (
    accuracy_score,
    confusion_matrix,
    f1_score,
    mean_absolute_error,
    r2_score,
)

__all__ = ["describe_edge", "format_grid", "html", "metrics", "render", "residual_plot", "tables"]


def metrics(y: np.ndarray, pred: np.ndarray, classifier: bool) -> dict[str, Any]:
    """Accuracy, macro-F1 and the confusion matrix; or RMSE, MAE and R²."""
    if classifier:
        labels = np.unique(np.concatenate([np.asarray(y), np.asarray(pred)]).astype(str))
        ys, ps = np.asarray(y).astype(str), np.asarray(pred).astype(str)
        return {
            "accuracy": float(accuracy_score(ys, ps)),
            "macro_f1": float(f1_score(ys, ps, average="macro")),
            "labels": labels.tolist(),
            "confusion_matrix": confusion_matrix(ys, ps, labels=labels).tolist(),
        }
    p = np.asarray(pred, dtype=np.float64)
    return {
        "rmse": float(np.sqrt(np.mean((p - y) ** 2))),
        "mae": float(mean_absolute_error(y, p)),
        "r2": float(r2_score(y, p)) if y.size > 1 else float("nan"),
    }


def _number(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def format_grid(grid: Sequence[Any], limit: int = 6) -> str:
    """A grid for a message: every value when there are at most ``limit``, else the
    first two, the last, and the count (a 25-value ``λ`` grid stays one line)."""
    values = list(grid)
    if len(values) <= limit:
        return "[" + ", ".join(_number(v) for v in values) + "]"
    head = ", ".join(_number(v) for v in values[:2])
    return f"[{head}, ..., {_number(values[-1])}] ({len(values)} values)"


def describe_edge(edge: Mapping[str, Any]) -> str:
    """One sentence for a ``grid_edges`` record of :mod:`core.training`: the parameter,
    the grid, the value, and what widening did.

    Parameters
    ----------
    edge : mapping
        ``parameter``, ``source``, ``side``, ``grid``, ``chosen``, ``widened``,
        ``widened_grid``, ``chosen_after_widening``, ``still_on_edge``, ``note``.

    Returns
    -------
    str
    """
    where = "[search] grid" if edge["source"] == "search" else "the estimator's own grid"
    end = "smallest" if edge["side"] == "low" else "largest"
    head = (
        f"{edge['parameter']} = {_number(edge['chosen'])} is the {end} value of {where} "
        f"{format_grid(edge['grid'])}"
    )
    if edge["widened"]:
        after = _number(edge["chosen_after_widening"])
        wider = format_grid(edge["widened_grid"])
        if edge["still_on_edge"]:
            return (
                f"{head}; widened once to {wider}, the choice {after} is still on its edge: "
                "the best value may lie further out (kept; give a wider grid explicitly to "
                "look further)"
            )
        return f"{head}; widened once to {wider}, which chose {after} inside it"
    reason = edge.get("note") or "not widened"
    if not edge["still_on_edge"]:
        return f"{head}; not widened: {reason}"
    return f"{head}; the best value may lie beyond it ({reason})"


def _curve_label(params: Mapping[str, Any]) -> str:
    """A tick label: lists (widened grids passed as parameters) shortened."""
    return ", ".join(
        f"{k}={format_grid(v, limit=3) if isinstance(v, list | tuple) else v}"
        for k, v in params.items()
    )


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def render(
    y: np.ndarray,
    pred: np.ndarray,
    classifier: bool,
    summary: dict[str, Any],
    curve: list[tuple[dict[str, Any], float]],
    key: str,
) -> dict[str, bytes]:
    """PNG files of the report: predicted vs true (or the confusion matrix), CV curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: dict[str, bytes] = {}
    cv = summary["cv"]
    if classifier:
        labels = cv["labels"]
        cm = np.asarray(cv["confusion_matrix"])
        fig, ax = plt.subplots(figsize=(1.2 + 0.6 * len(labels), 1.0 + 0.6 * len(labels)))
        ax.imshow(cm, cmap="Blues")
        for (i, j), v in np.ndenumerate(cm):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("predicted (cross-validated)")
        ax.set_ylabel("true")
        ax.set_title(f"accuracy {cv['accuracy']:.3f}, macro-F1 {cv['macro_f1']:.3f}")
        files["report/confusion_matrix.png"] = _png(fig)
    else:
        p = np.asarray(pred, dtype=np.float64)
        fig, ax = plt.subplots(figsize=(4.5, 4.5))
        ax.scatter(y, p, s=12, alpha=0.7)
        lo, hi = float(min(y.min(), p.min())), float(max(y.max(), p.max()))
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
        ax.set_xlabel("true")
        ax.set_ylabel("predicted (cross-validated)")
        ax.set_title(f"RMSE {cv['rmse']:.3g}, R² {cv['r2']:.3f}")
        files["report/predicted_vs_true.png"] = _png(fig)
    if len(curve) > 1:
        fig, ax = plt.subplots(figsize=(max(4.5, 0.5 * len(curve)), 3.5))
        names = [_curve_label(params) for params, _ in curve]
        ax.plot(range(len(curve)), [v for _, v in curve], marker="o")
        ax.set_xticks(range(len(curve)), names, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(f"cross-validated {key}")
        ax.set_title("search")
        files["report/cv_curve.png"] = _png(fig)
    return files


def _last_partition(
    folds: Sequence[tuple[np.ndarray, np.ndarray]], n_bags: int
) -> list[tuple[int, np.ndarray]]:
    """The folds of the last repeat (whose held-out sets cover every bag once): the
    cross-validated predictions kept for the report are that repeat's."""
    seen = np.zeros(n_bags, dtype=bool)
    out: list[tuple[int, np.ndarray]] = []
    for index in range(len(folds) - 1, -1, -1):
        val = np.asarray(folds[index][1])
        if seen[val].any():
            break
        seen[val] = True
        out.append((index, val))
    return out[::-1]


def tables(
    names: Sequence[str],
    y: np.ndarray,
    pred: np.ndarray,
    classifier: bool,
    folds: Sequence[tuple[np.ndarray, np.ndarray]],
    sizes: np.ndarray | None = None,
) -> dict[str, Any]:
    """The report's tables from the cross-validated predictions.

    Parameters
    ----------
    names : sequence of str
        One name per bag (its file).
    y, pred : ndarray
        Labels and cross-validated predictions: one per bag, or one per cell when
        ``sizes`` (cells per bag) is given.
    classifier : bool
    folds : sequence of (train, validation) bag indices
    sizes : ndarray of int, optional
        Cells per bag, for per-cell models.

    Returns
    -------
    dict
        ``per_sample`` rows (file, label, prediction, residual; or file, cells,
        accuracy), ``per_fold`` rows (fold, bags, metric), and for classifiers
        ``per_class`` rows (class, support, precision, recall, F1) and the
        row-normalised confusion matrix ``confusion`` with its ``classes``.
    """
    from sklearn.metrics import precision_recall_fscore_support

    n_bags = len(names)
    offsets = None if sizes is None else np.concatenate([[0], np.cumsum(sizes)]).astype(int)

    def cells(bags: np.ndarray) -> np.ndarray:
        if offsets is None:
            return np.asarray(bags, dtype=int)
        return np.concatenate([np.arange(offsets[b], offsets[b + 1]) for b in bags])

    out: dict[str, Any] = {"classifier": classifier, "cell_level": sizes is not None}
    if sizes is not None:
        # Per cell: a hit (classes) or a squared error (values), averaged per sample.
        if classifier:
            per_cell, metric = np.asarray(y == pred, dtype=np.float64), "accuracy"
        else:
            per_cell, metric = (pred.astype(np.float64) - y) ** 2, "rmse"
        means = [float(per_cell[offsets[b] : offsets[b + 1]].mean()) for b in range(n_bags)]  # type: ignore[index]
        out["per_sample"] = [
            {
                "file": names[b],
                "cells": int(sizes[b]),
                metric: means[b] if classifier else float(np.sqrt(means[b])),
            }
            for b in range(n_bags)
        ]
    else:
        # Which fold held each bag out (the last repeat's): whole subjects per fold when
        # the data name them, checkable here.
        fold_of = np.full(n_bags, -1)
        for index, val in _last_partition(folds, n_bags):
            fold_of[val] = index
        if classifier:
            out["per_sample"] = [
                {"file": n, "fold": int(f), "label": str(t), "prediction": str(p),
                 "correct": bool(t == p)}
                for n, f, t, p in zip(names, fold_of.tolist(), y.tolist(), pred.tolist(),
                                      strict=True)
            ]  # fmt: skip
        else:
            out["per_sample"] = [
                {"file": n, "fold": int(f), "label": float(t), "prediction": float(p),
                 "residual": float(t - p)}
                for n, f, t, p in zip(names, fold_of.tolist(), y.tolist(), pred.tolist(),
                                      strict=True)
            ]  # fmt: skip
    rows = []
    for index, val in _last_partition(folds, n_bags):
        idx = cells(val)
        if classifier:
            value = float(np.mean(y[idx] == pred[idx]))
        else:
            value = float(np.sqrt(np.mean((pred[idx].astype(float) - y[idx]) ** 2)))
        rows.append({"fold": index, "bags": len(val), "accuracy" if classifier else "rmse": value})
    out["per_fold"] = rows
    if classifier:
        ys, ps = np.asarray(y).astype(str), np.asarray(pred).astype(str)
        classes = np.unique(np.concatenate([ys, ps]))
        precision, recall, f1, support = precision_recall_fscore_support(
            ys, ps, labels=classes, zero_division=0
        )
        out["per_class"] = [
            {
                "class": str(c),
                "support": int(s),
                "precision": float(p),
                "recall": float(r),
                "f1": float(f),
            }
            for c, p, r, f, s in zip(classes, precision, recall, f1, support, strict=True)
        ]
        cm = confusion_matrix(ys, ps, labels=classes).astype(float)
        out["classes"] = classes.tolist()
        out["confusion"] = (cm / np.maximum(cm.sum(axis=1, keepdims=True), 1.0)).tolist()
        if sizes is not None:
            out.update(frequency_agreement(names, ys, ps, np.asarray(sizes), classes))
    return out


def frequency_agreement(
    names: Sequence[str],
    y: np.ndarray,
    pred: np.ndarray,
    sizes: np.ndarray,
    classes: np.ndarray,
) -> dict[str, Any]:
    """Agreement of population frequencies, as a lab validates a gating method.

    Per sample and population, the percent of the sample's cells the labels give and
    the percent the cross-validated predictions give. Per population, over the
    samples, the Bland–Altman bias (mean of predicted − true) and 95 % limits of
    agreement (bias ± 1.96 SD of the differences; Bland & Altman, Lancet 1986,
    i:307–310). Per population, because over all populations of a sample the
    differences sum to zero: a pooled bias is zero by construction.

    Returns
    -------
    dict
        ``frequencies`` (file, class, true_percent, predicted_percent, difference) and
        ``agreement``: ``per_class`` (class, n, bias, sd, lower, upper) and ``worst``,
        the sample-population pair furthest from agreement.
    """
    n_bags, n_classes = len(names), classes.size
    bag = np.repeat(np.arange(n_bags), sizes)
    counts = np.zeros((2, n_bags, n_classes))
    np.add.at(counts[0], (bag, np.searchsorted(classes, y)), 1.0)
    np.add.at(counts[1], (bag, np.searchsorted(classes, pred)), 1.0)
    percent = 100.0 * counts / np.maximum(sizes, 1)[None, :, None]
    diff = percent[1] - percent[0]
    rows = [
        {
            "file": names[b],
            "class": str(classes[k]),
            "true_percent": float(percent[0, b, k]),
            "predicted_percent": float(percent[1, b, k]),
            "difference": float(diff[b, k]),
        }
        for b in range(n_bags)
        for k in range(n_classes)
    ]
    bias = diff.mean(axis=0)
    sd = diff.std(axis=0, ddof=1) if n_bags > 1 else np.zeros(n_classes)
    per_class = [
        {
            "class": str(classes[k]),
            "n": n_bags,
            "bias": float(bias[k]),
            "sd": float(sd[k]),
            "lower": float(bias[k] - 1.96 * sd[k]),
            "upper": float(bias[k] + 1.96 * sd[k]),
        }
        for k in range(n_classes)
    ]
    worst = rows[int(np.argmax(np.abs(diff).ravel()))]
    return {"frequencies": rows, "agreement": {"per_class": per_class, "worst": worst}}


def bland_altman_plot(tables: Mapping[str, Any]) -> dict[str, bytes]:
    """Bland–Altman plots of the population frequencies (per-cell classifiers), one
    panel per population: mean of true and predicted percent against their
    difference, the bias and 95 % limits; the sample furthest from agreement named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, per_class = tables["frequencies"], tables["agreement"]["per_class"]
    n = len(per_class)
    cols = min(n, 3)
    fig, axes = plt.subplots(
        (n + cols - 1) // cols, cols, figsize=(3.6 * cols, 3.0 * ((n + cols - 1) // cols)),
        squeeze=False,
    )  # fmt: skip
    for ax, a in zip(axes.ravel(), per_class, strict=False):
        mine = [r for r in rows if r["class"] == a["class"]]
        mean = np.array([(r["true_percent"] + r["predicted_percent"]) / 2 for r in mine])
        diff = np.array([r["difference"] for r in mine])
        ax.scatter(mean, diff, s=16, alpha=0.8)
        for value, style in ((a["bias"], "-"), (a["lower"], "--"), (a["upper"], "--")):
            ax.axhline(value, color="grey", ls=style, lw=1)
        i = int(np.argmax(np.abs(diff)))
        ax.annotate(mine[i]["file"].split(".")[0], (mean[i], diff[i]), fontsize=7)
        ax.set_title(
            f"{a['class']}: bias {a['bias']:+.2f}, [{a['lower']:.1f}, {a['upper']:.1f}]",
            fontsize=8,
        )
        ax.set_xlabel("mean of true and predicted %", fontsize=7)
        ax.set_ylabel("predicted − true %", fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in axes.ravel()[n:]:
        ax.set_visible(False)
    fig.suptitle("population frequencies, cross-validated (Bland–Altman)", fontsize=9)
    fig.tight_layout()
    return {"report/bland_altman.png": _png(fig)}


def residual_plot(tables: Mapping[str, Any]) -> dict[str, bytes]:
    """Residuals of the cross-validated predictions against the labels (bag regression)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = tables["per_sample"]
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.axhline(0.0, color="grey", lw=1)
    ax.scatter([r["label"] for r in rows], [r["residual"] for r in rows], s=14, alpha=0.8)
    ax.set_xlabel("true")
    ax.set_ylabel("true − predicted (cross-validated)")
    ax.set_title("residuals")
    return {"report/residuals.png": _png(fig)}


def html(
    name: str,
    version: str,
    summary: Mapping[str, Any],
    tables: Mapping[str, Any],
    files: Mapping[str, bytes],
    header: Mapping[str, Any] | None = None,
) -> str:
    """One self-contained HTML page: metrics, grid edges, tables, and every PNG of the
    report embedded as a data URL (no external resource, for air-gapped labs).

    ``header``: what a reviewer signs against, shown first (when it was trained, the
    training data's sha256, the library versions)."""
    cv = summary["cv"]
    shown = {k: v for k, v in cv.items() if not isinstance(v, list | dict)}
    parts = [
        f"<h1>{_escape(name)} / {_escape(version)}: training report</h1>",
        "<p class='header'>"
        + "<br>".join(
            f"<b>{_escape(str(k))}</b>: {_escape(str(v))}" for k, v in (header or {}).items()
        )
        + "</p>",
        _html_table([shown], "Cross-validated metrics"),
        _html_table(
            [
                {
                    "parameter": k,
                    "value": v,
                    "searched": format_grid(grid)
                    if isinstance(grid := summary["best_params"].get(k), list | tuple)
                    else "",
                }
                for k, v in (summary.get("chosen_params") or summary["best_params"]).items()
            ],
            "Chosen parameters (the values the model uses; the grid an estimator searched "
            "itself beside them)",
        ),
    ]
    parts += _weak_spots(cv.get("frequency_agreement"))
    parts += _regions(summary.get("explained_regions"))
    grouping = summary.get("grouping")
    if grouping:
        row = {k: v for k, v in grouping.items() if not isinstance(v, dict)}
        if grouping.get("suspected_repeats"):
            row["suspected_repeats"] = ", ".join(
                f"{k} ({n})" for k, n in grouping["suspected_repeats"].items()
            )
        parts.append(
            _html_table(
                [row],
                "How the folds were grouped (by groups: whole subjects left out; by bags: "
                "every bag a subject of its own)",
            )
        )
    edges = summary.get("grid_edges") or []
    if edges:
        items = "".join(f"<li>{_escape(describe_edge(e))}</li>" for e in edges)
        parts.append(f"<h2>Hyperparameters at the edge of their grid</h2><ul>{items}</ul>")
    calibration = summary.get("probability_calibration")
    if calibration:
        parts.append(
            _html_table(
                [calibration],
                "Class probabilities (temperature scaling; nll: per-cell negative "
                "log-likelihood out of fold, nll_at_1 before scaling)",
            )
        )
    parts += _result_tables(tables)
    parts += _figures(files)
    style = (
        "body{font-family:sans-serif;margin:2em;max-width:70em}"
        "table{border-collapse:collapse;margin:0.5em 0}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
        "th{background:#f3f3f3}figure{display:inline-block;margin:1em}"
    )
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        f"<title>{_escape(name)} {_escape(version)}</title><style>{style}</style>"
        f"</head><body>{''.join(parts)}</body></html>"
    )


def _cell(v: Any) -> str:
    return _escape(_number(v) if isinstance(v, float) else str(v))


def _html_table(rows: Sequence[Mapping[str, Any]], title: str) -> str:
    """A titled HTML table of ``rows`` (dicts sharing their keys); empty without rows."""
    if not rows:
        return ""
    head = "".join(f"<th>{_escape(str(k))}</th>" for k in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in r.values()) + "</tr>" for r in rows
    )
    return f"<h2>{_escape(title)}</h2><table><tr>{head}</tr>{body}</table>"


def _weak_spots(weak: Mapping[str, Any] | None) -> list[str]:
    """The weakest class, sample and population frequency (per-cell classifiers)."""
    parts: list[str] = []
    if weak:
        pair = weak["worst_pair"]
        parts.append(
            "<h2>Weak spots</h2><ul class='weak'>"
            f"<li>class <b>{_escape(weak['weakest_class']['class'])}</b>: recall "
            f"{_number(weak['weakest_class']['recall'])}</li>"
            f"<li>sample <b>{_escape(weak['weakest_sample']['file'])}</b>: accuracy "
            f"{_number(weak['weakest_sample']['accuracy'])}</li>"
            f"<li>furthest population frequency: <b>{_escape(pair['file'])} / "
            f"{_escape(pair['class'])}</b>, predicted {_number(pair['predicted_percent'])} % "
            f"against {_number(pair['true_percent'])} %</li>"
            + "".join(
                f"<li>{_escape(a['class'])}: predicted − true percent, bias "
                f"{_number(a['bias'])}, 95 % limits of agreement [{_number(a['lower'])}, "
                f"{_number(a['upper'])}]</li>"
                for a in weak["per_class"]
            )
            + "</ul>"
        )
    return parts


def _regions(regions: Mapping[str, Any] | None) -> list[str]:
    """Where the model looks: held-out contributions by marker region."""
    parts: list[str] = []
    if regions:
        how = (
            "each held-out cell labelled by the model of its cross-validation fold and "
            "counted 1/n towards its label's share (assignment)"
            if regions["method"] == "assignment"
            else "each training sample explained by the model of its cross-validation fold "
            f"(core.explain, {_escape(regions['method'])})"
        )
        parts.append(
            f"<h2>Where the model looks</h2><p>{how[0].upper() + how[1:]}, each cell's "
            "contribution added to the fifth of each marker's range it lies in; the mean "
            f"over the {regions['n_samples']} samples. Large entries are the regions that "
            "carry the model: debris sits in the lowest scatter, doublets in the highest.</p>"
        )
        for k, output in enumerate(regions["outputs"]):
            rows = [
                {"marker": m, **{r: v[k] for r, v in zip(regions["regions"], per, strict=True)}}
                for m, per in zip(regions["markers"], regions["mean_contribution"], strict=True)
            ]
            parts.append(_html_table(rows, f"Mean contribution to {output}, by marker region"))
    return parts


def _result_tables(tables: Mapping[str, Any]) -> list[str]:
    """Per fold, per class, the confusion matrix, agreement, per sample, frequencies."""
    parts: list[str] = []
    parts.append(_html_table(tables.get("per_fold", []), "Per fold (the last repeat's folds)"))
    if tables.get("per_class"):
        parts.append(_html_table(tables["per_class"], "Per class"))
        classes = tables["classes"]
        rows = [
            {"true \\ predicted": c, **dict(zip(classes, row, strict=True))}
            for c, row in zip(classes, tables["confusion"], strict=True)
        ]
        parts.append(_html_table(rows, "Confusion matrix, each row normalised to 1"))
    agreement = tables.get("agreement")
    if agreement:
        parts.append(
            _html_table(
                agreement["per_class"],
                "Population frequencies: Bland–Altman agreement of predicted and true "
                "percent per population, over the samples (bias, 95 % limits)",
            )
        )
        worst = sorted(tables["frequencies"], key=lambda r: -abs(r["difference"]))[:5]
        parts.append(_html_table(worst, "Furthest from agreement"))
    parts.append(_html_table(tables.get("per_sample", []), "Per sample"))
    if tables.get("frequencies"):
        parts.append(_html_table(tables["frequencies"], "Population frequencies per sample"))
    return parts


def _figures(files: Mapping[str, bytes]) -> list[str]:
    """Every PNG of the report embedded as a data URL."""
    parts: list[str] = []
    import base64

    for path, content in sorted(files.items()):
        if path.endswith(".png"):
            data = base64.b64encode(content).decode()
            parts.append(
                f'<figure><img alt="{_escape(path)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{_escape(path)}</figcaption></figure>"
            )
    return parts
