"""A tensor-parallel refusal through the engine says why first, on one line: not a whole
`LayerSpec(...)` repr and a model config dump before the reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineEngine, PipelineModule
from pipeline.model.layers import LayerSpec
from pipeline.parallel.tensor.layers import ParallelTransformerBlock
from tests.support.hf_models import tiny_config
from tests.support.rank_harness import run_ranks

_REASON = "num_heads = 3 is not divisible by the tensor-parallel size 2"


def block_from_config(config: Any, num_heads: int, group: Any = None) -> nn.Module:
    """A tp block sized from a model config (whose repr is a many-line JSON dump)."""
    return ParallelTransformerBlock(12, num_heads, group)


def _refused(rank: int, world_size: int) -> None:
    config = tiny_config("llama")
    assert "\n" in repr(config)  # the dump the message used to start with
    module = PipelineModule([LayerSpec(block_from_config, config, 3)] * 2, num_stages=1,
                            loss_fn=F.mse_loss)
    with pytest.raises(ValueError) as refused:
        PipelineEngine(module, num_microbatches=2, timeout=60, tensor_parallel=world_size)
    message = str(refused.value)
    assert message.startswith(_REASON), message
    assert "\n" not in message and len(message) < 400, message
    assert "LayerSpec(block_from_config)" in message and "fix the LayerSpec" in message


@pytest.mark.multiprocess
def test_a_tp_refusal_gives_the_reason_first_on_one_line() -> None:
    # regression: the message began with "LayerSpec(...) with args (..., LlamaConfig {" and
    # the whole config, one key a line, before the reason
    run_ranks(_refused, 2)
