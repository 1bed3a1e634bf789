"""The landmark map: a sample's per-marker scale and shift onto the training populations,
and the check that refuses a map fitted to a population's spread (issue 44, point 1).

The map is the per-marker affine map of largest likelihood under the training cells'
populations, a Gaussian mixture with the pooled LDA's means, shared covariance and
priors (:class:`~.reference.Reference`): the populations are the landmarks, CytoNorm's
and DeepCyTOF's idea without clustering, fitted by EM instead of by label-then-map
rounds.

A likelihood can be raised by squeezing a marker on which a population is wider than
in the training batch. On Miami's cytometer in the real three-centre benchmark
(``bench/bench_real_batches.py``) the map scaled CD8 by 0.25 where the sample's true
population means say 0.62, and labelled 0.868 of the cells against 0.908 as measured.
So each map is checked against what a landmark is, a population's place: the sample's
populations, identified as measured, are compared marker by marker with the training
populations' means, before and after the map (:func:`population_places`). A map whose
gain lies mostly in markers it moves away from those places is refused
(:func:`landmark_map`), and the sample is answered as measured and flagged out of
range: past the gate, it comes from an instrument the model did not undo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ...alignment import MarkerQuality
from .reference import SD_FLOOR, Reference, canonical_cells, sample_moments

__all__ = [
    "LANDMARK_CELLS",
    "REFUSAL_SHARE",
    "LandmarkMap",
    "landmark_affine",
    "landmark_gain",
    "landmark_map",
    "population_places",
]

#: Cells of a sample the landmark map is fitted on (a seeded draw).
LANDMARK_CELLS = 20_000
#: EM rounds of the landmark map, and Newton steps per M-step.
EM_ROUNDS = 15
NEWTON_STEPS = 3
#: A map is refused when less than this share of its likelihood gain remains once the
#: markers it moves away from the populations' places are left as measured. Set on
#: the real three-centre data (``bench_real_batches.py``, one centre trains, seed 0):
#: the three maps that cost most against the cells as measured kept 0.03, 0.04 and
#: 0.15 of their gain, the other maps with such a marker 0.33 or more. On the emulated
#: batches (3 seeds) every such map kept 0.39 or more but one GvHD sample's (0.09;
#: 0.986 of its cells right as measured, 0.987 mapped).
REFUSAL_SHARE = 0.25
#: A marker whose cells' mean lies beyond this many of their standard deviations from
#: zero is centred in the landmark map's Newton steps (:func:`_em_affine`).
CENTRE_BEYOND = 1000.0
#: A population counts as a place of its own from this share of the sample's cells.
PLACE_SHARE = 0.01


def _log_joint(mixture: dict[str, Any], x: NDArray[np.float64]) -> NDArray[np.float64]:
    """Each cell's log prior plus log density under each training population, up to
    one constant (cells x populations; the shared covariance's normalisation left out)."""
    L = mixture["whitening"]
    z, m = x @ L, mixture["means"] @ L
    d2 = (z**2).sum(axis=1)[:, None] - 2.0 * z @ m.T + (m**2).sum(axis=1)[None, :]
    return mixture["log_priors"][None, :] - 0.5 * d2


def _posterior(logp: NDArray[np.float64]) -> NDArray[np.float64]:
    """Each cell's posterior over the training populations from :func:`_log_joint`."""
    logp = logp - logp.max(axis=1, keepdims=True)
    r = np.exp(logp)
    return r / r.sum(axis=1, keepdims=True)


def _responsibilities(mixture: dict[str, Any], x: NDArray[np.float64]) -> NDArray[np.float64]:
    """Each cell's posterior over the training populations (cells x populations)."""
    return _posterior(_log_joint(mixture, x))


def _mean_log_density(logp: NDArray[np.float64]) -> float:
    """Mean over cells of the log mixture density, from :func:`_log_joint`."""
    top = logp.max(axis=1)
    return float((top + np.log(np.exp(logp - top[:, None]).sum(axis=1))).mean())


def _log_likelihood(
    mixture: dict[str, Any], x: NDArray[np.float64], a: NDArray, b: NDArray
) -> float:
    """Mean log-likelihood of ``x`` mapped by ``x ↦ a x + b`` under the training cells'
    Gaussian mixture (the LDA's, shared covariance), plus the map's log-Jacobian
    ``Σ log a``: the likelihood of ``x`` itself under the mapped model, comparable
    between maps (constants left out)."""
    return _mean_log_density(_log_joint(mixture, x * a + b)) + float(np.log(a).sum())


def _em_affine(
    x: NDArray[np.float64],
    mixture: dict[str, Any],
    a: NDArray,
    b: NDArray,
    flat: NDArray[np.bool_] | None = None,
    centre: NDArray[np.float64] | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64], float]:
    """EM for the per-marker affine map ``x ↦ a x + b`` of largest likelihood under the
    training cells' Gaussian mixture, from ``(a, b)``; returns the map and its
    :func:`_log_likelihood`.

    E-step: each cell's responsibilities under the mapped mixture. M-step: with
    ``u = [a, b]`` the expected complete log-likelihood is
    ``-½ uᵀ A u + cᵀ u + n Σ log a`` (``P`` the mixture's shared precision,
    ``A = [[P ⊙ XᵀX, diag(Σx) P], [P diag(Σx), n P]]``, ``c`` from the cells'
    expected means), concave in ``u``: a few Newton steps, halved where a scale
    would turn non-positive.

    A ``flat`` marker (its cells all at one value, a detector at its bound) keeps
    its ``(a, b)``: its scale and shift are not separately identified, and the
    Newton system is singular in them.

    The Newton steps read each marker about ``centre`` (``b`` too): ``A``'s
    condition grows with the square of a marker's distance from its centre over its
    spread, and at 1e8 the system was singular in floating point.
    """
    L, means = mixture["whitening"], mixture["means"]
    P = L @ L.T
    n, d = x.shape
    centre = np.zeros(d) if centre is None else centre
    x = x - centre
    b = b + a * centre
    sums = x.sum(axis=0)
    A = np.block([[P * (x.T @ x), sums[:, None] * P], [P * sums[None, :], n * P]])
    free = np.flatnonzero(np.tile(~flat, 2)) if flat is not None else np.arange(2 * d)
    for _ in range(EM_ROUNDS):
        r = _responsibilities(mixture, x * a + b)
        target = (r @ means) @ P
        c = np.concatenate([(x * target).sum(axis=0), target.sum(axis=0)])
        u = np.concatenate([a, b])
        for _ in range(NEWTON_STEPS):
            grad = c - A @ u
            grad[:d] += n / u[:d]
            hess = A.copy()
            hess[np.arange(d), np.arange(d)] += n / u[:d] ** 2
            step = np.zeros(2 * d)
            step[free] = np.linalg.solve(hess[np.ix_(free, free)], grad[free])
            t = 1.0
            while np.any(u[:d] + t * step[:d] <= 0):
                t /= 2.0
            u = u + t * step
        a, b = u[:d], u[d:]
    return a, b - a * centre, _log_likelihood(mixture, x, a, b)


