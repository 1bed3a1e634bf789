"""Marginal transfer against strong simple baselines on samples from unseen batches.

Synthetic cytometry in two batches (``make_batched_cytometry_tasks``: per-batch affine
and non-linear marker distortions and population shifts, ``--strength`` 2 by default;
8 samples per batch, 8 markers, 4 populations), 2,000 training cells per sample,
10,000 test cells per sample:

* leave-one-batch-out: train on one batch, test on every sample of the other (both
  directions);
* leave-one-sample-out: train on every other sample (both batches), test on the one
  left out (4 held-out samples, two per batch).
* other batch draws: leave-one-batch-out both ways on ``--draws`` more draws of the
  batch effects (seeds 1, 2, ...), for MTL, pooling and the baselines: how much one
  draw's ranking says.

Methods: ``MTL`` (``MarginalTransferClassifier()`` defaults: per-task normalisation
chosen by CV, Gaussian plus linear point kernel, MTL against pooling by CV), ``pooling``
(the same with ``pooling=True``), ``MTL paper kernel`` and ``pooled paper kernel`` (the
paper's Gaussian ``k_X`` without normalisation, the defaults before; the pooled one is
the reference of the fit-time target), and the baselines of ``bench/dg_baselines.py``
(pooled LDA, logistic regression, histogram gradient boosting, each with and without
per-sample standardisation; ``LDA + std`` and ``HGB + std`` also with their labels
refined per test sample by the Gaussian mixture the default model may apply). The
bagserve models are given the training samples' batches (``fit(..., groups=)``):
with both batches in training they choose their fallback for new batches by
leave-one-batch-out CV (a model without one, all of it). Reported: per-cell accuracy
and macro-F1 averaged over the test samples, and fit seconds, each fit timed in the
same run.

Run with ``.venv/bin/python bench/bench_dg_baselines.py [--quick] [--draws 3]``.
Writes bench/results/bench_dg_baselines.json.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from _report import report
from bagserve.core import Bags, MarginalTransferClassifier
from bagserve.core.datasets import make_batched_cytometry_tasks
from dg_baselines import BASELINES, baseline_predictions, refined_predictions, scores

#: Baselines also shown with the per-sample mixture refinement the default model may
#: apply (``refine=``): what that step alone does for any model.
REFINED = ("LDA + std", "HGB + std")

METHODS: dict[str, dict[str, Any]] = {
    "MTL": {},
    "pooling": {"pooling": True},
    "MTL paper kernel": {"point_kernel": "gaussian", "normalise": "none"},
    "pooled paper kernel": {"pooling": True, "point_kernel": "gaussian", "normalise": "none"},
}


def split_cells(tasks, y, idx):
    return [np.asarray(tasks[int(t)]) for t in idx], [
        y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in idx
    ]


def evaluate(
    train_x, train_y, test_x, test_y, seed: int, batches, methods=METHODS
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    classes = np.unique(np.concatenate(train_y))
    for name, (pred, fit) in baseline_predictions(train_x, train_y, test_x, seed=seed).items():
        variants = {name: pred}
        if name in REFINED:
            variants[f"{name} + mixture"] = refined_predictions(test_x, pred, classes)
        for label, labels in variants.items():
            per = [scores(t, p) for t, p in zip(test_y, labels, strict=True)]
            out[label] = {k: float(np.mean([s[k] for s in per])) for k in per[0]}
            out[label]["fit_seconds"] = fit
    train_bags = Bags.from_arrays(train_x)
    test_bags = Bags.from_arrays(test_x)
    for name, params in methods.items():
        model = MarginalTransferClassifier(random_state=seed, **params)
        t0 = time.perf_counter()
        # The batches are named, as a lab's configuration names them: with two or more
        # in training, the model chooses by leave-one-batch-out cross-validation.
        model.fit(train_bags, np.concatenate(train_y), groups=batches)
        fit = time.perf_counter() - t0
        answers = model.predict_tasks(test_bags)
        per = [scores(t, a.predictions) for t, a in zip(test_y, answers, strict=True)]
        out[name] = {k: float(np.mean([s[k] for s in per])) for k in per[0]}
        out[name]["fit_seconds"] = fit
        if name == "MTL":
            answered = sum(a.report.fallback for a in answers)
            fb = model.fallback_
            out[name]["chosen"] = f"{model.normalise_}, tau {model.tau_}" + (
                f"; fallback ({fb.point_kernel_}"
                + (f" + {fb.blend_.point_kernel_} tau {fb.blend_.tau_}" if fb.blend_ else "")
                + f") answered {answered}/{len(test_x)}"
                if fb is not None
                else ""
            )
    return out


def draw(seed: int, strength: float, n_train: int, n_test: int):
    """One draw of the two batches: training and test cells per sample, and batches.

    One call, then each sample's cells split: training and test cells of a sample
    share its batch effects and its population proportions."""
    tasks, y, batches = make_batched_cytometry_tasks(
        2, 8, n_train + n_test, random_state=[seed, 1], strength=strength
    )
    train_tasks = Bags.from_arrays([np.asarray(tasks[t])[:n_train] for t in range(len(tasks))])
    test_tasks = Bags.from_arrays([np.asarray(tasks[t])[n_train:] for t in range(len(tasks))])
    per_task = [y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in range(len(tasks))]
    y_train = np.concatenate([v[:n_train] for v in per_task])
    y_test = np.concatenate([v[n_train:] for v in per_task])
    return train_tasks, y_train, test_tasks, y_test, batches


def across_batches(data, seed: int, directions, methods=METHODS) -> list[dict[str, Any]]:
    """Train on one batch, test on every sample of the other, for each direction."""
    train_tasks, y_train, test_tasks, y_test, batches = data
    rows = []
    for train_b, test_b in directions:
        tr = np.flatnonzero(batches == train_b)
        te = np.flatnonzero(batches == test_b)
        res = evaluate(
            *split_cells(train_tasks, y_train, tr),
            *split_cells(test_tasks, y_test, te),
            seed,
            batches[tr],
            methods,
        )
        for name, figures in res.items():
            rows.append({"case": f"batch {train_b} -> batch {test_b}: {name}", **figures})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer cells, one direction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--strength", type=float, default=2.0, help="size of the batch effects (1 = mild)"
    )
    parser.add_argument(
        "--draws", type=int, default=3, help="further draws of the batch effects (0: none)"
    )
    args = parser.parse_args()
    n_train, n_test = (1000, 3000) if args.quick else (2000, 10_000)
    data = draw(args.seed, args.strength, n_train, n_test)
    train_tasks, y_train, test_tasks, y_test, batches = data
    directions = [(0, 1)] if args.quick else [(0, 1), (1, 0)]
    results = across_batches(data, args.seed, directions)
    held_out = [0, 8] if args.quick else [0, 3, 8, 11]
    loso: dict[str, list[dict[str, float]]] = {}
    for i in held_out:
        tr = np.setdiff1d(np.arange(len(batches)), [i])
        res = evaluate(
            *split_cells(train_tasks, y_train, tr),
            *split_cells(test_tasks, y_test, [i]),
            args.seed,
            batches[tr],
        )
        for name, figures in res.items():
            loso.setdefault(name, []).append(figures)
    for name, rows in loso.items():
        mean = {
            k: float(np.mean([r[k] for r in rows]))
            if not isinstance(rows[0][k], str)
            else "; ".join(sorted({r[k] for r in rows}))
            for k in rows[0]
        }
        results.append({"case": f"leave one sample out ({len(held_out)}): {name}", **mean})
    # Further draws of the batch effects: the paper-kernel rows add nothing here.
    ours = {k: v for k, v in METHODS.items() if "paper" not in k}
    for seed in range(args.seed + 1, args.seed + 1 + (0 if args.quick else args.draws)):
        rows = across_batches(draw(seed, args.strength, n_train, n_test), seed, directions, ours)
        results += [{**r, "case": f"draw {seed}, {r['case']}"} for r in rows]
    for r in results:
        r["strength"] = args.strength
    report(results, "bench_dg_baselines", save=not args.quick, width=14)
    print("\nmethods:", ", ".join([*METHODS, *BASELINES]))


if __name__ == "__main__":
    main()
