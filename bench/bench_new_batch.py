"""A new instrument batch: marginal transfer against simple baselines on three data sets
not designed for it (issue 30, items 3 and 4).

Every table trains on one batch of 8 samples and labels every sample of another batch,
per cell. Data sets:

* ``gvhd``: ``core.datasets.emulate_batches`` on the 12 FlowCAP-I GvHD samples
  (channels /1023, ``labels="aligned"``: gates 1, 3, 4 and 0 = every other cell, the
  rest class): 2 batches x 8 samples x 3,000 cells, the sources split between the
  batches (no patient in both). Populations keep the real gates' shapes and the rest
  class is the real, heterogeneous ungated cells; each batch has its own monotone
  non-linear instrument per marker.
* ``flowsom``: the same from the FlowSOM example's one gated sample (19,225 cells,
  ``ff.fcs``: compensated and logicle-transformed upstream; the 10 named fluorescence
  markers as they are, FSC-A and SSC-A linear; all 12 channels standardised on the
  sample; ``gating_result.csv``: 6 gates and ``Unlabeled``, the rest class, 29 %).
  ``emulate_batches`` needs a source per batch at least: the sample's cells are split
  at random into 4 *pseudo-sources* (a new split per seed), 2 per batch, so the
  samples differ by their drawn proportions and their instruments only, not by
  patient.
* ``synthetic``: ``make_batched_cytometry_tasks(2, 8, 3000, strength=2)`` (Gaussian
  populations moved by affine, non-linear and population shifts per batch; no rest
  class, so its ``gated`` and ``all`` scorings are one).

Protocols and scorings:

* ``batch A -> batch B``, both directions, 3 generator seeds (``--seeds``);
* ``all`` cells: trained on every cell of the training samples, the rest class a class;
  ``gated`` cells: trained on the training samples' non-rest cells only and scored on
  the test samples' non-rest cells (DeepCyTOF's scoring);
* DeepCyTOF's one-reference protocol on ``synthetic`` (seed 0): one labelled sample
  of a batch labels the 8 samples of the other, 2 references per batch. The model's
  defaults choose their hyperparameters by cross-validation over tasks, which one
  sample does not offer: its cells are split at random into 4 parts, fitted as 4
  tasks with the defaults unchanged.

Methods: the baselines of ``dg_baselines.py`` (``LDA``, ``LDA + std``,
``logistic + std``, ``HGB + std``; ``+ std`` standardises each sample by its own mean
and sd per marker), the calibrate-then-LDA baselines of ``calibration_baselines.py``
(``landmarks + LDA``: a per-marker scale and shift from population landmarks;
``CytoNorm + LDA``: a monotone spline from each batch's reference control, where the
data set has controls: ``emulate_batches(control_cells=)``, one per batch, never a
training or test sample) and the rows of ``MTL_VARIANTS``
(``MarginalTransferClassifier`` with ``random_state`` = the seed: its defaults; the
rest label named, ``unassigned=``; out-of-range tasks calibrated to the training
reference, ``calibrate="quantile"``, in the ``all`` scoring only; ``batch control``:
fitted with the training batch's control and every test sample mapped by its batch's
control first; a row whose parameters the installed estimator lacks is skipped with a
note). No model is given the batches or sources (one batch in training). Per row:
per-cell accuracy and macro-F1 averaged over the test samples (then over seeds), the
per-seed range, the standard error over all (seed, test sample) scores, fit seconds;
in a second table the worst (seed, test sample) accuracy and, in the all-cells
scoring, the rest label's precision and recall over every test cell. Per table: the
best method, the best baseline and whether ``MTL (defaults)`` is within one standard
error of the best baseline (``gap <= SE``, the SE of the best baseline's accuracy over
the test samples of every seed).

Run with ``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python
bench/bench_new_batch.py [--quick]`` (``--quick``: 1 seed, 1,000 cells per sample, one
reference per batch, no JSON written). Writes bench/results/bench_new_batch.json and
prints the README's tables (markdown); ``--tables`` prints them from that JSON alone.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _report import report
from bagserve.core import Bags, MarginalTransferClassifier
from bagserve.core.datasets import emulate_batches, load_flowcap_gvhd, make_batched_cytometry_tasks
from calibration_baselines import cytonorm_then_lda, landmarks_then_lda
from dg_baselines import baseline_predictions, scores

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
GVHD = DATA / "flowcap1_gvhd"
FLOWSOM = DATA / "flowsom_example"
BASELINES = ("LDA", "LDA + std", "logistic + std", "HGB + std")
#: Calibrate, then LDA (``calibration_baselines.py``); CytoNorm's needs a control per
#: batch, which the synthetic data set has not.
CALIBRATED = ("landmarks + LDA", "CytoNorm + LDA")
#: Placeholder for the data set's rest label in ``MTL_VARIANTS`` (such a row is run on
#: data sets with a rest class and in the ``all`` scoring only).
REST = object()
#: The bagserve rows: name -> ``MarginalTransferClassifier`` parameters (``random_state``
#: is the seed). Add rows here; one whose parameters ``get_params()`` lacks is skipped.
MTL_VARIANTS: dict[str, dict[str, Any]] = {
    # Calibration and cell model chosen by the instrument-perturbed folds.
    "MTL (defaults)": {},
    "MTL, rest label named": {"unassigned": REST},
    # Each batch's reference control maps its samples first (data sets with controls).
    "MTL, batch control": {},
    # Each training sample's centre named, ``fit(groups=)``: the search leaves one
    # centre out (data with several real training batches).
    "MTL, centres named": {},
}
#: Rows given each batch's reference control (fit: the training batch's; predict: the
#: test batch's); run only where the data set has controls.
WITH_CONTROL = {"MTL, batch control"}
#: Rows fitted with each training sample's batch named (``fit(groups=)``); run only
#: where ``evaluate`` is given the groups.
WITH_GROUPS = {"MTL, centres named"}
#: Rows run in the ``all`` scoring only.
ALL_CELLS_ONLY: set[str] = set()
#: FlowSOM example channels: the logicle-transformed fluorescence markers ($PnS) and the
#: linear scatter areas; "Qdot 605-A" (no marker) and the H/W scatter are left out.
FLOWSOM_MARKERS = ("GFP", "CD8", "l/d", "TCRyd", "CD45", "TCRb", "NK1/1", "CD4", "CD19", "CD3")
FLOWSOM_SCATTER = ("FSC-A", "SSC-A")
FLOWSOM_PARTS = 4
REFERENCE_PARTS = 4


# ----------------------------------------------------------------------------- data
def _gvhd_sources() -> tuple[Bags, np.ndarray, Any]:
    tasks, y, _ = load_flowcap_gvhd(GVHD)
    return tasks, y, 0


def _flowsom_sample() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The 12 channels (standardised on the sample) and per-cell gate codes; code 0 is
    ``Unlabeled``."""
    from bagserve.core.io import read_sample

    sample = read_sample(FLOWSOM / "ff.fcs")
    cols = [sample.names.index(n) for n in (*FLOWSOM_SCATTER, *FLOWSOM_MARKERS)]
    x = np.asarray(sample.points[:, cols], dtype=np.float64)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    gates = np.array([line.strip().strip('"') for line in (FLOWSOM / "gating_result.csv").open()])
    if gates.size != x.shape[0]:
        raise ValueError(f"{gates.size} gates for {x.shape[0]} cells")
    names = ["Unlabeled", *sorted(set(gates) - {"Unlabeled"})]
    codes = np.searchsorted(np.array(names[1:]), gates) + 1
    codes[gates == "Unlabeled"] = 0
    return x, codes, names


