"""Can folds within the training batch tell which method labels a new batch best?
(issue 30, item 4: "the default model chooses among these by its folds").

On the data and protocol of ``bench_new_batch.py`` (one batch of 8 samples trains, the
other batch's 8 are labelled, per cell, all cells and gated cells), every method is
also scored by 4 leave-two-samples-out folds of the training batch: the default
``MarginalTransferClassifier`` and the per-sample standardised baselines (``LDA + std``,
``logistic + std``, ``HGB + std``). Per run it prints both accuracies and the method the
folds would pick; at the end, how often the pick is the new batch's best method, its
mean shortfall against that best (the regret), the default's, and the rank correlation
between fold and new-batch accuracies.

Run with ``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/fold_choice.py
[--cells 1000] [--seeds 0,1]`` (about 4 minutes at the defaults). Prints only.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import numpy as np
from bagserve.core import Bags, MarginalTransferClassifier
from bench_new_batch import cells, cohorts, gated
from dg_baselines import baseline_predictions, scores
from scipy.stats import spearmanr

BASELINES = ("LDA + std", "logistic + std", "HGB + std")
MTL = "MTL (defaults)"


def accuracies(train_x, train_y, test_x, test_y, seed: int) -> dict[str, list[float]]:
    """Per method, the accuracy on every test sample."""
    out = {
        name: [scores(v, p)["accuracy"] for v, p in zip(test_y, pred, strict=True)]
        for name, (pred, _) in baseline_predictions(
            train_x, train_y, test_x, seed=seed, names=BASELINES
        ).items()
    }
    model = MarginalTransferClassifier(random_state=seed)
    model.fit(Bags.from_arrays(train_x), np.concatenate(train_y))
    answers = model.predict_tasks(Bags.from_arrays(test_x))
    out[MTL] = [float(np.mean(a.predictions == v)) for a, v in zip(answers, test_y, strict=True)]
    return out


def one_run(xs, ys, tx, ty, seed: int) -> dict[str, Any]:
    """Fold and new-batch accuracy of every method, and the folds' pick."""
    folds = np.array_split(np.arange(len(xs)), 4)
    cv: dict[str, list[float]] = {}
    for val in folds:
        trn = np.setdiff1d(np.arange(len(xs)), val)
        found = accuracies(
            [xs[i] for i in trn], [ys[i] for i in trn], [xs[i] for i in val],
            [ys[i] for i in val], seed,
        )  # fmt: skip
        for name, acc in found.items():
            cv.setdefault(name, []).extend(acc)
    fold_mean = {name: float(np.mean(v)) for name, v in cv.items()}
    test = {name: float(np.mean(v)) for name, v in accuracies(xs, ys, tx, ty, seed).items()}
    pick = max(fold_mean, key=fold_mean.__getitem__)
    return {"folds": fold_mean, "test": test, "pick": pick}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=1000)
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    runs = []
    for data, make in cohorts(args.cells).items():
        for seed in (int(s) for s in args.seeds.split(",")):
            tasks, y, batches, rest = make(seed)
            for a in (0, 1):
                xs, ys = cells(tasks, y, np.flatnonzero(batches == a))
                tx, ty = cells(tasks, y, np.flatnonzero(batches != a))
                for scoring in ("all", "gated") if rest is not None else ("all",):
                    if scoring == "gated":
                        run = one_run(*gated(xs, ys, rest), *gated(tx, ty, rest), seed)
                    else:
                        run = one_run(xs, ys, tx, ty, seed)
                    run.update(data=data, seed=seed, direction=f"{a} -> {1 - a}", scoring=scoring)
                    runs.append(run)
                    print(
                        f"{data:9s} seed {seed} {run['direction']} {scoring:5s} pick "
                        f"{run['pick']:15s} | "
                        + "  ".join(
                            f"{n}: {run['folds'][n]:.4f} / {run['test'][n]:.4f}"
                            for n in (MTL, *BASELINES)
                        ),
                        flush=True,
                    )
    best = [max(r["test"].values()) for r in runs]
    hits = sum(r["test"][r["pick"]] == b for r, b in zip(runs, best, strict=True))
    regret = np.mean([b - r["test"][r["pick"]] for r, b in zip(runs, best, strict=True)])
    default = np.mean([b - r["test"][MTL] for r, b in zip(runs, best, strict=True)])
    rho = [
        spearmanr(list(r["folds"].values()), [r["test"][n] for n in r["folds"]]).statistic
        for r in runs
    ]
    print(f"\n{len(runs)} runs: the folds pick the new batch's best in {hits}")
    print(f"mean regret: fold pick {regret:.4f}, always {MTL} {default:.4f}")
    print(f"rank correlation, folds against new batch: mean {np.nanmean(rho):.2f}")
    for data in dict.fromkeys(r["data"] for r in runs):
        for scoring in ("all", "gated"):
            rows = [r for r in runs if r["data"] == data and r["scoring"] == scoring]
            if rows:
                means = {n: np.mean([r["test"][n] for r in rows]) for n in (MTL, *BASELINES)}
                picked = np.mean([r["test"][r["pick"]] for r in rows])
                print(
                    f"{data} {scoring}: pick {picked:.4f}; "
                    + ", ".join(f"{n} {v:.4f}" for n, v in means.items())
                )


if __name__ == "__main__":
    main()
