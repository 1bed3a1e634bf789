"""Held-out coverage of the conformal intervals and sets of the ridge models on bags.

Run with ``make bench`` (or ``.venv/bin/python bench/bench_conformal.py [--quick]``).
Prints a table and writes ``bench/results/bench_conformal.json``.

Jackknife+ (Barber, Candès, Ramdas, Tibshirani, Ann. Statist. 2021) from the
closed-form leave-one-bag-out models: ``DistributionRidge.predict_interval`` and
``DistributionRidgeClassifier.predict_set``, at nominal coverage 0.8, 0.9 and 0.95,
on the exact (T x T Gram) path and the random-feature primal path (``n_components``).

(a) Paper generators, each repeat an independent draw of T = 100 training and 200
    held-out bags of 100 points (SW2 features, 50 directions x 50 levels):
    * ``entropy``: rotated 2-D Gaussians labelled by the entropy of their first
      marginal (paper 003 supplement A.2.1);
    * ``gmm-count``: Gaussian mixtures with 1..4 components in 2-D, the number of
      components regressed as a real value (paper 000 §5.1);
    * ``gmm-sets``: the same task as classification, prediction sets; also the held-out
      log-loss of ``predict_proba`` against the raw softmax of the scores and against
      a temperature plus per-class bias (the variant ``predict_proba`` does not use).
    ``auto``: the default closed-form LOO search of (γ, λ) on each training set (the
    same LOO residuals then calibrate the intervals: data reuse the jackknife+ theorem
    does not cover); ``fixed``: (γ, λ) found by that search once on an independent
    pilot draw, then held fixed (the theorem's setting). Coverage is averaged over all
    held-out bags; its standard error is the spread of the per-repeat coverage over
    sqrt(repeats).
(b) The yeast dose-response FCS bags (../shared/data/cytoflow_yeast, read as
    examples/yeast_dose/train.toml reads them: FSC-A, SSC-A, FITC-A, arcsinh with
    cofactor 150, standard scaling learned on the training bags of each fold; target
    log10 of the inducer dose). Only 21 labelled bags: outer leave-one-bag-out, each
    of the 21 models (T = 20, automatic search) gives an interval for its left-out
    bag. The 21 indicators are not independent (the models share 19 bags), so the
    binomial standard error sqrt(c(1-c)/21) is a rough guide only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.optimize
from _report import RESULTS
from bagserve.core import (
    Bags,
    DistributionRidge,
    DistributionRidgeClassifier,
    SlicedWasserstein,
)
from bagserve.core.conformal import softmax
from bagserve.core.datasets import make_entropy_bags, make_gmm_modes
from bagserve.core.io.preprocessing import Preprocessing
from bagserve.core.training import load_config, read_data

LEVELS = (0.8, 0.9, 0.95)
N_TRAIN, N_TEST, N_POINTS = 100, 200, 100
N_COMPONENTS = 200
PILOT_SEED = 1000
#: This benchmark measures jackknife+ as such (the estimators' default is CV+ with
#: domain-scaled residuals since groups existed: bench_intervals.py compares the two).
JACKKNIFE = {"calibration": "jackknife+", "interval_scaling": "none"}
ROOT = Path(__file__).resolve().parents[1]
YEAST_CONFIG = ROOT / "examples" / "yeast_dose" / "train.toml"


def sw(seed: int) -> SlicedWasserstein:
    return SlicedWasserstein(n_directions=50, n_levels=50, random_state=seed)


def draw(task: str, seed: int) -> tuple[Bags, np.ndarray]:
    n = N_TRAIN + N_TEST
    if task == "entropy":
        return make_entropy_bags(n, N_POINTS, random_state=seed)
    bags, y = make_gmm_modes(n, N_POINTS, max_components=4, dim=2, random_state=seed)
    return bags, (y.astype(np.float64) if task == "gmm-count" else y)


def estimator(task: str, seed: int, n_components: int | None, **fixed: Any) -> Any:
    cls = DistributionRidgeClassifier if task == "gmm-sets" else DistributionRidge
    return cls(sw(seed), n_components=n_components, random_state=seed, **JACKKNIFE, **fixed)


def temperature_and_bias(scores: np.ndarray, codes: np.ndarray) -> tuple[float, np.ndarray]:
    """The calibration predict_proba does not use, for comparison: softmax(a·s + b) with
    a per-class bias b, fitted like core.conformal.fit_temperature (Platt's targets)."""
    n, C = scores.shape
    counts = np.bincount(codes, minlength=C).astype(np.float64)
    targets = np.repeat((1.0 / (counts[codes] + C))[:, None], C, axis=1)
    targets[np.arange(n), codes] = (counts[codes] + 1.0) / (counts[codes] + C)

    def loss(theta: np.ndarray) -> float:
        z = theta[0] * scores + theta[1:]
        z = z - z.max(axis=1, keepdims=True)
        return -float(np.sum(targets * (z - np.log(np.exp(z).sum(axis=1, keepdims=True))))) / n

    res = scipy.optimize.minimize(
        loss, np.r_[1.0, np.zeros(C)], method="L-BFGS-B", bounds=[(1e-8, None)] + [(None, None)] * C
    )
    return float(res.x[0]), res.x[1:]


def log_loss(proba: np.ndarray, codes: np.ndarray) -> float:
    return float(-np.mean(np.log(np.maximum(proba[np.arange(len(codes)), codes], 1e-300))))


def generator_case(task: str, n_components: int | None, selection: str, repeats: int) -> dict:
    fixed: dict[str, float] = {}
    if selection == "fixed":
        bags, y = draw(task, PILOT_SEED)
        pilot = estimator(task, PILOT_SEED, n_components)
        pilot.fit(bags.take(np.arange(N_TRAIN)), y[:N_TRAIN])
        fixed = {"gamma": pilot.gamma_, "alpha": pilot.alpha_}
    per_repeat: dict[float, list[float]] = {c: [] for c in LEVELS}
    sizes: dict[float, list[float]] = {c: [] for c in LEVELS}
    rmse = []
    calibration: dict[str, list[float]] = {
        "log_loss_predict_proba": [],
        "log_loss_raw_softmax": [],
        "log_loss_temperature_and_bias": [],
        "argmax_flips_temperature_and_bias": [],
        "accuracy_temperature_and_bias": [],
    }
    t0 = time.perf_counter()
    for r in range(repeats):
        bags, y = draw(task, r)
        train, test = bags.take(np.arange(N_TRAIN)), bags.take(np.arange(N_TRAIN, len(bags)))
        ytr, yte = y[:N_TRAIN], y[N_TRAIN:]
        model = estimator(task, r, n_components, **fixed).fit(train, ytr)
        if task == "gmm-sets":
            codes = np.searchsorted(model.classes_, yte)
            pred = model.predict(test)
            rmse.append(np.mean(pred == yte))
            scores = model.decision_function(test)
            onehot = np.eye(model.classes_.size)[np.searchsorted(model.classes_, ytr)]
            a, b = temperature_and_bias(onehot - model.loo_residuals_, onehot.argmax(axis=1))
            biased = softmax(a * scores + b)
            calibration["log_loss_predict_proba"].append(log_loss(model.predict_proba(test), codes))
            calibration["log_loss_raw_softmax"].append(log_loss(softmax(scores), codes))
            calibration["log_loss_temperature_and_bias"].append(log_loss(biased, codes))
            flipped = model.classes_[biased.argmax(axis=1)]
            calibration["argmax_flips_temperature_and_bias"].append(np.mean(flipped != pred))
            calibration["accuracy_temperature_and_bias"].append(np.mean(flipped == yte))
            for c in LEVELS:
                sets = model.predict_set(test, coverage=c)
                per_repeat[c].append(float(np.mean(sets[np.arange(len(yte)), codes])))
                sizes[c].append(float(sets.sum(axis=1).mean()))
        else:
            rmse.append(np.sqrt(np.mean((model.predict(test) - yte) ** 2)))
            for c in LEVELS:
                iv = model.predict_interval(test, coverage=c)
                per_repeat[c].append(float(np.mean((iv[:, 0] <= yte) & (yte <= iv[:, 1]))))
                sizes[c].append(float(np.mean(iv[:, 1] - iv[:, 0])))
    out: dict[str, Any] = {
        "data": task,
        "path": "exact" if n_components is None else f"n_components={n_components}",
        "selection": selection,
        "held_out_bags": repeats * N_TEST,
        "repeats": repeats,
        "accuracy" if task == "gmm-sets" else "rmse": float(np.mean(rmse)),
        "seconds": time.perf_counter() - t0,
    }
    if fixed:
        out.update(fixed)
    if task == "gmm-sets":
        out.update({k: float(np.mean(v)) for k, v in calibration.items()})
    for c in LEVELS:
        cov = np.array(per_repeat[c])
        out[f"coverage_{c}"] = float(cov.mean())
        out[f"coverage_se_{c}"] = float(cov.std(ddof=1) / np.sqrt(repeats))
        out[f"{'set_size' if task == 'gmm-sets' else 'width'}_{c}"] = float(np.mean(sizes[c]))
    return out


def yeast_case(n_components: int | None) -> dict:
    config = load_config(YEAST_CONFIG)
    data = read_data(config)
    y = data.y.astype(np.float64)
    markers = list(data.panel.markers)
    pre_spec = dict(config.get("preprocessing", {}))
    T = len(data.bags)
    lo_hi = {c: np.empty((T, 2)) for c in LEVELS}
    point = np.empty(T)
    t0 = time.perf_counter()
    for i in range(T):
        keep = np.delete(np.arange(T), i)
        train, test = data.bags.take(keep), data.bags.take([i])
        pre = Preprocessing(**pre_spec).fit(train, markers)
        model = DistributionRidge(sw(0), n_components=n_components, random_state=0, **JACKKNIFE)
        model.fit(pre.apply(train, markers), y[keep])
        new = pre.apply(test, markers)
        point[i] = model.predict(new)[0]
        for c in LEVELS:
            lo_hi[c][i] = model.predict_interval(new, coverage=c)[0]
    out: dict[str, Any] = {
        "data": "yeast dose (log10 IP)",
        "path": "exact" if n_components is None else f"n_components={n_components}",
        "selection": "auto",
        "held_out_bags": T,
        "repeats": 1,
        "rmse": float(np.sqrt(np.mean((point - y) ** 2))),
        "target_sd": float(y.std()),
        "seconds": time.perf_counter() - t0,
    }
    for c in LEVELS:
        cov = float(np.mean((lo_hi[c][:, 0] <= y) & (y <= lo_hi[c][:, 1])))
        out[f"coverage_{c}"] = cov
        out[f"coverage_se_{c}"] = float(np.sqrt(cov * (1 - cov) / T))
        out[f"width_{c}"] = float(np.mean(lo_hi[c][:, 1] - lo_hi[c][:, 0]))
    return out


def cost_case() -> dict:
    """What an interval costs on top of a prediction (one extra T-vector per bag): the
    median of 3 timings of each, interleaved (the machine is shared)."""
    bags, y = make_entropy_bags(300 + 2000, N_POINTS, random_state=7)
    model = DistributionRidge(sw(7), **JACKKNIFE).fit(bags.take(np.arange(300)), y[:300])
    new = bags.take(np.arange(300, len(bags)))
    model.predict(new[:10]), model.predict_interval(new[:10])  # warm-up
    times: dict[str, list[float]] = {"predict": [], "predict_interval": []}
    for _ in range(3):
        for name in times:
            t0 = time.perf_counter()
            getattr(model, name)(new)
            times[name].append(time.perf_counter() - t0)
    t_pred, t_iv = (float(np.median(v)) for v in times.values())
    return {
        "case": "2000 new bags of 100 points, exact model on 300 bags",
        "predict_seconds": t_pred,
        "predict_interval_seconds": t_iv,
        "ratio": t_iv / t_pred,
    }


def fmt(v: float, se: float | None = None) -> str:
    return f"{v:.3f}" if se is None else f"{v:.3f} ± {se:.3f}"


def print_table(rows: list[dict]) -> None:
    head = ["data", "path", "selection", "bags", "point"]
    for c in LEVELS:
        head += [f"cov {c}", f"width/size {c}"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        point = f"acc {r['accuracy']:.3f}" if "accuracy" in r else f"rmse {r['rmse']:.3f}"
        cells = [r["data"], r["path"], r["selection"], str(r["held_out_bags"]), point]
        for c in LEVELS:
            key = "set_size" if f"set_size_{c}" in r else "width"
            cells += [fmt(r[f"coverage_{c}"], r[f"coverage_se_{c}"]), fmt(r[f"{key}_{c}"])]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 repeats (a smoke run, no JSON)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    t0 = time.perf_counter()
    rows = []
    for task in ("entropy", "gmm-count", "gmm-sets"):
        for n_components in (None, N_COMPONENTS):
            for selection in ("auto", "fixed"):
                rows.append(generator_case(task, n_components, selection, repeats))
                print(f"  {task} {n_components} {selection}: {rows[-1]['seconds']:.1f} s")
    for n_components in (None, 50):
        rows.append(yeast_case(n_components))
        print(f"  yeast {n_components}: {rows[-1]['seconds']:.1f} s")
    cost = cost_case()
    print()
    print_table(rows)
    print(
        f"\ncost: predict {cost['predict_seconds']:.3f} s, predict_interval "
        f"{cost['predict_interval_seconds']:.3f} s for 2000 bags (ratio {cost['ratio']:.2f})"
    )
    print("\nclassifier probabilities on held-out bags (gmm-sets rows):")
    for r in rows:
        if r["data"] == "gmm-sets":
            print(
                f"  {r['path']}, {r['selection']}: log-loss predict_proba "
                f"{r['log_loss_predict_proba']:.4f}, raw softmax {r['log_loss_raw_softmax']:.4f}, "
                f"temperature+bias {r['log_loss_temperature_and_bias']:.4f} (flips "
                f"{r['argmax_flips_temperature_and_bias']:.3f} of argmax decisions, accuracy "
                f"{r['accuracy_temperature_and_bias']:.3f} vs {r['accuracy']:.3f})"
            )
    print(f"total {time.perf_counter() - t0:.0f} s")
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / "bench_conformal.json"
        path.write_text(json.dumps({"rows": rows, "cost": cost}, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