def cohorts(
    n_cells: int,
) -> dict[str, Callable[[int], tuple[Bags, np.ndarray, np.ndarray, Any, np.ndarray]]]:
    """Per data set: seed -> (tasks, labels, batches, rest label or None, control
    flags: True for a batch's reference control, never a training or test sample)."""
    gvhd = _gvhd_sources()
    flowsom = _flowsom_sample()

    def emulated_gvhd(seed: int):
        sources, y, rest = gvhd
        tasks, labels, batches, origin = emulate_batches(
            sources, y, 2, 8, n_cells, random_state=seed, control_cells=n_cells
        )
        return tasks, labels, batches, rest, origin < 0

    def emulated_flowsom(seed: int):
        x, codes, _ = flowsom
        # One sample: random pseudo-sources (a new split per seed), 2 per batch.
        part = np.random.default_rng([seed, 7]).permutation(x.shape[0]) % FLOWSOM_PARTS
        sources = Bags.from_arrays([x[part == k] for k in range(FLOWSOM_PARTS)])
        y = np.concatenate([codes[part == k] for k in range(FLOWSOM_PARTS)])
        tasks, labels, batches, origin = emulate_batches(
            sources, y, 2, 8, n_cells, random_state=seed, control_cells=n_cells
        )
        return tasks, labels, batches, 0, origin < 0

    def synthetic(seed: int):
        tasks, labels, batches = make_batched_cytometry_tasks(
            2, 8, n_cells, random_state=[seed, 1], strength=2.0
        )
        return tasks, labels, batches, None, np.zeros(len(tasks), dtype=bool)

    return {"gvhd": emulated_gvhd, "flowsom": emulated_flowsom, "synthetic": synthetic}


