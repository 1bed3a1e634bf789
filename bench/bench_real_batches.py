"""Real new centres: marginal transfer against the baselines of ``bench_new_batch.py`` on
labelled cytometry measured in three centres, with no emulated shift (issue 44).

Data: the HIPC Lyoplate T-cell panel (Finak et al. 2016, Sci Rep 6:20686; FlowCAP III)
as the source distribution of ``CytOpT`` 0.0.4 on PyPI ships it in ``tests/data``
(the sdist is downloaded with ``pip download`` into ``bench/.cache`` and checked
against its sha256; nothing of it is kept in the repository): five samples of
cryopreserved PBMC, each a file of pre-gated T cells with 7 markers (CCR7, CD4,
CD45RA, CD3, HLA-DR, CD38, CD8) and one label per cell among 10 populations (CD4 and
CD8 naive, central memory, effector memory, effector, activated) from manual gating
in the centre that measured it. The centres stained with the same lyophilised plates
and measured on their own instruments:

* Stanford: ``W2_1``, ``W2_7``, ``W2_9`` (patient and replicate 1A, 3A, 3C, as
  CytOpT's tests name them), 31,342, 33,992 and 33,960 cells;
* Miami: ``pM_7`` (3A), 42,394 cells;
* UCLA: ``IU_5`` (2B), 45,949 cells.

The values are used as shipped (a 0-4,096 channel scale), divided by 4,096.

Protocols, 3 seeds each, 3,000 cells drawn at random per training sample (a new draw
per seed):

* ``hipc``: train on the samples of one centre and label every cell of every sample
  of the two other centres. Stanford has three samples; Miami and UCLA have one each,
  which the bagserve models get split at random into 4 tasks (as
  ``bench_new_batch.py``'s one-reference protocol does: their defaults choose by
  folds over tasks).
* ``hipc (two centres)``: train on the samples of two centres and label every cell of
  the third centre's samples. Each training sample is one task; ``MTL, centres named``
  is fitted with each one's centre as its group (``fit(groups=)``: the search leaves
  one centre out), ``MTL (defaults)`` without.

Every cell carries a population label, so there is no rest class: the all-cells and
gated-cells scorings are one, and no rest-label precision or recall exists. No centre
measured a reference control, so ``CytoNorm + LDA`` and ``MTL, batch control`` do not
run. Methods, figures and verdicts are ``bench_new_batch.py``'s (``evaluate``,
``summarise``, ``markdown``): the model runs with its defaults as they are.

Run with ``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python
bench/bench_real_batches.py [--quick]`` (``--quick``: 1 seed, 1,000 training cells per
sample, no JSON written). Writes bench/results/bench_real_batches.json and prints the
README's tables (markdown); ``--tables`` prints them from that JSON alone.
"""

from __future__ import annotations

import argparse
import json
import tarfile
import time
from collections import defaultdict
from typing import Any

import numpy as np
from _pypi import pypi_archive
from _report import RESULTS, report
from bench_new_batch import REFERENCE_PARTS, evaluate, markdown, mtl_rows, summarise

SDIST = "CytOpT-0.0.4.tar.gz"
SDIST_SHA256 = "b4543ba28ab71d297a8b69394519d5ed98b0cb7a38e1745c68ec1a6343f0bf41"
#: File stem in the sdist's ``tests/data`` -> the centre that measured and gated it.
SAMPLES = {
    "W2_1": "Stanford",
    "W2_7": "Stanford",
    "W2_9": "Stanford",
    "pM_7": "Miami",
    "IU_5": "UCLA",
}
MARKERS = ("CCR7", "CD4", "CD45RA", "CD3", "HLADR", "CD38", "CD8")
CHANNEL_RANGE = 4096.0


def _table(tar: tarfile.TarFile, name: str) -> tuple[list[str], list[str]]:
    """A CSV of the sdist's test data: its header's fields and its data lines."""
    member = tar.extractfile(f"CytOpT-0.0.4/tests/data/{name}.csv")
    if member is None:
        raise SystemExit(f"{SDIST} has no tests/data/{name}.csv")
    lines = member.read().decode().splitlines()
    return [h.strip('"') for h in lines[0].split(",")], lines[1:]