def landmark_gain(
    x: NDArray[np.float64], reference: Reference
) -> tuple[NDArray[np.float64], NDArray[np.float64], float]:
    """The landmark map's scale and shift per marker for sample ``x``, and how much it
    raises the sample's likelihood over the cells as measured (mean log-likelihood per
    cell under the training populations' mixture, with the map's Jacobian): EM
    (:func:`_em_affine`) from the moment map (the sample's mean and standard deviation
    onto the training samples'), on at most :data:`LANDMARK_CELLS` of the sample's
    cells (a seeded draw).

    The start matters: the likelihood has a local maximum per way of matching
    populations. On the emulated GvHD batches EM from the identity and from the
    moments reached the same map in all 24 samples checked; on the synthetic batches,
    whose populations move each by its own shift, the identity's was the likelier in
    5 of 8 samples and wrong (accuracy 0.55-0.79 against 0.98-0.996), so a
    likelihood cannot choose between starts. Label-then-map rounds from the identity
    (the issue-44 baseline) left one emulated GvHD sample at 0.143.
    """
    fit = landmark_map(x, reference)
    return fit.scale, fit.shift, fit.gain


def _em_from_moments(
    judged: NDArray[np.float64], reference: Reference
) -> tuple[NDArray[np.float64], NDArray[np.float64], float, NDArray[np.bool_]]:
    """EM (:func:`_em_affine`) on the cells ``judged`` from their moment map; the map,
    its :func:`_log_likelihood`, and the markers flat in them (at the floor, which the
    moment map only shifts to the training mean)."""
    assert reference.mixture is not None
    floor = SD_FLOOR * reference.sd
    m, s = sample_moments(judged, floor)
    a = reference.sd / s
    flat = s <= floor
    # Markers far from zero next to their spread are centred (:func:`_em_affine`);
    # those within CENTRE_BEYOND spreads keep the plain arithmetic, so saved models
    # answer bit for bit.
    centre = np.where(~flat & (np.abs(m) > CENTRE_BEYOND * s), m, 0.0)
    a, b, best = _em_affine(judged, reference.mixture, a, reference.mean - a * m, flat, centre)
    return a, b, best, flat


def landmark_affine(
    x: NDArray[np.float64], reference: Reference
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The landmark map's scale and shift per marker (:func:`landmark_gain`)."""
    a, b, _ = landmark_gain(x, reference)
    return a, b


def population_places(
    x: NDArray[np.float64], a: NDArray, b: NDArray, reference: Reference
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.bool_]]:
    """How far sample ``x``'s populations sit from the training populations' means, per
    marker, as measured and under the map ``x ↦ a x + b``.

    The populations are identified as measured (each cell's posterior under the
    training mixture), so the map cannot choose its own populations. Per population
    ``k`` and marker ``j``, ``|m_kj - μ_kj|`` before and ``|a_j m_kj + b_j - μ_kj|``
    after, in the training samples' standard deviations of the marker (``m_k`` the
    population's mean as measured, ``μ_k`` its training mean). Averaged two ways:

    * over the sample's cells (each population by its share);
    * over its populations alike (those with at least :data:`PLACE_SHARE` of the
      cells): a small population's place counts as much as a large one's.

    Returns
    -------
    before, after : ndarray of shape (d,)
        The cells' averages.
    worse : ndarray of bool, shape (d,)
        Markers the map moves further away in either average.
    """
    assert reference.mixture is not None
    return _places(x, _responsibilities(reference.mixture, x), a, b, reference)


