"""Data generators from the papers (all seeded) and small bundled point clouds.

* :func:`make_gmm_modes` — count the modes of a Gaussian mixture (paper 000 §5.1,
  after Oliva et al. 2014), with :class:`GaussianMixtures` to redraw the points of
  fixed mixtures as the paper's repeats do;
* :func:`make_entropy_bags` — learn the entropy of the first marginal of rotated 2-D
  Gaussians (paper 003 supplement A.2.1; the paper's formula, not ITE's);
* :func:`load_digits_clouds` — scikit-learn's bundled 8×8 digits as weighted 2-D point
  clouds, optionally rotated and translated (paper 000 §5.2's MNIST recipe);
* :func:`make_ellipse_tasks` — the rotated-ellipse domain-generalization tasks of
  paper 004 (Algorithm 1);
* :func:`make_cytometry_tasks` — synthetic flow-cytometry-like samples: shared cell
  populations, sample-specific proportions and instrument/batch shifts;
* :func:`make_batched_cytometry_tasks` — the same in batches with affine, non-linear
  and population shifts per batch (domain generalisation across batches);
* :func:`emulate_batches` — new samples in instrument batches emulated from real
  labelled samples (their populations' own shapes, the ungated cells as they are);
* :func:`make_pendulum_transitions` — transitions of the under-actuated pendulum of
  paper 002's experiment (Deisenroth et al. 2009);
* :func:`load_flowcap_gvhd` — the FlowCAP-I GvHD samples with per-cell gates, read from
  a directory of the shared test data (never bundled: tests and benchmarks only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from ._random import check_generator
from .bags import Bags

__all__ = [
    "GaussianMixtures",
    "emulate_batches",
    "load_digits_clouds",
    "load_flowcap_gvhd",
    "load_state_productivity",
    "make_batched_cytometry_tasks",
    "make_cytometry_tasks",
    "make_dose_response_bags",
    "make_ellipse_tasks",
    "make_entropy_bags",
    "make_gmm_modes",
    "make_pendulum_transitions",
]


@dataclass(frozen=True)
class GaussianMixtures:
    """Equal-weight Gaussian mixtures, one per bag (paper 000 §5.1).

    Attributes
    ----------
    n_components : ndarray of shape (T,)
        Number of components ``p_t`` of each mixture: the label to predict.
    means : list of ndarray of shape (p_t, r)
    cholesky : list of ndarray of shape (p_t, r, r)
        Lower Cholesky factors of the component covariances.
    """

    n_components: NDArray[np.int64]
    means: list[NDArray[np.float64]]
    cholesky: list[NDArray[np.float64]]

    @classmethod
    def draw(
        cls, n_bags: int, max_components: int, dim: int, random_state: Any = None
    ) -> GaussianMixtures:
        """Draw mixture parameters.

        ``p ~ U{1..C}``; means ``μ_j ~ U([-5, 5]^r)``; covariances
        ``Σ_j = a_j A_j A_jᵀ + B_j`` with ``a_j ~ U[1, 4]``, ``A_j`` entries
        ``~ U[-1, 1]`` and ``B_j`` diagonal with entries ``~ U[0, 1]``.
        """
        rng = check_generator(random_state)
        p = rng.integers(1, max_components + 1, size=n_bags)
        means, chols = [], []
        for k in p:
            means.append(rng.uniform(-5.0, 5.0, size=(k, dim)))
            a = rng.uniform(1.0, 4.0, size=(k, 1, 1))
            A = rng.uniform(-1.0, 1.0, size=(k, dim, dim))
            B = rng.uniform(0.0, 1.0, size=(k, dim))
            cov = a * (A @ A.transpose(0, 2, 1))
            cov[:, np.arange(dim), np.arange(dim)] += B
            chols.append(np.linalg.cholesky(cov))
        return cls(p.astype(np.int64), means, chols)

    def sample(self, n_points: int, random_state: Any = None) -> Bags:
        """Draw ``n_points`` points from every mixture (components equally likely)."""
        rng = check_generator(random_state)
        bags = []
        for mu, L in zip(self.means, self.cholesky, strict=True):
            comp = rng.integers(0, mu.shape[0], size=n_points)
            z = rng.standard_normal((n_points, mu.shape[1]))
            bags.append(mu[comp] + np.einsum("nij,nj->ni", L[comp], z))
        return Bags.from_arrays(bags)


def make_gmm_modes(
    n_bags: int,
    n_points: int,
    max_components: int,
    dim: int,
    random_state: Any = None,
) -> tuple[Bags, NDArray[np.int64]]:
    """Bags from random Gaussian mixtures, labelled by their number of components.

    Paper 000 §5.1 (from Oliva et al. 2014): the task is to count the modes. Labels
    are in ``1..max_components``.

    Returns
    -------
    bags : Bags
        ``n_bags`` bags of ``n_points`` points in ``R^dim``.
    y : ndarray of shape (n_bags,)
        Number of components of each bag's mixture.
    """
    rng = check_generator(random_state)
    mixtures = GaussianMixtures.draw(n_bags, max_components, dim, rng)
    return mixtures.sample(n_points, rng), mixtures.n_components


def make_entropy_bags(
    n_bags: int = 100,
    n_points: int = 500,
    random_state: Any = None,
) -> tuple[Bags, NDArray[np.float64]]:
    """Rotated 2-D Gaussians labelled by the entropy of their first marginal.

    Paper 003 supplement A.2.1: ``A ∈ R^{2×2}`` with ``A_ij ~ U[0, 1]`` drawn once;
    for each bag ``β ~ U[0, π]``, ``Σ = R(β) A Aᵀ R(β)ᵀ`` and ``n_points`` draws from
    ``N(0, Σ)``. The target is ``H = ½ ln(2πe σ²)`` with ``σ² = Σ_11`` (ITE's demo
    squares the variance by mistake; this follows the paper).

    Returns
    -------
    bags : Bags
    y : ndarray of shape (n_bags,)
        Differential entropy of the first coordinate, in nats.
    """
    rng = check_generator(random_state)
    A = rng.uniform(0.0, 1.0, size=(2, 2))
    beta = rng.uniform(0.0, np.pi, size=n_bags)
    c, s = np.cos(beta), np.sin(beta)
    R = np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)
    cov = R @ (A @ A.T) @ R.transpose(0, 2, 1)
    L = np.linalg.cholesky(cov + 1e-12 * np.eye(2))
    z = rng.standard_normal((n_bags, n_points, 2))
    points = np.einsum("tij,tnj->tni", L, z)
    y = 0.5 * np.log(2.0 * np.pi * np.e * cov[:, 0, 0])
    return Bags.from_arrays(points), y


def load_digits_clouds(
    max_rotation: float = 0.0,
    max_translation: float = 0.0,
    random_state: Any = None,
) -> tuple[Bags, NDArray[np.int64]]:
    """scikit-learn's 1,797 bundled 8×8 digits as weighted 2-D point clouds.

    Paper 000 §5.2 recipe, on the small digits set that ships with scikit-learn
    (MNIST is not bundled): the points of an image are its active pixels
    (intensity > 0) at ``(column, row) / 3.5 - 1`` in ``[-1, 1]²`` and each point's
    weight is its intensity over the image's total. Perturbations act on the points
    exactly (no image resampling): a rotation about the centre by an angle
    ``~ U[-max_rotation, max_rotation]`` (radians) and a translation
    ``~ U[-max_translation, max_translation]²``.

    Returns
    -------
    bags : Bags
        Weighted bags in ``R²``.
    y : ndarray of shape (1797,)
        Digit labels 0..9.
    """
    from sklearn.datasets import load_digits

    rng = check_generator(random_state)
    digits = load_digits()
    images = digits.images  # (n, 8, 8), intensities 0..16
    n, h, w = images.shape
    rows, cols = np.nonzero(images.reshape(n, -1) > 0)
    pix_r, pix_c = np.divmod(cols, w)
    coords = np.stack([pix_c / ((w - 1) / 2.0) - 1.0, pix_r / ((h - 1) / 2.0) - 1.0], axis=1)
    weights = images.reshape(n, -1)[rows, cols]
    angle = rng.uniform(-max_rotation, max_rotation, size=n)
    shift = rng.uniform(-max_translation, max_translation, size=(n, 2))
    c, s = np.cos(angle[rows]), np.sin(angle[rows])
    x, yv = coords[:, 0], coords[:, 1]
    coords = np.stack([c * x - s * yv, s * x + c * yv], axis=1) + shift[rows]
    sizes = np.bincount(rows, minlength=n)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return Bags(coords, offsets, weights), digits.target.astype(np.int64)


def make_ellipse_tasks(
    n_tasks: int,
    n_points: int,
    random_state: Any = None,
    *,
    semi_axes: tuple[float, float] = (1.0, 0.2),
    angle_range: tuple[float, float] = (np.pi / 4, 3 * np.pi / 4),
) -> tuple[Bags, NDArray[np.int64], NDArray[np.float64]]:
    """Rotated-ellipse classification tasks (paper 004 §8.2, Algorithm 1).

    Each task draws an angle ``α ~ U[angle_range]``, rotates an ellipse with the given
    semi-axes (major axis first) by ``α`` about the origin, and samples ``n_points``
    points uniformly inside it. A point is labelled ``+1`` on the right of the major
    axis (the side of the normal ``(sin α, -cos α)``) and ``-1`` on the left. Every task
    has mean zero, so only second-order information (the orientation) tells the tasks
    apart, and the Bayes risk given the marginal is zero.

    Returns
    -------
    tasks : Bags
        ``n_tasks`` bags of ``n_points`` points in ``R²``.
    y : ndarray of shape (n_tasks * n_points,)
        Labels in ``{-1, +1}`` for every point, task after task.
    angles : ndarray of shape (n_tasks,)
    """
    rng = check_generator(random_state)
    a, b = semi_axes
    angles = rng.uniform(*angle_range, size=n_tasks)
    # Uniform in the unit disc (radius √U), stretched to the ellipse: still uniform.
    r = np.sqrt(rng.uniform(size=(n_tasks, n_points)))
    phi = rng.uniform(0.0, 2.0 * np.pi, size=(n_tasks, n_points))
    u, v = a * r * np.cos(phi), b * r * np.sin(phi)
    c, s = np.cos(angles)[:, None], np.sin(angles)[:, None]
    points = np.stack([c * u - s * v, s * u + c * v], axis=-1)
    # v is the coordinate along the minor axis; v < 0 lies on the (sin α, -cos α) side.
    y = np.where(v < 0, 1, -1).astype(np.int64).ravel()
    return Bags.from_arrays(points), y, angles


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
    if y.shape[0] != sources.n_points:
        raise ValueError(f"{y.shape[0]} labels for {sources.n_points} source cells")
    if len(sources) < n_batches:
        raise ValueError(f"{len(sources)} source samples cannot fill {n_batches} batches")
    rng = check_generator(random_state)
    classes = np.unique(y)
    pooled_sd = sources.points.std(axis=0)
    pooled_sd[pooled_sd == 0] = 1.0
    order = rng.permutation(len(sources))
    owners = np.array_split(order, n_batches)
    arrays, labels, batches, origin = [], [], [], []
    levels = np.quantile(sources.points, np.linspace(0.2, 0.8, 7), axis=0)
    dim = sources.dim
    w = 0.5 * pooled_sd
    instruments = []
    for batch in range(n_batches):
        a = np.exp(rng.normal(0.0, 0.15 * strength, dim))
        b = rng.normal(0.0, 0.5 * strength, dim) * pooled_sd
        c = rng.uniform(0.0, 0.6 * strength, dim)
        m = levels[rng.integers(0, levels.shape[0], dim), np.arange(dim)]
        instruments.append((a, b, c, m))
        for k in range(samples_per_batch):
            src = int(owners[batch][k % owners[batch].size])
            lo, hi = int(sources.offsets[src]), int(sources.offsets[src + 1])
            x_src, y_src = sources.points[lo:hi], y[lo:hi]
            present = np.array([np.any(y_src == c_) for c_ in classes])
            counts = np.array([np.sum(y_src == c_) for c_ in classes], dtype=np.float64)
            props = np.zeros(classes.size)
            props[present] = rng.dirichlet(concentration * counts[present] / counts.sum())
            pop = rng.choice(classes.size, size=n_cells, p=props)
            x = np.empty((n_cells, dim))
            for j in np.flatnonzero(np.bincount(pop, minlength=classes.size)):
                cells = x_src[y_src == classes[j]]
                rows = pop == j
                pick = cells[rng.integers(0, cells.shape[0], int(rows.sum()))]
                sd = cells.std(axis=0) if cells.shape[0] > 1 else pooled_sd * 0.1
                x[rows] = pick + 0.1 * sd * rng.standard_normal(pick.shape)
            x = a * x + b + c * w * np.tanh((x - m) / w)
            x = np.exp(rng.normal(0.0, 0.03, dim)) * x + rng.normal(0.0, 0.05, dim) * pooled_sd
            arrays.append(x)
            labels.append(classes[pop])
            batches.append(batch)
            origin.append(src)
    if control_cells > 0:
        # A stream of its own: the samples above are the same with or without controls.
        stream = np.random.default_rng(rng.integers(0, 2**63))
        for batch, (a, b, c, m) in enumerate(instruments):
            rows = stream.integers(0, sources.n_points, control_cells)
            pick, sd = sources.points[rows], 0.1 * pooled_sd
            x = pick + sd * stream.standard_normal(pick.shape)
            x = a * x + b + c * w * np.tanh((x - m) / w)
            jitter = np.exp(stream.normal(0.0, 0.03, dim))
            x = jitter * x + stream.normal(0.0, 0.05, dim) * pooled_sd
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


def make_dose_response_bags(
    n_bags: int,
    n_cells: int,
    random_state: Any = None,
) -> tuple[Bags, NDArray[np.float64], list[str]]:
    """Synthetic dose-response samples: a reporter marker responds to a dose.

    Each sample gets a dose ``d ~ U[0, 2]`` (log10 units of an inducer). A fraction
    ``d / 2`` of its cells respond, shifting the reporter (``GFP``) up by ``1.5 d``;
    scatter markers carry cell size. Every sample also has a small instrument offset.
    The label is the dose: a property of the whole distribution (its responding
    fraction and shift), not of any one cell.

    Returns
    -------
    bags : Bags
        ``n_bags`` samples of ``n_cells`` cells, markers ``["FSC-A", "SSC-A", "GFP"]``.
    dose : ndarray of shape (n_bags,)
    markers : list of str
    """
    rng = check_generator(random_state)
    dose = rng.uniform(0.0, 2.0, size=n_bags)
    arrays = []
    for d in dose:
        size = rng.normal(0.0, 1.0, size=n_cells)
        fsc = 2.0 + 0.5 * size + 0.2 * rng.standard_normal(n_cells)
        ssc = 1.0 + 0.3 * size + 0.3 * rng.standard_normal(n_cells)
        responding = rng.uniform(size=n_cells) < d / 2.0
        gfp = 0.3 * size + 0.4 * rng.standard_normal(n_cells) + 1.5 * d * responding
        x = np.column_stack([fsc, ssc, gfp]) + rng.normal(0.0, 0.1, size=3)
        arrays.append(x)
    return Bags.from_arrays(arrays), dose, ["FSC-A", "SSC-A", "GFP"]


GVHD_CHANNELS = ("FSC.H", "SSC.H", "FL1.H", "FL2.H", "FL3.H", "FL4.H")


#: US Census divisions of the 48 contiguous states (the batches of
#: :func:`load_state_productivity`).
CENSUS_DIVISIONS = {
    "New England": ("CT", "ME", "MA", "NH", "RI", "VT"),
    "Middle Atlantic": ("NJ", "NY", "PA"),
    "East North Central": ("IL", "IN", "MI", "OH", "WI"),
    "West North Central": ("IA", "KS", "MN", "MO", "NE", "ND", "SD"),
    "South Atlantic": ("DE", "FL", "GA", "MD", "NC", "SC", "VA", "WV"),
    "East South Central": ("AL", "KY", "MS", "TN"),
    "West South Central": ("AR", "LA", "OK", "TX"),
    "Mountain": ("AZ", "CO", "ID", "MT", "NV", "NM", "UT", "WY"),
    "Pacific": ("CA", "OR", "WA"),
}


def load_state_productivity() -> tuple[Bags, NDArray[np.float64], NDArray[np.str_], list[str]]:
    """Munnell's state productivity and public capital panel as grouped regression tasks.

    Munnell, "Why has productivity declined? Productivity and public investment", New
    England Economic Review (1990): 48 contiguous US states x 17 years (1970-1986), as
    the ``linearmodels`` package ships it (``linearmodels.datasets.munnell``; install
    ``linearmodels``, which the dev extra has). Each state is a task, each state-year a
    point with 4 inputs: log public capital, log private capital, log employment and
    the unemployment rate; the target is log gross state product. Real per-site data
    with strong site effects: the test bed of marginal-transfer *regression*.

    Returns
    -------
    tasks : Bags
        One bag per state (17 points x 4 inputs), states in alphabetical order of
        their postal codes.
    y : ndarray of shape (816,)
        Log gross state product, task after task.
    divisions : ndarray of str, shape (48,)
        Each state's census division (:data:`CENSUS_DIVISIONS`): its batch.
    states : list of str
        The postal codes.
    """
    try:
        from linearmodels.datasets import munnell
    except ImportError as exc:  # pragma: no cover - the dev extra installs it
        raise ImportError(
            "load_state_productivity reads the data linearmodels ships: pip install linearmodels"
        ) from exc
    df = munnell.load().sort_values(["ST_ABB", "YR"])
    division = {st: name for name, states in CENSUS_DIVISIONS.items() for st in states}
    arrays, targets, groups, states = [], [], [], []
    for st, part in df.groupby("ST_ABB", sort=True):
        arrays.append(
            np.column_stack(
                [np.log(part["P_CAP"]), np.log(part["PC"]), np.log(part["EMP"]), part["UNEMP"]]
            ).astype(np.float64)
        )
        targets.append(np.log(part["GSP"].to_numpy(dtype=np.float64)))
        groups.append(division[str(st)])
        states.append(str(st))
    return Bags.from_arrays(arrays), np.concatenate(targets), np.array(groups), states


def load_flowcap_gvhd(
    directory: str | Path,
    samples: list[int] | None = None,
    *,
    labels: Literal["aligned", "binary", "raw"] = "aligned",
    transform: Literal["channel", "arcsinh", "none"] = "channel",
    cofactor: float = 150.0,
) -> tuple[Bags, NDArray[np.int64], list[int]]:
    """FlowCAP-I GvHD flow samples with per-cell manual gates (one task per sample).

    Reads ``sample{k}.csv.gz`` (6 channels: FSC.H, SSC.H, FL1.H..FL4.H) and
    ``labels{k}.csv.gz`` from ``directory``. The data are not shipped with bagserve;
    they are test inputs only (see the data set's README for source and licence).

    Parameters
    ----------
    directory : path
        Folder with the 12 sample/label pairs.
    samples : list of int, optional
        Sample numbers to read (default 1..12).
    labels : {"aligned", "binary", "raw"}, default="aligned"
        Gate IDs are not aligned across samples except 1, 3 and 4 (README).
        ``"aligned"``: keep 1, 3, 4 and map every other gate (0, 2, 5) to 0 ("other");
        ``"binary"``: 1 for gates {1, 3, 4}, 0 otherwise; ``"raw"``: the file's IDs.
    transform : {"channel", "arcsinh", "none"}, default="channel"
        ``"channel"``: the values are 1024-channel numbers; divide by 1023 to put every
        channel in ``[0, 1]``. ``"arcsinh"``: ``arcsinh(x / cofactor)``.
        ``"none"``: raw values.

    Returns
    -------
    tasks : Bags
        One bag per sample (12,751–32,700 cells each).
    y : ndarray of shape (n_cells_total,)
        Per-cell labels, sample after sample.
    samples : list of int
        The sample numbers, in order.
    """
    import gzip

    directory = Path(directory)
    samples = list(range(1, 13)) if samples is None else list(samples)
    arrays, ys = [], []
    for k in samples:
        with gzip.open(directory / f"sample{k}.csv.gz", "rt") as fh:
            header = fh.readline().strip().replace('"', "").split(",")
            if tuple(header) != GVHD_CHANNELS:
                raise ValueError(
                    f"sample{k}.csv.gz: expected columns {GVHD_CHANNELS}, got {header}"
                )
            x = np.loadtxt(fh, delimiter=",", dtype=np.float64, ndmin=2)
        lab = np.loadtxt(directory / f"labels{k}.csv.gz", dtype=np.int64, ndmin=1)
        if lab.shape[0] != x.shape[0]:
            raise ValueError(f"sample {k}: {x.shape[0]} cells but {lab.shape[0]} labels")
        if labels == "aligned":
            lab = np.where(np.isin(lab, (1, 3, 4)), lab, 0)
        elif labels == "binary":
            lab = np.isin(lab, (1, 3, 4)).astype(np.int64)
        elif labels != "raw":
            raise ValueError(f"labels must be 'aligned', 'binary' or 'raw', got {labels!r}")
        if transform == "channel":
            x = x / 1023.0
        elif transform == "arcsinh":
            x = np.arcsinh(x / cofactor)
        elif transform != "none":
            raise ValueError(f"transform must be 'channel', 'arcsinh' or 'none', got {transform!r}")
        arrays.append(x)
        ys.append(lab)
    return Bags.from_arrays(arrays), np.concatenate(ys), samples


def make_pendulum_transitions(
    n: int,
    *,
    dt: float = 0.1,
    noise: float = 0.05,
    random_state: Any = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Transitions of the under-actuated pendulum (paper 002 §5.1).

    States ``(θ, ω)`` uniform on ``[-π, π] × [-7, 7]`` and torques ``u`` uniform on
    ``[-5, 5]`` Nm (too weak to swing up directly). The dynamics (Deisenroth et al.
    2009: mass 1 kg, length 1 m, friction 0.05 N m s) ``θ'' = (u - b ω - m g l sin θ) /
    (m l²)`` are integrated over ``dt`` by four RK4 steps; Gaussian noise of standard
    deviation ``noise`` is added to the next angular velocity.

    Returns
    -------
    X : ndarray of shape (n, 4)
        ``(sin θ, cos θ, ω, u)``.
    Y : ndarray of shape (n, 3)
        The next state ``(sin θ', cos θ', ω')``.
    """
    rng = check_generator(random_state)
    theta = rng.uniform(-np.pi, np.pi, n)
    omega = rng.uniform(-7.0, 7.0, n)
    u = rng.uniform(-5.0, 5.0, n)
    m, length, g, b = 1.0, 1.0, 9.81, 0.05

    def deriv(th: NDArray[np.float64], om: NDArray[np.float64]):
        return om, (u - b * om - m * g * length * np.sin(th)) / (m * length**2)

    th, om = theta.copy(), omega.copy()
    h = dt / 4
    for _ in range(4):
        k1 = deriv(th, om)
        k2 = deriv(th + h / 2 * k1[0], om + h / 2 * k1[1])
        k3 = deriv(th + h / 2 * k2[0], om + h / 2 * k2[1])
        k4 = deriv(th + h * k3[0], om + h * k3[1])
        th = th + h / 6 * (k1[0] + 2 * k2[0] + 2 * k3[0] + k4[0])
        om = om + h / 6 * (k1[1] + 2 * k2[1] + 2 * k3[1] + k4[1])
    om = om + noise * rng.standard_normal(n)
    X = np.column_stack([np.sin(theta), np.cos(theta), omega, u])
    Y = np.column_stack([np.sin(th), np.cos(th), om])
    return X, Y
