"""Training cost, today against after: the yeast and GvHD examples and the synthetic
batches, fit time and accuracy, both code trees timed in the same run.

"Today" is HEAD with the files the change touched (``CHANGED``) as they were at the
commit before it (``--before REV``), in a ``git worktree`` made in a temporary directory
and removed at the end (``--before-tree DIR`` uses a checkout already made): the
estimators' own commits made meanwhile are on both sides. "After" is this working
tree. Each measurement runs
in a fresh process that imports ``bagserve`` from its tree, and the two trees take turns
within every round (today, after, after, today, ...), so both see the same machine load.
Both read the same data: the example configurations of *this* tree, whose data paths
resolve beside it (``../shared/data``), are given to both.

Cases:

* ``yeast``: ``train(examples/yeast_dose/train.toml)`` (distribution ridge; its grid
  edges are widened). Seconds of the ``train`` call (imports excluded: a warm-up
  training in the same process pays them), and the CV RMSE and chosen parameters.
* ``gvhd``: ``train(examples/gvhd/train.toml)`` (marginal transfer, 12 samples, 4 outer
  folds); ``--quick`` trains on samples 1-6 only. CV accuracy and seconds.
* ``synthetic``: ``make_batched_cytometry_tasks(2, 8, 3000, strength=2)``: per direction
  (batch 0 -> 1, 1 -> 0) ``MarginalTransferClassifier(random_state=0).fit`` on the 8
  samples of one batch and ``HistGradientBoostingClassifier(max_iter=200,
  early_stopping=False)`` on the same pooled cells, accuracy on the other batch's
  samples; the ratio MTL/HGB is taken within one process, so load cancels.

Every case also reports the peak resident memory of its process (``peak RSS MB``, the
largest of its rounds): the training, the interpreter and its imports (about 240 MB).
To see where a peak comes from, run a case's child under memray (``pip install
memray``; ``python -m memray run -o out.bin bench/bench_training.py --child . --case
gvhd``), whose high-water-mark allocation records name the lines that hold the memory.

Run with ``.venv/bin/python bench/bench_training.py [--quick] [--rounds 3]
[--gvhd-rounds 1] [--cases yeast,gvhd,synthetic]``. Writes bench/results/bench_training.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = ("yeast", "gvhd", "synthetic")
#: The commit before the training-cost change, and the files it changed: "today" is
#: HEAD with these files as they were then. The first step (fold evaluations shared
#: across the candidates and the widening refit) was 04e337a with core/training/folds.py,
#: core/training/fit_memory.py, _transfer_cv.py and _transfer_nystroem.py; the second
#: (one median per search for both bandwidths, task statistics on all cores, with the
#: fallback rules of issue 30 made meanwhile) was bb75d39 with every estimator file
#: changed since; the third (the search stops evaluating candidates that cannot win,
#: and every median heuristic once per fit) 04bf58d; the fourth (a candidate's folds on
#: all cores) e4d0385; the fifth (steps worse than the best configuration seen stop
#: after a round, held-out features from the statistics pass, the median and the
#: canonical order without sorting every column) c99ae30, with every estimator file; the
#: sixth (the caches kept for later fits drop the held-out features once their search is
#: over: peak memory) 05f539c. Issue 44 replaced marginal transfer as a whole (a package
#: in place of the module): "today" is the whole tree at 2db7065, no file list.
BEFORE = "2db7065"
CHANGED: tuple[str, ...] = ()


# ---------------------------------------------------------------------------- child
def _import_tree(tree: Path) -> None:
    """Make ``bagserve`` and ``bagserve.core`` come from ``tree`` (the editable install
    maps them to this tree): the package modules are created from its files before any
    import can find the installed ones."""
    import importlib.util

    for name, folder in (("bagserve", "bagserve"), ("bagserve.core", "core")):
        spec = importlib.util.spec_from_file_location(
            name, tree / folder / "__init__.py", submodule_search_locations=[str(tree / folder)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def _gvhd_config(quick: bool, out: Path) -> Path:
    """The GvHD example's configuration with absolute data paths (``--quick``: samples
    1-6), written to ``out``."""
    import tomllib

    src = ROOT / "examples" / "gvhd" / "train.toml"
    config = tomllib.loads(src.read_text())
    data = config["data"]
    base = src.parent
    folder = (base / data["files"]).parent.resolve()
    names = [f"sample{i}.csv.gz" for i in range(1, 7)] if quick else None
    files = [str(folder / n) for n in names] if names else str(folder / Path(data["files"]).name)
    data["files"] = files
    data["cell_label_files"] = str((base / data["cell_label_files"]).resolve())
    lines = []
    for table, values in config.items():
        lines.append(f"[{table}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml(value)}")
    path = out / "gvhd.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f'"{k}" = {_toml(v)}' for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


def _train_case(config: Path) -> dict[str, Any]:
    import warnings

    from bagserve.core.training import train

    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        result = train(config, output=out)
        seconds = time.perf_counter() - t0
    metrics = result.metrics
    cv = {k: v for k, v in metrics["cv"].items() if isinstance(v, float)}
    return {"seconds": seconds, "cv": cv, "best_params": metrics.get("best_params")}


def _synthetic_case(quick: bool) -> dict[str, Any]:
    import warnings

    from bagserve.core import Bags, MarginalTransferClassifier
    from bagserve.core.datasets import make_batched_cytometry_tasks
    from sklearn.ensemble import HistGradientBoostingClassifier

    warnings.simplefilter("ignore")
    n = 1000 if quick else 3000
    tasks, y, batches = make_batched_cytometry_tasks(2, 8, n, strength=2, random_state=0)
    cells = [np.asarray(tasks[t]) for t in range(len(tasks))]
    labels = [y[tasks.offsets[t] : tasks.offsets[t + 1]] for t in range(len(tasks))]
    out: dict[str, Any] = {}
    for train_b in (0, 1):
        tr = np.flatnonzero(batches == train_b)
        te = np.flatnonzero(batches != train_b)
        x_tr = [cells[t] for t in tr]
        y_tr = np.concatenate([labels[t] for t in tr])
        t0 = time.perf_counter()
        hgb = HistGradientBoostingClassifier(max_iter=200, early_stopping=False, random_state=0)
        hgb.fit(np.concatenate(x_tr), y_tr)
        hgb_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        mtl = MarginalTransferClassifier(random_state=0).fit(Bags.from_arrays(x_tr), y_tr)
        mtl_s = time.perf_counter() - t0
        test = Bags.from_arrays([cells[t] for t in te])
        y_te = np.concatenate([labels[t] for t in te])
        mtl_acc = float(np.mean(mtl.predict(test) == y_te))
        hgb_acc = float(np.mean(hgb.predict(np.concatenate([cells[t] for t in te])) == y_te))
        out[f"batch {train_b}"] = {
            "mtl_seconds": mtl_s,
            "hgb_seconds": hgb_s,
            "ratio": mtl_s / hgb_s,
            "mtl_accuracy": mtl_acc,
            "hgb_accuracy": hgb_acc,
        }
    return out


def child(tree: Path, case: str, quick: bool) -> None:
    _import_tree(tree)
    if case == "yeast":
        config = ROOT / "examples" / "yeast_dose" / "train.toml"
        _train_case(config)  # warm-up: imports, and the report's first figure
        result = _train_case(config)
    elif case == "gvhd":
        with tempfile.TemporaryDirectory() as tmp:
            result = _train_case(_gvhd_config(quick, Path(tmp)))
    else:
        result = _synthetic_case(quick)
    # The process's peak resident memory (Linux counts KiB): the case's training plus
    # the interpreter and its imports (about 240 MB), as a user's process would see.
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result, default=float))


# --------------------------------------------------------------------------- parent
def _run(tree: Path, case: str, quick: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", str(tree), "--case", case]
    if quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} on {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    return float(np.median(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="GvHD on 6 samples, 1,000 cells")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gvhd-rounds", type=int, default=1)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument(
        "--before",
        default=BEFORE,
        help="today: HEAD with the files this change touched (CHANGED) as of this commit",
    )
    parser.add_argument("--before-tree", type=Path, help="a checkout to time as today")
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.case, args.quick)
        return
    cases = [c for c in args.cases.split(",") if c]
    with tempfile.TemporaryDirectory() as tmp:
        before = args.before_tree
        if before is None:
            before = Path(tmp) / "before"
            # With a file list, HEAD with those files as they were (other commits made
            # meanwhile stay on both sides); without one, the whole tree as it was.
            base = "HEAD" if CHANGED else args.before
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), base],
                check=True,
                capture_output=True,
            )
            if CHANGED:
                subprocess.run(
                    ["git", "-C", str(before), "checkout", args.before, "--", *CHANGED],
                    check=True,
                    capture_output=True,
                )
        try:
            rows = _measure(before.resolve(), cases, args.quick, args.rounds, args.gvhd_rounds)
        finally:
            if args.before_tree is None:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)],
                    check=False,
                    capture_output=True,
                )
    _print(rows, args.quick)


def _measure(
    before: Path, cases: list[str], quick: bool, rounds: int, gvhd_rounds: int
) -> list[dict[str, Any]]:
    sides = {"today": before, "after": ROOT}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(rounds):
        # GvHD takes minutes a side: once, unless --gvhd-rounds asks for more.
        for case in [c for c in cases if c != "gvhd" or r < gvhd_rounds]:
            # Alternate which side goes first, so neither always meets the same load.
            order = ("today", "after") if r % 2 == 0 else ("after", "today")
            for side in order:
                runs.setdefault((case, side), []).append(_run(sides[side], case, quick))
                print(f"round {r + 1}: {case} {side} done", file=sys.stderr, flush=True)
    rows = []
    for case in cases:
        today, after = runs[(case, "today")], runs[(case, "after")]
        peak = {
            side: max(g["peak_rss_mb"] for g in got)
            for side, got in (("today", today), ("after", after))
        }
        if case == "synthetic":
            for key in (k for k in today[0] if k != "peak_rss_mb"):
                row: dict[str, Any] = {"case": f"synthetic, train on {key}"}
                for side, got in (("today", today), ("after", after)):
                    for field in ("mtl_seconds", "hgb_seconds", "ratio"):
                        row[f"{side} {field}"] = _median([g[key][field] for g in got])
                    row[f"{side} mtl_accuracy"] = got[0][key]["mtl_accuracy"]
                row["hgb_accuracy"] = after[0][key]["hgb_accuracy"]
                row["same accuracy"] = all(
                    g[key]["mtl_accuracy"] == today[0][key]["mtl_accuracy"] for g in today + after
                )
                # One process trains both directions: its peak covers the two.
                row["today peak RSS MB"], row["after peak RSS MB"] = peak["today"], peak["after"]
                rows.append(row)
            continue
        row = {"case": case}
        row["today seconds"] = _median([g["seconds"] for g in today])
        row["after seconds"] = _median([g["seconds"] for g in after])
        row["speed-up"] = row["today seconds"] / row["after seconds"]
        row["today cv"] = today[0]["cv"]
        row["after cv"] = after[0]["cv"]
        row["same cv"] = all(g["cv"] == today[0]["cv"] for g in today + after)
        row["same best_params"] = all(
            g["best_params"] == today[0]["best_params"] for g in today + after
        )
        row["best_params"] = after[0]["best_params"]
        row["today peak RSS MB"], row["after peak RSS MB"] = peak["today"], peak["after"]
        rows.append(row)
    rows.append({"case": "machine", "load average": list(os.getloadavg()), "rounds": rounds})
    return rows


def _print(rows: list[dict[str, Any]], quick: bool) -> None:
    sys.path.insert(0, str(HERE))
    from _report import report

    report(rows, "bench_training", save=not quick, width=24)


if __name__ == "__main__":
    main()
