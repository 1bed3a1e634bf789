"""What the training batch looks like: the target every calibration maps a sample onto.

:class:`Reference` holds it in plain arrays (stored with the model): the training
samples' moments, the training batch's reference control, and for classifiers the
training cells' populations as a Gaussian mixture, the landmarks' target
(:mod:`.landmarks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ...alignment import CONTROL_LEVELS
from ...bags import Bags, subsample_bags

__all__ = [
    "SD_FLOOR",
    "Reference",
    "canonical_cells",
    "fit_reference",
    "flat_markers",
    "sample_moments",
    "suspect_markers",
    "tied_markers",
    "wild_markers",
]

#: Floor of a marker's standard deviation, relative to the training reference's: a
#: marker a sample does not spread (all its cells on a detector bound) is shifted,
#: not blown up.
SD_FLOOR = 1e-3
#: Two markers are tied when their cells' correlation is within this of ±1: one is an
#: affine copy of the other (the same channel read twice), up to rounding. Measured
#: cells never come near it: their spread off the line would be a few 1e-5 of their
#: standard deviation.
TIE = 1e-9
#: Cells the ties are looked for on (the first ones): an exact tie holds on any cells.
TIE_CELLS = 20_000
#: A cell further than this many training standard deviations from the training mean
#: on a marker was not measured as the training batch measures (no instrument's
#: gain or offset that a calibration undoes moves a cell that far).
WILD = 1e3


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
        as measured (:func:`.landmarks.landmark_gain`,
        :func:`.calibration.landmark_gain_limit`).
    landmark_refusal : float or None
        The share of a landmark map's gain that must remain once the markers it moves
        away from the training populations' places are left as measured; below it
        the map is refused (:func:`.landmarks.landmark_map`). ``None``: never refused,
        as models saved before the rule answer.
    """

    mean: NDArray[np.float64]
    sd: NDArray[np.float64]
    control_quantiles: NDArray[np.float64] | None = None
    control_scale: NDArray[np.float64] | None = None
    mixture: dict[str, Any] | None = None
    landmark_gain_limit: float | None = None
    landmark_refusal: float | None = None

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


def sample_moments(x: NDArray[np.float64], floor: NDArray[np.float64]) -> tuple[NDArray, NDArray]:
    """Per-marker mean and standard deviation (floored), the same for any cell order."""
    x = canonical_cells(x, None, 0)
    return x.mean(axis=0), np.maximum(x.std(axis=0), floor)


def flat_markers(x: NDArray[np.float64], reference: Reference) -> NDArray[np.bool_]:
    """The markers on which sample ``x``'s cells all read one value (a detector at its
    bound, a file of one cell repeated): their range is at most :data:`SD_FLOOR`
    training standard deviations. The range, not the standard deviation: it is the
    same to the bit in any order of the cells."""
    return np.ptp(x, axis=0) <= SD_FLOOR * reference.sd


def tied_markers(x: NDArray[np.float64], flat: NDArray[np.bool_]) -> NDArray[np.bool_]:
    """The markers of sample ``x`` (of at least three cells; two always lie on a
    line) that are an affine copy of another marker, apart from the ``flat`` ones:
    their cells' correlation is within :data:`TIE` of ±1, on the first
    :data:`TIE_CELLS` cells."""
    tied = np.zeros(x.shape[1], dtype=bool)
    spread = np.flatnonzero(~flat)
    if x.shape[0] < 3 or spread.size < 2:
        return tied
    z = x[:TIE_CELLS, spread]
    z = z - z.mean(axis=0)
    z /= np.maximum(np.linalg.norm(z, axis=0), np.finfo(np.float64).tiny)
    near = np.abs(z.T @ z) >= 1.0 - TIE
    np.fill_diagonal(near, False)
    tied[spread] = near.any(axis=1)
    return tied


def wild_markers(x: NDArray[np.float64], reference: Reference) -> NDArray[np.bool_]:
    """The markers on which a cell of sample ``x`` lies more than :data:`WILD`
    training standard deviations from the training mean. Three such cells (at 1e30)
    among 600 inflated a standardised sample's moments until its other cells, all
    near zero, were labelled 0.46 right (0.98 without them), in range; a linear
    regressor answered them 5e27."""
    # From the column extremes: no cells-sized temporary on every prediction.
    reach = WILD * reference.sd
    return (x.max(axis=0) - reference.mean > reach) | (reference.mean - x.min(axis=0) > reach)


def suspect_markers(x: NDArray[np.float64], reference: Reference) -> NDArray[np.bool_]:
    """The markers of sample ``x`` not measured as the training batch measures them:
    without a measurement of their own (:func:`flat_markers`, :func:`tied_markers`),
    or with a cell beyond anything an instrument's shift explains
    (:func:`wild_markers`)."""
    flat = flat_markers(x, reference)
    return flat | tied_markers(x, flat) | wild_markers(x, reference)


def fit_reference(
    tasks: list[NDArray[np.float64]],
    codes: NDArray[np.int64] | None,
    control: NDArray[np.float64] | None,
    gain_limit: float | None = None,
    refusal: float | None = None,
) -> Reference:
    """The :class:`Reference` of the training samples ``tasks`` (cells x markers each),
    their cells' class ``codes`` (concatenated; None for a regressor), the training
    batch's reference ``control``, the landmark gain a sample may show and still be
    left as measured (None: every sample mapped), and the landmark map's refusal
    share (None: never refused)."""
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
    return Reference(mean, sd, cq, cs, mixture, gain_limit, refusal if mixture else None)
