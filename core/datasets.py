"""Data generators from the papers (all seeded) and small bundled point clouds.

* :func:`make_gmm_modes` — count the modes of a Gaussian mixture (paper 000 §5.1,
  after Oliva et al. 2014), with :class:`GaussianMixtures` to redraw the points of
  fixed mixtures as the paper's repeats do;
* :func:`make_entropy_bags` — learn the entropy of the first marginal of rotated 2-D
  Gaussians (paper 003 supplement A.2.1; the paper's formula, not ITE's);
* :func:`load_digits_clouds` — scikit-learn's bundled 8×8 digits as weighted 2-D point
  clouds, optionally rotated and translated (paper 000 §5.2's MNIST recipe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._random import check_generator
from .bags import Bags

__all__ = [
    "GaussianMixtures",
    "load_digits_clouds",
    "make_entropy_bags",
    "make_gmm_modes",
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
