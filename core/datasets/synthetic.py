"""The papers' generators (seeded) and scikit-learn's digits as point clouds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._random import check_generator
from ..bags import Bags

__all__ = [
    "GaussianMixtures",
    "load_digits_clouds",
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
