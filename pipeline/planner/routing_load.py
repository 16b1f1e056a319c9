"""How unevenly a balanced router loads the expert-parallel ranks: the expected busiest rank's
(and busiest expert's) routed rows over the mean, from sampling alone.

Model (a router balanced in expectation, e.g. by an auxiliary loss): each of N tokens picks
k distinct experts of E, every choice equally likely, independently of the other tokens.
The E experts sit in G equal groups (the G = ep ranks of an ep group, E / ep experts each;
or G = E single experts). A token sends to one group a hypergeometric count of its k
(E items, E / G marked, k drawn): mean k / G, variance k·p(1 - p)(E - k)/(E - 1), p = 1/G.
A group's load, the sum over the N tokens, has mean μ = N·k/G and variance
σ² = N·k·p(1 - p)(E - k)/(E - 1). The G loads sum to N·k exactly, so they are
equicorrelated with ρ = -1/(G - 1); in the normal approximation they are
c·(Z_i - Z̄) for G standard normals Z_i, c = σ·√(G/(G - 1)), and the busiest is
c·(max Z_i - Z̄), whose expectation is c·E[max of G standard normals] (Z̄ has mean 0).

`sets` independent groups that wait for each other (the t tensor-parallel ranks of a
replica each route their own s/t tokens through their own ep group, and meet at the next
tensor-parallel collective) take the largest of `sets` such maxima.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from pipeline.planner.errors import PlanError

__all__ = ["busiest_expert_ratio", "busiest_load_ratio", "busiest_rank_ratio",
           "expected_max_deviation", "expected_max_standard_normal",
           "expected_normal_order_statistics", "local_expert_spread"]

_GRID = np.linspace(-12.0, 12.0, 24_001)
"""Quadrature points for `expected_max_standard_normal` (step 0.001; the integrand is below
1e-30 beyond ±12 for any n up to 10^6)."""
_SAMPLES = 1 << 15
"""Draws of one set's largest deviation for `expected_max_deviation` with sets > 1."""


@functools.lru_cache(maxsize=256)
def expected_max_standard_normal(n: int) -> float:
    """E[max of n independent standard normals] = ∫ x · n φ(x) Φ(x)^(n-1) dx, by the
    trapezoid rule (1/√π at n = 2, 3/(2√π) at n = 3)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PlanError(f"n={n!r} must be a whole number >= 1")
    cdf = np.array([0.5 * (1.0 + math.erf(x / math.sqrt(2.0))) for x in _GRID])
    pdf = np.exp(-_GRID ** 2 / 2) / math.sqrt(2 * math.pi)
    return float(np.trapezoid(_GRID * n * pdf * cdf ** (n - 1), _GRID))


@functools.lru_cache(maxsize=256)
def expected_normal_order_statistics(n: int) -> tuple[float, ...]:
    """E[Z_(i)], i = 1..n, the expected order statistics of n independent standard normals
    (smallest first): ∫ x · n·C(n-1, i-1) Φ^(i-1) (1 - Φ)^(n-i) φ dx, by the trapezoid rule
    (±1/√π at n = 2; the last is `expected_max_standard_normal(n)`)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PlanError(f"n={n!r} must be a whole number >= 1")
    cdf = np.array([0.5 * (1.0 + math.erf(x / math.sqrt(2.0))) for x in _GRID])
    pdf = np.exp(-_GRID ** 2 / 2) / math.sqrt(2 * math.pi)
    low, high = np.log(np.clip(cdf, 1e-300, None)), np.log(np.clip(1 - cdf, 1e-300, None))
    values = []
    for i in range(1, n + 1):
        log_weight = (math.log(n) + math.lgamma(n) - math.lgamma(i) - math.lgamma(n - i + 1)
                      + (i - 1) * low + (n - i) * high)
        values.append(float(np.trapezoid(_GRID * np.exp(log_weight) * pdf, _GRID)))
    return tuple(values)


