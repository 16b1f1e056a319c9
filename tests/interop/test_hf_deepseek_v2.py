"""DeepSeek-V2 through `layers_from_hf`: from a `save_pretrained` directory one step's loss and
every gradient equal HF's, single-process and at pp 2 × dp 2 × ep 2, for a group-limited router
with low-rank q and for V2-Lite's shape (greedy, q projected directly); the export is
`save_pretrained`'s and loads with nothing missing or unexpected; planted routing bugs fail;
bad configs are one line before any rank starts."""

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
from pipeline.moe.balancing import MoEBalancing
from pipeline.moe.layer import MoEFeedForward
from pipeline.moe.routing import Routing, route
from tests.interop.test_moe_balancing import sequence_oracle, z_oracle
from tests.support.hf_moe_equivalence import moe_step_differences
from tests.support.hf_moe_models import tiny_moe_config, tiny_moe_model
from tests.support.rank_harness import run_ranks

TOLERANCE = 1e-5
FAMILY = "deepseek_v2"
SHAPES: dict[str, dict[str, Any]] = {
    "group-limited, q low-rank": {},  # 4 groups of 2 experts, the best group's top 2
    "V2-Lite: greedy, q direct": {"groups": 1, "q_rank": None},
}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _step_differences(tmp_path: Path, shape: dict[str, Any], balancing: Any = None,
                      oracle: Any = None) -> dict[str, float]:
    """One forward and backward of our single-stage layers loaded from HF's `save_pretrained`
    directory against HF's own on the same batch: the loss's and the worst gradient's
    relative differences. `oracle` (one layer's router logits -> its balancing loss) adds to
    HF's loss, per MoE layer, what `balancing` should add."""
    model = tiny_moe_model(FAMILY, seed=3, **shape)
    model.save_pretrained(tmp_path)
    hf = layers_from_hf(tiny_moe_config(FAMILY, **shape), balancing=balancing)
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn)
    load_hf_weights(module, hf, tmp_path)
    module.materialize([0])
    ids = torch.randint(1, 128, (4, 8), generator=torch.Generator().manual_seed(1))
    labels = causal_lm_targets(ids)
    loss = hf.loss_fn(module.stage(0)(ids), labels)
    loss.backward()
    out = model(input_ids=ids, labels=labels, output_router_logits=oracle is not None)
    expected = out.loss
    if oracle is not None:
        assert len(out.router_logits) == 3  # the MoE layers 1..3
        expected = expected + sum(oracle(logits) for logits in out.router_logits)
    expected.backward()
    reference = dict(model.named_parameters())
    grads = [_relative(param.grad, reference[hf.hf_name(*key)].grad)
             for key, param in module.named_layer_parameters()]
    assert len(grads) == len(reference)
    return {"loss": abs(float(loss.detach()) - float(expected.detach())) / float(expected.detach()),
            "grad": max(grads)}


@pytest.mark.parametrize("label", list(SHAPES))
def test_step_from_save_pretrained_equals_hf(tmp_path: Path, label: str) -> None:
    found = _step_differences(tmp_path, SHAPES[label])
    assert found["loss"] <= TOLERANCE and found["grad"] <= TOLERANCE, found


def test_sequence_loss_equals_its_definition_on_v2_lite(tmp_path: Path) -> None:
    """DeepSeek-V2's own balancing shape, the sequence-level loss, with the z-loss: loss and
    every gradient within 1e-5 of HF's model plus the oracles on its router logits (greedy
    routing: the oracle's plain top-k is the router's choice)."""
    balancing = MoEBalancing(method="sequence", aux_loss_coef=0.5, router_z_loss_coef=0.01)

    def oracle(logits: torch.Tensor) -> torch.Tensor:
        return sequence_oracle(logits, 2, 0.5, 4) + z_oracle(logits, 0.01)

    found = _step_differences(tmp_path, SHAPES["V2-Lite: greedy, q direct"], balancing, oracle)
    assert found["loss"] <= TOLERANCE and found["grad"] <= TOLERANCE, found


