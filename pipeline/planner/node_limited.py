"""Group-limited (node-limited) routing and the cross-node bytes of an expert all-to-all:
one copy per (token, expert) pair, or one per destination node (DeepEP).

Legend: E routed experts, k top-k, G expert groups (HF `n_group`), M groups a token may use
(HF `topk_group`), ep the ranks splitting the experts (E / ep each, in rank order), N the
nodes the ep group spans, m_n its ranks on node n.

Routing, as DeepSeek-V2 / V3 have it (HF `DeepseekV3TopkRouter`, Megatron-Core
`moe_utils.group_limited_topk`, this engine's `pipeline.moe.routing.route_grouped`): the E
experts in G equal groups of consecutive experts, a token scores the groups, keeps the M
best and takes its k experts among their M·E/G. DeepSeek-V3 (report §2.1.2, "node-limited
routing") puts its 8 groups of 32 on 8 nodes, top-4 groups: a token reaches at most 4 nodes.
Priced at uniform routing among the allowed experts: the M groups a uniform M-subset of the
G, the k experts a uniform k-subset of their M·E/G (each expert is then chosen with
probability k/E, the balanced routing the rest of the planner assumes).

Dispatch:
- per expert (`alltoall`): Megatron-Core's `MoEAlltoAllTokenDispatcher` (`token_dispatcher.py`
  of `MEGATRON_CORE_COMMIT`: `num_out_tokens = routing_map.size(0) * moe_router_topk`, the
  splits per rank the sum of its experts' token counts) and this engine's
  (`pipeline.moe.expert_parallel`: n·k slots sorted by expert, `all_to_all_single`) send a
  token's hidden state once per (token, expert) pair: k copies, of which the experts on other
  nodes cross the network;
- per node (`deepep`): DeepEP's normal kernels (deepseek-ai/DeepEP `deep_ep/buffer.py`,
  `get_dispatch_layout`: `num_tokens_per_rdma_rank`, "the number of tokens to be sent to each
  RDMA rank (with the same GPU index)"; README: "forwarding data from NVLink domain to RDMA
  domain", aligned with DeepSeek-V3's group-limited gating), which Megatron-Core runs as
  `--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep`: one copy over the
  network to each destination node, forwarded there over NVLink; the combine reduces on that
  node and sends one back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from pipeline.planner.errors import PlanError

__all__ = ["DISPATCHERS", "ExpertRouting", "cross_node_copies", "node_hit_probabilities",
           "node_members", "off_node_scale", "routing_problems"]

DISPATCHERS = ("alltoall", "deepep")
"""How a plan dispatches tokens to experts: one copy per (token, expert) pair, or one per
destination node (`off_node_scale`)."""


def routing_problems(experts: int, topk: int, groups: int, top_groups: int) -> list[str]:
    """What is wrong with group-limited routing of E = `experts`, k = `topk`, G = `groups`,
    M = `top_groups` (Megatron-Core's checks, `transformer_config.py`: the groups divide the
    experts, group_topk <= num_groups; and the M groups must hold k experts); [] if nothing.
    The counts themselves (whole numbers >= 1, k <= E) are the caller's to check first."""
    problems = []
    for name, value in (("expert_groups", groups), ("topk_groups", top_groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value!r} must be a whole number >= 1 (1: no group limit)")
    if problems:
        return problems
    if top_groups > groups:
        problems.append(f"topk_groups={top_groups} must be at most expert_groups={groups} "
                        "(a token keeps M of the G groups); lower topk_groups")
    elif experts % groups:
        problems.append(f"expert_groups={groups} must divide experts={experts} (equal groups "
                        "of consecutive experts); choose among "
                        f"{[g for g in range(1, min(experts, 64) + 1) if experts % g == 0]}")
    elif top_groups * (experts // groups) < topk:
        problems.append(f"topk_groups={top_groups} groups of {experts // groups} experts hold "
                        f"fewer than topk={topk}; raise topk_groups")
    return problems


@dataclass(frozen=True)
class ExpertRouting:
    """How a MoE layer's tokens pick experts: k of E, from M of G groups (G = M = 1: any)."""

    experts: int
    topk: int
    groups: int = 1
    top_groups: int = 1

    def __post_init__(self) -> None:
        counts = [f"{name}={value!r} must be a whole number >= 1"
                  for name, value in (("experts", self.experts), ("topk", self.topk))
                  if isinstance(value, bool) or not isinstance(value, int) or value < 1]
        if not counts and self.topk > self.experts:
            counts.append(f"topk={self.topk} must be at most experts={self.experts}")
        problems = counts or routing_problems(self.experts, self.topk, self.groups,
                                              self.top_groups)
        if problems:
            raise PlanError("expert routing: " + "; ".join(problems))


def node_members(ep: int, stride: int, devices_per_node: int) -> tuple[int, ...]:
    """m_n: the ep group's ranks on each node it spans, `stride` apart in the rank order (the
    count on a node `expert_parallel.all_to_all_seconds` uses; the last node may hold fewer)."""
    local = max(1, min(ep, devices_per_node // stride))
    full, rest = divmod(ep, local)
    return (local,) * full + ((rest,) if rest else ())


@lru_cache(maxsize=4096)
def node_hit_probabilities(routing: ExpertRouting, members: tuple[int, ...]) -> tuple[float, ...]:
    """P(a token's k experts include one on node n), for each node n of an ep group of
    sum(`members`) ranks (E / ep experts each, in rank order), at uniform group-limited
    routing. Exactly: P(miss n) = Σ_S C(A − a_S, k) / C(A, k) / C(G, M) over the M-subsets S
    of groups, A = M·E/G the experts S allows and a_S those of them on n; the subsets are
    counted by their a_S (a knapsack over the groups that overlap n)."""
    E, k, G, M = routing.experts, routing.topk, routing.groups, routing.top_groups
    ep = sum(members)
    if E % ep:
        raise PlanError(f"ep={ep} must divide experts={E} (E / ep experts a rank)")
    per_rank, per_group, allowed = E // ep, E // G, M * (E // G)
    chosen = math.comb(G, M) * math.comb(allowed, k)
    hits = []
    start = 0
    for m in members:
        end = start + m * per_rank  # node n holds experts [start, end)
        overlaps = [max(0, min(end, (g + 1) * per_group) - max(start, g * per_group))
                    for g in range(G)]
        touching = [o for o in overlaps if o]
        # ways[j][a]: j-subsets of the touching groups holding a of node n's experts
        ways = [[0] * (end - start + 1) for _ in range(M + 1)]
        ways[0][0] = 1
        for overlap in touching:
            for j in range(min(M, len(touching)), 0, -1):
                for a in range(end - start, overlap - 1, -1):
                    ways[j][a] += ways[j - 1][a - overlap]
        apart = G - len(touching)  # groups with none of n's experts
        missed = sum(ways[j][a] * math.comb(apart, M - j) * math.comb(allowed - a, k)
                     for j in range(M + 1) for a in range(end - start + 1) if ways[j][a])
        hits.append(1.0 - missed / chosen)
        start = end
    return tuple(hits)


def cross_node_copies(routing: ExpertRouting, members: tuple[int, ...],
                      dispatcher: str) -> float:
    """Copies of a token's hidden state that leave its node, on average over the ep group's
    ranks (a token starts on node n with probability m_n / ep, independent of its route):
    per node (`deepep`), Σ_n P(n hit)·(1 − m_n/ep), the expected distinct remote nodes, at
    most M where groups map to nodes; per expert (`alltoall`), k·Σ_n (m_n/ep)(1 − m_n/ep),
    each of the k experts on node n with probability m_n/ep."""
    ep = sum(members)
    away = [1.0 - m / ep for m in members]
    if dispatcher == "alltoall":
        return routing.topk * sum(m / ep * rest for m, rest in zip(members, away, strict=True))
    if dispatcher == "deepep":
        hits = node_hit_probabilities(routing, members)
        return sum(hit * rest for hit, rest in zip(hits, away, strict=True))
    raise PlanError(f"moe dispatcher {dispatcher!r} is not known; choose from "
                    f"{', '.join(DISPATCHERS)}")


def off_node_scale(routing: ExpertRouting | None, ep: int, stride: int,
                   devices_per_node: int, dispatcher: str = "alltoall") -> float:
    """The share of the per-expert dispatch's cross-node bytes that `dispatcher` sends: 1 for
    `alltoall`; for `deepep` the expected remote nodes over the expected remote expert copies
    (`cross_node_copies`). DeepSeek-V3's shape (E 256, k 8, G 8, M 4) at ep 64 over 8 nodes:
    3.18 against 7, 0.454 (per-expert sends 2.2 times the bytes). Within one node: 1
    (nothing crosses)."""
    if dispatcher not in DISPATCHERS:
        raise PlanError(f"moe dispatcher {dispatcher!r} is not known; choose from "
                        f"{', '.join(DISPATCHERS)}")
    members = node_members(ep, stride, devices_per_node)
    if dispatcher == "alltoall" or len(members) == 1:
        return 1.0
    if routing is None:
        raise PlanError("the deepep dispatcher is priced from the model's routing (experts, "
                        "topk, expert groups); this model has none: use --moe-dispatcher "
                        "alltoall")
    return (cross_node_copies(routing, members, dispatcher)
            / cross_node_copies(routing, members, "alltoall"))
