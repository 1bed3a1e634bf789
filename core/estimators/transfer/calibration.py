"""Calibrate a sample to the training batch before any model sees it (issue 44, point 1).

Every map here is increasing within each marker, so no calibration reorders a
sample's cells on a marker or invents a population:

* ``"control"``: the batch's reference control mapped onto the training batch's
  control, quantile by quantile (:func:`core.alignment.control_map`, CytoNorm's
  idea), and the same map applied to every sample of the batch. The control's
  biology is the reference's, so a sample's own proportions are kept.
* ``"landmarks"`` (classifiers): the per-marker scale and shift under which the
  sample is most likely under the training cells' populations, a Gaussian mixture
  with the pooled LDA's means, shared covariance and priors (:func:`landmark_affine`;
  the populations are the landmarks, CytoNorm's and DeepCyTOF's idea without
  clustering, fitted by EM instead of by label-then-map rounds).
* ``"standardise"``: each sample by its own mean and standard deviation per marker;
  the training samples alike, so the cell model lives in standardised units. Undoes
  a per-sample affine effect, but a sample whose populations' proportions differ
  from the training samples' is moved too (biology read as batch).
* ``"none"``: the cells as measured (asked for, never chosen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ...alignment import CONTROL_LEVELS, MarkerQuality, control_map
from ...bags import Bags, subsample_bags

__all__ = [
    "CALIBRATIONS",
    "ControlFit",
    "Reference",
    "calibrate",
    "canonical_cells",
    "fit_control",
    "fit_reference",
    "landmark_affine",
    "landmark_gain",
    "landmark_gain_limit",
    "shift",
    "standardised",
]

#: Every calibration, fewest assumptions first (the one-standard-error rule's order):
#: the control assumes only that it is the same material in every batch; landmarks,
#: that the sample's populations sit where the training populations do; the moments,
#: that the sample's proportions are the training samples' (biology read as batch).
#: ``"none"`` is never chosen, only asked for: every sample is calibrated.
CALIBRATIONS = ("control", "landmarks", "standardise", "none")
#: Cells of a sample the landmark map is fitted on (a seeded draw).
LANDMARK_CELLS = 20_000
#: EM rounds of the landmark map, and Newton steps per M-step.
EM_ROUNDS = 15
NEWTON_STEPS = 3
#: Floor of a marker's standard deviation, relative to the training reference's: a
#: marker a sample does not spread (all its cells on a detector bound) is shifted,
#: not blown up.
SD_FLOOR = 1e-3


@dataclass(frozen=True)
class Reference:
    """What the training batch looks like, in plain arrays (stored with the model).

    Attributes
    ----------
    mean, sd : ndarray of shape (d,)
        Training samples' per-marker mean and standard deviation, averaged over the
        samples (the moment map's target).
    control_quantiles : ndarray of shape (len(CONTROL_LEVELS), d) or None
        The training batch's reference control at :data:`~core.alignment.CONTROL_LEVELS`.
    control_scale : ndarray of shape (d,) or None
        The control's standard deviation per marker (the unit of its quality report).
    mixture : dict or None
        Classifiers: the training cells' populations as a Gaussian mixture, the pooled
        LDA's ``means`` (classes x d), ``whitening`` (the Cholesky factor of the
        shared precision) and ``log_priors``: the landmarks' target.
    landmark_gain_limit : float or None
        The largest gain in likelihood a landmark map may bring a sample that is left
        as measured (:func:`landmark_gain`, :func:`landmark_gain_limit`).
    """

    mean: NDArray[np.float64]
    sd: NDArray[np.float64]
    control_quantiles: NDArray[np.float64] | None = None
    control_scale: NDArray[np.float64] | None = None
    mixture: dict[str, Any] | None = None
    landmark_gain_limit: float | None = None

    def as_state(self) -> dict[str, Any]:
        """The arrays a model artifact stores."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Reference:
        return cls(**state)


def canonical_cells(x: NDArray[np.float64], most: int | None, seed: int) -> NDArray[np.float64]:
    """At most ``most`` of sample ``x``'s cells (a draw seeded by ``seed`` and the
    sample's size), in lexicographic order: whatever the order the cells arrive in,
    the same cells in the same order, so every sum over them is the same to the bit
    (:func:`core.bags.subsample_bags`)."""
    return subsample_bags(Bags.from_arrays([x]), most, seed, canonical=True).points


def _moments(x: NDArray[np.float64], floor: NDArray[np.float64]) -> tuple[NDArray, NDArray]:
    """Per-marker mean and standard deviation (floored), the same for any cell order."""
    x = canonical_cells(x, None, 0)
    return x.mean(axis=0), np.maximum(x.std(axis=0), floor)