def _every_group_eligible(logits: torch.Tensor, top_k: int, **options: Any) -> Routing:
    """Planted bug: group_limited_greedy run as greedy (every group eligible)."""
    return route(logits, top_k, **{**options, "groups": 1, "top_groups": 1})


def _unscaled(logits: torch.Tensor, top_k: int, **options: Any) -> Routing:
    """Planted bug: routed_scaling_factor not applied to the combine weights."""
    return route(logits, top_k, **{**options, "scaling": 1.0})


@pytest.mark.parametrize("planted", [_every_group_eligible, _unscaled])
def test_planted_routing_bugs_fail_the_step_comparison(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: Any) -> None:
    monkeypatch.setattr(layer_module, "route", planted)
    found = _step_differences(tmp_path, SHAPES["group-limited, q low-rank"])
    assert found["loss"] > TOLERANCE or found["grad"] > TOLERANCE, found


@pytest.mark.parametrize("label", list(SHAPES))
def test_export_holds_save_pretrained_names_and_loads(tmp_path: Path, label: str) -> None:
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_moe_model(FAMILY, seed=3, **SHAPES[label])
    model.save_pretrained(tmp_path / "hf")
    hf = layers_from_hf(tiny_moe_config(FAMILY, **SHAPES[label]))
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
    ({"num_experts_per_tok": 3}, r"num_experts_per_tok=3 exceeds the 2"),
    ({"topk_method": "noaux_tc"}, r"topk_method='noaux_tc' is not one .*'greedy'"),
    ({"norm_topk_prob": True}, r"norm_topk_prob=True: transformers' DeepSeek-V2 router "
                               r"ignores it"),
    ({"topk_group": None}, r"group_limited_greedy' needs integer n_group and topk_group"),
    ({"n_routed_experts": 10 ** 12}, r"1000000000000 experts.*lower the expert count"),
])
def test_bad_config_is_one_line_in_under_a_second(change: dict[str, Any], match: str) -> None:
    config = tiny_moe_config(FAMILY)
    for name, value in change.items():
        setattr(config, name, value)
    start = time.perf_counter()
    with pytest.raises(PipelineConfigError, match=match) as raised:
        layers_from_hf(config, expert_parallel=2)
    assert time.perf_counter() - start < 1.0
    assert "\n" not in str(raised.value)


def test_balancing_defaults_to_none_and_refuses_hf_batch() -> None:
    """HF's DeepSeek-V2 adds no balancing loss, even with output_router_logits: the default
    adds none; HF's whole-batch loss is refused; the census-free losses read its softmax."""
    config = tiny_moe_config(FAMILY)
    config.output_router_logits = True
    hf = layers_from_hf(config)
    assert hf.balancing is not None and hf.balancing.method == "none" and hf.balance is None
    block: Any = hf.layers[2].build()  # type: ignore[union-attr]  # HF layer 1: sparse
    assert isinstance(block.layer.mlp, MoEFeedForward)
    assert not isinstance(hf.layers[1].build().layer.mlp, MoEFeedForward)  # type: ignore
    with pytest.raises(PipelineConfigError, match=r"does not take 'hf-batch'.*'none'"):
        layers_from_hf(config, balancing="hf-batch")
    for method in ("microbatch", "sequence", "aux-free"):
        layers_from_hf(config, balancing=method)  # type: ignore[arg-type]


def _pipelined_rank(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for label, shape in SHAPES.items():
        found = moe_step_differences(FAMILY, pp=2, dp=2, ep=2, export=True,
                                     model_options=shape)
        results[label] = {k: found[k] for k in ("loss", "grad", "param", "export",
                                                "export_names", "export_problems")}
    if rank == 0:
        torch.save(results, out)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_dp2_ep2_step_equals_hf(tmp_path: Path) -> None:
    out = str(tmp_path / "found.pt")
    run_ranks(_pipelined_rank, 4, out, timeout=400)
    found = torch.load(out)
    print(found)  # shown with pytest -s
    for label in SHAPES:
        assert all(found[label][k] <= TOLERANCE
                   for k in ("loss", "grad", "param", "export")), (label, found)
        assert found[label]["export_names"] and not found[label]["export_problems"], found
