"""Per-cell explanations (core.explain): exact sums against naive double sums, and the
first-order influence against removing the cells it ranks first."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from bagserve.core import (
    Bags,
    ConditionalMeanEmbedding,
    DensityFeatures,
    DistributionRidge,
    DistributionRidgeClassifier,
    MeanEmbedding,
    SlicedWasserstein,
)
from bagserve.core.explanations import cells as cells_module
from bagserve.core.explanations import explain

N_CELLS = 400


def planted(seed: int, n_bags: int = 24, n: int = N_CELLS, d: int = 3):
    """Bags whose target is the share (0-10 %) of a population shifted by +3 on every
    marker, among standard normal background cells; also which cells were planted."""
    rng = np.random.default_rng(seed)
    bags, y, marks = [], [], []
    for _ in range(n_bags):
        share = rng.uniform(0.0, 0.1)
        m = round(share * n)
        cells = rng.normal(size=(n, d))
        cells[:m] += 3.0
        bags.append(cells)
        y.append(m / n)
        mark = np.zeros(n, dtype=bool)
        mark[:m] = True
        marks.append(mark)
    return bags, np.array(y), marks


@pytest.fixture(scope="module")
def data():
    return planted(7)


def fit(rep, kernel, data, cls=DistributionRidge, **kw):
    bags, y, _ = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grid-edge warnings on toy data
        return cls(representation=rep, kernel=kernel, random_state=0, **kw).fit(bags, y)


def gaussian_point_kernel(A, B, sigma):
    sq = ((A[:, None, :] - B[None, :, :]) ** 2).sum(axis=2)
    return np.exp(-sq / (2.0 * sigma**2))


def rff(X, W):
    proj = X @ W.T
    return np.hstack([np.cos(proj), np.sin(proj)]) / math.sqrt(W.shape[0])


# ------------------------------------------------------------------ exact additivity
def naive_dual_linear(model, bag, point_map):
    """``c_x = w_x Σ_i a_i ⟨φ(x), μ_i⟩``, ``μ_i = mean_y φ(y)`` over training bag ``i``,
    as a double sum over training bags and their cells (``point_map(X, Y)`` gives
    ``⟨φ(x), φ(y)⟩`` for all pairs)."""
    train = model.train_bags_
    a = model.dual_coef_[:, 0]
    n = bag.shape[0]
    c = np.zeros(n)
    for i, cells in enumerate(train):
        c += a[i] * point_map(bag, cells).mean(axis=1)
    return c / n


@pytest.mark.parametrize("method", ["rff", "nystroem", "exact"])
def test_mean_embedding_linear_kernel_is_an_exact_sum_of_cells(data, method):
    bags, _, _ = data
    rep = MeanEmbedding(method=method, bandwidth=1.0, random_state=0)
    model = fit(rep, "linear", data)
    assert not model.primal_
    model.train_bags_ = bags  # the oracle's own copy of what the model was fitted on
    bag = bags[0]
    e = explain(model, bag)
    fitted = model.representation_
    if method == "rff":

        def point_map(X, Y):
            return rff(X, fitted.frequencies_) @ rff(Y, fitted.frequencies_).T
    elif method == "nystroem":

        def point_map(X, Y):
            fx = gaussian_point_kernel(X, fitted.landmarks_, 1.0) @ fitted.normalization_
            fy = gaussian_point_kernel(Y, fitted.landmarks_, 1.0) @ fitted.normalization_
            return fx @ fy.T
    else:

        def point_map(X, Y):
            return gaussian_point_kernel(X, Y, 1.0)

    expected = naive_dual_linear(model, bag, point_map)
    assert e.method == "exact"
    np.testing.assert_allclose(e.contributions[:, 0], expected, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(e.baseline, model.intercept_, rtol=0, atol=0)
    prediction = model.predict([bag])[0]
    assert e.prediction[0] == prediction
    assert abs(e.baseline[0] + e.contributions.sum() - prediction) < 1e-12


def test_primal_linear_ridge_and_l2_density_are_exact(data):
    bags, _, _ = data
    # Density features with the L2 divergence are sample means of a cosine basis.
    rep = DensityFeatures(divergence="l2", n_basis=2, random_state=0)
    model = fit(rep, "linear", data)
    assert model.primal_  # 8 features for 24 bags: solved in feature space
    bag = bags[1]
    e = explain(model, bag)
    fitted = model.representation_
    u = np.clip((bag - fitted.low_) / fitted.span_, 0.0, 1.0)
    k = np.arange(2)
    one_d = np.where(k == 0, 1.0, math.sqrt(2.0)) * np.cos(np.pi * u[:, :, None] * k)
    basis = np.einsum("na,nb,nc->nabc", one_d[:, 0], one_d[:, 1], one_d[:, 2]).reshape(len(bag), -1)
    expected = basis @ model.coef_[:, 0] / len(bag)
    assert e.method == "exact"
    np.testing.assert_allclose(e.contributions[:, 0], expected, rtol=1e-9, atol=1e-13)
    assert abs(e.baseline[0] + e.total[0] - model.predict([bag])[0]) < 1e-12


def test_classifier_scores_are_explained_per_class(data):
    bags, y, _ = data
    labels = np.where(y > 0.05, "high", "low")
    rep = MeanEmbedding(method="rff", bandwidth=1.0, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = DistributionRidgeClassifier(representation=rep, kernel="linear", random_state=0)
        model.fit(bags, labels)
    e = explain(model, bags[2])
    assert e.outputs == ["high", "low"]
    scores = model._decision([bags[2]])[0]
    np.testing.assert_allclose(e.baseline + e.total, scores, rtol=0, atol=1e-12)
    assert e.contributions.shape == (len(bags[2]), 2)


def test_weighted_cells_contribute_by_their_weight(data):
    bags, _, _ = data
    model = fit(MeanEmbedding(method="rff", bandwidth=1.0, random_state=0), "linear", data)
    bag = bags[3]
    w = np.random.default_rng(1).uniform(0.1, 1.0, len(bag))
    e = explain(model, Bags.from_arrays([bag], weights=[w]))
    fitted = model.representation_
    z = rff(bag, fitted.frequencies_)
    g = sum(
        a * rff(c, fitted.frequencies_).mean(axis=0)
        for a, c in zip(model.dual_coef_[:, 0], bags, strict=True)
    )
    np.testing.assert_allclose(e.contributions[:, 0], (w / w.sum()) * (z @ g), rtol=1e-9)
    prediction = model.predict(Bags.from_arrays([bag], weights=[w]))[0]
    assert abs(e.baseline[0] + e.total[0] - prediction) < 1e-12


# ---------------------------------------------------------------------- influence
# Removing the k = 1 % cells of largest contribution moves the prediction by about
# -(n/(n-k)) Σ c_x over them (first order in k/n). Tolerances: the mean embeddings are
# linear in the measure, so only the kernel's curvature over a 1 % move is left (10 %);
# quantiles and density estimates are not smooth functionals of a sample (the quantile
# density and the KDE are themselves estimated, and the planted cells sit where
# they change fastest): a factor of 2, with the sign always right.
INFLUENCE_CASES = [
    (SlicedWasserstein(random_state=0), 2.0),
    (SlicedWasserstein(p=1, random_state=0), 2.0),
    (SlicedWasserstein(paired=True, n_directions=200, random_state=0), 2.0),
    (MeanEmbedding(method="exact", bandwidth=1.0), 1.1),
    (MeanEmbedding(method="rff", bandwidth=1.0, random_state=0), 1.1),
    (MeanEmbedding(method="nystroem", bandwidth=1.0, random_state=0), 1.1),
    (DensityFeatures(divergence="hellinger", n_basis=5, random_state=0), 2.0),
    (DensityFeatures(divergence="js", n_basis=5, random_state=0), 2.0),
    (DensityFeatures(divergence="tv", n_basis=5, random_state=0), 2.0),
]


@pytest.mark.parametrize(("rep", "factor"), INFLUENCE_CASES, ids=lambda v: repr(v)[:40])
def test_removing_the_top_cells_moves_the_prediction_by_their_influence(data, rep, factor):
    bags, _, marks = data
    model = fit(rep, "gaussian", data)
    for b in (4, 5):
        bag = bags[b]
        e = explain(model, bag)
        assert e.method == "influence"
        p = model.predict([bag])[0]
        assert e.prediction[0] == p
        # Influences sum to zero (exactly for the mean embeddings, up to one cell's
        # weight per quantile level for the sliced embedding).
        assert abs(e.total[0]) <= 0.02 * np.abs(e.contributions).sum()
        c = e.contributions[:, 0]
        n, k = len(bag), len(bag) // 100
        for sign in (1, -1):
            top = np.argsort(-sign * c)[:k]
            predicted = -(n / (n - k)) * c[top].sum()
            moved = model.predict([np.delete(bag, top, axis=0)])[0] - p
            assert np.sign(moved) == np.sign(predicted) == -sign
            assert predicted / factor <= moved * 1.0 <= predicted * factor or (
                predicted * factor <= moved <= predicted / factor
            ), (moved, predicted)
        if marks[b].sum() >= 10:  # the planted cells are the ones found
            from sklearn.metrics import roc_auc_score

            assert roc_auc_score(marks[b], c) > 0.95


def test_explaining_a_large_bag_in_chunks_changes_nothing(data, monkeypatch):
    bags, _, _ = data
    for rep in (
        MeanEmbedding(method="rff", bandwidth=1.0, random_state=0),
        MeanEmbedding(method="exact", bandwidth=1.0),
    ):
        model = fit(rep, "gaussian", data)
        whole = explain(model, bags[6]).contributions
        monkeypatch.setattr(cells_module, "_BLOCK", 64)
        chunked = explain(model, bags[6]).contributions
        monkeypatch.undo()
        np.testing.assert_allclose(chunked, whole, rtol=1e-10, atol=1e-15)


def test_cells_are_placed_among_the_quantiles_exactly():
    """The step function read from the binned table counts the quantiles below each
    cell as np.searchsorted does, ties and cells beyond the quantiles included, on
    grids coarse enough to put many cells in the bins that hold a quantile."""
    rng = np.random.default_rng(3)
    cases = []
    for n, L in ((5000, 100), (300, 7), (1000, 1)):
        u = np.round(rng.standard_t(2, n), 2)  # heavy tails and many ties
        q = np.sort(rng.choice(u, L))  # quantiles are cell values
        cases.append((u, q))
    u = rng.normal(size=400)
    cases.append((u, np.full(5, u[0])))  # one value repeated
    cases.append((u * 1e-300, np.sort(rng.choice(u * 1e-300, 30))))  # spans underflow
    cases.append((u + 1e12, np.sort(rng.choice(u + 1e12, 30))))  # far from zero
    far = u.copy()
    far[:3] = (1e300, -1e300, 1e20)  # cells past any index the grid's map can give
    cases.append((far, np.sort(rng.choice(u[3:], 30))))
    tiny = np.array([0.0, 5e-324, 1e-323, 2e-323, -5e-324])  # a subnormal spread
    cases.append((tiny, np.sort(tiny[[0, 1, 2]])))
    for bins in (2, 64, 1 << 14):
        for u, q in cases:
            # A step per quantile: the value of a cell counts the quantiles below it.
            levels = np.arange(q.size + 1, dtype=np.float64)[:, None]
            expected = np.searchsorted(q, u, side="left")
            for span in (None, (u.min(), u.max())):  # clipped first, or not
                out = np.empty((1, u.size))
                scratch = (np.empty(u.size), np.empty(u.size, dtype=np.intp))
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(cells_module, "_BINS", bins)
                    cells_module._step_lookup(u, q, levels, out, scratch, span)
                np.testing.assert_array_equal(out[0], expected)


def test_conditional_mean_embedding_is_explained(data):
    bags, y, _ = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin = ConditionalMeanEmbedding(
            representation=MeanEmbedding(method="rff", bandwidth=1.0, random_state=0),
            kernel="linear",
            alpha=1e-3,
        ).fit(bags, y)
        gau = ConditionalMeanEmbedding(
            representation=SlicedWasserstein(random_state=0), alpha=1e-3
        ).fit(bags, y)
    e = lin.explain(bags[0])
    assert e.method == "exact"
    assert abs(e.baseline[0] + e.total[0] - lin.predict(bags[:1])[0]) < 1e-12
    np.testing.assert_array_equal(e.baseline, [0.0])
    g = gau.explain(bags[4])
    assert g.method == "influence"
    # E[Y|P] = (k_P (K + λn)⁻¹) y, here k_P ((K + λn)⁻¹ y): the same to rounding.
    np.testing.assert_allclose(g.prediction[0], gau.predict(bags[4:5])[0], rtol=1e-12)
    top = np.argsort(-g.contributions[:, 0])[:4]
    moved = gau.predict([np.delete(bags[4], top, axis=0)])[0] - g.prediction[0]
    assert moved < 0


def test_summaries(data):
    bags, _, marks = data
    model = fit(MeanEmbedding(method="rff", bandwidth=1.0, random_state=0), "linear", data)
    bag = bags[5]
    e = model.explain(bag, markers=["CD3", "CD19", "CD45"])
    pops = e.by_population(np.where(marks[5], "planted", "background"))
    assert sum(p.n_cells for p in pops) == len(bag)
    np.testing.assert_allclose(sum(p.contribution for p in pops), e.total, rtol=1e-12)
    share = {p.label: p for p in pops}
    assert share["planted"].contribution[0] > 0
    # The planted cells are high on every marker: each marker's position matters upwards.
    assert all(m.effect[0] > 0 for m in e.by_marker())
    top = e.top_cells(5, sign=1)
    assert [t.contribution for t in top] == sorted((t.contribution for t in top), reverse=True)
    assert all(marks[5][t.index] for t in top)
    np.testing.assert_array_equal(top[0].values, bag[top[0].index])
    summary = e.to_dict(top=3, labels=np.where(marks[5], "planted", "background"))
    assert summary["method"] == "exact" and len(summary["top_cells"]) == 3
    assert set(summary["top_cells"][0]["values"]) == {"CD3", "CD19", "CD45"}


def test_bad_inputs_are_named():
    rng = np.random.default_rng(0)
    bags = [rng.normal(size=(30, 2)) for _ in range(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = DistributionRidge(representation=SlicedWasserstein(random_state=0)).fit(
            bags, np.arange(6.0)
        )
    with pytest.raises(ValueError, match="marker"):
        explain(model, rng.normal(size=(30, 3)))
    with pytest.raises(ValueError, match="one bag"):
        explain(model, Bags.from_arrays(bags[:2]))


def test_the_public_name_is_the_function():
    import bagserve.core as core
    import bagserve.core.explanations  # noqa: F401  (the package must not shadow it)

    assert core.explain is explain


def test_training_regions_show_where_the_model_looks(data):
    from bagserve.core.training.regions import BINS, held_out_regions

    bags, y, _ = data
    folds = [(np.setdiff1d(np.arange(24), v), v) for v in np.array_split(np.arange(24), 4)]
    final = fit(MeanEmbedding(method="rff", bandwidth=1.0, random_state=0), "gaussian", data)
    regions = held_out_regions(
        final,
        Bags.from_arrays(bags),
        y,
        folds,
        {"transform": "none", "scale": "none"},
        ["A", "B", "C"],
    )
    assert regions["n_samples"] == 24 and regions["regions"] == list(BINS)
    table = np.array(regions["mean_contribution"])  # marker x region x output
    # The planted cells (+3 on every marker) are in each marker's highest fifth: it
    # carries the model, upwards, more than any other region.
    assert np.all(np.argmax(table[:, :, 0], axis=1) == len(BINS) - 1)
    assert np.all(table[:, -1, 0] > 0)


def test_a_per_cell_models_regions_are_its_cells_shares_by_region():
    """Per-cell models: each held-out cell carries 1/n of its label's share (the
    assignment part of their explanation). Cells of class "b" are exactly a fifth of
    every sample and sit above a gap in marker A, so A's highest fifth holds all of
    "b"'s share and nothing else of it; summed over the regions of any marker, the
    table gives each class's mean share over the samples, as counted here."""
    from bagserve.core.training.regions import BINS, held_out_cell_regions

    rng = np.random.default_rng(3)
    arrays, labels = [], []
    for t in range(8):
        n = 100 + 25 * t
        high = n // 5
        # Values from one set, so that no held-out cell falls in a bin with no
        # training cell (such a bin goes to the region above it).
        a = rng.choice(np.linspace(-3.0, 0.0, 31), n)
        a[:high] = rng.choice(np.linspace(5.0, 6.0, 11), high)
        arrays.append(np.column_stack([a, rng.normal(size=n)]))
        labels.append(np.where(a > 2.5, "b", "a"))
    raw = Bags.from_arrays(arrays)
    folds = [(np.setdiff1d(np.arange(8), v), v) for v in np.array_split(np.arange(8), 4)]
    spec = {"transform": "none", "scale": "standard"}
    given = np.concatenate(labels)
    regions = held_out_cell_regions(raw, given, ["a", "b"], folds, spec, ["A", "B"])
    assert regions["method"] == "assignment" and regions["regions"] == list(BINS)
    assert regions["outputs"] == ["a", "b"] and regions["n_samples"] == 8
    table = np.array(regions["mean_contribution"])  # marker x region x class
    shares = np.array([[np.mean(lab == c) for c in ("a", "b")] for lab in labels])
    np.testing.assert_allclose(table.sum(axis=1), np.tile(shares.mean(axis=0), (2, 1)))
    np.testing.assert_allclose(table[0, -1, 1], shares[:, 1].mean(), rtol=1e-12)
    assert np.all(table[0, :-1, 1] == 0) and table[0, -1, 0] == 0
    # A regressor: each cell carries value / n of its sample's mean value.
    values = np.concatenate([x[:, 1] for x in arrays])
    mean = np.mean([x[:, 1].mean() for x in arrays])
    reg = held_out_cell_regions(raw, values, None, folds, spec, ["A", "B"])
    assert reg["outputs"] == ["prediction"]
    np.testing.assert_allclose(np.array(reg["mean_contribution"]).sum(axis=1)[:, 0], mean)


