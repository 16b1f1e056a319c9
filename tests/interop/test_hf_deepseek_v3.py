"""DeepSeek-V3 through `layers_from_hf`: from a `save_pretrained` directory one step's loss and
every gradient equal HF's (single-process and pp 2 × dp 2 × ep 2, where the aux-free bias moves
as defined), the group-limited sigmoid router chooses as HF's on a planted near tie, the export
is `save_pretrained`'s; planted routing bugs fail; bad configs are one line."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from pipeline import PipelineModule
from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_weights import hf_checkpoint_tensors, hf_state_dict, load_hf_weights
from pipeline.moe import layer as layer_module
from pipeline.moe.layer import MoEFeedForward
from pipeline.moe.routing import Routing, route_grouped
from tests.support.hf_moe_equivalence import moe_step_differences
from tests.support.hf_moe_models import (
    expected_aux_free_biases,
    tiny_moe_config,
    tiny_moe_model,
)
from tests.support.rank_harness import run_ranks

TOLERANCE = 1e-5
FAMILY = "deepseek_v3"


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _step_differences(tmp_path: Path, groups: int, top_groups: int) -> dict[str, float]:
    """One forward and backward of our single-stage layers loaded from HF's `save_pretrained`
    directory against HF's own on the same batch: the loss's and the worst gradient's
    relative differences."""
    options = {"groups": groups, "top_groups": top_groups}
    model = tiny_moe_model(FAMILY, seed=3, **options)
    model.save_pretrained(tmp_path)
    hf = layers_from_hf(tiny_moe_config(FAMILY, **options))
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn)
    load_hf_weights(module, hf, tmp_path)
    module.materialize([0])
    ids = torch.randint(1, 128, (4, 8), generator=torch.Generator().manual_seed(1))
    labels = causal_lm_targets(ids)
    loss = hf.loss_fn(module.stage(0)(ids), labels)
    loss.backward()
    expected = model(input_ids=ids, labels=labels).loss
    expected.backward()
    reference = dict(model.named_parameters())
    grads = [_relative(param.grad, reference[hf.hf_name(*key)].grad)
             for key, param in module.named_layer_parameters()]
    assert len(grads) == len(reference)
    return {"loss": abs(float(loss.detach()) - float(expected.detach())) / float(expected.detach()),
            "grad": max(grads)}


@pytest.mark.parametrize(("groups", "top_groups"), [(2, 1), (4, 2)])
def test_step_from_save_pretrained_equals_hf(tmp_path: Path, groups: int,
                                             top_groups: int) -> None:
    found = _step_differences(tmp_path, groups, top_groups)
    assert found["loss"] <= TOLERANCE and found["grad"] <= TOLERANCE, found


def _plain_top_k(logits: torch.Tensor, top_k: int, *, groups: int, top_groups: int,
                 normalize: bool, scaling: float, bias: torch.Tensor | None) -> Routing:
    """Planted bug: group-limited selection off (every group eligible)."""
    return route_grouped(logits, top_k, groups=groups, top_groups=groups,
                         normalize=normalize, scaling=scaling, bias=bias)


def _bias_in_the_weights(logits: torch.Tensor, top_k: int, *, groups: int, top_groups: int,
                         normalize: bool, scaling: float, bias: torch.Tensor | None
                         ) -> Routing:
    """Planted bug: the correction bias added to the combine weights, not only the choice."""
    routing = route_grouped(logits, top_k, groups=groups, top_groups=top_groups,
                            normalize=normalize, scaling=scaling, bias=bias)
    assert bias is not None
    weights = routing.weights + scaling * bias.gather(0, routing.experts.reshape(-1)).view_as(
        routing.weights)
    return Routing(routing.probs, weights, routing.experts)


@pytest.mark.parametrize("planted", [_plain_top_k, _bias_in_the_weights])
def test_planted_routing_bugs_fail_the_near_tie_choice(monkeypatch: pytest.MonkeyPatch,
                                                       planted: Any) -> None:
    monkeypatch.setattr(layer_module, "route_grouped", planted)
    with pytest.raises(AssertionError):
        test_router_choice_equals_hf_on_a_planted_near_tie()


@pytest.mark.parametrize("planted", [_plain_top_k, _bias_in_the_weights])
def test_planted_routing_bugs_fail_the_step_comparison(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: Any) -> None:
    monkeypatch.setattr(layer_module, "route_grouped", planted)
    found = _step_differences(tmp_path, 4, 2)
    assert found["loss"] > TOLERANCE or found["grad"] > TOLERANCE, found


def test_router_choice_equals_hf_on_a_planted_near_tie() -> None:
    """Every expert's router row is one vector v scaled by 1 + 1e-6·e: the sigmoid scores tie
    to ~1e-7 (which way depends on the token's sign of v·x), as do the correction bias's 1e-7
    steps: together they decide groups and experts."""
    config = tiny_moe_config(FAMILY, groups=4, top_groups=2)
    model = tiny_moe_model(FAMILY, seed=5, groups=4, top_groups=2)
    gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        v = torch.randn(config.hidden_size) * 0.3
        gate.weight.copy_(torch.stack([v * (1 + 1e-6 * e) for e in range(8)]))
        gate.e_score_correction_bias.copy_(torch.tensor([3, 0, 2, 5, 1, 4, 7, 6]) * 1e-7)
    tokens = torch.randn(64, config.hidden_size)
    _, hf_weights, hf_experts = gate(tokens)
    hf = layers_from_hf(config)
    block: Any = hf.layers[2].build()  # type: ignore[union-attr]  # HF layer 1: sparse
    ours: MoEFeedForward = block.layer.mlp
    ours.load_state_dict({**ours.state_dict(), "gate.weight": gate.weight.detach(),
                          "gate.e_score_correction_bias": gate.e_score_correction_bias})
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    local = ours.dispatcher

    def recording(experts: Any, hidden: torch.Tensor, chosen: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
        seen.append((chosen, weights))
        return local(experts, hidden, chosen, weights)

    ours.dispatcher = recording
    ours.eval()
    with torch.no_grad():
        ours(tokens.unsqueeze(0), None)
    chosen, weights = seen[0]
    order, hf_order = chosen.argsort(dim=-1), hf_experts.argsort(dim=-1)
    assert torch.equal(chosen.gather(1, order), hf_experts.gather(1, hf_order))
    # the same fp32 operations as HF's: equal far below the bias's 1e-7 steps
    assert torch.allclose(weights.gather(1, order), hf_weights.gather(1, hf_order),
                          rtol=0.0, atol=1e-8)
    assert len(set(map(tuple, chosen.sort(dim=-1)[0].tolist()))) > 1  # token-dependent


def test_export_holds_save_pretrained_names_and_loads(tmp_path: Path) -> None:
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_moe_model(FAMILY, seed=3)
    model.save_pretrained(tmp_path / "hf")
    hf = layers_from_hf(tiny_moe_config(FAMILY))
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn)
    load_hf_weights(module, hf, tmp_path / "hf")
    module.materialize([0])
    tensors = hf_checkpoint_tensors(hf_state_dict(module, hf), hf)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as handle:
        assert set(tensors) == set(handle.keys())
    (tmp_path / "out").mkdir()
    save_file(tensors, str(tmp_path / "out" / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(str(tmp_path / "out"))
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


@pytest.mark.parametrize(("change", "match"), [
    ({"n_group": 3}, r"n_group=3 must be >= 1 and divide the 8"),
    ({"topk_group": 5}, r"topk_group=5 must be in 1\.\.n_group=4"),
    ({"n_group": 8}, r"n_group=8 leaves 1 expert per group"),
    ({"num_experts_per_tok": 5, "topk_group": 2}, r"num_experts_per_tok=5 exceeds the 4"),
    ({"n_routed_experts": 10 ** 12}, r"1000000000000 experts.*lower the expert count"),
])
def test_bad_routing_config_is_one_line_in_under_a_second(change: dict[str, int],
                                                          match: str) -> None:
    config = tiny_moe_config(FAMILY)
    for name, value in change.items():
        setattr(config, name, value)
    start = time.perf_counter()
    with pytest.raises(PipelineConfigError, match=match) as raised:
        layers_from_hf(config, expert_parallel=2)
    assert time.perf_counter() - start < 1.0
    assert "\n" not in str(raised.value)


def test_ep_not_dividing_a_huge_expert_count_is_one_line_in_under_a_second() -> None:
    config = tiny_moe_config(FAMILY)
    config.n_routed_experts, config.n_group, config.topk_group = 10 ** 12 + 1, 1, 1
    start = time.perf_counter()
    with pytest.raises(PipelineConfigError, match=r"expert_parallel=2 must divide"):
        layers_from_hf(config, expert_parallel=2)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("balancing", ["hf-batch", "microbatch", "sequence"])
def test_balancing_with_a_loss_is_refused(balancing: str) -> None:
    with pytest.raises(PipelineConfigError, match=r"'aux-free'.*or 'none'"):
        layers_from_hf(tiny_moe_config(FAMILY), balancing=balancing)  # type: ignore[arg-type]


def test_default_balancing_is_aux_free_on_the_checkpoint_bias() -> None:
    hf = layers_from_hf(tiny_moe_config(FAMILY))
    assert hf.balancing is not None and hf.balancing.method == "aux-free"
    block: Any = hf.layers[2].build()  # type: ignore[union-attr]
    ours: MoEFeedForward = block.layer.mlp
    assert ours.bias is ours.gate.e_score_correction_bias and ours.expert_bias is None
    assert not isinstance(hf.layers[1].build().layer.mlp, MoEFeedForward)  # type: ignore


def _pipelined_rank(rank: int, world_size: int, out: str) -> None:
    found = moe_step_differences(FAMILY, pp=2, dp=2, ep=2, export=True)
    expected = expected_aux_free_biases(found["routes"])
    bias = max(_relative(moved, expected[index]) for index, moved in found["biases"].items())
    if rank == 0:
        keep = {k: found[k] for k in ("loss", "grad", "param", "export", "export_names",
                                      "export_problems")}
        torch.save(keep | {"bias": bias, "bias_layers": sorted(found["biases"])}, out)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_dp2_ep2_step_equals_hf(tmp_path: Path) -> None:
    out = str(tmp_path / "found.pt")
    run_ranks(_pipelined_rank, 4, out, timeout=300)
    found = torch.load(out)
    assert all(found[k] <= TOLERANCE for k in ("loss", "grad", "param", "export")), found
    assert found["export_names"] and not found["export_problems"], found
    # DeepSeek-V3's default aux-free balancing moved the checkpoint's bias as defined
    assert found["bias_layers"] and found["bias"] <= 1e-6, found
