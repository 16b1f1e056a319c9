"""One training step of a tiny HF family at pp × cp against HF itself (test helper)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop import hf_context_layers
from pipeline.interop.hf_context_parallel import context_parallel_hf
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf
from pipeline.interop.hf_weights import gather_hf_state_dict, load_hf_weights
from pipeline.parallel.context import mask as position_mask
from pipeline.parallel.context import ring, sharding
from pipeline.parallel.data_parallel import NoOpGradReducer
from pipeline.parallel.tensor.shard_layout import layout_of
from pipeline.runtime import parallel_setup
from tests.support.hf_models import tiny_config, tiny_model, token_batch

__all__ = ["PLANTED", "CPCase", "cp_step_errors"]

LEARNING_RATE = 0.1


def _keys_in_natural_order(length: int, cp: int, device: Any = None) -> torch.Tensor:
    """Planted bug: the gathered keys taken as positions 0..S-1, as if each rank held one
    contiguous block (the balanced chunk order forgotten in the mask)."""
    return torch.arange(length, device=device)


def _strictly_earlier(query: torch.Tensor, key: torch.Tensor, padding: Any = None,
                      window: Any = None) -> torch.Tensor:
    """Planted bug: the causal mask off by one (a token does not see itself)."""
    return _CONTEXT_MASK(query - 1, key, padding, window)


def _merge_without_its_weight(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                              block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Planted bug in ring attention: each block's log-sum-exp dropped, so the online softmax
    merges the blocks' outputs with equal weight."""
    return _RING_MERGE(out, lse, block_out, torch.zeros_like(block_lse))


_RING_MERGE = ring._merge
_CONTEXT_MASK = position_mask.context_mask


def _no_reduction(*_: Any, **__: Any) -> NoOpGradReducer:
    """Planted bug: gradients are not reduced over the cp ranks."""
    return NoOpGradReducer()


PLANTED: dict[str, tuple[Any, str, Any]] = {
    "keys-in-natural-order": (hf_context_layers, "gathered_positions",
                              _keys_in_natural_order),
    "mask-off-by-one": (position_mask, "context_mask", _strictly_earlier),
    "no-cp-reduction": (parallel_setup, "make_grad_reducer", _no_reduction),
    "ring-block-weight-dropped": (ring, "_merge", _merge_without_its_weight),
}
"""name -> (module, attribute, replacement)."""


@dataclass(frozen=True)
class CPCase:
    """A tiny HF family at pp × dp × cp × tp under a schedule."""

    family: str
    pp: int
    cp: int
    tp: int = 1
    dp: int = 1
    """Replicas, each passing its own rows (the same rows on each of its cp ranks)."""
    sequence_parallel: bool = False
    overlap: bool = False
    """``tensor_parallel_hf(..., overlap=True)``: tp collectives beside the GEMMs."""
    ring: bool = False
    """``context_parallel_hf(..., attention="ring")``."""
    padded: bool = False
    length: int = 8
    schedule: str = "1f1b"
    zero: bool = False
    """ZeRO-1: optimizer state sharded over dp × cp."""
    recompute: str = "none"
    planted: str = ""

    def label(self) -> str:
        return "-".join(p for p in (self.family, f"pp{self.pp}", f"cp{self.cp}",
                                    f"tp{self.tp}" if self.tp > 1 else "",
                                    f"dp{self.dp}" if self.dp > 1 else "",
                                    "sp" if self.sequence_parallel else "",
                                    "overlap" if self.overlap else "",
                                    "ring" if self.ring else "",
                                    "padded" if self.padded else "", self.schedule,
                                    "zero1" if self.zero else "",
                                    "" if self.recompute == "none" else self.recompute,
                                    self.planted) if p)


def _relative(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """||got - want|| / ||want|| over this rank's pairs, then the largest over the world."""
    sums = torch.zeros(2, dtype=torch.float64)
    for got, want in pairs:
        sums[0] += (got.double() - want.double()).pow(2).sum()
        sums[1] += want.double().pow(2).sum()
    error = (sums[0].sqrt() / sums[1].sqrt()).reshape(1)
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return float(error)


def cp_step_errors(case: CPCase) -> dict[str, float]:
    """On every rank: one SGD step of `case` (weights read from a `save_pretrained`
    directory; every cp rank given the whole batch) against HF's model(labels=) + backward
    + the same step. Relative errors of the loss, the reduced gradients, the updated
    weights and the whole exported state dict (the largest over the ranks)."""
    torch.set_num_threads(1)
    sharding.check_context_parallel_sequence(case.length, case.cp)
    hf_model = tiny_model(case.family, tied=False, seed=3)
    ids, mask = token_batch(4, case.length, seed=2, padded=case.padded)
    labels = causal_lm_targets(ids, mask if case.padded else None)
    hf = layers_from_hf(tiny_config(case.family, tied=False))
    if case.tp > 1:  # cp over tp: the order the transforms compose in
        hf = tensor_parallel_hf(hf, sequence_parallel=case.sequence_parallel,
                                overlap=case.overlap)
    hf = context_parallel_hf(hf, attention="ring" if case.ring else "all-gather")
    module = PipelineModule(hf.layers, num_stages=case.pp, loss_fn=hf.loss_fn,
                            partition_method="uniform", recompute=case.recompute)
    with tempfile.TemporaryDirectory() as directory:
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        if dist.get_rank() == 0:
            hf_model.save_pretrained(box[0])
        dist.barrier()
        load_hf_weights(module, hf, box[0])  # read as each rank builds its stages
        engine = PipelineEngine(module, schedule=case.schedule, num_microbatches=2,
                                context_parallel=case.cp, tensor_parallel=case.tp,
                                data_parallel=case.dp,
                                zero_stage=int(case.zero),
                                timeout=60,
                                optimizer=lambda p: torch.optim.SGD(p, lr=LEARNING_RATE))
        dist.barrier()
    rows = ids.shape[0] // case.dp
    mine = slice(engine.position.dp_rank * rows, (engine.position.dp_rank + 1) * rows)
    inputs = (ids[mine], mask[mine]) if case.padded else ids[mine]
    loss = engine.train_batch(inputs, labels[mine])
    grads = engine.reduced_gradients()

    expected = hf_model(input_ids=ids, attention_mask=mask if case.padded else None,
                        labels=labels).loss
    expected.backward()
    reference = dict(hf_model.named_parameters())
    def mine(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        layout = layout_of(param)  # a tp slice: the same slice of HF's tensor
        return whole if layout is None else layout.shard(whole)

    grad = _relative([(grads[key], mine(p, reference[hf.hf_name(*key)].grad))
                      for key, p in module.named_layer_parameters()])
    torch.optim.SGD(hf_model.parameters(), lr=LEARNING_RATE).step()
    engine.finish_param_gather()
    param = _relative([(p.detach(), mine(p, reference[hf.hf_name(*key)].detach()))
                       for key, p in module.named_layer_parameters()])
    state = gather_hf_state_dict(module, hf)  # what save_hf_checkpoint writes
    target = hf_model.state_dict()
    if set(state) != set(target):
        raise AssertionError(f"{case.label()}: the export's keys differ from HF's: "
                             f"{sorted(set(state) ^ set(target))}")
    export = _relative([(state[name], target[name]) for name in state])
    return {"loss": abs(loss - expected.item()) / abs(expected.item()), "grad": grad,
            "param": param, "export": export}