def cells(tasks: Bags, y: np.ndarray, idx) -> tuple[list[np.ndarray], list[np.ndarray]]:
    return [np.asarray(tasks[int(t)]) for t in idx], [
        y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in idx
    ]


def gated(xs, ys, rest) -> tuple[list[np.ndarray], list[np.ndarray]]:
    keep = [v != rest for v in ys]
    return [x[k] for x, k in zip(xs, keep, strict=True)], [
        v[k] for v, k in zip(ys, keep, strict=True)
    ]


# ----------------------------------------------------------------------------- methods
_SKIPPED: set[str] = set()


def mtl_rows(rest: Any, scoring: str = "all") -> dict[str, dict[str, Any]]:
    """The ``MTL_VARIANTS`` rows the installed estimator, the data (``rest``: its rest
    label, None for none) and the scoring support."""
    known = MarginalTransferClassifier().get_params()
    rows = {}
    for name, params in MTL_VARIANTS.items():
        if scoring != "all" and name in ALL_CELLS_ONLY:
            continue
        missing = sorted(set(params) - set(known))
        if missing:
            if name not in _SKIPPED:
                print(f"  skipped {name!r}: MarginalTransferClassifier has no {missing}")
                _SKIPPED.add(name)
            continue
        if any(v is REST for v in params.values()):
            if rest is None:
                continue
            params = {k: rest if v is REST else v for k, v in params.items()}
        rows[name] = params
    return rows


def _chosen(model: Any, answers: list[Any]) -> str:
    """What the default model chose (for the reading): cell model and calibration as
    fitted, and the calibrations the test samples were answered with."""
    used = sorted({str(a.report.calibrated) for a in answers})
    threshold = model.reject_threshold_
    return f"{model.selection_['cell_model']}/{model.calibration_}; answered {', '.join(used)}" + (
        "" if threshold is None else f"; reject below {threshold:g}"
    )


def _figures(test_y, predictions, fit: float, rest: Any) -> dict[str, Any]:
    """Accuracy and macro-F1 per test sample, fit seconds and, with a rest label, its
    counts per test sample: cells predicted rest that are, predicted, truly rest."""
    per = [scores(v, p) for v, p in zip(test_y, predictions, strict=True)]
    out = {
        "accuracy": [s["accuracy"] for s in per],
        "macro_f1": [s["macro_f1"] for s in per],
        "fit_seconds": fit,
    }
    if rest is not None:
        out["rest_counts"] = [
            [int(np.sum((p == rest) & (v == rest))), int(np.sum(p == rest)), int(np.sum(v == rest))]
            for v, p in zip(test_y, predictions, strict=True)
        ]
    return out