def hipc_samples() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Per sample: its centre, its cells (cells x ``MARKERS``, scaled) and their labels."""
    archive = pypi_archive("cytopt==0.0.4", SDIST, SDIST_SHA256, sdist=True)
    out = []
    with tarfile.open(archive) as tar:
        for stem, centre in SAMPLES.items():
            header, lines = _table(tar, f"{stem}_values")
            if tuple(header[1:]) != MARKERS:
                raise SystemExit(f"{stem}_values.csv: markers {header[1:]}, expected {MARKERS}")
            x = np.loadtxt(lines, delimiter=",", usecols=range(1, 1 + len(MARKERS)))
            _, labels = _table(tar, f"{stem}_clust")
            y = np.loadtxt(labels, delimiter=",", usecols=1, dtype=np.int64)
            if y.shape[0] != x.shape[0]:
                raise SystemExit(f"{stem}: {y.shape[0]} labels for {x.shape[0]} cells")
            out.append((centre, x / CHANNEL_RANGE, y))
    return out


def _split_case(case: str) -> tuple[str, str, str]:
    """The protocol (data set), the training centres and the method of a row's
    ``case``."""
    table, method = case.rsplit(": ", 1)
    data, training = table.split(", ")[:2]
    return data, training.split(" -> ")[0], method


def per_sample_markdown(results: list[dict[str, Any]]) -> str:
    """Per protocol, a table of each method's accuracy on each test sample (mean over
    the seeds), a column per training centre(s) and test sample."""
    cell = {
        (*_split_case(r["case"]), stem): a
        for r in results
        for stem, a in r.get("accuracy_per_test_sample", {}).items()
    }
    out = []
    for data in dict.fromkeys(d for d, _, _, _ in cell):
        columns = list(dict.fromkeys((c, stem) for d, c, _, stem in cell if d == data))
        methods = list(dict.fromkeys(m for d, _, m, _ in cell if d == data))
        trained = "centres" if any(" + " in c for c, _ in columns) else "centre"
        out += [
            f"*{data}: accuracy per test sample (training {trained} -> test sample)*",
            "",
            "| method | " + " | ".join(f"{c} -> {stem}" for c, stem in columns) + " |",
            "|---|" + "---|" * len(columns),
        ]
        for m in methods:
            row = " | ".join(f"{cell[(data, c, m, s)]:.3f}" for c, s in columns)
            out.append(f"| {m} | {row} |")
        out.append("")
    return "\n".join(out)


def protocol_runs(
    samples: list[tuple[str, np.ndarray, np.ndarray]],
    data: str,
    training: list[tuple[str, ...]],
    seeds: range,
    n_cells: int,
) -> list[dict[str, Any]]:
    """The rows of one protocol: for each tuple of ``training`` centres, train on
    their samples (``n_cells`` random cells each, a new draw per seed) and label every
    cell of every other centre's samples. With two or more training samples each is
    one task, and the rows of ``WITH_GROUPS`` get the samples' centres as groups;
    one sample is split into ``REFERENCE_PARTS`` tasks."""
    centres = list(dict.fromkeys(SAMPLES.values()))
    runs: dict[str, dict[int, Any]] = defaultdict(dict)
    tested: dict[str, list[str]] = {}
    for seed in seeds:
        # The one-centre protocol keeps its original stream: its numbers stay as tabled.
        rng = np.random.default_rng([seed, 44] if len(training[0]) == 1 else [seed, 44, 2])
        for chosen in training:
            train_x, train_y, groups, test_x, test_y = [], [], [], [], []
            tested_here = []
            for (c, x, y), stem in zip(samples, SAMPLES, strict=True):
                if c in chosen:
                    keep = rng.choice(x.shape[0], n_cells, replace=False)
                    train_x.append(x[keep])
                    train_y.append(y[keep])
                    groups.append(c)
                else:
                    test_x.append(x)
                    test_y.append(y)
                    tested_here.append(stem)
            parts = 1 if len(train_x) > 1 else REFERENCE_PARTS
            others = " + ".join(c for c in centres if c not in chosen)
            table = f"{data}, {' + '.join(chosen)} -> {others}, all cells"
            tested[table] = tested_here
            t0 = time.perf_counter()
            runs[table][seed] = evaluate(
                train_x,
                train_y,
                test_x,
                test_y,
                seed,
                mtl_rows(None),
                parts=parts,
                groups=np.array(groups) if len(chosen) > 1 else None,
            )
            print(f"  {table}, seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    results: list[dict[str, Any]] = []
    for table, by_seed in runs.items():
        rows = summarise(table, by_seed)
        for row in rows[:-1]:
            method = row["case"].rsplit(": ", 1)[1]
            acc = np.mean([by_seed[s][method]["accuracy"] for s in by_seed], axis=0)
            row["accuracy_per_test_sample"] = {
                stem: round(float(a), 4) for stem, a in zip(tested[table], acc, strict=True)
            }
        results += rows
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 1,000 cells, no JSON")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0, 1, ...")
    parser.add_argument(
        "--tables", action="store_true", help="print the tables of the saved JSON, run nothing"
    )
    args = parser.parse_args()
    if args.tables:
        saved = json.loads((RESULTS / "bench_real_batches.json").read_text())
        print(markdown(saved) + "\n" + per_sample_markdown(saved))
        return
    n_cells = 1000 if args.quick else 3000
    seeds = range(1 if args.quick else args.seeds)
    start = time.perf_counter()
    samples = hipc_samples()
    for (centre, x, y), stem in zip(samples, SAMPLES, strict=True):
        counts = np.bincount(y)[1:]
        print(f"  {stem} ({centre}): {x.shape[0]} cells, per label {counts.tolist()}")
    centres = list(dict.fromkeys(SAMPLES.values()))
    results = protocol_runs(samples, "hipc", [(c,) for c in centres], seeds, n_cells)
    pairs = [tuple(c for c in centres if c != held) for held in centres]
    results += protocol_runs(samples, "hipc (two centres)", pairs, seeds, n_cells)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    report(results, "bench_real_batches", save=not args.quick)
    print("\n" + markdown(results) + "\n" + per_sample_markdown(results))


if __name__ == "__main__":
    main()
