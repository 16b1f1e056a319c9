"""Mixture-of-experts models in the planner: shapes from HF MoE configs and model strings
(parameters against HF models, top-k FLOPs), expert parallelism as a search dimension (its
memory against the accounting, its all-to-all against the definition), the pick and its
launch line, and every ep refusal naming its cause."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pipeline.planner.data_parallel as data_parallel
import pipeline.planner.grid as grid
import pipeline.planner.request_check as request_check
from pipeline.cli import main
from pipeline.planner import PRESETS, PlanConfig, PlanError, SearchOptions, load_model, plan
from pipeline.planner.engines import engine_options
from pipeline.planner.expert_parallel import expert_all_to_all, expert_sizes, exposed_in_ops
from pipeline.planner.hf_config import shape_from_hf_config
from pipeline.planner.launch import launch_lines
from pipeline.planner.predict import PlanContext
from pipeline.planner.pricing import allgather_seconds
from pipeline.planner.search import price
from schedules import CostModel
from schedules.analysis.accounting import expert_parallel_state_bytes
from schedules.analysis.all_to_all import ExpertAllToAll

__all__: list[str] = []

GIB = 2**30
H100 = PRESETS["h100-80g"]
TINY = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 32}
MOE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", {"intermediate_size": 48, "num_local_experts": 4,
                                  "num_experts_per_tok": 2}),
    "qwen2_moe-shared-dense-layer": ("Qwen2MoeConfig", {
        "intermediate_size": 96, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 80, "num_experts": 4, "num_experts_per_tok": 2,
        "mlp_only_layers": [1]}),
    "qwen3_moe-sparse-step": ("Qwen3MoeConfig", {
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
        "num_experts_per_tok": 3, "head_dim": 16, "decoder_sparse_step": 2}),
}
SHAPE = ("layers=8,hidden=1024,heads=8,vocab=1000,seq=512,mlp=swiglu,norm=rmsnorm,bias=none,"
         "learned_positions=false,ffn=4096")
MOE = SHAPE + ",experts=8,topk=2,expert_ffn=4096"
"""Experts dominate: 8 × 3 × 1024 × 4096 parameters a block against 4 × 1024² of attention."""


def _count(module: Any) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


@pytest.mark.parametrize("name", sorted(MOE_FAMILIES))
def test_parameters_and_top_k_flops_equal_the_hf_moe_models(name: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    class_name, arguments = MOE_FAMILIES[name]
    config = getattr(transformers, class_name)(**TINY, **arguments)
    model = transformers.AutoModelForCausalLM.from_config(config)
    document = json.loads(config.to_json_string(use_diff=True))
    (tmp_path / "config.json").write_text(json.dumps(document))
    profile = load_model(str(tmp_path))
    assert profile.num_parameters == _count(model)
    shape = shape_from_hf_config(document)
    assert shape.num_parameters() == _count(model)
    # the standard forward FLOPs per token: 2 per weight of every matrix product a token
    # runs through (its k experts of E, the shared expert, the router), QKᵀ and its product
    # with V 2·s·(a·d) each, the logits 2·h·V
    k, experts = config.num_experts_per_tok, profile.experts
    expected = 2 * shape.hidden * shape.vocab
    for block in model.model.layers:
        weights = 0
        for module_name, module in block.named_modules():
            if type(module).__name__ == "Linear":
                weights += module.weight.numel()
            elif module_name == "mlp.gate":  # the router (its own class, not a Linear)
                weights += module.weight.numel()
            elif module_name == "mlp.experts":
                weights += _count(module) * k // experts
        expected += 2 * weights + 4 * shape.seq * shape.heads * shape.head_dim
    assert shape.flops_per_token() == expected
    assert profile.flops_per_sample == pytest.approx(shape.seq * expected, rel=1e-12)
    sparse = [index for index in range(3) if "experts" in dict(
        model.model.layers[index].mlp.named_children())]
    assert [index for index in range(3) if profile.layers[1 + index].expert_params] == sparse


def test_the_model_string_describes_the_same_moe_as_the_hf_config() -> None:
    text = ("layers=3,hidden=64,heads=8,kv_heads=2,vocab=100,seq=32,mlp=swiglu,norm=rmsnorm,"
            "bias=qkv,learned_positions=false,ffn=96,experts=4,topk=2,expert_ffn=32,"
            "shared_ffn=80,shared_gate=true,dense_layers=1")
    document = TINY | MOE_FAMILIES["qwen2_moe-shared-dense-layer"][1] | {
        "model_type": "qwen2_moe"}
    assert load_model(text).num_parameters == shape_from_hf_config(document).num_parameters()
    with pytest.raises(PlanError, match="topk=9 must be at most experts=8"):
        load_model(SHAPE + ",experts=8,topk=9,expert_ffn=64")
    with pytest.raises(PlanError, match="needs experts=, topk= and expert_ffn="):
        load_model(SHAPE + ",experts=8,topk=2")


def _all_to_all_oracle(nbytes: float, ep: int, cluster: Any) -> float:
    """One all-to-all by its definition: each rank sends nbytes / ep to each of the ep - 1
    others, all at once; peers on its node over NVLink, the rest over its NIC share."""
    per_node = cluster.devices_per_node
    local = min(ep, per_node)
    links = []
    if local > 1:
        links.append(cluster.intra_latency + (local - 1) * nbytes / ep
                     / (cluster.intra_bandwidth * cluster.link_efficiency))
    if ep > local:
        share = cluster.nics_per_node * cluster.nic_bandwidth / per_node
        links.append(cluster.inter_latency + (ep - local) * nbytes / ep
                     / (share * cluster.link_efficiency))
    return max(links)


@pytest.mark.parametrize(("devices_per_node", "ep"), [(8, 4), (8, 8), (2, 4)])
def test_all_to_all_is_dispatch_and_combine_of_top_k_copies(devices_per_node: int,
                                                            ep: int) -> None:
    cluster = replace(H100, nodes=16 // devices_per_node, devices_per_node=devices_per_node)
    model = load_model(MOE)
    # tokens spread evenly (a measured imbalance of 1.0); the busiest rank's share at the
    # sampling floor: tests/planner/test_expert_kernels.py
    context = PlanContext(model, cluster, 64, "bf16", routing_imbalance=1.0)
    config = PlanConfig(pp=2, tp=1, dp=8, schedule="1f1b", chunks=1, microbatch_size=2,
                        num_microbatches=4, zero_stage=0, recompute="none", ep=ep)
    table = context.table(config)
    found = expert_all_to_all(table, cluster, batch=2, ep=ep)
    assert found is not None
    # per MoE layer and microbatch: s·k·h tokens' bf16 hidden states out and back (2),
    # each stage holds 4 of the 8 MoE blocks
    one = _all_to_all_oracle(2 * 512 * 2 * 1024 * 2, ep, cluster)
    assert np.allclose(found.forward, [4 * 2 * one] * 2, rtol=1e-12)
    assert np.allclose(found.backward, found.forward, rtol=1e-12)
    assert expert_all_to_all(table, cluster, batch=2, ep=1) is None
    dense = PlanContext(load_model(SHAPE), cluster, 64, "bf16")
    assert expert_all_to_all(dense.table(config), cluster, batch=2, ep=ep) is None
    # the simulator prices them on its lane; the cost-aware generators plan on ops holding
    # them, exposed: inside F and I (a fused B = I + W carries them)
    costs = table.costs(2)
    lane = CostModel(forward=costs.forward.tolist(), backward=costs.input_grad.tolist(),
                     weight=costs.weight_grad.tolist(), all_to_all=found)
    inside = exposed_in_ops(lane)
    assert inside.all_to_all is None
    assert np.allclose(np.subtract(inside.forward, costs.forward), found.forward)
    assert np.allclose(np.subtract(inside.backward, costs.input_grad), found.backward)
    assert inside.weight == lane.weight
    assert exposed_in_ops(replace(lane, all_to_all=None)).all_to_all is None
    priced = price(model, cluster, 64, config)
    # at least its own m·(F + B) all-to-alls (the delay to its end: test_moe_breakdown)
    assert priced.breakdown["ep_comm"] >= 4 * 2 * (4 * 2 * one) * (1 - 1e-9)
    assert sum(priced.breakdown.values()) == pytest.approx(priced.step_seconds, rel=1e-9)


def test_dualpipev_overlap_hides_part_of_the_all_to_all_that_dualpipev_exposes() -> None:
    """The planner prices the all-to-all on the simulator's lane: exposed in ops run alone
    (dualpipev: the whole m·(forward + backward) of the last rank), partly hidden under the
    other microbatch's compute in dualpipev-overlap's F&B pairs."""
    cluster = replace(H100, nodes=2, devices_per_node=8)
    model = load_model(MOE)
    found = {}
    for name in ("dualpipev", "dualpipev-overlap"):
        config = PlanConfig(pp=2, tp=1, dp=8, schedule=name, chunks=2, microbatch_size=1,
                            num_microbatches=8, zero_stage=0, recompute="none", ep=8)
        found[name] = price(model, cluster, 64, config)
        assert sum(found[name].breakdown.values()) == pytest.approx(
            found[name].step_seconds, rel=1e-9)
    plain, paired = (found[n].breakdown["ep_comm"] for n in ("dualpipev", "dualpipev-overlap"))
    assert 0 < paired < plain
    assert found["dualpipev-overlap"].step_seconds < found["dualpipev"].step_seconds


def test_overlapped_gather_at_ep_gathers_dense_over_dp_and_experts_over_dp_by_ep() -> None:
    """ZeRO-1's overlapped parameter gather at ep > 1, priced from its definition: each
    stage's dense parameters all-gathered over dp (half an all-reduce of their fp32 bytes),
    then its 1/ep of the experts over the dp / ep replicas holding the same ones."""
    cluster = replace(H100, nodes=2, devices_per_node=8)
    context = PlanContext(load_model(MOE), cluster, 64, "bf16")
    config = PlanConfig(pp=2, tp=1, dp=8, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=8, zero_stage=1, recompute="none", ep=4)
    table = context.table(config)
    gather = data_parallel.param_gather(table, cluster, dp=8, tp=1, zero_stage=1, ep=4)
    assert gather is not None
    expected = [allgather_seconds(4 * dense, 8, 1, cluster)
                + allgather_seconds(4 * experts / 4, 2, 4, cluster)
                for dense, experts in zip(table.params, table.experts, strict=True)]
    assert np.allclose(gather.time, expected, rtol=1e-12)
    assert all(e > 0 for e in table.experts)
    at_1 = data_parallel.param_gather(table, cluster, dp=8, tp=1, zero_stage=1, ep=1)
    assert at_1 is not None and np.allclose(at_1.time, [
        allgather_seconds(4 * (d + e), 8, 1, cluster)
        for d, e in zip(table.params, table.experts, strict=True)], rtol=1e-12)
    priced = price(load_model(MOE), cluster, 64, config,
                   options=SearchOptions(overlap_param_gather=True))
    assert priced.config.ep == 4


def test_all_to_all_interface_is_the_shared_one() -> None:
    value = ExpertAllToAll(forward=[1.0, 2.0], backward=[3.0, 4.0])
    assert (value.forward, value.backward) == ([1.0, 2.0], [3.0, 4.0])


@pytest.mark.parametrize(("ep", "zero"), [(1, 0), (2, 1), (4, 0), (8, 1)])
def test_expert_states_are_the_accountings(ep: int, zero: int) -> None:
    model = load_model(MOE)
    context = PlanContext(model, H100, 64, "bf16")
    config = PlanConfig(pp=1, tp=1, dp=8, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=8, zero_stage=zero, recompute="none", ep=ep)
    memory, _ = context.memory(config, context.held_trace(config))
    experts = sum(layer.expert_params for layer in model.layers)
    dense = model.num_parameters - experts
    states = memory.parameters + memory.gradients + memory.optimizer
    assert states == pytest.approx(expert_parallel_state_bytes(
        int(dense), int(experts), expert_parallel=ep, data_parallel=8, zero_stage=zero),
        rel=1e-12)


def _small_cluster(memory_gib: float) -> Any:
    """A toy H100 of a few GiB, without CUDA's runtime (its NCCL buffers alone would take
    GiB: `runtime_memory`)."""
    return replace(H100, nodes=1, device_memory=memory_gib * GIB, compute_capability=0)


FAST = {"schedules": ("1f1b",), "recompute_choices": ("none",)}


def test_pick_uses_ep_when_experts_dominate_memory_and_ep_1_for_a_dense_model() -> None:
    cluster = _small_cluster(3.0)
    moe = plan(load_model(MOE), cluster, 16, options=SearchOptions(**FAST))
    assert moe.best.config.ep > 1
    # without ep the experts' states alone (16 bytes each over ≥ 1/pp of them) need pp ≥ 8
    no_ep = plan(load_model(MOE), cluster, 16, options=SearchOptions(**FAST,
                                                                     expert_parallel=(1,)))
    assert all(p.config.ep == 1 for p in no_ep.predictions)
    assert moe.best.step_seconds < no_ep.best.step_seconds
    assert moe.best.breakdown["ep_comm"] > 0
    dense = plan(load_model(SHAPE), cluster, 16, options=SearchOptions(**FAST))
    assert {p.config.ep for p in dense.predictions} == {1}
    assert all(p.breakdown["ep_comm"] == 0 for p in dense.predictions)


def _ep_rules(config: PlanConfig, experts: int) -> bool:
    """The engine's rules: ep divides dp and the experts; tp 1 without sequence parallelism."""
    return config.dp % config.ep == 0 and experts % config.ep == 0 \
        and (config.ep == 1 or config.tp == 1)


