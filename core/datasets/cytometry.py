"""Flow-cytometry-like samples: synthetic, in batches, and emulated from real ones."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._random import check_generator
from ..bags import Bags

__all__ = ["emulate_batches", "make_batched_cytometry_tasks", "make_cytometry_tasks"]


def make_cytometry_tasks(
    n_tasks: int,
    n_cells: int,
    n_markers: int = 8,
    n_populations: int = 4,
    batch_shift: float = 1.0,
    random_state: Any = None,
    *,
    panel_seed: int = 0,
) -> tuple[Bags, NDArray[np.int64]]:
    """Synthetic flow samples: shared populations seen through per-sample batch effects.

    The *panel* (``panel_seed``) fixes the populations: centre ``m_k ~ N(0, 1.5² I)`` and
    per-marker spreads in ``[0.4, 0.8]``. Each sample (``random_state``) draws its
    population proportions from a Dirichlet(2) law and a batch effect acting on every
    marker, ``x ↦ a ⊙ x + b`` with ``log a ~ N(0, 0.15²)`` and ``b ~ N(0, batch_shift²)``.
    The label of a cell is its population, so a model that sees the sample's
    distribution can undo the batch effect; a pooled model cannot. Calls with the same
    panel and different ``random_state`` give new samples of the same populations.

    Returns
    -------
    tasks : Bags
        ``n_tasks`` samples of ``n_cells`` cells with ``n_markers`` markers.
    y : ndarray of shape (n_tasks * n_cells,)
        Population of every cell, ``0..n_populations-1``.
    """
    panel = np.random.default_rng([panel_seed, n_markers, n_populations])
    centres = panel.normal(0.0, 1.5, size=(n_populations, n_markers))
    spreads = panel.uniform(0.4, 0.8, size=(n_populations, n_markers))
    rng = check_generator(random_state)
    arrays, labels = [], []
    for _ in range(n_tasks):
        props = rng.dirichlet(np.full(n_populations, 2.0))
        pop = rng.choice(n_populations, size=n_cells, p=props)
        x = centres[pop] + spreads[pop] * rng.standard_normal((n_cells, n_markers))
        a = np.exp(rng.normal(0.0, 0.15, size=n_markers))
        b = rng.normal(0.0, batch_shift, size=n_markers)
        arrays.append(a * x + b)
        labels.append(pop)
    return Bags.from_arrays(arrays), np.concatenate(labels).astype(np.int64)


def make_batched_cytometry_tasks(
    n_batches: int,
    tasks_per_batch: int,
    n_cells: int,
    n_markers: int = 8,
    n_populations: int = 4,
    random_state: Any = None,
    *,
    panel_seed: int = 0,
    strength: float = 1.0,
) -> tuple[Bags, NDArray[np.int64], NDArray[np.int64]]:
    """Synthetic flow samples in batches (centres, runs, instruments) that differ in
    more than an affine shift: the hard case for models trained on other batches.

    Populations as in :func:`make_cytometry_tasks` (``panel_seed``). Each *batch* gets

    * an affine distortion per marker, ``x ↦ a ⊙ x + b`` (``log a ~ N(0, (0.25 s)²)``,
      ``b ~ N(0, (1.2 s)²)``),
    * a monotone non-linear one per marker, ``x ↦ x + c ⊙ tanh(x - d)`` with
      ``c ~ U(0, 0.8 s)`` and ``d ~ N(0, 1)`` (a compressed or stretched region, as a
      changed detector voltage or a different compensation leaves it),
    * population shifts: every population's centre moves by ``N(0, (0.35 s)²)`` per
      marker (biology or staining that differs between centres),

    where ``s`` is ``strength``; each *sample* adds its own proportions (Dirichlet(2)) and
    a small affine jitter (``log a ~ N(0, 0.05²)``, ``b ~ N(0, 0.2²)``).

    Returns
    -------
    tasks : Bags
        ``n_batches * tasks_per_batch`` samples of ``n_cells`` cells, batch after batch.
    y : ndarray of shape (n_tasks * n_cells,)
        Population of every cell.
    batches : ndarray of shape (n_tasks,)
        The batch of every sample.
    """
    panel = np.random.default_rng([panel_seed, n_markers, n_populations])
    centres = panel.normal(0.0, 1.5, size=(n_populations, n_markers))
    spreads = panel.uniform(0.4, 0.8, size=(n_populations, n_markers))
    rng = check_generator(random_state)
    arrays, labels, batches = [], [], []
    for batch in range(n_batches):
        a = np.exp(rng.normal(0.0, 0.25 * strength, size=n_markers))
        b = rng.normal(0.0, 1.2 * strength, size=n_markers)
        c = rng.uniform(0.0, 0.8 * strength, size=n_markers)
        d = rng.normal(0.0, 1.0, size=n_markers)
        shifted = centres + rng.normal(0.0, 0.35 * strength, size=centres.shape)
        for _ in range(tasks_per_batch):
            props = rng.dirichlet(np.full(n_populations, 2.0))
            pop = rng.choice(n_populations, size=n_cells, p=props)
            x = shifted[pop] + spreads[pop] * rng.standard_normal((n_cells, n_markers))
            x = a * (x + c * np.tanh(x - d)) + b
            jitter_a = np.exp(rng.normal(0.0, 0.05, size=n_markers))
            jitter_b = rng.normal(0.0, 0.2, size=n_markers)
            arrays.append(jitter_a * x + jitter_b)
            labels.append(pop)
            batches.append(batch)
    return (
        Bags.from_arrays(arrays),
        np.concatenate(labels).astype(np.int64),
        np.asarray(batches, dtype=np.int64),
    )


def emulate_batches(
    sources: Bags,
    y: NDArray[Any],
    n_batches: int = 2,
    samples_per_batch: int = 8,
    n_cells: int = 3000,
    random_state: Any = None,
    *,
    strength: float = 1.0,
    concentration: float = 30.0,
    control_cells: int = 0,
) -> tuple[Bags, NDArray[Any], NDArray[np.int64], NDArray[np.int64]]:
    """New labelled samples in instrument batches, emulated from real labelled samples.

    A benchmark generator that was not designed for any model: populations keep the
    shapes the real gates give them (skewed, multimodal, truncated at the detector's
    bounds), and a rest class such as the ungated cells stays the heterogeneous
    mixture it is. Each emulated sample

    * takes a source sample (the sources are split between the batches, so no patient
      is in two batches; each is reused when a batch has more samples than sources),
    * draws its population proportions from ``Dirichlet(concentration · p)``, ``p``
      the source's own proportions (patients of one kind, not copies),
    * draws each population's cells from that population's cells in the source with
      replacement, each moved by Gaussian noise of 0.1 times the population's
      standard deviation per marker (a smoothed bootstrap: no cell repeats exactly),
    * passes through its batch's *instrument*: per marker a monotone non-linear gain
      ``x ↦ a x + b + c w tanh((x - m) / w)`` in units of the marker's pooled standard
      deviation (``log a ~ N(0, (0.15 s)²)``, ``b ~ N(0, (0.5 s)²)``, ``c ~ U(0, 0.6 s)``,
      ``m`` a random pooled quantile between 0.2 and 0.8, ``w`` half a standard
      deviation): a changed detector voltage moves and stretches a marker, and its
      response compresses or expands one region, as a changed compensation or a
      non-linear amplifier leaves it,
    * and adds its own small affine jitter per marker (``log a ~ N(0, 0.03²)``,
      ``b ~ N(0, 0.05²)`` standard deviations).

    ``s`` is ``strength``. The instruments are monotone per marker, so labels remain
    recoverable in principle; how well a model trained on one batch labels another is
    what the generator measures.

    With ``control_cells`` > 0, every batch also measures a *reference control*: an
    aliquot of one material (every source's cells pooled, in their pooled
    proportions), drawn afresh per batch and passed through that batch's instrument
    and its own jitter, as a lab runs one control tube per batch (CytoNorm's design).
    The controls come after every sample, drawn from a stream of their own, so the
    samples are the same with or without them.

    Parameters
    ----------
    sources : Bags
        Real samples (e.g. :func:`load_flowcap_gvhd`), at least ``n_batches`` of them.
    y : ndarray of shape (sources.n_points,)
        Every source cell's label (a rest class included, as it is).
    n_batches, samples_per_batch, n_cells : int
        The emulated cohort's shape.
    random_state : int, Generator or None
    strength : float, default=1.0
        Scale of the instruments' differences.
    concentration : float, default=30.0
        How close each sample's proportions stay to its source's.
    control_cells : int, default=0
        Cells of each batch's reference control; 0 for none.

    Returns
    -------
    tasks : Bags
        ``n_batches * samples_per_batch`` samples of ``n_cells`` cells, batch after batch,
        then (with ``control_cells``) one control per batch, in batch order.
    labels : ndarray of shape (n_tasks * n_cells,)
    batches : ndarray of shape (n_tasks,)
    source : ndarray of shape (n_tasks,)
        The source sample of each emulated one (samples of one source are one
        patient: group them when scoring); -1 for a control.
    """
    y = np.asarray(y)
    if y.shape[0] != sources.n_points or len(sources) < n_batches:
        raise ValueError(
            f"{y.shape[0]} labels for {sources.n_points} source cells"
            if y.shape[0] != sources.n_points
            else f"{len(sources)} source samples cannot fill {n_batches} batches"
        )
    rng = check_generator(random_state)
    classes = np.unique(y)
    pooled_sd = sources.points.std(axis=0)
    pooled_sd[pooled_sd == 0] = 1.0
    owners = np.array_split(rng.permutation(len(sources)), n_batches)
    arrays, labels, batches, origin = [], [], [], []
    levels = np.quantile(sources.points, np.linspace(0.2, 0.8, 7), axis=0)
    w = 0.5 * pooled_sd
    instruments = []
    for batch in range(n_batches):
        instruments.append(_draw_instrument(rng, strength, pooled_sd, levels))
        for k in range(samples_per_batch):
            src = int(owners[batch][k % owners[batch].size])
            lo, hi = int(sources.offsets[src]), int(sources.offsets[src + 1])
            x, pop = _resample(
                rng, sources.points[lo:hi], y[lo:hi], classes, n_cells, concentration, pooled_sd
            )
            arrays.append(_jitter(rng, _instrument(x, instruments[-1], w), pooled_sd))
            labels.append(classes[pop])
            batches.append(batch)
            origin.append(src)
    if control_cells > 0:
        # A stream of its own: the samples above are the same with or without controls.
        stream = np.random.default_rng(rng.integers(0, 2**63))
        for batch, instrument in enumerate(instruments):
            x, rows = _control(stream, sources, control_cells, instrument, w, pooled_sd)
            arrays.append(x)
            labels.append(y[rows])
            batches.append(batch)
            origin.append(-1)
    return (
        Bags.from_arrays(arrays),
        np.concatenate(labels),
        np.asarray(batches, dtype=np.int64),
        np.asarray(origin, dtype=np.int64),
    )


def _resample(
    rng: np.random.Generator,
    x_src: NDArray[np.float64],
    y_src: NDArray[Any],
    classes: NDArray[Any],
    n_cells: int,
    concentration: float,
    pooled_sd: NDArray[np.float64],
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """One emulated sample's cells drawn from its source (:func:`emulate_batches`):
    proportions near the source's, each population's cells by a smoothed bootstrap;
    returns the cells and each cell's population (an index into ``classes``)."""
    present = np.array([np.any(y_src == c_) for c_ in classes])
    counts = np.array([np.sum(y_src == c_) for c_ in classes], dtype=np.float64)
    props = np.zeros(classes.size)
    props[present] = rng.dirichlet(concentration * counts[present] / counts.sum())
    pop = rng.choice(classes.size, size=n_cells, p=props)
    x = np.empty((n_cells, x_src.shape[1]))
    for j in np.flatnonzero(np.bincount(pop, minlength=classes.size)):
        cells = x_src[y_src == classes[j]]
        rows = pop == j
        pick = cells[rng.integers(0, cells.shape[0], int(rows.sum()))]
        sd = cells.std(axis=0) if cells.shape[0] > 1 else pooled_sd * 0.1
        x[rows] = pick + 0.1 * sd * rng.standard_normal(pick.shape)
    return x, pop


def _draw_instrument(
    rng: np.random.Generator,
    strength: float,
    pooled_sd: NDArray[np.float64],
    levels: NDArray[np.float64],
) -> tuple[NDArray[np.float64], ...]:
    """A batch's instrument gains ``(a, b, c, m)`` per marker (:func:`emulate_batches`)."""
    dim = pooled_sd.shape[0]
    a = np.exp(rng.normal(0.0, 0.15 * strength, dim))
    b = rng.normal(0.0, 0.5 * strength, dim) * pooled_sd
    c = rng.uniform(0.0, 0.6 * strength, dim)
    m = levels[rng.integers(0, levels.shape[0], dim), np.arange(dim)]
    return a, b, c, m


def _control(
    stream: np.random.Generator,
    sources: Bags,
    n_cells: int,
    instrument: tuple[NDArray[np.float64], ...],
    w: NDArray[np.float64],
    pooled_sd: NDArray[np.float64],
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """A batch's reference control: pooled source cells through the batch's instrument
    and their own jitter; returns the cells and the source rows they came from."""
    rows = stream.integers(0, sources.n_points, n_cells)
    pick, sd = sources.points[rows], 0.1 * pooled_sd
    x = pick + sd * stream.standard_normal(pick.shape)
    return _jitter(stream, _instrument(x, instrument, w), pooled_sd), rows


def _jitter(
    rng: np.random.Generator, x: NDArray[np.float64], pooled_sd: NDArray[np.float64]
) -> NDArray[np.float64]:
    """A sample's own small affine jitter per marker (in pooled standard deviations)."""
    dim = x.shape[1]
    return np.exp(rng.normal(0.0, 0.03, dim)) * x + rng.normal(0.0, 0.05, dim) * pooled_sd


def _instrument(
    x: NDArray[np.float64], gains: tuple[NDArray[np.float64], ...], w: NDArray[np.float64]
) -> NDArray[np.float64]:
    """A batch's instrument: ``a x + b + c w tanh((x - m) / w)`` per marker."""
    a, b, c, m = gains
    return a * x + b + c * w * np.tanh((x - m) / w)
