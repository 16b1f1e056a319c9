"""tp > 1 over a layer that splits nothing is refused by name, on every rank, before a step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline import PipelineEngine, PipelineModule
from pipeline.errors import PipelineConfigError
from pipeline.parallel.tensor import split_check
from pipeline.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from pipeline.parallel.tensor.split_check import check_layers_split, mark_replicated, unsplit_layers
from tests.support.rank_harness import run_ranks


def _replicated_by_definition(layer: nn.Module) -> bool:
    """The oracle, from the definition: trainable parameters, none carrying a tp dim."""
    params = [p for p in layer.parameters() if p.requires_grad]
    return bool(params) and all(getattr(p, "pipesched_tensor_parallel_dim", None) is None
                                for p in params)


def test_unsplit_layers_are_the_ones_holding_parameters_and_splitting_none() -> None:
    norm = nn.LayerNorm(4)
    layers: list[tuple[int, nn.Module]] = [
        (0, nn.Linear(4, 4)), (1, ColumnParallelLinear(4, 8, None)), (2, nn.GELU()),
        (3, RowParallelLinear(8, 4, None)), (4, mark_replicated(nn.LayerNorm(4))),
        (5, norm), (6, nn.Sequential(nn.Linear(4, 4), ColumnParallelLinear(4, 4, None)))]
    frozen = nn.Linear(2, 2).requires_grad_(False)
    layers.append((7, frozen))
    expected = [index for index, layer in layers
                if _replicated_by_definition(layer) and index != 4]  # 4: marked on purpose
    assert [int(text.split()[1]) for text in unsplit_layers(layers)] == expected == [0, 5]
    assert unsplit_layers(layers)[0] == "layer 0 (Linear, 20 parameters)"
    check_layers_split(layers, 1, gather=False)  # tp = 1: nothing to split
    with pytest.raises(PipelineConfigError, match=r"tensor_parallel=2 but layer 0 \(Linear, "
                       r"20 parameters\); layer 5 \(LayerNorm, 8 parameters\) split no "
                       r"parameter.*tensor_parallel_hf.*mark_replicated"):
        check_layers_split(layers, 2, gather=False)


def _hf_llama_at_tp2(rank: int, world_size: int) -> None:
    from pipeline.interop.hf_layers import layers_from_hf
    from tests.support.hf_models import tiny_config

    torch.set_num_threads(1)
    hf = layers_from_hf(tiny_config("llama"))

    def engine(module: PipelineModule) -> PipelineEngine:
        return PipelineEngine(module, num_microbatches=2, tensor_parallel=2, timeout=60,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1))

    module = PipelineModule(hf.layers, num_stages=2, loss_fn=hf.loss_fn,
                            partition_method="uniform")
    with pytest.raises(PipelineConfigError) as caught:
        engine(module)
    message = str(caught.value)
    # every rank names every offending layer, its own stage's and the other stage's
    for layer in ("layer 1 (HFBlock(LlamaDecoderLayer)", "layer 2 (HFBlock(LlamaDecoderLayer)",
                  "layer 3 (HFFinalNorm"):
        assert layer in message, message
    assert "tensor_parallel_hf" in message
    # the planted bug: without the check the same run builds, each tp rank the whole stage
    original = split_check.unsplit_layers
    split_check.unsplit_layers = lambda layers: []
    try:
        module = PipelineModule(hf.layers, num_stages=2, loss_fn=hf.loss_fn,
                                partition_method="uniform")
        stages = list(engine(module).stage_ids)
    finally:
        split_check.unsplit_layers = original
    full = PipelineModule(hf.layers, num_stages=2, partition_method="uniform")
    full.materialize(stages)
    assert sum(p.numel() for p in module.parameters()) == sum(
        p.numel() for p in full.parameters())


@pytest.mark.multiprocess
def test_tp_over_unsplit_hf_layers_is_refused_by_name() -> None:
    pytest.importorskip("transformers")
    run_ranks(_hf_llama_at_tp2, 4)
