"""Context parallelism for HF MoE models, with expert parallelism carved from dp × cp. From a
`save_pretrained` directory (``output_router_logits=True``, causal mask), one SGD step of tiny
Mixtral at dp 2 × cp 2 × ep 2 (4 ranks: HF's whole-batch balancing census, right-padded rows,
ring attention, Megatron-Core's per-microbatch loss), at ep 4 (over dp and cp) and without
ep, of Qwen2-MoE and Qwen3-MoE at dp 2 × cp 2 × ep 2, and of Mixtral at pp 2 × dp 2 × cp 2 ×
ep 2 (8 ranks) equals HF's step on the whole batch within 1e-5 (loss, every gradient,
updated weights); planted bugs (router statistics per cp rank only, in the census and in the
per-microbatch loss; the balancing shares not summed over cp; expert gradients averaged over
the dense dp × cp group) fail; the layout and the refusals are checked before ranks start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_context_parallel import context_parallel_hf
from pipeline.interop.hf_layers import layers_from_hf
from pipeline.interop.hf_moe_context import ContextBalancedLoss
from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf
from pipeline.moe import balance_loss, router_losses
from pipeline.parallel.config import ParallelConfig
from pipeline.parallel.expert_clipping import ExpertReplicatedGrads
from pipeline.parallel.expert_reduction import ExpertSplitReducer
from pipeline.parallel.topology import Topology, TopologyError
from pipeline.runtime import parallel_setup
from tests.support.hf_moe_cp_equivalence import moe_cp_step
from tests.support.hf_moe_models import tiny_moe_config
from tests.support.rank_harness import run_ranks

TOLERANCE = 1e-5
CLIP = 0.05
"""Below the tiny Mixtral's gradient norm: the step clips."""
CP2_EP2: dict[str, Any] = {"pp": 1, "dp": 2, "cp": 2, "ep": 2}
"""4 ranks: each replica's two cp ranks are its ep group."""
CASES_4: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral cp2 ep2": ("mixtral", CP2_EP2),
    "mixtral cp2 ep2 padded": ("mixtral", CP2_EP2 | {"padded": True}),
    "mixtral cp2 ep2 ring": ("mixtral", CP2_EP2 | {"ring": True}),
    "mixtral cp2 ep2 microbatch": ("mixtral", CP2_EP2 | {"balancing": "microbatch"}),
    "mixtral cp2 ep4": ("mixtral", CP2_EP2 | {"ep": 4}),  # the ep group spans dp and cp
    "mixtral cp2 ep1": ("mixtral", CP2_EP2 | {"ep": 1}),
    "mixtral cp2 ep2 clipped, checkpoint": ("mixtral", CP2_EP2 | {"clip": CLIP,
                                                                  "checkpoint": True}),
    "qwen2_moe cp2 ep2": ("qwen2_moe", CP2_EP2),
    "qwen3_moe cp2 ep2": ("qwen3_moe", CP2_EP2),
}
PP2_DP2_CP2_EP2: dict[str, Any] = {"pp": 2, "dp": 2, "cp": 2, "ep": 2}
CASES_8: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral pp2 dp2 cp2 ep2": ("mixtral", PP2_DP2_CP2_EP2),
    "mixtral pp2 dp2 cp2 ep2 microbatch": ("mixtral", PP2_DP2_CP2_EP2
                                           | {"balancing": "microbatch"}),
}


# -- planted bugs ----------------------------------------------------------------------------

_CENSUS_GROUP: list[Any] = []
_FINISH_CENSUS = balance_loss.BalanceLoss.finish_census


def _census_of_own_cp_rank(self: Any, replicas: int, num_microbatches: int,
                           device: Any = None) -> None:
    """Planted bug: the census summed over the pipeline's stages only, so each cp rank
    takes its own tokens' counts for the whole sequence's."""
    original = dist.all_reduce
    dist.all_reduce = lambda tensor, *a, **k: original(tensor, group=_CENSUS_GROUP[0])
    try:
        _FINISH_CENSUS(self, replicas, num_microbatches, device)
    finally:
        dist.all_reduce = original


def _counts_of_own_cp_rank(statistics: torch.Tensor, group: Any) -> torch.Tensor:
    """Planted bug: the per-microbatch loss's counts not summed over the cp group."""
    return statistics


def _shares_not_summed(self: Any, outputs: Any, targets: Any) -> torch.Tensor:
    """Planted bug: each cp rank's balancing share taken as if the reducer summed them."""
    return self.loss_sum(outputs[0], targets) * self.scale + outputs[1].sum()


def _experts_over_dense_group(dense: Any, expert_dp_group: Any, ep: int, *,
                              bucket_mb: float) -> ExpertSplitReducer:
    """Planted bug: expert gradients averaged over the dense dp × cp group (which mixes the
    ep ranks' different experts) instead of the expert-data-parallel group."""
    return ExpertSplitReducer(dense, dense.group, ep, bucket_mb=bucket_mb)


def _norm_of_dp_ranks(params: Any, group: Any, *, dp_rank: int, ep: int,
                      tp_rank: int) -> ExpertReplicatedGrads:
    """Planted bug: the clipping norm counts by dp rank (dp_rank · cp + cp_rank // cp), as
    if ep were carved from dp: dense squares on every cp rank, experts on too many."""
    return ExpertReplicatedGrads(params, group, dp_rank=dp_rank // CP2_EP2["cp"], ep=ep,
                                 tp_rank=tp_rank)