# ------------------------------------------------------------------------------- cost
def _rows_through_point_features(monkeypatch):
    """Counts the cells that go through a mean embedding's point feature map."""
    seen = {"rows": 0}
    original = MeanEmbedding._point_features

    def counting(self, pts):
        seen["rows"] += pts.shape[0]
        return original(self, pts)

    monkeypatch.setattr(MeanEmbedding, "_point_features", counting)
    return seen


@pytest.mark.parametrize("kernel", ["linear", "gaussian"])
@pytest.mark.parametrize("method", ["rff", "nystroem"])
def test_mean_embedding_explanations_form_each_cells_features_once(
    data, monkeypatch, kernel, method
):
    """The point features are the cost of a prediction: an explanation forms them once
    per cell (the linear head's values in the embedding's own pass; otherwise the
    second pass evaluates ⟨φ(x), ∇f⟩ without forming φ(x))."""
    bags, _, _ = data
    model = fit(MeanEmbedding(method=method, bandwidth=1.0, random_state=0), kernel, data)
    bag = bags[6]
    seen = _rows_through_point_features(monkeypatch)
    explain(model, bag)
    assert seen["rows"] == len(bag)


def test_feature_inner_is_the_features_times_the_vector(data):
    bags, _, _ = data
    rng = np.random.default_rng(5)
    cells = rng.normal(size=(300, 3)) * 2.0
    for method in ("rff", "nystroem"):
        rep = MeanEmbedding(method=method, bandwidth=0.7, n_components=64, random_state=0)
        rep.fit(bags)
        Z = rep._point_features(cells)
        for k in (1, 3):  # one column takes the amplitude-phase form
            g = rng.normal(size=(Z.shape[1], k))
            np.testing.assert_allclose(rep.feature_inner(cells, g), Z @ g, rtol=1e-9, atol=1e-12)


