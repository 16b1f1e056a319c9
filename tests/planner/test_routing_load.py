"""The busiest expert-parallel rank's expected load under a balanced router
(`pipeline.planner.routing_load`) against a Monte-Carlo oracle written here from the
definition: tokens each drawing k distinct experts uniformly, the experts' rows summed per
rank, the busiest rank over the mean, averaged over many draws."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pipeline.planner.routing_load as routing_load
from pipeline.planner.errors import PlanError
from pipeline.planner.routing_load import (
    busiest_expert_ratio,
    busiest_load_ratio,
    busiest_rank_ratio,
    expected_max_deviation,
    expected_max_standard_normal,
    local_expert_variance,
    rows_distribution,
)

__all__: list[str] = []

_TRIALS = 600


def _monte_carlo(tokens: int, topk: int, experts: int, groups: int, sets: int = 1,
                 seed: int = 7) -> tuple[float, float]:
    """(mean of the busiest group's load over the mean load, its standard error): `sets`
    pools of `tokens` tokens, each token k distinct experts of E (the first k of a random
    permutation), expert x in group x // (E / groups); the busiest over all pools' groups."""
    rng = np.random.default_rng(seed)
    per_group = experts // groups
    ratios = np.empty(_TRIALS)
    for trial in range(_TRIALS):
        picks = rng.random((sets, tokens, experts)).argsort(axis=-1)[..., :topk]
        loads = [np.bincount((pool // per_group).ravel(), minlength=groups) for pool in picks]
        ratios[trial] = np.max(loads) / (tokens * topk / groups)
    return float(ratios.mean()), float(ratios.std(ddof=1) / math.sqrt(_TRIALS))


def test_expected_max_of_standard_normals_has_its_closed_forms() -> None:
    # E[max] of 1, 2, 3 standard normals: 0, 1/√π, 3/(2√π); of 5: 1.1629644736 (tables)
    assert expected_max_standard_normal(1) == pytest.approx(0.0, abs=1e-9)
    assert expected_max_standard_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    assert expected_max_standard_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi),
                                                            rel=1e-9)
    assert expected_max_standard_normal(5) == pytest.approx(1.1629644736, rel=1e-8)
    draws = np.random.default_rng(1).standard_normal((200_000, 64)).max(axis=1)
    assert expected_max_standard_normal(64) == pytest.approx(draws.mean(), abs=0.01)


def test_several_sets_take_the_largest_deviation() -> None:
    # one set: the closed form; two ranks: √2·(max(Z1, Z2) - Z̄) = |Z1 - Z2|/√2 ~ |N(0, 1)|
    assert expected_max_deviation(4) == pytest.approx(
        math.sqrt(4 / 3) * expected_max_standard_normal(4), rel=1e-12)
    assert expected_max_deviation(2) == pytest.approx(math.sqrt(2 / math.pi), rel=1e-9)
    # the largest of 4 independent |N(0,1)|: E = ∫ 1 - (2Φ(x) - 1)^4 dx over x > 0
    x = np.linspace(0.0, 12.0, 120_001)
    half = np.array([math.erf(v / math.sqrt(2)) for v in x])
    assert expected_max_deviation(2, 4) == pytest.approx(
        float(np.trapezoid(1 - half ** 4, x)), rel=0.01)
    assert expected_max_deviation(1, 8) == 0.0
    assert expected_max_deviation(8, 4) > expected_max_deviation(8) > expected_max_deviation(4)


@pytest.mark.parametrize(("tokens", "topk", "experts", "groups", "sets"), [
    (1024, 2, 8, 2, 1),    # Mixtral top-2, ep 2
    (1024, 2, 8, 4, 1),    # ep 4
    (512, 2, 8, 8, 1),     # ep 8: a rank per expert
    (512, 4, 16, 4, 1),    # fine-grained, top-4
    (256, 2, 8, 2, 4),     # tp 4: four ep groups wait for each other's busiest
    (256, 6, 64, 8, 2),    # DeepSeek-V2-like top-6 of 64, ep 8, tp 2
])
def test_busiest_group_matches_a_monte_carlo_of_the_routing(
        tokens: int, topk: int, experts: int, groups: int, sets: int) -> None:
    found = busiest_load_ratio(tokens, topk, experts, groups, sets)
    mean, error = _monte_carlo(tokens, topk, experts, groups, sets)
    # the normal approximation of a sum of hypergeometric counts, within 3 % of the excess
    # over 1 and the oracle's own noise
    assert found - 1 == pytest.approx(mean - 1, rel=0.03, abs=3 * error)
    assert found > 1


def test_an_unconstrained_maximum_is_caught() -> None:
    """Planted: the loads as independent (no √(G/(G-1)): the G loads sum to N·k), at ep 2
    top-2 of 8; drawn with replacement (no (E-k)/(E-1)), at ep 2 top-4 of 8: each misses
    the oracle by more than the tolerance the right formula meets."""
    mean, error = _monte_carlo(1024, 2, 8, 2)
    sigma = math.sqrt(2048 * 0.25 * 6 / 7)
    independent = 1 + sigma * expected_max_standard_normal(2) / 1024
    assert abs(independent - mean) > 0.03 * (mean - 1) + 3 * error
    mean, error = _monte_carlo(1024, 4, 8, 2)
    with_replacement = 1 + math.sqrt(4096 * 0.25) * expected_max_deviation(2) / 2048
    assert abs(with_replacement - mean) > 0.03 * (mean - 1) + 3 * error
    assert busiest_load_ratio(1024, 4, 8, 2) - 1 == pytest.approx(mean - 1, rel=0.03,
                                                                  abs=3 * error)


def _busiest_ranks_deviations(tokens: int, topk: int, experts: int, ep: int, trials: int,
                               seed: int = 3) -> np.ndarray:
    """trials × E/ep: the busiest rank's experts' rows less their own mean, over routings
    drawn from the definition (ep·n tokens, k distinct experts each, rank r holding experts
    E/ep·r ..; the busiest the rank with the most rows)."""
    rng = np.random.default_rng(seed)
    local = experts // ep
    deviations = np.empty((trials, local))
    for trial in range(trials):
        picks = rng.random((ep * tokens, experts)).argsort(axis=-1)[:, :topk]
        ranks = np.bincount(picks.ravel(), minlength=experts).reshape(ep, local)
        mine = ranks[int(ranks.sum(axis=1).argmax())].astype(float)
        deviations[trial] = mine - mine.mean()
    return deviations


@pytest.mark.parametrize(("tokens", "topk", "experts", "ep"), [
    (512, 2, 8, 2), (512, 2, 8, 1), (256, 4, 16, 2), (128, 6, 64, 8)])
def test_the_busiest_ranks_experts_spread_as_a_monte_carlo_of_the_routing(
        tokens: int, topk: int, experts: int, ep: int) -> None:
    """The variance of one of the busiest rank's experts' rows about the rank's mean."""
    squares = (_busiest_ranks_deviations(tokens, topk, experts, ep, 4 * _TRIALS) ** 2
               ).mean(axis=1)
    mean, error = squares.mean(), squares.std(ddof=1) / math.sqrt(len(squares))
    found = local_expert_variance(tokens, topk, experts, ep)
    # the normal approximation within 3 % and the oracle's noise
    assert abs(found - mean) <= 0.03 * mean + 3 * error
    assert local_expert_variance(tokens, topk, experts, experts) == 0.0  # one local expert


def test_an_experts_spread_about_the_wrong_mean_is_caught() -> None:
    """Planted: one expert's variance about the pool's mean (σ_e², no c²·(m - 1)/m: the
    rank's own mean is the one the rows spread about) misses the oracle at ep 2, top-2 of 8,
    by more than the tolerance the right formula meets."""
    squares = (_busiest_ranks_deviations(512, 2, 8, 2, 4 * _TRIALS) ** 2).mean(axis=1)
    mean, error = squares.mean(), squares.std(ddof=1) / math.sqrt(len(squares))
    about_the_pool = 1024 * 2 * (1 / 8) * (7 / 8) * 6 / 7
    assert abs(about_the_pool - mean) > 0.03 * mean + 3 * error
    assert abs(local_expert_variance(512, 2, 8, 2) - mean) <= 0.03 * mean + 3 * error


def _normal_mass(low: float, high: float, mean: float, sigma: float) -> float:
    def cdf(x: float) -> float:
        return 0.5 * (1 + math.erf((x - mean) / (sigma * math.sqrt(2))))

    return cdf(high) - cdf(low)


@pytest.mark.parametrize(("mean", "variance"), [(517.3, 329.0), (3000.0, 1.2e5), (40.2, 2.5),
                                                (1.5, 4.0)])
def test_rows_are_the_normal_on_the_integers_binned_within_tiles(mean: float,
                                                                 variance: float) -> None:
    law = rows_distribution(mean, variance, 64)
    sigma = math.sqrt(variance)
    assert sum(p for _, p in law) == pytest.approx(1.0, rel=1e-12)
    rows = [r for r, _ in law]
    assert rows == sorted(set(rows)) and rows[0] >= 0
    # each 64-row tile band (64·j, 64·(j + 1)] holds the normal's mass over it (r takes
    # (r - ½, r + ½]; 0 all below ½), but for the tails beyond ±4.5 σ (7·10^-6) left out
    for band in range(int(max(0, mean - 4 * sigma)) // 64, int(mean + 4 * sigma) // 64 + 1):
        found = sum(p for r, p in law if 64 * band < r <= 64 * (band + 1) or r == band == 0)
        low = -math.inf if band == 0 else 64 * band + 0.5
        assert found == pytest.approx(_normal_mass(low, 64 * band + 64.5, mean, sigma),
                                      abs=1e-5)
    if sigma < 2:  # every integer on its own: the normal's mass
        for r, p in law:
            low = -math.inf if r == 0 else r - 0.5
            assert p == pytest.approx(_normal_mass(low, r + 0.5, mean, sigma), abs=1e-5)
    spread = sum((r - mean) ** 2 * p for r, p in law)
    if mean > 5 * sigma:  # nothing clipped at 0
        assert sum(r * p for r, p in law) == pytest.approx(mean, rel=1e-3)
        assert spread == pytest.approx(variance, rel=0.1)


def test_rows_without_variance_keep_the_mean_and_bad_ones_are_refused() -> None:
    assert rows_distribution(100.0, 0.0, 64) == ((100, 1.0),)
    (low, p_low), (high, p_high) = rows_distribution(100.25, 0.0, 64)
    assert (low, high) == (100, 101) and p_low == pytest.approx(0.75) and p_high == 0.25
    for mean, variance, granule, words in ((math.nan, 1.0, 64, "mean=nan"),
                                           (10.0, -1.0, 64, "variance=-1.0"),
                                           (-1.0, 1.0, 64, "mean=-1.0"),
                                           (10.0, 1.0, 48, "granule=48")):
        with pytest.raises(PlanError, match=words):
            rows_distribution(mean, variance, granule)


def test_what_does_not_vary_is_even_and_rank_and_expert_pool_their_group() -> None:
    assert busiest_load_ratio(1000, 2, 8, 1) == 1.0  # one rank holds every expert
    assert busiest_load_ratio(1000, 8, 8, 4) == 1.0  # every token goes to every expert
    assert busiest_load_ratio(0, 2, 8, 4) == 1.0
    # ep ranks pool ep·n tokens; a rank's E/ep experts against one expert's
    assert busiest_rank_ratio(512, 2, 8, 4, 2) == busiest_load_ratio(2048, 2, 8, 4, 2)
    assert busiest_expert_ratio(512, 2, 8, 4, 2) == busiest_load_ratio(2048, 2, 8, 8, 2)
    assert busiest_expert_ratio(512, 2, 8, 4) > busiest_rank_ratio(512, 2, 8, 4) > 1
    # more tokens: relatively more even (σ/μ ∝ 1/√N)
    assert busiest_rank_ratio(4096, 2, 8, 4) - 1 == pytest.approx(
        (busiest_rank_ratio(1024, 2, 8, 4) - 1) / 2, rel=1e-9)


@pytest.mark.parametrize(("args", "words"), [
    ((100, 2, 8, 3), "groups=3 must divide experts=8"),
    ((100, 9, 8, 2), "topk=9"),
    ((-1, 2, 8, 2), "tokens=-1"),
    ((100, 0, 8, 2), "topk=0"),
])
def test_bad_sizes_are_refused_by_name(args: tuple[int, ...], words: str) -> None:
    with pytest.raises(PlanError, match=words):
        busiest_load_ratio(*args)
    with pytest.raises(PlanError, match="n=0"):
        routing_load.expected_max_standard_normal(0)