@functools.lru_cache(maxsize=256)
def expected_max_deviation(groups: int, sets: int = 1) -> float:
    """E[largest of `sets` independent copies of √(G/(G-1))·(max_i Z_i - Z̄)], G = `groups`
    standard normals each: the busiest of G sum-constrained loads in units of one load's σ.
    One set: √(G/(G-1))·`expected_max_standard_normal(G)` exactly. Several: from the
    empirical distribution of 2^15 seeded draws of one set's maximum M (sorted, M_(1..S)),
    whose largest of `sets` has expectation Σ_i ((i/S)^sets - ((i-1)/S)^sets)·M_(i)."""
    if groups < 2:
        return 0.0
    scale = math.sqrt(groups / (groups - 1))
    if sets == 1:
        return scale * expected_max_standard_normal(groups)
    draws = np.random.default_rng(0).standard_normal((_SAMPLES, groups))
    largest = np.sort(draws.max(axis=1) - draws.mean(axis=1)) * scale
    ranks = np.arange(_SAMPLES + 1) / _SAMPLES
    return float(np.diff(ranks ** sets) @ largest)


def busiest_load_ratio(tokens: int, topk: int, experts: int, groups: int,
                       sets: int = 1) -> float:
    """Expected load of the busiest of `groups` equal groups of the `experts` (over
    `sets` independent pools) relative to the mean, when `tokens` tokens each pick `topk`
    distinct experts uniformly at random: 1 + σ·`expected_max_deviation`/μ (module
    docstring). 1 where nothing varies (one group, k = E, no tokens)."""
    for name, value in (("tokens", tokens), ("topk", topk), ("experts", experts),
                        ("groups", groups), ("sets", sets)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name != "tokens"):
            raise PlanError(f"{name}={value!r} must be a whole number >= "
                            f"{int(name != 'tokens')}")
    if experts % groups or topk > experts:
        raise PlanError(f"groups={groups} must divide experts={experts} and topk={topk} be "
                        "at most experts")
    if groups == 1 or topk == experts or tokens == 0:
        return 1.0
    share = 1 / groups
    mean = tokens * topk * share
    sigma = math.sqrt(tokens * topk * share * (1 - share) * (experts - topk) / (experts - 1))
    return 1.0 + sigma * expected_max_deviation(groups, sets) / mean


def busiest_rank_ratio(rank_tokens: int, topk: int, experts: int, ep: int,
                       tp: int = 1) -> float:
    """The busiest ep rank's routed rows over the mean, n·k, for ranks routing `rank_tokens`
    tokens each (b·s/t with sequence parallelism): the ep group pools ep·n tokens, its ep
    ranks hold E/ep experts each, and the t groups of a replica (one per tp rank, t ranks
    apart) wait for each other's busiest."""
    return busiest_load_ratio(ep * rank_tokens, topk, experts, ep, tp)


def busiest_expert_ratio(rank_tokens: int, topk: int, experts: int, ep: int,
                         tp: int = 1) -> float:
    """The busiest single expert's rows over the mean, ep·n·k/E (the same pool as
    `busiest_rank_ratio`, E groups of one)."""
    return busiest_load_ratio(ep * rank_tokens, topk, experts, experts, tp)


def local_expert_spread(rank_tokens: int, topk: int, experts: int, ep: int
                        ) -> tuple[float, ...]:
    """Each of a rank's E/ep local experts' expected rows less their mean, smallest first:
    the E experts' loads over the ep group's pool (N = ep·n tokens) are c·(Z_j - Z̄),
    c = σ_e·√(E/(E-1)), σ_e² = N·k·p(1 - p)(E - k)/(E - 1), p = 1/E (module docstring); a
    rank's own experts' deviations from their mean are c·(Z_j - Z̄_local), whose expected
    order statistics are c·E[Z_(i)] of E/ep normals (`expected_normal_order_statistics`).
    Zeros where nothing varies (one local expert, k = E, no tokens)."""
    local = experts // ep
    if local == 1 or topk == experts or rank_tokens == 0:
        return (0.0,) * local
    tokens, share = ep * rank_tokens, 1 / experts
    sigma = math.sqrt(tokens * topk * share * (1 - share) * (experts - topk) / (experts - 1))
    scale = sigma * math.sqrt(experts / (experts - 1))
    return tuple(scale * z for z in expected_normal_order_statistics(local))