PLANTED: dict[str, tuple[Any, str, Callable[..., Any], dict[str, Any]]] = {
    "census per cp rank": (balance_loss.BalanceLoss, "finish_census", _census_of_own_cp_rank,
                           {}),
    "microbatch counts per cp rank": (router_losses, "reduce_token_statistics",
                                      _counts_of_own_cp_rank,
                                      {"balancing": "microbatch"}),
    "shares not summed over cp": (ContextBalancedLoss, "__call__", _shares_not_summed, {}),
    "experts over dp x cp": (parallel_setup, "ExpertSplitReducer", _experts_over_dense_group,
                             {}),
    "clipping norm by dp rank": (parallel_setup, "ExpertReplicatedGrads", _norm_of_dp_ranks,
                                 {"clip": CLIP}),
}


@contextlib.contextmanager
def _planted(owner: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _worst(found: dict[str, float]) -> float:
    return max(found[key] for key in ("loss", "grad", "param", "norm", "reload")
               if key in found)


def _ranks(rank: int, world_size: int, out: str) -> None:
    cases = CASES_4 if world_size == 4 else CASES_8
    layout = CP2_EP2 if world_size == 4 else PP2_DP2_CP2_EP2
    results = {label: moe_cp_step(family, **options)
               for label, (family, options) in cases.items()}
    # the census's planted group: this rank's pipeline (no other cp rank of its sequence)
    topology = Topology(layout["pp"], layout["dp"], cp=layout["cp"], ep=layout["ep"])
    _CENSUS_GROUP[:] = [None]
    for pipeline in topology.all_pipeline_groups():  # new_group is collective: all, in order
        group = dist.new_group(list(pipeline))
        if rank in pipeline:
            _CENSUS_GROUP[0] = group
    for bug, (owner, name, replacement, options) in PLANTED.items():
        with _planted(owner, name, replacement):
            results[f"planted: {bug}"] = moe_cp_step("mixtral", **layout, **options)
    if rank == 0:
        torch.save(results, out)


def _check(found: dict[str, dict[str, float]], cases: dict[str, Any]) -> None:
    print(found)  # shown with pytest -s
    for label, (_, options) in cases.items():
        assert _worst(found[label]) <= TOLERANCE, (label, found[label])
        if "clip" in options:
            assert found[label]["clipped"] == 1.0, found[label]
        assert ("reload" in found[label]) == bool(options.get("checkpoint")), found[label]
    for bug in PLANTED:
        assert _worst(found[f"planted: {bug}"]) > 1e-3, (bug, found)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cp2_ep2_steps_equal_hf_and_planted_bugs_fail(tmp_path: Path) -> None:
    out = str(tmp_path / "found.pt")
    run_ranks(_ranks, 4, out, timeout=900)
    _check(torch.load(out), CASES_4)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_dp2_cp2_ep2_steps_equal_hf_and_planted_bugs_fail(tmp_path: Path) -> None:
    out = str(tmp_path / "found.pt")
    run_ranks(_ranks, 8, out, timeout=900)
    _check(torch.load(out), CASES_8)


# -- the layout and refusals, before any rank starts ----------------------------------------

def test_ep_is_carved_from_dp_x_cp_in_rank_order() -> None:
    topology = Topology(1, 2, 1, ep=2, cp=2)  # ranks: (dp, cp) = 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1)
    assert [topology.position(r).ep_group for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [topology.position(r).expert_dp_group for r in range(4)] == \
        [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [topology.position(r).ep_rank for r in range(4)] == [0, 1, 0, 1]
    four = Topology(2, 1, 1, ep=4, cp=4)  # the ep group spans the cp ranks of a sequence
    assert four.position(5).ep_group == four.position(5).cp_group == (4, 5, 6, 7)
    assert sorted(r for g in four.all_ep_groups() for r in g) == list(range(8))
    assert sorted(r for g in Topology(1, 2, 2, ep=2, cp=2).all_expert_dp_groups()
                  for r in g) == list(range(8))
    assert Topology(1, 4, 1, ep=2).position(3).ep_group == (2, 3)  # cp = 1: as before


def test_ep_that_does_not_divide_dp_x_cp_is_one_line() -> None:
    with pytest.raises(TopologyError, match=r"ep=4 must divide dp=1 × cp=2 = 2 .*among \[1, 2\]"):
        Topology(1, 1, 1, ep=4, cp=2)
    with pytest.raises(PipelineConfigError, match=r"expert_parallel=4 must divide "
                                                  r"data_parallel=1 × context_parallel=2"):
        ParallelConfig(data_parallel=1, context_parallel=2, expert_parallel=4)
    assert ParallelConfig(data_parallel=1, context_parallel=2, expert_parallel=2)


def test_uncovered_moe_layouts_are_refused() -> None:
    with pytest.raises(PipelineConfigError, match=r"not 'olmoe' \(it is not checked"):
        context_parallel_hf(layers_from_hf(tiny_moe_config("olmoe")))
    with pytest.raises(PipelineConfigError, match=r"not 'deepseek_v3' \(its attention is "
                                                  r"multi-head latent"):
        context_parallel_hf(layers_from_hf(tiny_moe_config("deepseek_v3")))
    with pytest.raises(PipelineConfigError, match=r"tensor_parallel_hf's MoE layers are not "
                                                  r"split over cp yet"):
        context_parallel_hf(tensor_parallel_hf(layers_from_hf(tiny_moe_config("mixtral"))))
    with pytest.raises(PipelineConfigError, match=r"tied input and output embeddings"):
        context_parallel_hf(layers_from_hf(tiny_moe_config("mixtral", tied=True)))
