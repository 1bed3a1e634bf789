"""Per-cell explanations (core.explain): do they find the cells that carry the signal,
what do they say on real data, and what do they cost.

Run with ``OMP_NUM_THREADS=1 .venv/bin/python bench/bench_explain.py [--quick]``. Prints
three tables and writes ``bench/results/bench_explain.json`` (``--cost-only``: the third
table alone, not written):

1. **Planted signal.** Bags of background cells (three Gaussian populations in 4
   markers) with a rare population planted at a place of its own (high on markers 0 and
   1, as a blast population would be); the target is its frequency. Models are trained
   on bags with frequencies in [0, 6 %]; each test bag (frequencies 0.1 %, 0.5 %, 1 %,
   2 %, 5 %) is explained, and the ranking of its cells by contribution is scored by
   the ROC AUC of finding the planted cells. Goal: AUC >= 0.95 at 1 %, for every
   representation.
2. **Yeast dose response** (``../shared/data/cytoflow_yeast``, 24 real samples, the
   inducer dose as target, arcsinh transform): the markers' effects of the explanation
   of the highest-dose sample, and the figure of its cells coloured by contribution
   (``docs/guide/explain-yeast.png``).
3. **Cost.** Explaining one bag of 10^5 cells against predicting it, best of 7
   alternated rounds each, in the same run (goal: at most 2x), with the load average
   (the exact mean embedding, quadratic in the bag, at 5,000 cells; and at 30,000 cells
   with 300 training bags, beyond the per-cell sums' 64 MiB); and a marginal-transfer
   model's explanation of a sample of 10^5 cells against labelling it, per cell model.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from _report import report
from bagserve.core import (
    Bags,
    DensityFeatures,
    DistributionRidge,
    MarginalTransferClassifier,
    MeanEmbedding,
    SlicedWasserstein,
    explain,
)
from bagserve.core.datasets import make_cytometry_tasks
from bagserve.core.io import Panel, Preprocessing, read_sample
from sklearn.metrics import roc_auc_score

ROOT = Path(__file__).resolve().parents[1]
YEAST = ROOT.parent / "shared" / "data" / "cytoflow_yeast" / "dose_response"
FIGURE = ROOT / "docs" / "guide" / "explain-yeast.png"
DOSE = {
    "B1": 5.0, "B2": 3.75, "B3": 2.8125, "B4": 2.109, "B5": 1.5820, "B6": 1.1865,
    "B7": 0.8899, "B8": 0.6674, "B9": 0.5, "B10": 0.3754, "B11": 0.2816, "B12": 0.2112,
    "C1": 0.1584, "C2": 0.1188, "C3": 0.0892, "C4": 0.0668, "C5": 0.05, "C6": 0.0376,
    "C7": 0.0282, "C8": 0.0211, "C9": 0.0159,
}  # fmt: skip
FREQUENCIES = (0.001, 0.005, 0.01, 0.02, 0.05)


def planted_bag(rng: np.random.Generator, n: int, share: float) -> tuple[np.ndarray, np.ndarray]:
    """``n`` cells, ``round(share n)`` of them planted; returns cells and the planted mask."""
    means = np.array([[0, 0, 0, 0], [2, -1, 1, 0], [-1, 2, 0, 1]], dtype=float)
    m = round(share * n)
    background = means[rng.integers(0, 3, n - m)] + rng.normal(scale=0.7, size=(n - m, 4))
    planted = np.array([3.0, 3.0, 0.0, 0.0]) + rng.normal(scale=0.3, size=(m, 4))
    cells = np.vstack([planted, background])
    mark = np.zeros(n, dtype=bool)
    mark[:m] = True
    order = rng.permutation(n)
    return cells[order], mark[order]


def representations(quick: bool) -> list[tuple[str, Any, str, int]]:
    """(name, representation, kernel, cells per bag)."""
    n = 2000 if quick else 5000
    return [
        ("SW2, Gaussian", SlicedWasserstein(random_state=0), "gaussian", n),
        ("SW1, Gaussian", SlicedWasserstein(p=1, random_state=0), "gaussian", n),
        (
            "RFF mean, linear",
            MeanEmbedding(method="rff", bandwidth=1.0, random_state=0),
            "linear",
            n,
        ),
        (
            "RFF mean, Gaussian",
            MeanEmbedding(method="rff", bandwidth=1.0, random_state=0),
            "gaussian",
            n,
        ),
        (
            "Nystroem mean, Gaussian",
            MeanEmbedding(method="nystroem", bandwidth=1.0, random_state=0),
            "gaussian",
            n,
        ),
        ("exact MMD, Gaussian", MeanEmbedding(method="exact", bandwidth=1.0), "gaussian", 1000),
        (
            "density L2, linear",
            DensityFeatures("l2", n_basis=8, subspaces="pairs", max_points=None, random_state=0),
            "linear",
            n,
        ),
        (
            "density Hellinger, Gaussian",
            DensityFeatures(
                "hellinger", n_basis=8, subspaces="pairs", max_points=None, random_state=0
            ),
            "gaussian",
            n,
        ),
    ]


def planted_signal(quick: bool) -> list[dict[str, Any]]:
    rows = []
    n_train, n_test = (16, 2) if quick else (40, 5)
    for name, rep, kernel, n in representations(quick):
        rng = np.random.default_rng(0)
        shares = rng.uniform(0.0, 0.06, n_train)
        train = [planted_bag(rng, n, s)[0] for s in shares]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = DistributionRidge(rep, kernel=kernel, random_state=0).fit(train, shares)
        row: dict[str, Any] = {"case": f"planted: {name}", "cells per bag": n}
        for share in FREQUENCIES:
            aucs = []
            for _ in range(n_test):
                cells, mark = planted_bag(rng, n, share)
                if mark.sum() == 0:
                    continue
                e = explain(model, cells)
                aucs.append(roc_auc_score(mark, e.contributions[:, 0]))
            row[f"AUC at {100 * share:g} % (mean)"] = float(np.mean(aucs))
            row[f"AUC at {100 * share:g} % (min)"] = float(np.min(aucs))
        row["method"] = e.method
        rows.append(row)
    return rows


def yeast(quick: bool) -> list[dict[str, Any]]:
    files = [f for f in sorted(YEAST.glob("Yeast_*.fcs")) if f.stem.split("_")[1] in DOSE]
    panel = Panel(("FSC-A", "SSC-A", "FITC-A"), {"FITC-A": ("GFP",)})
    pre = Preprocessing(transform="arcsinh", cofactor=150.0)
    samples = [read_sample(f) for f in files]
    bags = pre.apply(Bags.from_arrays([panel.select(s) for s in samples]), list(panel.markers))
    dose = np.log10([DOSE[f.stem.split("_")[1]] for f in files])
    rows = []
    for name, rep in (
        ("SW2", SlicedWasserstein(random_state=0)),
        ("RFF mean", MeanEmbedding(method="rff", random_state=0)),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = DistributionRidge(rep, random_state=0).fit(bags, dose)
        top = int(np.argmax(dose))
        e = explain(model, bags[top], markers=list(panel.markers))
        row: dict[str, Any] = {"case": f"yeast dose response: {name}", "sample": files[top].name}
        for m in e.by_marker():
            row[f"effect of {m.marker}"] = float(m.effect[0])
        rows.append(row)
        if name == "SW2" and not quick:
            figure(e, files[top].name)
    return rows


def figure(e: Any, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = e.contributions[:, 0]
    scale = float(np.quantile(np.abs(c), 0.99)) or 1.0
    order = np.argsort(np.abs(c))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, (i, j) in zip(axes, ((0, 2), (1, 2)), strict=True):
        sc = ax.scatter(
            e.points[order, i], e.points[order, j], c=c[order], cmap="coolwarm",
            vmin=-scale, vmax=scale, s=6,
        )  # fmt: skip
        ax.set_xlabel(f"{e.markers[i]} (arcsinh)")
        ax.set_ylabel(f"{e.markers[j]} (arcsinh)")
    fig.colorbar(sc, ax=axes, label="contribution to log10 dose")
    fig.suptitle(f"{title}: why this prediction (red raises the dose, blue lowers it)")
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=110, bbox_inches="tight")
    plt.close(fig)


def best_of(fn: Any, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cost(quick: bool) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    n = 20_000 if quick else 100_000
    big, _ = planted_bag(rng, n, 0.01)
    rows = []
    for name, rep, kernel, _ in representations(quick):
        # Quadratic in the bag: 10^5 cells is not its regime.
        cells = big if not name.startswith("exact") else big[: n // 20]
        shares = rng.uniform(0.0, 0.06, 20)
        train = [planted_bag(rng, 2000, s)[0] for s in shares]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = DistributionRidge(rep, kernel=kernel, random_state=0).fit(train, shares)
        rows.append(
            cost_row(
                f"cost, {len(cells)} cells: {name}",
                lambda m=model, c=cells: m.predict([c]),
                lambda m=model, c=cells: explain(m, c),
            )
        )
    return rows


def cost_row(case: str, predict_fn: Any, explain_fn: Any) -> dict[str, Any]:
    """A cost table's row: the best of 7 alternated rounds of each (a burst of load
    hits both alike), and their ratio."""
    predict_fn()  # warm
    predict, explaining = np.inf, np.inf
    for _ in range(7):
        predict = min(predict, best_of(predict_fn, 1))
        explaining = min(explaining, best_of(explain_fn, 1))
    return {
        "case": case,
        "predict s": predict,
        "explain s": explaining,
        "ratio": explaining / predict,
        "load average": os.getloadavg()[0],
    }


def cost_beyond_budget(quick: bool) -> list[dict[str, Any]]:
    """The exact mean embedding where the per-cell sums of every training bag exceed
    the explanation's budget (64 MiB): 300 training bags, 30,000 cells (69 MiB)."""
    rng = np.random.default_rng(2)
    n_bags, n = (40, 6000) if quick else (300, 30_000)
    shares = rng.uniform(0.0, 0.06, n_bags)
    train = [planted_bag(rng, 100, s)[0] for s in shares]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = DistributionRidge(
            MeanEmbedding(method="exact", bandwidth=1.0), kernel="gaussian", random_state=0
        ).fit(train, shares)
    cells, _ = planted_bag(rng, n, 0.01)
    case = (
        f"cost, {n} cells: exact MMD, {n_bags} training bags "
        f"({n * n_bags * 8 / 2**20:.0f} MiB of per-cell sums)"
    )
    return [cost_row(case, lambda: model.predict([cells]), lambda: explain(model, cells))]


