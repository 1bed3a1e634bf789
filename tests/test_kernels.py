"""Kernels on distances: conventions, parameter checks, positive definiteness per representation."""

from __future__ import annotations

import numpy as np
import pytest
from bagserve.core import MeanEmbedding, SlicedWasserstein, get_kernel
from bagserve.core.kernels import DISTANCE_KERNELS, cityblock_distances, squared_euclidean_distances

from .conftest import random_bags

D = np.array([0.0, 0.5, 1.0, 2.0])
SQ = D**2


@pytest.mark.parametrize(
    ("name", "params", "gamma", "expected"),
    [
        ("gaussian", {}, 0.7, np.exp(-0.7 * D**2)),
        ("laplace", {}, 0.7, np.exp(-0.7 * D)),
        ("exponential", {}, 0.7, np.exp(-0.7 * D)),
        ("power_exponential", {"beta": 0.3}, 0.7, np.exp(-0.7 * D**0.6)),
        ("cauchy", {}, 0.7, 1 / (1 + 0.7 * D**2)),
        ("student", {"theta": 1.5}, 0.7, 1 / (1 + 0.7 * D**1.5)),
        ("imq", {}, 0.7, 1 / np.sqrt(1 + 0.7 * D**2)),
        ("matern32", {}, 0.7, (1 + np.sqrt(3) * 0.7 * D) * np.exp(-np.sqrt(3) * 0.7 * D)),
        (
            "matern52",
            {},
            0.7,
            (1 + np.sqrt(5) * 0.7 * D + 5 * (0.7 * D) ** 2 / 3) * np.exp(-np.sqrt(5) * 0.7 * D),
        ),
        ("rational_quadratic", {"alpha": 2.0}, 0.7, (1 + 0.7 * D**2 / 2.0) ** -2.0),
    ],
)
def test_radial_kernel_conventions(name, params, gamma, expected):
    k = get_kernel(name, params)
    np.testing.assert_allclose(k(SQ, gamma), expected, rtol=1e-14)
    assert k(np.zeros(1), gamma)[0] == 1.0


def test_paper_003_parametrisations():
    theta = 1.3
    # K_e = exp(-D/(2θ²)), K_C = 1/(1 + D²/θ²), K_t = 1/(1 + D^θ), K_r = 1 - D²/(D² + θ).
    np.testing.assert_allclose(
        get_kernel("laplace")(SQ, 1 / (2 * theta**2)), np.exp(-D / (2 * theta**2))
    )
    np.testing.assert_allclose(get_kernel("cauchy")(SQ, 1 / theta**2), 1 / (1 + D**2 / theta**2))
    np.testing.assert_allclose(get_kernel("student", {"theta": theta})(SQ, 1.0), 1 / (1 + D**theta))
    np.testing.assert_allclose(
        get_kernel("rational_quadratic")(SQ, 1 / theta), 1 - D**2 / (D**2 + theta)
    )
    np.testing.assert_allclose(
        get_kernel("imq")(SQ, 1 / theta**2) / theta, 1 / np.sqrt(D**2 + theta**2)
    )


def test_inner_product_kernels():
    G = np.array([[2.0, 0.5], [0.5, 1.0]])
    np.testing.assert_allclose(get_kernel("linear")(G, None), G)
    np.testing.assert_allclose(
        get_kernel("polynomial", {"degree": 3, "coef0": 0.5})(G, 0.2), (0.2 * G + 0.5) ** 3
    )
    assert get_kernel("polynomial").uses_inner_product
    assert not get_kernel("gaussian").uses_inner_product


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("student", {"theta": 2.5}, "theta <= 2"),
        ("power_exponential", {"beta": 1.5}, "beta <= 1"),
        ("polynomial", {"degree": 1.5}, "positive integer"),
        ("polynomial", {"coef0": -1.0}, "coef0"),
        ("gaussian", {"theta": 1.0}, "unknown parameter"),
        ("sigmoid", {}, "unknown kernel"),
    ],
)
def test_invalid_kernels_are_rejected(name, params, message):
    with pytest.raises(ValueError, match=message):
        get_kernel(name, params)


def test_gamma_must_be_positive():
    with pytest.raises(ValueError, match="gamma > 0"):
        get_kernel("gaussian")(SQ, 0.0)


def test_pairwise_distance_helpers(rng):
    A, B = rng.normal(size=(7, 4)), rng.normal(size=(5, 4))
    naive = ((A[:, None] - B[None]) ** 2).sum(-1)
    np.testing.assert_allclose(squared_euclidean_distances(A, B), naive, rtol=1e-12)
    S = squared_euclidean_distances(A)
    assert np.all(np.diag(S) == 0) and np.all(S == S.T)
    np.testing.assert_allclose(cityblock_distances(A, B), np.abs(A[:, None] - B[None]).sum(-1))


REPRESENTATIONS = {
    "sw2": lambda: SlicedWasserstein(p=2, n_directions=20, n_levels=20, random_state=0),
    "sw1": lambda: SlicedWasserstein(p=1, n_directions=20, n_levels=20, random_state=0),
    "mmd-exact": lambda: MeanEmbedding(),
    "mmd-exact-laplace": lambda: MeanEmbedding(kernel="laplace"),
    "mmd-rff": lambda: MeanEmbedding(method="rff", n_components=200, random_state=0),
    "mmd-nystroem": lambda: MeanEmbedding(method="nystroem", n_components=50, random_state=0),
}
KERNELS = [
    ("gaussian", {}),
    ("laplace", {}),
    ("power_exponential", {"beta": 0.5}),
    ("cauchy", {}),
    ("student", {"theta": 2.0}),
    ("student", {"theta": 0.7}),
    ("imq", {}),
    ("matern32", {}),
    ("matern52", {}),
    ("rational_quadratic", {"alpha": 0.5}),
    ("linear", {}),
    ("polynomial", {"degree": 3}),
]


def test_every_kernel_is_listed():
    assert {name for name, _ in KERNELS} == set(DISTANCE_KERNELS)


@pytest.mark.parametrize("rep_name", sorted(REPRESENTATIONS))
@pytest.mark.parametrize(("name", "params"), KERNELS)
def test_gram_is_positive_semidefinite(rng, rep_name, name, params):
    # Bags that are close to each other make near-singular Grams: a demanding case.
    bags = random_bags(rng, n_bags=25, sizes=(5, 30))
    emb = REPRESENTATIONS[rep_name]().fit(bags).embed(bags)
    k = get_kernel(name, params)
    base = emb.inner() if k.uses_inner_product else emb.sq_distances()
    for gamma in [None] if name == "linear" else [0.01, 0.3, 10.0]:
        scale = gamma if gamma is None else gamma / np.median(base[base > 0])
        K = k(base, scale)
        np.testing.assert_allclose(K, K.T, atol=1e-12)
        assert np.linalg.eigvalsh(K).min() >= -1e-10 * np.trace(K)
        if not k.uses_inner_product:
            np.testing.assert_allclose(np.diag(K), 1.0)


def test_gaussian_on_sw1_has_no_square(rng):
    # "gaussian" is exp(-γ SW_1), the positive-definite choice (paper 000 §2.4).
    bags = random_bags(rng, n_bags=3)
    sw = SlicedWasserstein(p=1, random_state=0).fit(bags)
    F = sw.transform(bags)
    sw1 = np.abs(F[0] - F[1]).sum()
    D2 = sw.embed(bags).sq_distances()
    assert D2[0, 1] == pytest.approx(sw1)
    assert get_kernel("gaussian")(D2, 0.5)[0, 1] == pytest.approx(np.exp(-0.5 * sw1))