def standardised(x: NDArray[np.float64], floor: NDArray[np.float64]) -> NDArray[np.float64]:
    """``x`` by its own mean and standard deviation per marker (``floor``: the smallest
    standard deviation divided by)."""
    m, s = _moments(x, floor)
    return (x - m) / s


def fit_reference(
    tasks: list[NDArray[np.float64]],
    codes: NDArray[np.int64] | None,
    control: NDArray[np.float64] | None,
    gain_limit: float | None = None,
) -> Reference:
    """The :class:`Reference` of the training samples ``tasks`` (cells x markers each),
    their cells' class ``codes`` (concatenated; None for a regressor), the training
    batch's reference ``control``, and the landmark gain a sample may show and still
    be left as measured (:func:`landmark_gain_limit`; None: every sample mapped)."""
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

    moments = np.array([[t.mean(axis=0), t.std(axis=0)] for t in tasks])
    mean, sd = moments[:, 0].mean(axis=0), moments[:, 1].mean(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    cq = cs = None
    if control is not None:
        cq = np.quantile(control, CONTROL_LEVELS, axis=0)
        cs = control.std(axis=0)
    mixture = None
    if codes is not None:
        lda = LinearDiscriminantAnalysis(store_covariance=True).fit(np.vstack(tasks), codes)
        cov = np.asarray(lda.covariance_, dtype=np.float64)
        cov += 1e-6 * float(np.mean(np.diag(cov)) or 1.0) * np.eye(cov.shape[0])
        mixture = {
            "means": np.asarray(lda.means_, dtype=np.float64),
            "whitening": np.linalg.cholesky(np.linalg.inv(cov)),
            "log_priors": np.log(np.asarray(lda.priors_, dtype=np.float64)),
        }
    return Reference(mean, sd, cq, cs, mixture, gain_limit)


def landmark_gain_limit(
    tasks: list[NDArray[np.float64]],
    codes: NDArray[np.int64],
    cv: int,
    seed: int,
    factor: float,
) -> float:
    """The landmark gain (:func:`landmark_gain`) a sample may show and still be a new
    patient of the training batch: ``factor`` times the largest gain of a training
    sample under the mixture of the others (``cv`` folds of samples, drawn by
    ``seed``). Held out, not in-sample: a sample's own cells in the mixture lower its
    gain (on the 12 real GvHD samples, at most 0.94 in-sample against 1.37 held out).
    """
    order = np.random.default_rng([seed, 4]).permutation(len(tasks))
    offsets = np.cumsum([0, *(t.shape[0] for t in tasks)])
    gains = []
    for held in np.array_split(order, min(cv, len(tasks))):
        train = np.setdiff1d(np.arange(len(tasks)), held)
        if train.size == 0:
            continue
        rows = np.concatenate([np.arange(offsets[t], offsets[t + 1]) for t in train])
        reference = fit_reference([tasks[t] for t in train], codes[rows], None)
        gains += [landmark_gain(tasks[t], reference)[2] for t in held]
    return factor * max(max(gains, default=0.0), 0.0)


def _log_likelihood(
    mixture: dict[str, Any], x: NDArray[np.float64], a: NDArray, b: NDArray
) -> float:
    """Mean log-likelihood of ``x`` mapped by ``x ↦ a x + b`` under the training cells'
    Gaussian mixture (the LDA's, shared covariance), plus the map's log-Jacobian
    ``Σ log a``: the likelihood of ``x`` itself under the mapped model, comparable
    between maps (constants left out)."""
    L = mixture["whitening"]
    z = (x * a + b) @ L
    m = mixture["means"] @ L
    d2 = (z**2).sum(axis=1)[:, None] - 2.0 * z @ m.T + (m**2).sum(axis=1)[None, :]
    logp = mixture["log_priors"][None, :] - 0.5 * d2
    top = logp.max(axis=1)
    ll = top + np.log(np.exp(logp - top[:, None]).sum(axis=1))
    return float(ll.mean() + np.log(a).sum())


def _em_affine(
    x: NDArray[np.float64], mixture: dict[str, Any], a: NDArray, b: NDArray
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
    """
    L, means, log_priors = mixture["whitening"], mixture["means"], mixture["log_priors"]
    P = L @ L.T
    n, d = x.shape
    sums = x.sum(axis=0)
    A = np.block([[P * (x.T @ x), sums[:, None] * P], [P * sums[None, :], n * P]])
    for _ in range(EM_ROUNDS):
        z = (x * a + b) @ L
        m = means @ L
        logp = log_priors - 0.5 * ((z**2).sum(1)[:, None] - 2.0 * z @ m.T + (m**2).sum(1))
        logp -= logp.max(axis=1, keepdims=True)
        r = np.exp(logp)
        r /= r.sum(axis=1, keepdims=True)
        target = (r @ means) @ P
        c = np.concatenate([(x * target).sum(axis=0), target.sum(axis=0)])
        u = np.concatenate([a, b])
        for _ in range(NEWTON_STEPS):
            grad = c - A @ u
            grad[:d] += n / u[:d]
            hess = A.copy()
            hess[np.arange(d), np.arange(d)] += n / u[:d] ** 2
            step = np.linalg.solve(hess, grad)
            t = 1.0
            while np.any(u[:d] + t * step[:d] <= 0):
                t /= 2.0
            u = u + t * step
        a, b = u[:d], u[d:]
    return a, b, _log_likelihood(mixture, x, a, b)


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
    assert reference.mixture is not None
    judged = canonical_cells(x, LANDMARK_CELLS, 5)
    m, s = _moments(judged, SD_FLOOR * reference.sd)
    a = reference.sd / s
    a, b, best = _em_affine(judged, reference.mixture, a, reference.mean - a * m)
    ones = np.ones_like(a)
    return a, b, best - _log_likelihood(reference.mixture, judged, ones, np.zeros_like(a))


def landmark_affine(
    x: NDArray[np.float64], reference: Reference
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The landmark map's scale and shift per marker (:func:`landmark_gain`)."""
    a, b, _ = landmark_gain(x, reference)
    return a, b


@dataclass(frozen=True)
class ControlFit:
    """A batch's control map onto the training batch's control, fitted once per batch,
    and its quality (:func:`core.alignment.control_map`)."""

    mapping: Any
    quality: MarkerQuality
    unit: NDArray[np.float64]


def fit_control(control: NDArray[np.float64], reference: Reference) -> ControlFit:
    """The map of the batch whose reference ``control`` (cells x markers) is given.

    Raises
    ------
    ValueError
        The model was fitted without the training batch's control.
    """
    if reference.control_quantiles is None or reference.control_scale is None:
        raise ValueError(
            "this model was fitted without a reference control (fit(..., control=)): "
            "a batch's control has nothing to be mapped onto"
        )
    mapping, quality = control_map(control, reference.control_quantiles, reference.control_scale)
    unit = np.where(reference.control_scale > 0, reference.control_scale, 1.0)
    return ControlFit(mapping, quality, unit)


def calibrate(
    how: str, x: NDArray[np.float64], reference: Reference, control: ControlFit | None
) -> tuple[NDArray[np.float64], MarkerQuality | None, str]:
    """Sample ``x`` (cells x markers) in the cell model's space, calibrated by ``how``;
    with a control, the map's quality for this sample (how far it moved its cells);
    and the calibration that ran.

    Landmarks run only where they are evidence of an instrument: a sample whose
    landmark map raises its likelihood no more than a training sample's own map does
    (``reference.landmark_gain_limit``) is a new patient of the training batch, left
    as measured (``"none"``). On the 12 real GvHD samples, left out four at a time,
    landmarks on every sample labelled 0.833 of the cells against 0.870 as measured.
    The gains measured (3 seeds, 3,000 cells; the guide page
    ``docs/guide/marginal-transfer.md`` has the table): a held-out training sample at
    most 1.95 (real GvHD patients, four splits), 2.78, 0.29 and 2.51 (the emulated
    GvHD, FlowSOM and synthetic batches' own samples); a sample of another emulated
    batch at least 1.77, 3.45 and 30.5. The GvHD ranges overlap.

    Raises
    ------
    ValueError
        ``how="control"`` without the batch's control map.
    """
    if how == "none":
        return x, None, how
    if how == "standardise":
        return standardised(x, SD_FLOOR * reference.sd), None, how
    if how == "landmarks":
        a, b, gain = landmark_gain(x, reference)
        limit = reference.landmark_gain_limit
        if limit is not None and gain <= limit:
            return x, None, "none"
        return x * a + b, None, how
    if how != "control":
        raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {how!r}")
    if control is None:
        raise ValueError("calibration 'control' needs the batch's reference control")
    mapped = control.mapping(x)
    moved = np.median(np.abs(mapped - x), axis=0) / control.unit
    q = control.quality
    return mapped, MarkerQuality(moved, q.before, q.after, q.worse), how


def shift(how: str, x: NDArray[np.float64], z: NDArray[np.float64], reference: Reference) -> float:
    """How far calibration ``how`` moved sample ``x`` to ``z`` (its cells in the cell
    model's space): the largest over markers of the median displacement of a cell, in
    the training samples' standard deviations of that marker, with ``z`` read back in
    the training batch's units (a standardised sample is put at the training samples'
    mean and spread first)."""
    if how == "none":
        return 0.0
    if how == "standardise":
        z = z * reference.sd + reference.mean
    return float(np.max(np.median(np.abs(z - x), axis=0) / reference.sd))