def cost_per_cell(quick: bool) -> list[dict[str, Any]]:
    """Marginal transfer (a per-cell model): explaining a sample's shares against
    labelling its cells (``predict_tasks``, as the service does), per cell model."""
    tasks, y = make_cytometry_tasks(10, 2000, n_markers=6, random_state=[11, 0])
    new, _ = make_cytometry_tasks(1, 20_000 if quick else 100_000, n_markers=6, random_state=5)
    cells = np.asarray(new[0])
    rows = []
    for cell_model in ("linear", "kernel", "trees"):
        model = MarginalTransferClassifier(
            calibrate="standardise", cell_model=cell_model, random_state=0
        ).fit(tasks, y)
        rows.append(
            cost_row(
                f"cost, {cells.shape[0]} cells: marginal transfer, {cell_model}",
                lambda m=model: m.predict_tasks([cells]),
                lambda m=model: m.explain(cells),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run (smaller, unsaved)")
    parser.add_argument(
        "--cost-only", action="store_true", help="only the cost rows (a rerun, unsaved)"
    )
    args = parser.parse_args()
    costs = cost(args.quick) + cost_beyond_budget(args.quick) + cost_per_cell(args.quick)
    if args.cost_only:
        report(costs, "bench_explain", save=False, width=24)
        return
    results = planted_signal(args.quick) + yeast(args.quick) + costs
    report(results, "bench_explain", save=not args.quick, width=24)


if __name__ == "__main__":
    main()