def evaluate(
    train_x,
    train_y,
    test_x,
    test_y,
    seed: int,
    mtl: dict[str, dict[str, Any]],
    parts: int = 1,
    rest: Any = None,
    controls: tuple[np.ndarray, np.ndarray] | None = None,
    groups: np.ndarray | None = None,
) -> dict[str, dict[str, Any]]:
    """Per method: accuracy and macro-F1 of every test sample, fit seconds, notes.

    ``parts`` > 1 splits each training sample's cells at random into that many tasks
    for the bagserve models (one labelled reference gives them folds). ``rest``: the
    rest label where it is scored (its precision and recall are counted).
    ``controls``: the training and the test batch's reference controls, for
    ``CytoNorm + LDA``. ``groups``: each training sample's batch, for the rows of
    ``WITH_GROUPS`` (a sample's parts share its batch)."""
    out: dict[str, dict[str, Any]] = {}
    for name, (pred, fit) in baseline_predictions(
        train_x, train_y, test_x, seed=seed, names=BASELINES
    ).items():
        out[name] = _figures(test_y, pred, fit, rest)
    out["landmarks + LDA"] = _figures(
        test_y, *landmarks_then_lda(train_x, train_y, test_x, rest), rest
    )
    if controls is not None:
        out["CytoNorm + LDA"] = _figures(
            test_y, *cytonorm_then_lda(train_x, train_y, test_x, *controls), rest
        )
    if parts > 1:
        rng = np.random.default_rng([seed, 11])
        split_x, split_y = [], []
        for x, v in zip(train_x, train_y, strict=True):
            part = rng.permutation(len(x)) % parts
            split_x += [x[part == k] for k in range(parts)]
            split_y += [v[part == k] for k in range(parts)]
        train_x, train_y = split_x, split_y
        groups = None if groups is None else np.repeat(groups, parts)
    train_bags, test_bags = Bags.from_arrays(train_x), Bags.from_arrays(test_x)
    for name, params in mtl.items():
        own, new = controls if name in WITH_CONTROL and controls else (None, None)
        if name in WITH_CONTROL and own is None:
            continue
        if name in WITH_GROUPS and groups is None:
            continue
        named = groups if name in WITH_GROUPS else None
        model = MarginalTransferClassifier(**{"random_state": seed, **params})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            model.fit(train_bags, np.concatenate(train_y), groups=named, control=own)
            fit = time.perf_counter() - t0
        answers = model.predict_tasks(test_bags, control=new)
        out[name] = _figures(test_y, [a.predictions for a in answers], fit, rest)
        edges = sum("grid" in str(w.message) for w in caught)
        out[name]["chosen"] = _chosen(model, answers) + (
            f"; {edges} grid-edge warnings" if edges else ""
        )
    return out


