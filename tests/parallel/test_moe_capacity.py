"""Expert capacity (Megatron-Core's capacity factor): the MoE layer's output against an
oracle written from the definition, on one rank and with the experts split over an ep group
of two, and a planted off-by-one in the capacity failing it."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.moe import layer as layer_module
from pipeline.moe.expert_parallel import AllToAllDispatcher
from pipeline.moe.layer import MoEFeedForward, RouterConfig
from tests.support.rank_harness import run_ranks

E, K, H, WIDTH = 4, 2, 8, 6


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * WIDTH, H) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(E, H, WIDTH) * 0.3)
        self.act_fn = F.silu


def _layer(factor: float | None, policy: str = "probs") -> MoEFeedForward:
    torch.manual_seed(0)
    gate = nn.Linear(H, E, bias=False)
    with torch.no_grad():
        gate.weight[0] += 2.0  # expert 0 is everyone's favourite: it overflows
    config = RouterConfig(num_experts=E, top_k=K, normalize_top_k=True,
                          capacity_factor=factor, drop_policy=policy)  # type: ignore[arg-type]
    return MoEFeedForward(config, gate, _Experts())


def _tokens(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(1, 12, H, generator=generator).abs()
    tokens[0, 7] = tokens[0, 2]  # two equal tokens: equal weights, the earlier one wins
    return tokens


def _oracle(layer: MoEFeedForward, tokens: torch.Tensor, factor: float, policy: str
            ) -> tuple[torch.Tensor, int]:
    """From the definition: capacity C = ceil(factor · n · k / E); each expert keeps its C
    slots of largest combine weight (ties: earlier token) or its first C tokens; a token's
    output is the weighted sum of its kept experts. Also returns how many slots dropped."""
    x = tokens.reshape(-1, H)
    n = x.shape[0]
    capacity = math.ceil(factor * n * K / E)
    x = x.detach()
    probs = torch.softmax(x @ layer.gate.weight.detach().T, dim=-1)
    top, chosen = probs.topk(K, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    slots: dict[int, list[tuple[float, int, int]]] = {e: [] for e in range(E)}
    for t in range(n):
        for j in range(K):
            weight = float(top[t, j])
            key = -weight if policy == "probs" else 0.0
            slots[int(chosen[t, j])].append((key, t, j))
    out = torch.zeros_like(x)
    dropped = 0
    experts = layer.experts
    for e, listed in slots.items():
        listed.sort()
        dropped += max(0, len(listed) - capacity)
        for _, t, j in listed[:capacity]:
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += top[t, j] * (experts.down_proj[e] @ (F.silu(gate) * up))
    return out.reshape(tokens.shape).detach(), dropped


CASES = [(0.7, "probs"), (0.7, "position"), (1.0, "probs"), (0.25, "position")]


def _floor_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Planted bug: the capacity rounded down."""
    return math.floor(factor * num_tokens * top_k / num_experts)


def _differences(make: Callable[[float | None, str], MoEFeedForward], seed: int) -> list[float]:
    worst = []
    for factor, policy in CASES:
        layer = make(factor, policy)
        tokens = _tokens(seed)
        out, _ = layer(tokens, None)
        expected, dropped = _oracle(_layer(factor, policy), tokens, factor, policy)
        assert dropped > 0, (factor, policy)  # the case must drop something
        worst.append(float((out.detach() - expected).abs().max()))
    return worst


def test_capacity_drops_as_the_definition_says_and_a_floor_fails() -> None:
    assert max(_differences(_layer, seed=1)) < 1e-6
    saved = layer_module.expert_capacity
    layer_module.expert_capacity = _floor_capacity
    try:
        assert max(_differences(_layer, seed=1)) > 1e-3
    finally:
        layer_module.expert_capacity = saved


def test_no_capacity_factor_is_dropless() -> None:
    tokens = _tokens(3)
    dropless, _ = _layer(None)(tokens, None)
    roomy, _ = _layer(float(E) / K)(tokens, None)  # capacity n: nothing can drop
    expected, dropped = _oracle(_layer(None), tokens, float(E) / K, "probs")
    assert dropped == 0
    assert torch.allclose(dropless, expected, atol=1e-6)
    assert torch.equal(dropless, roomy)


@pytest.mark.parametrize("factor", [0.0, -1.0, float("inf"), True, "1"])
def test_a_bad_capacity_factor_is_one_line(factor: object) -> None:
    with pytest.raises(ValueError, match=r"capacity_factor must be a positive number"):
        RouterConfig(num_experts=E, top_k=K, normalize_top_k=True,
                     capacity_factor=factor)  # type: ignore[arg-type]


def test_a_capacity_factor_on_a_dense_hf_model_is_refused() -> None:
    transformers = pytest.importorskip("transformers")
    from pipeline.interop.hf_layers import layers_from_hf
    from tests.support.hf_moe_models import tiny_moe_config

    config = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=32,
                                      vocab_size=32)
    with pytest.raises(PipelineConfigError, match=r"capacity_factor=1\.0 .* dense"):
        layers_from_hf(config, capacity_factor=1.0)
    with pytest.raises(PipelineConfigError, match=r"mixtral: capacity_factor must be"):
        layers_from_hf(tiny_moe_config("mixtral"), capacity_factor=-2.0)
    hf = layers_from_hf(tiny_moe_config("mixtral"), capacity_factor=1.5)
    block = hf.layers[1].build()  # type: ignore[union-attr]
    assert block.layer.mlp.config.capacity_factor == 1.5


def _expert_parallel_layer(factor: float | None, policy: str) -> MoEFeedForward:
    """Experts split over the two ranks: this rank keeps E / 2 and exchanges tokens."""
    layer = _layer(factor, policy)
    local = E // 2
    first = dist.get_rank() * local
    for name in ("gate_up_proj", "down_proj"):
        whole = getattr(layer.experts, name)
        setattr(layer.experts, name, nn.Parameter(whole.detach()[first:first + local].clone()))
    layer.dispatcher = AllToAllDispatcher(dist.group.WORLD, E, 2)
    return layer


def _check_ep(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    # each rank routes its own tokens; the slots that drop are the ones the oracle drops on
    # that rank's tokens alone, wherever the experts run
    assert max(_differences(_expert_parallel_layer, seed=10 + rank)) < 1e-6
    layer = _expert_parallel_layer(0.7, "probs")
    out, _ = layer(_tokens(10 + rank).requires_grad_(), None)
    out.sum().backward()  # the backward all-to-alls match up although ranks drop differently
    assert layer.experts.down_proj.grad is not None


@pytest.mark.multiprocess
def test_capacity_at_ep_2_drops_what_one_rank_drops() -> None:
    """Two ranks with different tokens, experts 0-1 on rank 0 and 2-3 on rank 1: every
    case's output equals the single-rank oracle on the rank's own tokens."""
    run_ranks(_check_ep, 2, timeout=120)
