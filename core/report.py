"""Training reports: cross-validated metrics, PNG plots (matplotlib, no display), and the
sentences that describe a hyperparameter chosen at the edge of its grid."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sklearn.metrics import (
    accuracy_score,
    confusion_matrix,
    f1_score,
    mean_absolute_error,
    r2_score,
)

__all__ = ["describe_edge", "format_grid", "metrics", "render"]


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
