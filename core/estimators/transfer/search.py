"""Choose the calibration and the cell model under instrument shift (issue 44, point 2).

Folds hold out whole training samples. With one training batch, each held-out sample
is scored as measured (a new patient of the training lab) and passed through drawn
instruments (:mod:`.perturbation`) — and its batch's control through the same
instrument, where the model has one — before it is calibrated and scored: a candidate
is judged on new patients and on what a new batch would do to them, on samples whose
biology differs from the reference (never the same sample re-perturbed). With several
batches named (``groups``), the folds leave one batch out and the real batches are
the shift, unperturbed.

Every candidate (calibration × cell model) is scored on every (held-out sample,
instrument); the choice is the simplest candidate within one standard error of the
best mean (Breiman's one-standard-error rule; simplest: the cell models' order, then
the calibrations'). Training cells in the folds are a seeded draw of ``cv_points`` per
sample, which bounds the search's cost whatever the samples' sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .calibration import CALIBRATIONS, calibrate, fit_control, standardised
from .cell_models import CELL_MODELS, cell_scores, fit_cell_model
from .landmarks import REFUSAL_SHARE
from .open_set import choose_reject
from .perturbation import draw_instruments
from .reference import SD_FLOOR, fit_reference
from .task_map import TaskMap, fit_task_map

__all__ = ["Candidate", "Problem", "Selection", "candidates", "choose", "without_control"]


@dataclass(frozen=True)
class Candidate:
    calibration: str
    cell_model: str

    @property
    def name(self) -> str:
        return f"{self.cell_model}/{self.calibration}"


@dataclass(frozen=True)
class Problem:
    """What the search is given: the training samples as measured, their targets, and
    the settings."""

    tasks: list[NDArray[np.float64]]
    Y: NDArray[np.float64]
    codes: NDArray[np.int64] | None
    rest: int | None
    control: NDArray[np.float64] | None
    groups: NDArray[Any] | None
    calibrations: tuple[str, ...]
    cell_models: tuple[str, ...]
    cv: int
    cv_points: int
    perturbations: int
    n_components: int
    embedding_points: int
    gain_limit: float | None
    seed: int

    @property
    def classifier(self) -> bool:
        return self.codes is not None


@dataclass
class Selection:
    """The search's outcome and its record (``selection_`` of the model)."""

    calibration: str
    calibration_without_control: str
    cell_model: str
    reject_threshold: float | None
    scores: dict[str, float] = field(default_factory=dict)
    standard_errors: dict[str, float] = field(default_factory=dict)
    fold_scores: dict[str, list[float]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    folds: str = ""

    def record(self) -> dict[str, Any]:
        return {
            "calibration": self.calibration,
            "calibration_without_control": self.calibration_without_control,
            "cell_model": self.cell_model,
            "reject_threshold": self.reject_threshold,
            "scores": self.scores,
            "standard_errors": self.standard_errors,
            "fold_scores": self.fold_scores,
            "order": self.order,
            "folds": self.folds,
        }


def _draw(n: int, most: int, seed: int) -> NDArray[np.int64]:
    """At most ``most`` of ``n`` rows, a seeded draw that depends on ``n`` only."""
    if n <= most:
        return np.arange(n)
    return np.sort(np.random.default_rng([seed, n, 3]).choice(n, most, replace=False))


def _folds(p: Problem, rng: np.random.Generator) -> tuple[list[NDArray[np.int64]], bool]:
    """Held-out task indices per fold, and whether the folds are real batches."""
    n = len(p.tasks)
    if p.groups is not None and np.unique(p.groups).size > 1:
        return [np.flatnonzero(p.groups == g) for g in np.unique(p.groups)], True
    order = rng.permutation(n)
    return [f for f in np.array_split(order, min(p.cv, n)) if f.size], False


def _score(p: Problem, scores: NDArray[np.float64], target: NDArray[np.float64]) -> float:
    if p.classifier:
        return float(np.mean(np.argmax(scores, axis=1) == np.argmax(target, axis=1)))
    return -float(np.sqrt(np.mean((scores - target) ** 2)))


def _fold_rows(
    p: Problem, idx: NDArray[np.int64]
) -> tuple[list[NDArray[np.float64]], list[NDArray[np.float64]]]:
    """Each chosen task's cells (a draw of ``cv_points``) and their targets."""
    offsets = np.concatenate([[0], np.cumsum([t.shape[0] for t in p.tasks])])
    xs, ys = [], []
    for t in idx:
        rows = _draw(p.tasks[t].shape[0], p.cv_points, p.seed)
        xs.append(p.tasks[t][rows])
        ys.append(p.Y[offsets[t] + rows])
    return xs, ys


def _evaluate_fold(
    p: Problem,
    train: NDArray[np.int64],
    held: NDArray[np.int64],
    real_batches: bool,
    rng: np.random.Generator,
    out: dict[Candidate, list[float]],
    kept: dict[Candidate, list[tuple[NDArray[np.float64], NDArray[np.int64]]]],
) -> None:
    xs, ys = _fold_rows(p, train)
    codes = None if p.codes is None else np.argmax(np.vstack(ys), axis=1)
    reference = fit_reference(xs, codes, p.control, p.gain_limit, REFUSAL_SHARE)
    floor = SD_FLOOR * reference.sd
    models: dict[str, dict[str, Any]] = {}
    maps: dict[str, TaskMap] = {}
    Y = np.vstack(ys)
    for space in {"standardise" if c == "standardise" else "raw" for c in p.calibrations}:
        cells = [standardised(x, floor) for x in xs] if space == "standardise" else xs
        maps[space] = fit_task_map(cells, p.n_components, p.embedding_points, np.inf, p.seed)
        for m in p.cell_models:
            models[f"{space}/{m}"] = fit_cell_model(m, cells, Y, maps[space], p.classifier, p.seed)
    held_x, held_y = _fold_rows(p, held)
    # Every (held-out sample, instrument) seen by each calibration, stacked, so that
    # each fold model scores them all in one call.
    seen: list[tuple[NDArray[np.float64], Any]] = []
    truth: list[NDArray[np.float64]] = []
    for x, y in zip(held_x, held_y, strict=True):
        # A new patient of the training batch (as measured) and of new instruments.
        instruments = [None]
        if not real_batches:
            instruments += draw_instruments(x, p.perturbations, rng)
        for inst in instruments:
            control = None
            if p.control is not None and "control" in p.calibrations:
                control = fit_control(p.control if inst is None else inst(p.control), reference)
            seen.append((x if inst is None else inst(x), control))
            truth.append(y)
    sizes = [y.shape[0] for y in truth]
    bounds = np.cumsum([0, *sizes])
    for c in p.calibrations:
        cells = [calibrate(c, z, reference, control)[0] for z, control in seen]
        space = "standardise" if c == "standardise" else "raw"
        stacked = np.vstack(cells)
        tmap = maps[space]
        psi = np.repeat(tmap.context(tmap.embed(cells)), sizes, axis=0)
        for m in p.cell_models:
            scores = cell_scores(models[f"{space}/{m}"], stacked, tmap, psi, p.classifier)
            cand = Candidate(c, m)
            for k, y in enumerate(truth):
                s = scores[bounds[k] : bounds[k + 1]]
                out.setdefault(cand, []).append(_score(p, s, y))
                if p.classifier and p.rest is not None:
                    kept.setdefault(cand, []).append((s, np.argmax(y, axis=1)))


def _one_se(candidates: list[Candidate], table: dict[Candidate, list[float]]) -> Candidate:
    """The first of ``candidates`` (simplest first) within one standard error of the
    best mean score (the SE of the per-(sample, instrument) differences to the best)."""
    means = {c: float(np.mean(table[c])) for c in candidates}
    best = max(candidates, key=lambda c: means[c])
    for c in candidates:
        diff = np.asarray(table[best]) - np.asarray(table[c])
        se = diff.std(ddof=1) / np.sqrt(diff.size) if diff.size > 1 else 0.0
        if means[best] - means[c] <= se:
            return c
    return best


def candidates(
    calibrate: str, cell_model: str, classifier: bool, has_control: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The calibrations and cell models the search chooses among (one of each where
    the parameters fix it).

    A classifier's sample is calibrated by its control or its landmarks, which keep its
    biology (its populations' proportions); the moments erase it (on the 12 real GvHD
    samples, 0.805 of the cells against 0.842). A regressor has no populations, and a
    sample's level may be its signal (Munnell's states), so its candidates are the
    moments and the cells as measured.
    """
    if calibrate == "control" and not has_control:
        raise ValueError("calibrate='control' needs fit(..., control=)")
    wanted = ("control", "landmarks") if classifier else ("control", "standardise", "none")
    calibrations = tuple(c for c in CALIBRATIONS if c in wanted and (c != "control" or has_control))
    models = tuple(m for m in CELL_MODELS if m != "trees" or classifier)
    return (
        (calibrate,) if calibrate != "auto" else calibrations,
        (cell_model,) if cell_model != "auto" else models,
    )


def without_control(calibration: str, classifier: bool) -> str:
    """The calibration of a sample whose batch's control is not given, for a model
    whose cell model lives where ``calibration`` puts the cells: a model calibrated by
    its control sees cells in the training batch's units, as landmarks (classifiers)
    or no calibration (regressors) leave them."""
    if calibration != "control":
        return calibration
    return "landmarks" if classifier else "none"


def choose(p: Problem) -> Selection:
    """Score every candidate on the folds and choose (see the module docstring)."""
    rng = np.random.default_rng([p.seed, 2])
    folds, real = _folds(p, rng)
    table: dict[Candidate, list[float]] = {}
    kept: dict[Candidate, list[Any]] = {}
    all_idx = np.arange(len(p.tasks))
    for held in folds:
        train = np.setdiff1d(all_idx, held)
        if train.size == 0:
            continue
        _evaluate_fold(p, train, held, real, rng, table, kept)
    order = [Candidate(c, m) for m in p.cell_models for c in p.calibrations]
    chosen = _one_se(order, table)
    fallback = without_control(chosen.calibration, p.classifier)
    threshold = None
    if chosen in kept and p.rest is not None:
        threshold, _ = choose_reject(kept[chosen], p.rest)
    return Selection(
        calibration=chosen.calibration,
        calibration_without_control=fallback,
        cell_model=chosen.cell_model,
        reject_threshold=threshold,
        scores={c.name: float(np.mean(v)) for c, v in table.items()},
        standard_errors={
            c.name: float(np.std(v, ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0
            for c, v in table.items()
        },
        fold_scores={c.name: [float(x) for x in v] for c, v in table.items()},
        order=[c.name for c in order],
        folds=(
            "leave one batch out"
            if real
            else f"{len(folds)} folds x {p.perturbations} drawn instruments"
        ),
    )
