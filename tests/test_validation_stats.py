"""The method-comparison statistics against independent implementations: scipy's ODR
(Deming), a naive Passing–Bablok, the Bland–Altman definitions, the score equation and
the binomial tails (Wilson and exact intervals), scikit-learn's kappa and confusion
matrix, and a direct analysis of variance (precision)."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
from bagserve.core.validation import (
    bland_altman,
    correlation,
    deming,
    kappa,
    passing_bablok,
    precision,
    proportion,
    qualitative_agreement,
)
from scipy import stats
from sklearn.metrics import cohen_kappa_score, confusion_matrix

with warnings.catch_warnings():
    # Deprecated in SciPy 1.17 (moving to the odrpack package), still the reference.
    warnings.simplefilter("ignore", DeprecationWarning)
    from scipy import odr


def _pairs(seed: int, n: int = 30, slope: float = 1.05, noise: float = 0.3):
    rng = np.random.default_rng(seed)
    truth = rng.uniform(1.0, 20.0, n)
    x = truth + rng.normal(0, noise, n)
    y = 0.4 + slope * truth + rng.normal(0, noise * 1.5, n)
    return x, y


@pytest.mark.parametrize("error_ratio", [0.25, 1.0, 4.0])
def test_deming_matches_orthogonal_distance_regression(error_ratio):
    x, y = _pairs(1)
    fit = deming(x, y, error_ratio=error_ratio)
    # ODR weights each axis by the inverse of its error variance: lambda = var(ey)/var(ex).
    data = odr.RealData(x, y, sx=1.0, sy=np.sqrt(error_ratio))
    out = odr.ODR(data, odr.unilinear, beta0=[1.0, 0.0], sstol=1e-14, partol=1e-14).run()
    slope, intercept = out.beta
    assert fit.slope == pytest.approx(slope, rel=1e-6)
    assert fit.intercept == pytest.approx(intercept, rel=1e-6, abs=1e-8)
    assert fit.error_ratio == error_ratio


def test_deming_error_ratio_changes_the_slope():
    # With error in y only (huge lambda) Deming tends to ordinary least squares of y on x;
    # with error in x only (tiny lambda) to the inverse regression.
    x, y = _pairs(2, noise=1.5)
    ols = np.polyfit(x, y, 1)[0]
    inverse = 1.0 / np.polyfit(y, x, 1)[0]
    assert deming(x, y, error_ratio=1e8).slope == pytest.approx(ols, rel=1e-5)
    assert deming(x, y, error_ratio=1e-8).slope == pytest.approx(inverse, rel=1e-5)


def test_deming_jackknife_interval_from_leave_one_out_refits():
    x, y = _pairs(3, n=12)
    fit = deming(x, y, error_ratio=2.0)
    n = x.size
    loo = [deming(np.delete(x, i), np.delete(y, i), error_ratio=2.0) for i in range(n)]
    t = stats.t.ppf(0.975, n - 1)
    for key in ("slope", "intercept"):
        theta = getattr(fit, key)
        pseudo = n * theta - (n - 1) * np.array([getattr(f, key) for f in loo])
        se = pseudo.std(ddof=1) / math.sqrt(n)
        expected = (theta - t * se, theta + t * se)
        assert getattr(fit, f"{key}_ci") == pytest.approx(expected, rel=1e-9)


def _naive_passing_bablok(x, y, confidence=0.95):
    """Passing & Bablok (1983) as written, pair by pair (vertical pairs +inf)."""
    slopes = []
    for i, j in itertools.combinations(range(len(x)), 2):
        dx, dy = x[j] - x[i], y[j] - y[i]
        if dx == 0 and dy == 0:
            continue
        s = math.inf if dx == 0 else dy / dx
        if s == -1:
            continue
        slopes.append(s)
    slopes.sort()
    big_n = len(slopes)
    k = sum(1 for s in slopes if s < -1)

    def at(m):  # 1-based, open beyond the ends
        return -math.inf if m < 1 else (math.inf if m > big_n else slopes[m - 1])

    half = big_n // 2
    b = at(half + 1 + k) if big_n % 2 else (at(half + k) + at(half + 1 + k)) / 2
    n = len(x)
    c = stats.norm.ppf(0.5 + confidence / 2) * math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    m1 = math.floor((big_n - c) / 2 + 0.5)
    m2 = big_n - m1 + 1
    lo, hi = at(m1 + k), at(m2 + k)
    a = float(np.median([yi - b * xi for xi, yi in zip(x, y, strict=True)]))
    ends = sorted(
        float(np.median([yi - s * xi for xi, yi in zip(x, y, strict=True)])) for s in (lo, hi)
    )
    return b, a, (lo, hi), tuple(ends)


@pytest.mark.parametrize("seed", range(6))
def test_passing_bablok_matches_naive_implementation(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(8, 25))
    # Integer results: ties, identical points and vertical pairs all occur.
    x = rng.integers(0, 12, n).astype(float)
    y = np.round(x * rng.uniform(0.5, 1.5) + rng.normal(0, 1.5, n))
    if seed == 5:
        y = -0.3 * y  # a negative relation: slopes below -1 shift the median
    b, a, slope_ci, intercept_ci = _naive_passing_bablok(list(x), list(y))
    if not math.isfinite(b):
        with pytest.raises(ValueError, match="positively related"):
            passing_bablok(x, y)
        return
    fit = passing_bablok(x, y)
    assert fit.slope == pytest.approx(b, rel=1e-12)
    assert fit.intercept == pytest.approx(a, rel=1e-12, abs=1e-12)
    assert fit.slope_ci == pytest.approx(slope_ci, rel=1e-12)
    assert fit.intercept_ci == pytest.approx(intercept_ci, rel=1e-12, abs=1e-12)


def test_passing_bablok_recovers_an_exact_line():
    x = np.linspace(1, 10, 9)
    fit = passing_bablok(x, 2.0 + 0.5 * x)
    assert (fit.slope, fit.intercept) == pytest.approx((0.5, 2.0))
    assert fit.slope_ci == pytest.approx((0.5, 0.5))


def test_bland_altman_by_its_definitions():
    x, y = _pairs(4, n=40)
    d = y - x
    n = d.size
    ba = bland_altman(x, y)
    bias, sd = d.mean(), d.std(ddof=1)
    t = stats.t.ppf(0.975, n - 1)
    assert ba.bias == pytest.approx(bias) and ba.sd == pytest.approx(sd)
    assert (ba.lower, ba.upper) == pytest.approx((bias - 1.96 * sd, bias + 1.96 * sd))
    assert ba.bias_ci == pytest.approx((bias - t * sd / math.sqrt(n), bias + t * sd / math.sqrt(n)))
    se = math.sqrt(3 * sd**2 / n)
    assert ba.lower_ci == pytest.approx((ba.lower - t * se, ba.lower + t * se))
    assert ba.upper_ci == pytest.approx((ba.upper - t * se, ba.upper + t * se))
    # About 95 % of the differences lie within the limits.
    assert 0.85 <= np.mean((d >= ba.lower) & (d <= ba.upper)) <= 1.0


def test_bland_altman_ratio_scale_is_the_back_transformed_log_analysis():
    x, y = _pairs(5)
    ratio = bland_altman(x, y, scale="ratio")
    logs = bland_altman(np.log(x), np.log(y))
    assert ratio.bias == pytest.approx(math.exp(logs.bias))
    assert ratio.upper == pytest.approx(math.exp(logs.upper))
    assert ratio.bias_ci == pytest.approx(tuple(math.exp(v) for v in logs.bias_ci))
    # A geometric mean ratio: y = 1.1 x exactly reads 1.1 with no spread.
    exact = bland_altman(x, 1.1 * x, scale="ratio")
    assert exact.bias == pytest.approx(1.1) and exact.lower == pytest.approx(1.1)
    with pytest.raises(ValueError, match="> 0"):
        bland_altman(x - 100, y, scale="ratio")


def test_correlation_is_pearsons_r():
    x, y = _pairs(6)
    r = correlation(x, y)
    assert r.r == pytest.approx(stats.pearsonr(x, y)[0])
    assert r.r_ci[0] < r.r < r.r_ci[1]


@pytest.mark.parametrize(("k", "n"), [(0, 10), (1, 10), (39, 40), (120, 240), (234, 240), (40, 40)])
def test_wilson_bounds_solve_the_score_equation(k, n):
    z = stats.norm.ppf(0.975)
    p_hat, lo, hi = (float(v) for v in proportion(k, n, method="wilson"))
    assert p_hat == k / n
    # Each bound p solves (p_hat - p)^2 = z^2 p (1 - p) / n (Wilson 1927).
    for p in (lo, hi):
        if 0 < p < 1 or p_hat not in (0.0, 1.0):
            assert (p_hat - p) ** 2 == pytest.approx(z * z * p * (1 - p) / n, abs=1e-12)
    assert lo <= p_hat <= hi


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 10), (37, 40), (40, 40)])
def test_exact_bounds_are_the_binomial_tails(k, n):
    _, lo, hi = (float(v) for v in proportion(k, n, method="exact"))
    if k < n:
        assert stats.binom.cdf(k, n, hi) == pytest.approx(0.025, abs=1e-9)
    else:
        assert hi == 1.0
    if k > 0:
        assert stats.binom.sf(k - 1, n, lo) == pytest.approx(0.025, abs=1e-9)
    else:
        assert lo == 0.0


def test_empty_proportion_is_not_estimable():
    assert all(math.isnan(float(v)) for v in proportion(0, 0))


def test_kappa_and_per_class_counts_match_scikit_learn():
    rng = np.random.default_rng(7)
    classes = ["a", "b", "c"]
    ref = rng.choice(classes, 300)
    model = np.where(rng.random(300) < 0.8, ref, rng.choice(classes, 300))
    q = qualitative_agreement(ref, model, classes)
    assert q["kappa"]["kappa"] == pytest.approx(cohen_kappa_score(ref, model))
    matrix = confusion_matrix(ref, model, labels=classes)
    assert q["confusion"] == matrix.tolist()
    assert q["concordance"]["estimate"] == pytest.approx(np.mean(ref == model))
    for c, row in zip(classes, q["per_class"], strict=True):
        positive, called = ref == c, model == c
        assert row["sensitivity"]["estimate"] == pytest.approx(np.mean(called[positive]))
        assert row["specificity"]["estimate"] == pytest.approx(np.mean(~called[~positive]))
        assert row["ppv"]["estimate"] == pytest.approx(np.mean(positive[called]))
        assert row["npv"]["estimate"] == pytest.approx(np.mean(~positive[~called]))
    with pytest.raises(ValueError, match="none of the classes"):
        qualitative_agreement(ref, np.where(model == "a", "z", model), classes)


def test_kappa_of_a_matrix_by_hand():
    # Cohen's own kind of example: po = 0.7, pe = 0.5 -> kappa 0.4.
    k = kappa([[25, 25], [5, 45]])
    assert k["observed"] == pytest.approx(0.7)
    assert k["expected"] == pytest.approx((50 * 30 + 50 * 70) / 100**2)
    assert k["kappa"] == pytest.approx((0.7 - k["expected"]) / (1 - k["expected"]))


def test_precision_by_analysis_of_variance():
    rng = np.random.default_rng(8)
    runs, reps = 5, 3
    run_effect = np.repeat(rng.normal(0, 2.0, runs), reps)
    values = 50 + run_effect + rng.normal(0, 1.0, runs * reps)
    run_ids = np.repeat([f"day{i}" for i in range(runs)], reps)
    (row,) = precision(values, ["s1"] * values.size, run_ids)
    groups = values.reshape(runs, reps)
    ms_within = groups.var(axis=1, ddof=1).mean()  # balanced: the mean within-run variance
    ms_between = reps * groups.mean(axis=1).var(ddof=1)
    s_run2 = max(0.0, (ms_between - ms_within) / reps)
    assert row["sd_repeatability"] == pytest.approx(math.sqrt(ms_within))
    assert row["sd_within_lab"] == pytest.approx(math.sqrt(ms_within + s_run2))
    assert row["cv_repeatability"] == pytest.approx(100 * math.sqrt(ms_within) / values.mean())
    # Without runs: the SD of the replicates; specimens measured once are left out.
    rows = precision([1.0, 2.0, 4.0, 7.0], ["a", "a", "a", "b"])
    assert [r["specimen"] for r in rows] == ["a"]
    assert rows[0]["sd_repeatability"] == pytest.approx(np.std([1.0, 2.0, 4.0], ddof=1))
    assert rows[0]["sd_within_lab"] is None


def test_a_criterion_passes_only_when_its_interval_lies_within_the_limits():
    """CLSI EP09 judges a bias through its confidence interval: inside with it, pass;
    the estimate outside, fail; the estimate inside and the interval not, not shown
    (too few samples to tell), which the study's verdict must not call a pass."""
    from bagserve.core.validation.acceptance import NOT_SHOWN, judge, overall

    def analysis(bias, ci):
        return {
            "measurand": "m",
            "bland_altman": {"bias": bias, "bias_ci": ci, "lower": -0.2, "upper": 0.2},
            "ratio": {},
            "correlation": {},
            "deming": {},
            "passing_bablok": {},
        }

    def verdicts(bias, ci):
        rows = judge({"bias": (-0.1, 0.1)}, {"all": [analysis(bias, ci)]}, None)
        return [r["verdict"] for r in rows], overall(rows)

    assert verdicts(0.02, [-0.05, 0.08]) == (["pass"], "pass")
    assert verdicts(0.02, [-0.05, 0.15]) == ([NOT_SHOWN], NOT_SHOWN)
    assert verdicts(0.12, [0.05, 0.2]) == (["fail"], "fail")
    assert verdicts(None, None) == (["fail"], "fail")
    # The limits of agreement have no interval of their own: judged on the estimate.
    rows = judge({"limits_of_agreement": (-0.3, 0.3)}, {"all": [analysis(0.0, None)]}, None)
    assert [r["verdict"] for r in rows] == ["pass"]
    assert overall([*rows, {"verdict": NOT_SHOWN}]) == NOT_SHOWN
    assert overall([]) == "no acceptance limits given"