# ----------------------------------------------------------------------------- tables
def summarise(table: str, runs: dict[int, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of one table from its runs (seed or reference -> method -> figures)."""
    rows: list[dict[str, Any]] = []
    methods = list(next(iter(runs.values())))
    stats = {}
    for m in methods:
        acc = np.array([runs[s][m]["accuracy"] for s in runs])  # runs x test samples
        f1 = np.array([runs[s][m]["macro_f1"] for s in runs])
        se = float(acc.std(ddof=1) / np.sqrt(acc.size)) if acc.size > 1 else 0.0
        stats[m] = (float(acc.mean()), se)
        row = {
            "case": f"{table}: {m}",
            "accuracy_mean": float(acc.mean()),
            "macro_f1_mean": float(f1.mean()),
            "accuracy_per_run": [round(float(a), 4) for a in acc.mean(axis=1)],
            "accuracy_se": se,
            "worst_sample": float(acc.min()),
            "fit_seconds_mean": float(np.mean([runs[s][m]["fit_seconds"] for s in runs])),
        }
        if "rest_counts" in runs[next(iter(runs))][m]:
            hit, said, truly = np.sum([runs[s][m]["rest_counts"] for s in runs], axis=(0, 1))
            row["rest_precision"] = float(hit / said) if said else None
            row["rest_recall"] = float(hit / truly) if truly else None
        notes = [runs[s][m].get("chosen", "") for s in runs]
        if any(notes):
            row["chosen"] = " | ".join(notes)
        rows.append(row)
    rows.append(verdict(table, rows))
    return rows


#: Each bagserve row and the baselines it is held against: the default model is given no
#: control, so it meets the baselines that are given none either (as does the row given
#: the centres); the row given each batch's control meets every baseline, CytoNorm + LDA
#: included.
VERSUS = {
    "MTL (defaults)": tuple(m for m in (*BASELINES, *CALIBRATED) if m != "CytoNorm + LDA"),
    "MTL, batch control": (*BASELINES, *CALIBRATED),
    "MTL, centres named": tuple(m for m in (*BASELINES, *CALIBRATED) if m != "CytoNorm + LDA"),
}


def verdict(table: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A table's verdict from its rows: the best method and, for each row of
    ``VERSUS``, its gap to the best of its baselines with that baseline's standard
    error (within noise when the gap is at most the SE)."""
    stats = {
        r["case"].rsplit(": ", 1)[1]: (r["accuracy_mean"], r["accuracy_se"])
        for r in rows
        if "accuracy_mean" in r
    }
    out: dict[str, Any] = {
        "case": f"{table}: verdict",
        "best": max(stats, key=lambda m: stats[m][0]),
    }
    for mine, against in VERSUS.items():
        present = [m for m in against if m in stats]
        if mine not in stats or not present:
            continue
        best = max(present, key=lambda m: stats[m][0])
        gap = stats[best][0] - stats[mine][0]
        out[mine] = {
            "best_baseline": best,
            "gap": gap,
            "se": stats[best][1],
            "within_noise": bool(gap <= stats[best][1]),
        }
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    """The README's tables: one per data set and protocol, a column per direction and
    scoring; cells are accuracy / macro-F1 (the per-run range of the accuracy)."""
    tables: dict[str, dict[str, dict[str, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for r in results:
        table, method = r["case"].rsplit(": ", 1)
        data, _, column = table.partition(", ")
        group = data + (" (one reference)" if "reference" in column else "")
        tables[group][column][method] = r
    out = []
    for group, columns in tables.items():
        names = list(columns)
        methods = [m for m in next(iter(columns.values())) if m != "verdict"]
        out += [
            f"**{group}**",
            "",
            "| method | " + " | ".join(names) + " | fit (mean) |",
            "|---|" + "---|" * (len(names) + 1),
        ]
        for m in methods:
            cells = []
            for c in names:
                r, verdict = columns[c].get(m), columns[c]["verdict"]
                if r is None:
                    cells.append("")
                    continue
                runs = r["accuracy_per_run"]
                text = f"{r['accuracy_mean']:.3f} / {r['macro_f1_mean']:.3f}"
                if m == verdict["best"]:
                    text = f"**{text}**"
                if len(runs) > 1:
                    text += f" ({min(runs):.2f}–{max(runs):.2f})"
                cells.append(text)
            fits = [columns[c][m]["fit_seconds_mean"] for c in names if m in columns[c]]
            out.append(f"| {m} | " + " | ".join(cells) + f" | {np.mean(fits):.2f} s |")
        for mine in VERSUS:
            cells = []
            for c in names:
                v = columns[c]["verdict"].get(mine)
                if v is None:
                    cells.append("")
                    continue
                word = "ahead" if v["gap"] < 0 else "within" if v["within_noise"] else "**outside**"
                cells.append(f"{v['best_baseline']}: gap {v['gap']:+.3f}, SE {v['se']:.3f}: {word}")
            if any(cells):
                out.append(f"| {mine} vs best baseline | " + " | ".join(cells) + " | |")
        out.append("")
        out += _rest_and_worst(group, columns, methods)
    return "\n".join(out)


def _rest_and_worst(group: str, columns: dict[str, Any], methods: list[str]) -> list[str]:
    """A second table per group: the worst (seed, test sample) accuracy of each
    column and, where the rest label is scored, its precision / recall."""
    names = list(columns)
    out = [
        f"*{group}: worst sample's accuracy; rest label precision / recall (all cells)*",
        "",
        "| method | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for m in methods:
        cells = []
        for c in names:
            r = columns[c].get(m)
            if r is None:
                cells.append("")
                continue
            text = f"{r['worst_sample']:.3f}"
            if r.get("rest_precision") is not None:
                text += f"; {r['rest_precision']:.3f} / {r['rest_recall']:.3f}"
            cells.append(text)
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return [*out, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 seed, 1,000 cells, 2 references, no JSON"
    )
    parser.add_argument("--seeds", type=int, default=3, help="generator seeds 0, 1, ...")
    parser.add_argument(
        "--data", nargs="*", default=["gvhd", "flowsom", "synthetic"], help="data sets to run"
    )
    parser.add_argument(
        "--tables", action="store_true", help="print the tables of the saved JSON, run nothing"
    )
    args = parser.parse_args()
    if args.tables:
        saved = json.loads((Path(__file__).parent / "results" / "bench_new_batch.json").read_text())
        rows = [r for r in saved if not r["case"].endswith(": verdict")]
        for table in dict.fromkeys(r["case"].rsplit(": ", 1)[0] for r in rows):
            of = [r for r in rows if r["case"].rsplit(": ", 1)[0] == table]
            i = rows.index(of[-1]) + 1
            rows.insert(i, verdict(table, of))
        print(markdown(rows))
        return
    n_cells = 1000 if args.quick else 3000
    seeds = range(1 if args.quick else args.seeds)
    references = (0,) if args.quick else (0, 1)
    start = time.perf_counter()
    makers = cohorts(n_cells)
    results: list[dict[str, Any]] = []
    for data in args.data:
        runs: dict[str, dict[int, Any]] = defaultdict(dict)
        for seed in seeds:
            tasks, y, batches, rest, control = makers[data](seed)
            scorings = ("all",) if rest is None else ("all", "gated")
            for a, b in ((0, 1), (1, 0)):
                train = cells(tasks, y, np.flatnonzero((batches == a) & ~control))
                test = cells(tasks, y, np.flatnonzero((batches == b) & ~control))
                pair = None
                if control.any():
                    pair = tuple(
                        np.asarray(tasks[int(np.flatnonzero((batches == k) & control)[0])])
                        for k in (a, b)
                    )
                for scoring in scorings:
                    t0 = time.perf_counter()
                    if scoring == "gated":
                        tr, te = gated(*train, rest), gated(*test, rest)
                        mtl, scored_rest = mtl_rows(None, "gated"), None
                    else:
                        tr, te, mtl, scored_rest = train, test, mtl_rows(rest), rest
                    table = f"{data}, batch {a} -> {b}, {scoring} cells"
                    runs[table][seed] = evaluate(
                        *tr, *te, seed, mtl, rest=scored_rest, controls=pair
                    )
                    print(f"  {table}, seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
        for table, by_seed in runs.items():
            results += summarise(table, by_seed)
        if data == "synthetic":
            tasks, y, batches, _, _ = makers[data](0)
            by_ref = {}
            for a, b in ((0, 1), (1, 0)):
                test = cells(tasks, y, np.flatnonzero(batches == b))
                for k in references:
                    ref = int(np.flatnonzero(batches == a)[k])
                    t0 = time.perf_counter()
                    by_ref[ref] = evaluate(
                        *cells(tasks, y, [ref]),
                        *test,
                        0,
                        mtl_rows(None),
                        parts=REFERENCE_PARTS,
                    )
                    print(f"  one reference, sample {ref}: {time.perf_counter() - t0:.0f} s")
            results += summarise("synthetic, one reference -> other batch", by_ref)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    report(results, "bench_new_batch", save=not args.quick)
    print("\n" + markdown(results))


if __name__ == "__main__":
    main()
