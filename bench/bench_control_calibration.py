"""Calibration alone on a real multi-batch set: one control material measured on three
plates, with CytoNorm's own output beside it (issue 44).

Data: the example files that ship with ``cytonormpy`` 1.0.2 on PyPI (the wheel is
downloaded with ``pip download`` into ``bench/.cache`` and checked against its
sha256; nothing of it is kept in the repository): a mass-cytometry control
(``Unstim_Control``) measured on three plates (PTLG021, PTLG028, PTLG034), each plate
with its reference tube (``Control_1``) and a second tube of the material
(``Control_2``), 1,000 cells each, and ``Norm_...Control_2.fcs``: the second tubes as
the CytoNorm reference implementation normalised them.

Every method maps each plate's ``Control_2`` using only that plate's ``Control_1``
(the tube a lab runs per batch), onto the same goal: per channel, the mean over the
plates of their ``Control_1`` quantiles (CytoNorm's ``goal = "mean"``). Scored, per
channel, on ``arcsinh(x / 5)``: the 1-D Wasserstein distance between every two plates'
``Control_2`` after the map, divided by the same before it, averaged over the three
pairs; the tables give the median over channels and how many channels got worse
(ratio > 1). Channels: those CytoNorm's output changed. Methods:

* ``CytoNorm (reference output)``: the ``Norm_`` files as shipped;
* ``bagserve control map``: :func:`bagserve.core.alignment.control_map`, fitted on
  the plate's ``Control_1`` (what ``predict --control`` applies);
* ``per-sample quantile map``: each ``Control_2`` mapped by its *own* quantiles onto
  the goal (:func:`bagserve.core.bags.align_quantiles`, nine levels): what a map
  fitted on the sample itself does, with no control.

Run with ``.venv/bin/python bench/bench_control_calibration.py``. Writes
bench/results/bench_control_calibration.json.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
from _pypi import CACHE, pypi_archive
from _report import report
from bagserve.core.alignment import CONTROL_LEVELS, control_map
from bagserve.core.bags import Bags, align_quantiles
from bagserve.core.io import read_sample
from scipy.stats import wasserstein_distance

WHEEL = "cytonormpy-1.0.2-py3-none-any.whl"
WHEEL_SHA256 = "e809849906707d37f6ebcf52065648e70b38cde22a859290ee55e4ad9506654a"
PLATES = ("PTLG021", "PTLG028", "PTLG034")
COFACTOR = 5.0


def _resources() -> Path:
    """The wheel's example files, downloaded once and checked."""
    wheel = pypi_archive("cytonormpy==1.0.2", WHEEL, WHEEL_SHA256)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(CACHE, [n for n in z.namelist() if n.startswith("cytonormpy/_resources/")])
    return CACHE / "cytonormpy" / "_resources"


def _cells(path: Path) -> tuple[np.ndarray, list[str]]:
    sample = read_sample(path)
    return np.arcsinh(np.asarray(sample.points, dtype=np.float64) / COFACTOR), list(sample.names)


def _ratios(before: list[np.ndarray], after: list[np.ndarray]) -> np.ndarray:
    """Per channel: mean over plate pairs of the distance after / before."""
    pairs = [(0, 1), (0, 2), (1, 2)]
    out = []
    for j in range(before[0].shape[1]):
        b = [wasserstein_distance(before[p][:, j], before[q][:, j]) for p, q in pairs]
        a = [wasserstein_distance(after[p][:, j], after[q][:, j]) for p, q in pairs]
        out.append(np.mean(np.array(a) / np.maximum(np.array(b), 1e-12)))
    return np.array(out)


def main() -> None:
    res = _resources()
    refs, others, norms = [], [], []
    for plate in PLATES:
        ref, names = _cells(res / f"Gates_{plate}_Unstim_Control_1.fcs")
        other, _ = _cells(res / f"Gates_{plate}_Unstim_Control_2.fcs")
        norm, norm_names = _cells(res / f"Norm_Gates_{plate}_Unstim_Control_2.fcs")
        if norm_names != names:
            raise SystemExit(f"{plate}: the normalised file has other channels")
        refs.append(ref)
        others.append(other)
        norms.append(norm)
    # The channels the reference implementation normalised: where its output differs.
    changed = np.array(
        [
            any(not np.allclose(o[:, j], n[:, j]) for o, n in zip(others, norms, strict=True))
            for j in range(len(names))
        ]
    )
    cols = np.flatnonzero(changed)
    refs = [r[:, cols] for r in refs]
    others = [o[:, cols] for o in others]
    norms = [n[:, cols] for n in norms]
    goal = np.mean([np.quantile(r, CONTROL_LEVELS, axis=0) for r in refs], axis=0)
    scale = np.vstack(refs).std(axis=0)
    mapped, worse_reported = [], []
    for ref, other in zip(refs, others, strict=True):
        mapping, quality = control_map(ref, goal, scale)
        mapped.append(mapping(other))
        worse_reported.append(int(quality.worse.sum()))
    goal9 = np.mean(
        [
            np.quantile(o, [0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99], axis=0)
            for o in others
        ],
        axis=0,
    )
    own = [align_quantiles(Bags.from_arrays([o]), goal9).points for o in others]
    results = []
    for name, after in (
        ("CytoNorm (reference output)", norms),
        ("bagserve control map", mapped),
        ("per-sample quantile map", own),
    ):
        r = _ratios(others, after)
        row = {
            "case": name,
            "channels": int(cols.size),
            "median_ratio": float(np.median(r)),
            "mean_ratio": float(np.mean(r)),
            "channels_worse": int(np.sum(r > 1.0)),
        }
        if name == "bagserve control map":
            row["channels_reported_worse_per_plate"] = worse_reported
        results.append(row)
    report(results, "bench_control_calibration")
    print("\n| method | channels | EMD after / before, median | mean | channels worse |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['case']} | {r['channels']} | {r['median_ratio']:.3f} | "
            f"{r['mean_ratio']:.3f} | {r['channels_worse']} |"
        )


if __name__ == "__main__":
    main()