def test_cheap_density_evaluations_match_their_definitions():
    from bagserve.core.representations.grids import (
        binned_kde,
        cosine_basis,
        cosine_basis_inner,
        smoothed_at,
    )

    rng = np.random.default_rng(6)
    for k in (1, 2, 3):
        u = rng.uniform(size=(200, k))
        g = rng.normal(size=(6**k, 2))
        np.testing.assert_allclose(
            cosine_basis_inner(u, 6, g), cosine_basis(u, 6) @ g, rtol=1e-9, atol=1e-12
        )
        # A signed measure on a few points, smoothed and read at many (beyond 2^14:
        # several chunks), as the binned KDE reads it.
        pts = rng.uniform(size=(50, k))
        weights = rng.normal(size=50)
        at = rng.uniform(size=(20_000, k))
        np.testing.assert_allclose(
            smoothed_at(pts, weights, at, 0.1, 17),
            binned_kde(pts, weights, np.array([0, 50]), at, 0.1, 17)[0],
            rtol=1e-10,
            atol=1e-12,
        )


def test_set_kernel_point_sums_are_each_bags_mean_embedding_at_each_point():
    """By-products of the blocked Gram, mirrored blocks and threads included, against
    the mean of the point kernel over each bag."""
    from bagserve.core.representations.mean import set_kernel_gram

    rng = np.random.default_rng(8)
    A = Bags.from_arrays([rng.normal(size=(n, 2)) for n in (37, 90)])
    B = Bags.from_arrays([rng.normal(size=(n, 2)) + 1.0 for n in (20, 55, 8)])
    w = [rng.uniform(0.5, 1.0, n) for n in (37, 90)]
    weighted = Bags.from_arrays([A[0], A[1]], weights=w)
    for left, right in ((A, B), (A, None), (weighted, None)):
        other = left if right is None else right
        sums = np.zeros((left.n_points, len(other)))
        set_kernel_gram(left, right, "gaussian", 0.8, block_entries=64, n_jobs=2, point_sums=sums)
        ow = other.point_weights()
        K = gaussian_point_kernel(left.points, other.points, 0.8) * ow[None, :]
        expected = np.add.reduceat(K, other.offsets[:-1], axis=1)
        np.testing.assert_allclose(sums, expected, rtol=1e-12, atol=1e-15)
        # The first bags alone, where all would not fit: their columns, the Gram as is
        # (one thread: two threads add their parts in either order).
        first = np.zeros((left.n_points, 1))
        G = set_kernel_gram(left, right, "gaussian", 0.8, block_entries=64, point_sums=first)
        np.testing.assert_allclose(first, expected[:, :1], rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(
            G, set_kernel_gram(left, right, "gaussian", 0.8, block_entries=64)
        )


@pytest.mark.parametrize("kernel", ["linear", "gaussian"])
def test_exact_mean_embedding_explanation_reads_the_prediction_sums(data, monkeypatch, kernel):
    """Within the budget the cells' values are the prediction's own set-kernel sums (no
    second pass over the cells); beyond it, the second pass gives the same values."""
    bags, _, _ = data
    model = fit(MeanEmbedding(method="exact", bandwidth=1.0), kernel, data)
    bag = Bags.from_arrays([bags[6]], weights=[np.linspace(0.5, 1.0, len(bags[6]))])
    calls = {"n": 0}
    original = cells_module.point_kernel

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(cells_module, "point_kernel", counting)
    one_pass = explain(model, bag)
    assert calls["n"] == 0
    monkeypatch.setattr(cells_module, "_POINT_SUMS_BYTES", 0)
    two_pass = explain(model, bag)
    assert calls["n"] > 0
    np.testing.assert_allclose(
        one_pass.contributions, two_pass.contributions, rtol=1e-9, atol=1e-15
    )
    # A budget of three training bags: the second pass reads only the others' points.
    read = []
    monkeypatch.setattr(
        cells_module,
        "point_kernel",
        lambda X, Y, *a, **k: read.append(Y.shape[0]) or original(X, Y, *a, **k),
    )
    monkeypatch.setattr(cells_module, "_POINT_SUMS_BYTES", 8 * bag.n_points * 3)
    partial = explain(model, bag)
    beyond = model.train_embedding_.bags
    assert set(read) == {beyond.n_points - int(beyond.offsets[3])}
    np.testing.assert_allclose(one_pass.contributions, partial.contributions, rtol=1e-9, atol=1e-15)
    assert one_pass.prediction[0] == model.predict(bag)[0]