def _searched(model: Any) -> list[PlanConfig]:
    return list(grid.configurations(model, _small_cluster(80.0), 48,
                                    SearchOptions(**FAST, zero_stages=(0,))))


def test_searched_ep_sizes_follow_the_engines_rules() -> None:
    model = load_model(SHAPE + ",experts=6,topk=2,expert_ffn=512")
    configs = _searched(model)
    assert all(_ep_rules(config, 6) for config in configs)
    assert {(c.dp, c.ep) for c in configs} >= {(2, 2), (4, 2), (8, 2)}  # 4, 8 divide no 6
    assert expert_sizes(6, 6) == [1, 2, 3, 6] and expert_sizes(6, 0) == [1]


def test_searched_ep_rules_catch_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    # planted: ep sizes that divide dp only, not the experts
    monkeypatch.setattr(grid, "expert_sizes", lambda dp, experts, allowed=None, **_: [
        ep for ep in range(1, dp + 1) if dp % ep == 0])
    model = load_model(SHAPE + ",experts=6,topk=2,expert_ffn=512")
    assert not all(_ep_rules(config, 6) for config in _searched(model))


REFUSALS: list[tuple[str, Callable[[], object], list[str]]] = [
    ("ep does not divide the experts", lambda: plan(
        load_model(SHAPE + ",experts=6,topk=2,expert_ffn=512"), _small_cluster(80), 16,
        options=SearchOptions(expert_parallel=(4,))),
     ["expert-parallel size 4 does not divide the model's 6 experts", "use one of 1, 2, 3, 6"]),
    ("ep divides none of the dp asked", lambda: plan(
        load_model(MOE), _small_cluster(80), 16,
        options=SearchOptions(expert_parallel=(4,), data_parallel=(2,))),
     ["expert-parallel size 4 divides none of the data-parallel sizes 2", "use one of 1, 2"]),
    ("ep divides none of the dp the grid leaves", lambda: plan(
        load_model(MOE), replace(H100, nodes=1, devices_per_node=2), 16,
        options=SearchOptions(**FAST, expert_parallel=(4,))),
     ["ep must divide dp", "divide none of the data-parallel sizes left (1, 2)",
      "use one of 1, 2"]),
    ("ep on a dense model", lambda: plan(load_model(SHAPE), _small_cluster(80), 16,
                                         options=SearchOptions(expert_parallel=(2,))),
     ["expert-parallel size 2", "has no experts"]),
    ("tp with experts without sequence parallelism", lambda: plan(
        load_model(MOE), _small_cluster(80), 16, options=SearchOptions(tensor_parallel=(2,))),
     ["tensor-parallel size 2", "with sequence parallelism only", "--sequence-parallel"]),
    ("an engine whose MoE runs are unpriced", lambda: plan(
        load_model(MOE), _small_cluster(80), 16,
        options=SearchOptions(**engine_options("deepspeed"))),
     ["mixture of experts", "--engine pipesched"]),
    ("price: ep does not divide dp", lambda: PlanConfig(
        pp=2, tp=1, dp=4, schedule="1f1b", chunks=1, microbatch_size=1, num_microbatches=4,
        zero_stage=0, recompute="none", ep=3), ["ep=3 must be a whole number >= 1 dividing dp=4",
                                                "use one of 1, 2, 4"]),
    ("price: ep does not divide the experts", lambda: price(
        load_model(SHAPE + ",experts=6,topk=2,expert_ffn=512"), _small_cluster(80), 16,
        PlanConfig(pp=2, tp=1, dp=4, schedule="1f1b", chunks=1, microbatch_size=1,
                   num_microbatches=4, zero_stage=0, recompute="none", ep=4)),
     ["does not divide the model's 6 experts"]),
]


