"""How unevenly a balanced router loads the expert-parallel ranks: the expected busiest rank's
(and busiest expert's) routed rows over the mean, and how its experts' rows spread, from
sampling alone.

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

A rank's own E/ep experts' rows about their mean are c·(Z_j - Z̄_local) (G = E), a law
that does not depend on which rank is the busiest (`local_expert_variance`), made whole
rows by `rows_distribution`.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from pipeline.planner.errors import PlanError

__all__ = ["busiest_expert_ratio", "busiest_load_ratio", "busiest_rank_ratio",
           "expected_max_deviation", "expected_max_standard_normal",
           "local_expert_variance", "rows_distribution"]

_GRID = np.linspace(-12.0, 12.0, 24_001)
"""Quadrature points for `expected_max_standard_normal` (step 0.001; the integrand is below
1e-30 beyond ±12 for any n up to 10^6)."""
_TAILS = 4.5
"""`rows_distribution` keeps the normal's mass within ±4.5 σ (all but 7·10^-6)."""
_BIN_SIGMAS = 1.0
"""`rows_distribution`'s bins are at most one σ wide: against every integer on its own, the
Mixtral-8x22B experts' expected GEMM seconds move by under 7·10^-4 (the weight gradient's)
and 3·10^-5 (the others'), for a tenth of the GEMMs priced."""
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


def local_expert_variance(rank_tokens: int, topk: int, experts: int, ep: int) -> float:
    """Variance of one of a rank's E/ep local experts' rows about the mean of the rank's
    experts, whichever rank (the busiest too): the E experts' loads over the ep group's pool
    (N = ep·n tokens) are c·(Z_j - Z̄), c² = σ_e²·E/(E-1), σ_e² = N·k·p(1 - p)(E - k)/(E - 1),
    p = 1/E (module docstring); a rank's own experts deviate from their mean by
    c·(Z_j - Z̄_local), of variance c²·(m - 1)/m for m = E/ep local experts. For independent
    normals these deviations are independent of the ranks' means (Cochran's theorem), so
    knowing which rank is the busiest (a function of the means alone) leaves them as they
    are. 0 where nothing varies (one local expert, k = E, no tokens)."""
    local = experts // ep
    if local == 1 or topk == experts or rank_tokens == 0:
        return 0.0
    tokens, share = ep * rank_tokens, 1 / experts
    sigma_squared = tokens * topk * share * (1 - share) * (experts - topk) / (experts - 1)
    return sigma_squared * experts / (experts - 1) * (local - 1) / local


def _normal_cdf(values: np.ndarray) -> np.ndarray:
    return np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in values.tolist()])


def rows_distribution(mean: float, variance: float, granule: int
                      ) -> tuple[tuple[int, float], ...]:
    """(rows, probability) of a whole-number count of mean `mean` and variance `variance`:
    the normal N(mean, variance) on the integers r >= 0 (r takes the mass in (r - ½, r + ½],
    0 all of it below ½), its ±`_TAILS` σ kept and renormalised, grouped into bins of w
    integers aligned to multiples of w, each at its conditional mean (the truncated
    normal's, rounded into the bin): w the largest power of two at most σ·`_BIN_SIGMAS`
    and `granule`, which it divides (a GEMM's tiles split rows at multiples of `granule`,
    so no bin straddles a tile boundary; w = 1, every integer, below σ = 2). With no variance,
    the two integers around the mean, weighted so that the mean is kept."""
    if not (math.isfinite(mean) and mean >= 0 and math.isfinite(variance) and variance >= 0):
        raise PlanError(f"rows mean={mean!r} and variance={variance!r} must be finite, >= 0")
    if granule < 1 or granule & (granule - 1):
        raise PlanError(f"granule={granule!r} must be a power of two")
    sigma = math.sqrt(variance)
    if sigma == 0:
        low = math.floor(mean)
        share = mean - low
        return ((low, 1.0),) if share == 0 else ((low, 1 - share), (low + 1, share))
    width = 1 << max(0, min(granule.bit_length() - 1,
                            math.floor(math.log2(max(1.0, sigma * _BIN_SIGMAS)))))
    first = max(0, math.floor((mean - _TAILS * sigma) / width))
    last = math.ceil((mean + _TAILS * sigma) / width)
    # bin j holds the integers j·w + 1 .. (j + 1)·w, the reals (j·w + ½, (j + 1)·w + ½];
    # the integer 0 (the reals below ½) is a bin of its own
    edges = np.arange(first, last + 1) * width + 0.5
    lows = np.concatenate(([-math.inf], edges[:-1])) if first == 0 else edges[:-1]
    highs = np.concatenate(([0.5], edges[1:])) if first == 0 else edges[1:]
    alpha, beta = (lows - mean) / sigma, (highs - mean) / sigma
    mass = _normal_cdf(beta) - _normal_cdf(alpha)
    density = np.exp(-np.concatenate((alpha, beta)) ** 2 / 2) / math.sqrt(2 * math.pi)
    with np.errstate(divide="ignore", invalid="ignore"):
        centre = mean + sigma * (density[:len(alpha)] - density[len(alpha):]) / mass
    keep = mass > 1e-12
    floors = np.where(np.isinf(lows), 0.0, lows + 0.5)
    rows = np.clip(np.rint(np.where(keep, centre, floors)), floors, highs - 0.5)
    total = float(mass[keep].sum())
    return tuple((int(r), float(p) / total) for r, p in zip(rows[keep], mass[keep],
                                                             strict=True))
