"""``emulate_batches``: new samples in instrument batches emulated from labelled ones."""

from __future__ import annotations

import numpy as np
from bagserve.core import Bags
from bagserve.core.datasets import emulate_batches, load_flowcap_gvhd
from sklearn.mixture import GaussianMixture

from .conftest import SHARED_DATA


def _sources(n_sources: int = 4, n: int = 1500, seed: int = 0) -> tuple[Bags, np.ndarray]:
    """Sources with two Gaussian populations (labels 1, 2) and a rest class (label 0)
    that is a mixture of two far-apart clusters; source 3 has no population 2."""
    rng = np.random.default_rng(seed)
    arrays, labels = [], []
    for s in range(n_sources):
        y = rng.choice(3, size=n, p=[0.3, 0.4, 0.3] if s != 3 else [0.4, 0.6, 0.0])
        x = np.empty((n, 3))
        x[y == 1] = rng.normal([2.0, 0.0, 1.0], 0.3, size=(int(np.sum(y == 1)), 3))
        x[y == 2] = rng.normal([0.0, 2.0, 1.0], 0.3, size=(int(np.sum(y == 2)), 3))
        rest = np.flatnonzero(y == 0)
        far = rng.random(rest.size) < 0.5
        x[rest] = rng.normal(0.0, 0.3, size=(rest.size, 3)) + np.where(far, 4.0, -2.0)[:, None]
        arrays.append(x)
        labels.append(y)
    return Bags.from_arrays(arrays), np.concatenate(labels)


def _two_component_gain(x: np.ndarray) -> float:
    """Mean log-likelihood per cell gained by 2 Gaussian components over 1 (about 0 for
    a Gaussian cloud; large for a multimodal one)."""
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    one = GaussianMixture(1, random_state=0).fit(x).score(x)
    return float(GaussianMixture(2, random_state=0, n_init=2).fit(x).score(x) - one)