@pytest.mark.parametrize(("case", "words"), [(case, words) for _, case, words in REFUSALS],
                         ids=[name for name, _, _ in REFUSALS])
def test_every_ep_refusal_names_its_cause(case: Callable[[], object], words: list[str]) -> None:
    with pytest.raises(PlanError) as caught:
        case()
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_plan_prints_ep_in_the_pick_and_its_launch_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"preset": "h100-80g", "device_memory": 3 * GIB,
                                       "compute_capability": 0}))
    code = main(["plan", "--model", MOE, "--cluster", str(cluster), "--global-batch", "16",
                 "--schedules", "1f1b", "--no-recompute", "--top", "3"])
    assert code == 0
    out = capsys.readouterr().out
    pick = next(line for line in out.splitlines() if line.startswith("pick: "))
    ep = int(pick.split(" ep")[1].split()[0])
    assert ep > 1 and f"expert_parallel={ep}" in out
    code = main(["plan", "--model", MOE, "--cluster", "h100-80g", "--global-batch", "16",
                 "--price", "pp2,dp4,ep4"])
    assert code == 0
    out = capsys.readouterr().out
    assert "ep_comm" in out and "expert_parallel=4" in out
    config = PlanConfig(pp=2, tp=1, dp=4, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=4, zero_stage=0, recompute="none", ep=4)
    assert config.label() == "pp2 tp1 dp4 ep4 1f1b b1 m4 z0"
    assert config.engine_arguments()["expert_parallel"] == 4
    assert "expert_parallel" not in replace(config, ep=1).engine_arguments()
    assert any("expert_parallel=4" in line for line in launch_lines("pipesched", config, 16, 8))


def test_ep_refusal_catches_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    # planted: the request's expert checks skipped; the search then refuses for another
    # reason that does not name the experts ep fails to divide
    monkeypatch.setattr(request_check, "_expert_problems", lambda model, options: [])
    with pytest.raises(PlanError) as caught:
        REFUSALS[0][1]()
    assert "does not divide the model's 6 experts" not in str(caught.value)
