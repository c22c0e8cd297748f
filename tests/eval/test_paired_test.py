"""The learning checks' paired t test (``seal.report.paired_test``) against scipy, an independent implementation."""

from __future__ import annotations

import random

import pytest
from scipy import stats

from seal.report.paired_test import (
    paired_t,
    paired_t_power,
    regularized_incomplete_beta,
    seeds_for_power,
    t_cdf,
    t_quantile,
)


@pytest.mark.parametrize("df", [1, 2, 4, 11, 30, 150])
def test_the_t_distribution_is_scipys(df):
    for t in (-40.0, -3.2, -1.0, -0.01, 0.0, 0.5, 2.1, 7.0):
        assert t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-12)
    for q in (0.005, 0.025, 0.3, 0.5, 0.9, 0.975, 0.999):
        assert t_quantile(q, df) == pytest.approx(stats.t.ppf(q, df), abs=1e-8)


def test_the_incomplete_beta_is_scipys():
    for a, b, x in ((0.5, 0.5, 0.3), (2.0, 5.0, 0.9), (10.0, 0.5, 0.99), (1.0, 1.0, 0.25)):
        assert regularized_incomplete_beta(a, b, x) == pytest.approx(stats.beta.cdf(x, a, b), abs=1e-12)
    with pytest.raises(ValueError):
        regularized_incomplete_beta(1.0, 1.0, 1.5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_paired_test_is_scipys_in_each_direction(seed):
    rng = random.Random(seed)
    differences = [rng.gauss(-0.4, 1.0) for _ in range(12)]
    for predicted, alternative in ((-1, "less"), (1, "greater"), (0, "two-sided")):
        ours = paired_t(differences, predicted)
        theirs = stats.ttest_1samp(differences, 0.0, alternative=alternative)
        assert ours["t"] == pytest.approx(theirs.statistic, rel=1e-12)
        assert ours["p"] == pytest.approx(theirs.pvalue, abs=1e-12)
    assert paired_t(differences, -1)["count"] == sum(d < 0 for d in differences)
    assert paired_t(differences, 1)["count"] == sum(d > 0 for d in differences)


def test_differences_that_are_all_zero_pass_no_test():
    assert paired_t([0.0] * 8, -1)["p"] == 0.5 and paired_t([0.0] * 8, 0)["p"] == 1.0
    assert paired_t([-1e-3] * 8, -1)["p"] == 0.0  # every seed the same, in the predicted direction
    with pytest.raises(ValueError):
        paired_t([1.0], -1)
    with pytest.raises(ValueError):
        paired_t([1.0, 2.0], 2)


def test_the_power_is_the_noncentral_ts_within_its_approximation():
    # the exact power of a one-sided t test is the noncentral t's tail beyond the critical value
    for effect, sd, n in ((0.5, 1.0, 20), (0.011, 0.006, 5), (1.0, 1.0, 12)):
        critical = stats.t.ppf(1 - 0.025, n - 1)
        exact = stats.nct.sf(critical, n - 1, effect * n**0.5 / sd)
        assert paired_t_power(effect, sd, n, 0.025) == pytest.approx(exact, abs=0.06)
    n = seeds_for_power(0.5, 1.0, 0.025)
    assert paired_t_power(0.5, 1.0, n, 0.025) >= 0.9 > paired_t_power(0.5, 1.0, n - 1, 0.025)
    assert seeds_for_power(0.001, 1.0, 0.025) is None