def _task(tasks: Bags, y: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(tasks[t]), y[tasks.offsets[t] : tasks.offsets[t + 1]]


def test_shapes_labels_and_batches_of_disjoint_sources():
    sources, y = _sources()
    tasks, labels, batches, source = emulate_batches(sources, y, 2, 3, 500, random_state=0)
    assert len(tasks) == 6 and tasks.dim == 3 and set(tasks.sizes) == {500}
    assert labels.shape == (3000,)
    np.testing.assert_array_equal(batches, [0, 0, 0, 1, 1, 1])
    assert source.shape == (6,) and set(source) <= set(range(4))
    # No source (patient) in two batches; every source used.
    assert not set(source[batches == 0]) & set(source[batches == 1])
    assert set(source) == set(range(4))
    # Labels only from the source's own classes: source 3 has no population 2.
    assert set(np.unique(labels)) <= {0, 1, 2}
    for t in range(len(tasks)):
        own = set(np.unique(y[sources.offsets[source[t]] : sources.offsets[source[t] + 1]]))
        assert set(np.unique(_task(tasks, labels, t)[1])) <= own


def test_seeded_reproducibility():
    sources, y = _sources()
    first = emulate_batches(sources, y, 2, 2, 300, random_state=3)
    again = emulate_batches(sources, y, 2, 2, 300, random_state=3)
    other = emulate_batches(sources, y, 2, 2, 300, random_state=4)
    np.testing.assert_array_equal(first[0].points, again[0].points)
    for a, b in zip(first[1:], again[1:], strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(first[0].points, other[0].points)


def test_each_instrument_is_monotone_per_marker():
    """``strength=0`` makes every instrument the identity and draws the same random
    numbers: the two runs differ only by the instruments, so each marker's order of
    cells within a sample must be the same in both (the per-sample jitter after the
    instrument is one increasing affine map in both runs)."""
    sources, y = _sources()
    plain, y0, _, _ = emulate_batches(sources, y, 2, 2, 800, random_state=5, strength=0.0)
    moved, y1, _, _ = emulate_batches(sources, y, 2, 2, 800, random_state=5, strength=2.0)
    np.testing.assert_array_equal(y0, y1)
    bent = []
    for t in range(len(plain)):
        a, b = np.asarray(plain[t]), np.asarray(moved[t])
        for j in range(a.shape[1]):
            np.testing.assert_array_equal(np.argsort(a[:, j]), np.argsort(b[:, j]))
            # ... and the instrument is not one affine map per marker: within a
            # sample, what no straight line of the plain values explains.
            fit = np.polyval(np.polyfit(a[:, j], b[:, j], 1), a[:, j])
            bent.append(np.std(b[:, j] - fit) / np.std(b[:, j]))
    assert max(bent) > 0.05


def test_rest_class_stays_a_mixture():
    sources, y = _sources()
    tasks, labels, _, source = emulate_batches(sources, y, 2, 2, 3000, random_state=1)
    for t in range(len(tasks)):
        x, v = _task(tasks, labels, t)
        xs, vs = _task(sources, y, int(source[t]))
        src_gain = _two_component_gain(xs[vs == 0])
        assert src_gain > 0.5
        assert _two_component_gain(x[v == 0]) > 0.7 * src_gain
        # A Gaussian population stays close to one Gaussian after the instrument.
        assert _two_component_gain(x[v == 1]) < 0.3 * src_gain


def test_gvhd_ungated_cells_stay_heterogeneous():
    """On real samples: the ungated cells (label 0) keep most of the multimodality
    they have in their source."""
    sources, y, _ = load_flowcap_gvhd(SHARED_DATA / "flowcap1_gvhd", samples=[1, 2, 3, 4])
    tasks, labels, _, source = emulate_batches(sources, y, 2, 2, 2000, random_state=0)
    for t in range(len(tasks)):
        x, v = _task(tasks, labels, t)
        xs, vs = _task(sources, y, int(source[t]))
        src_gain = _two_component_gain(xs[vs == 0])
        assert src_gain > 0.5
        assert _two_component_gain(x[v == 0]) > 0.5 * src_gain


def test_a_control_per_batch_leaves_the_samples_as_they_were():
    sources, y = _sources()
    plain = emulate_batches(sources, y, 2, 3, 400, random_state=6)
    tasks, labels, batches, source = emulate_batches(
        sources, y, 2, 3, 400, random_state=6, control_cells=250
    )
    assert len(tasks) == 8 and list(tasks.sizes[-2:]) == [250, 250]
    np.testing.assert_array_equal(batches, [0, 0, 0, 1, 1, 1, 0, 1])
    np.testing.assert_array_equal(source, [*plain[3], -1, -1])
    n = plain[0].n_points
    np.testing.assert_array_equal(tasks.points[:n], plain[0].points)
    np.testing.assert_array_equal(labels[:n], plain[1])
    assert set(np.unique(labels[n:])) <= set(np.unique(y))


def test_each_control_goes_through_its_own_batchs_instrument():
    """With ``strength=0`` every instrument is the identity and the controls draw the
    same cells: each marker's order within a control is the same with the instruments
    on (monotone), and the two batches' controls, alike without instruments, differ
    with them by more than two aliquots of one batch would."""
    sources, y = _sources()
    plain = emulate_batches(sources, y, 2, 2, 300, random_state=7, strength=0.0, control_cells=800)
    moved = emulate_batches(sources, y, 2, 2, 300, random_state=7, strength=2.0, control_cells=800)
    for t in (4, 5):
        a, b = np.asarray(plain[0][t]), np.asarray(moved[0][t])
        for j in range(a.shape[1]):
            np.testing.assert_array_equal(np.argsort(a[:, j]), np.argsort(b[:, j]))
    gap_plain = np.abs(np.median(plain[0][4], 0) - np.median(plain[0][5], 0)).max()
    gap_moved = np.abs(np.median(moved[0][4], 0) - np.median(moved[0][5], 0)).max()
    assert gap_moved > 3 * gap_plain