def _places(
    x: NDArray[np.float64], r: NDArray[np.float64], a: NDArray, b: NDArray, reference: Reference
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.bool_]]:
    """:func:`population_places` with the cells' posteriors ``r`` as measured."""
    assert reference.mixture is not None
    counts = r.sum(axis=0)
    means = (r.T @ x) / np.maximum(counts, 1e-300)[:, None]
    target = reference.mixture["means"]
    before = np.abs(means - target) / reference.sd
    after = np.abs(means * a + b - target) / reference.sd
    share = counts / counts.sum()
    alike = (share >= PLACE_SHARE) / max(int(np.count_nonzero(share >= PLACE_SHARE)), 1)
    worse = (share @ after > share @ before) | (alike @ after > alike @ before)
    return share @ before, share @ after, worse


@dataclass(frozen=True)
class LandmarkMap:
    """A sample's landmark map, its gain, and whether it is refused.

    Attributes
    ----------
    scale, shift : ndarray of shape (d,)
        The map ``x ↦ scale x + shift`` (:func:`landmark_gain`).
    gain : float
        Its gain in mean log-likelihood per cell over the cells as measured.
    before, after, worse : ndarray of shape (d,)
        :func:`population_places` of the map.
    kept : float
        The gain left once the ``worse`` markers are left as measured.
    refused : bool
        Less than the reference's refusal share of ``gain`` is ``kept``: the map's
        evidence is a squeeze, not the populations' places.
    """

    scale: NDArray[np.float64]
    shift: NDArray[np.float64]
    gain: float
    before: NDArray[np.float64]
    after: NDArray[np.float64]
    worse: NDArray[np.bool_]
    kept: float
    refused: bool

    def quality(self, moved: NDArray[np.float64]) -> MarkerQuality:
        """The report of the map as applied, with ``moved`` the median displacement of
        the sample's cells per marker."""
        return MarkerQuality(moved, self.before, self.after, self.worse, by="landmarks")

    def held_back(self) -> MarkerQuality:
        """The report of a sample the gate left as measured: moved by 0 on every
        marker, its populations where they were, nothing made worse."""
        zero = np.zeros_like(self.scale)
        return MarkerQuality(
            zero, self.before, self.before, np.zeros_like(self.worse), by="landmarks"
        )

    def refusal(self) -> MarkerQuality:
        """The report of a sample whose map, past the gate, was refused: moved by 0
        on every marker, ``worse`` the markers that refused it."""
        zero = np.zeros_like(self.scale)
        return MarkerQuality(zero, self.before, self.after, self.worse, "landmarks", True)


def landmark_map(x: NDArray[np.float64], reference: Reference) -> LandmarkMap:
    """Sample ``x``'s landmark map (:func:`landmark_gain`) and the check of the
    populations' places (:func:`population_places`), on the same seeded draw of at
    most :data:`LANDMARK_CELLS` cells.

    The map is refused when leaving its ``worse`` markers as measured keeps less than
    ``reference.landmark_refusal`` of its gain. Left as measured, such markers would
    leave the rest of the map fitted to them, so a map is taken whole or not at all:
    on the emulated GvHD batches, a map with two of its six markers put back labelled
    a sample 0.18 where the whole map labelled it 0.95.
    """
    mixture = reference.mixture
    assert mixture is not None
    judged = canonical_cells(x, LANDMARK_CELLS, 5)
    # The cells as measured, scored once: the gain's base and the places' populations.
    measured = _log_joint(mixture, judged)
    base = _mean_log_density(measured)
    a, b, best, flat = _em_from_moments(judged, reference)
    # A flat marker's scale is the floor's 1 / SD_FLOOR, not a fit: its log-Jacobian
    # (log 1000) is no gain. Counted, one flat marker in one training sample raised the
    # gate's limit a thousandfold (0.007 to 6.9), and no new sample was calibrated.
    gain = best - base - float(np.log(a[flat]).sum())
    before, after, worse = _places(judged, _posterior(measured), a, b, reference)
    kept = gain
    if worse.any():
        guarded = _log_likelihood(mixture, judged, np.where(worse, 1.0, a), np.where(worse, 0.0, b))
        kept = guarded - base - float(np.log(a[flat & ~worse]).sum())
    share = reference.landmark_refusal
    refused = share is not None and gain > 0 and bool(worse.any()) and kept < share * gain
    return LandmarkMap(a, b, gain, before, after, worse, kept, refused)
