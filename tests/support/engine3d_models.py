"""Tiny models and comparison helpers for the 3D-parallel engine tests (pp × dp × tp, ZeRO-1,
tied weights, mixed precision), built identically on every rank and in the reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec
from pipeline.model.reference import build_reference, reference_step
from pipeline.parallel.param_marks import tensor_parallel_dim
from pipeline.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelTransformerBlock,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_lm_logits,
)
from pipeline.parallel.tensor.sequence import GatherSequence, ScatterSequence
from tests.support.pipeline_models import mlp_batch, mlp_layers

__all__ = ["CASES", "Case", "Spike", "run_case", "shard_of", "spike_layers"]

WIDTH, VOCAB, HEADS, FFN = 8, 12, 2, 16  # VOCAB, HEADS and FFN divide by tp = 2
FUSED_PARTS = {"qkv": 3}
"""Tensor-parallel layers whose weight stacks blocks split separately (Q;K;V)."""


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _token_batch(seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (batch, 5), generator=generator),
            torch.randint(0, VOCAB, (batch, 5), generator=generator))


def _head(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The input embedding reused as the output head: logits = h · Eᵀ."""
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    return hidden @ weight.T


def _parallel_head(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    assert isinstance(module, VocabParallelEmbedding)
    return parallel_lm_logits(hidden, module)


def tied_layers() -> list[Any]:
    """Embedding on the first stage, tied to the output head on the last."""
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH),
            LayerSpec(nn.Linear, WIDTH, WIDTH), torch.tanh,
            LayerSpec(nn.Linear, WIDTH, WIDTH), torch.tanh,
            TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=_head)]


def tensor_parallel_layers() -> list[Any]:
    """Vocab-parallel embedding, two tp transformer blocks, a column/row MLP, a gathered
    column-parallel head: every tp layer receives its group at build time."""
    return [LayerSpec(VocabParallelEmbedding, VOCAB, WIDTH),
            LayerSpec(ParallelTransformerBlock, WIDTH, HEADS, ffn_hidden=FFN),
            LayerSpec(ColumnParallelLinear, WIDTH, FFN), F.gelu,
            LayerSpec(RowParallelLinear, FFN, WIDTH),
            LayerSpec(ParallelTransformerBlock, WIDTH, HEADS, ffn_hidden=FFN),
            LayerSpec(ColumnParallelLinear, WIDTH, VOCAB, gather_output=True)]


def _sequence_batch(seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)  # 6 tokens: divisible by tp = 2
    return (torch.randint(0, VOCAB, (batch, 6), generator=generator),
            torch.randint(0, VOCAB, (batch, 6), generator=generator))


def sequence_parallel_layers() -> list[Any]:
    """Blocks with sequence parallelism between a scatter and a gather of the sequence, one
    with its collectives overlapped: stage boundaries carry each tp rank's slice."""
    return [LayerSpec(VocabParallelEmbedding, VOCAB, WIDTH), LayerSpec(ScatterSequence),
            LayerSpec(ParallelTransformerBlock, WIDTH, HEADS, ffn_hidden=FFN,
                      sequence_parallel=True, overlap=True),
            LayerSpec(ParallelTransformerBlock, WIDTH, HEADS, ffn_hidden=FFN,
                      sequence_parallel=True),
            LayerSpec(GatherSequence),
            LayerSpec(ColumnParallelLinear, WIDTH, VOCAB, gather_output=True)]


def tied_tensor_parallel_layers() -> list[Any]:
    """A vocab-parallel embedding tied to the head: tp shard i of one to shard i of the other."""
    return [TiedLayerSpec("embed", VocabParallelEmbedding, VOCAB, WIDTH),
            LayerSpec(ParallelTransformerBlock, WIDTH, HEADS, ffn_hidden=FFN),
            LayerSpec(ParallelTransformerBlock, WIDTH, HEADS, ffn_hidden=FFN),
            TiedLayerSpec("embed", VocabParallelEmbedding, VOCAB, WIDTH,
                          forward_fn=_parallel_head)]


class Spike(nn.Module):
    """Identity whose first training backward on global rank `rank` turns the gradient into
    inf: an fp16 overflow that only that rank sees."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.fired = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fired or not torch.is_grad_enabled() or dist.get_rank() != self.rank:
            return x
        self.fired = True
        y = x.clone()
        y.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        return y


def spike_layers(rank: int = 1) -> list[Any]:
    """The MLP with a `Spike` in the first stage of dp replica 1 (global rank 1 of pp2×dp2):
    the inf reaches only the first stage's gradients (backward flows upstream, the dp
    reduction stays within the stage), so only the vote tells the last stage to skip."""
    layers = mlp_layers()
    return [*layers[:2], LayerSpec(Spike, rank), *layers[2:]]


@dataclass(frozen=True)
class Model:
    layers: Callable[[], list[Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


MODELS = {
    "mlp": Model(mlp_layers, F.mse_loss, lambda seed, batch: mlp_batch(seed, batch)),
    "spike": Model(spike_layers, F.mse_loss, lambda seed, batch: mlp_batch(seed, batch)),
    "tied": Model(tied_layers, _token_loss, _token_batch),
    "tp": Model(tensor_parallel_layers, _token_loss, _token_batch),
    "tied-tp": Model(tied_tensor_parallel_layers, _token_loss, _token_batch),
    "tp-sp": Model(sequence_parallel_layers, _token_loss, _sequence_batch),
}


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _adam(params: Any) -> torch.optim.Optimizer:
    # eps well above rounding noise: the attention key bias has an analytically zero gradient
    # (softmax ignores a constant shift), and with eps = 1e-8 Adam would turn its ~1e-9
    # noise, which differs between any two summation orders, into updates of ~lr / 10
    return torch.optim.Adam(params, lr=1e-2, eps=1e-4)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {"sgd": _sgd, "adam": _adam}


@dataclass(frozen=True)
class Case:
    """One engine configuration checked against the single-process reference."""

    name: str
    model: str
    engine: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `PipelineEngine` (data_parallel, zero_stage, precision, ...)."""
    schedule: str = "1f1b"
    chunks: int = 1
    optimizer: str = "sgd"
    m: int = 4
    batch: int = 16
    """Global batch: dp × microbatch size × m."""


CASES = [
    Case("pp2×dp2", "mlp", {"data_parallel": 2}),
    Case("pp2×tp2 +clip", "tp", {"tensor_parallel": 2, "gradient_clipping": 0.05}),
    Case("pp2×tp2 sequence parallel + overlap, zb-h1", "tp-sp", {"tensor_parallel": 2},
         schedule="zb-h1", optimizer="adam"),
    Case("pp2×dp2 ZeRO-1 +clip", "mlp", {"data_parallel": 2, "zero_stage": 1,
                                         "gradient_clipping": 0.05, "bucket_mb": 2**-10},
         optimizer="adam"),
    Case("interleaved pp2×dp2 +clip", "mlp", {"data_parallel": 2, "gradient_clipping": 0.05},
         schedule="interleaved", chunks=2),
    Case("tied pp2×dp2", "tied", {"data_parallel": 2}),
    Case("tied pp2×dp2 ZeRO-1", "tied", {"data_parallel": 2, "zero_stage": 1},
         optimizer="adam"),
    Case("tied pp2×dp2 ZeRO-1 overlap_param_gather", "tied",
         {"data_parallel": 2, "zero_stage": 1, "overlap_param_gather": True,
          "bucket_mb": 2**-10}, optimizer="adam"),
    Case("bf16 pp2×dp2", "mlp", {"data_parallel": 2, "precision": "bf16"}),
]
GRID_CASE = Case("pp2×dp2×tp2 ZeRO-1 tied +clip", "tied-tp",
                 {"data_parallel": 2, "tensor_parallel": 2, "zero_stage": 1,
                  "gradient_clipping": 0.05}, optimizer="adam")


def shard_of(full: torch.Tensor, param: torch.Tensor, name: str, tp_rank: int,
             tp: int) -> torch.Tensor:
    """This tp rank's slice of the reference's full tensor (whole if `param` is replicated)."""
    dim = tensor_parallel_dim(param)
    if dim is None or tp == 1:
        return full
    parts = next((n for layer, n in FUSED_PARTS.items() if f"{layer}." in name), 1)
    return torch.cat([block.chunk(tp, dim)[tp_rank] for block in full.chunk(parts, dim)], dim)


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max()) if a.numel() else 0.0


def run_case(case: Case, device: torch.device | None = None) -> dict[str, Any]:
    """Two training steps of `case` on this rank (on `device`, default the engine's) and on
    the single-process CPU reference; the largest errors."""
    model = MODELS[case.model]
    module = PipelineModule(model.layers(), num_stages=2, chunks=case.chunks,
                            loss_fn=model.loss)
    factory = OPTIMIZERS[case.optimizer]
    engine = PipelineEngine(module, schedule=case.schedule, num_microbatches=case.m,
                            optimizer=factory, timeout=60, device=device, **case.engine)
    reference = build_reference(model.layers())
    reference_optimizer = factory([p for p in reference.parameters() if p.requires_grad])
    dp, tp = engine.topology.dp, engine.topology.tp
    dp_rank, tp_rank = engine.position.dp_rank, engine.position.tp_rank
    per_replica = case.batch // dp
    errors = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    grad_norm = grad_error_norm = 0.0
    reduce_calls: list[int] = []
    for step in range(2):
        inputs, targets = model.batch(step, case.batch)
        local = slice(dp_rank * per_replica, (dp_rank + 1) * per_replica)
        stats = getattr(engine.gradient_reducer, "stats", None)
        if stats is not None:
            stats.reset()
        loss = engine.train_batch(inputs[local], targets[local])
        if stats is not None:
            reduce_calls.append(stats.calls)
        expected = reference_step(reference, inputs, targets, loss_fn=model.loss,
                                  optimizer=reference_optimizer,
                                  max_grad_norm=case.engine.get("gradient_clipping"))
        errors["loss"] = max(errors["loss"], abs(loss - expected.loss) / abs(expected.loss))
        grads = engine.reduced_gradients()
        engine.finish_param_gather()  # overlap_param_gather: read the updated parameters
        coefficient = 1.0  # the step clips the reduced gradients in place
        if expected.grad_norm is not None:
            coefficient = min(1.0, case.engine["gradient_clipping"] / (expected.grad_norm + 1e-6))
            norm = engine.training.step.grad_norm
            assert norm is not None
            errors["norm"] = max(errors.get("norm", 0.0),
                                 abs(norm - expected.grad_norm) / expected.grad_norm)
        for key, param in module.named_layer_parameters():
            name = key[1]
            want = shard_of(expected.grads[key], param, name, tp_rank, tp) * coefficient
            errors["grad"] = max(errors["grad"], _max_error(grads[key], want))
            grad_error_norm += float((grads[key].float().cpu() - want).pow(2).sum())
            grad_norm += float(want.pow(2).sum())
            errors["param"] = max(errors["param"], _max_error(
                param.detach(), shard_of(expected.params[key], param, name, tp_rank, tp)))
    return {"case": case.name, "rank": engine.rank, **errors,
            "grad_relative": (grad_error_norm / grad_norm) ** 0.5 if grad_norm else 0.0,
            "clipped": engine.training.step.grad_norm is not None and
            engine.training.step.grad_norm > case.engine.get("gradient_clipping", 1e9),
            "reduce_calls": reduce_calls,
            "local_stages": len(engine.stage_ids),
            "state_bytes": engine.optimizer_state_bytes(),
            "unsharded_state_bytes": _unsharded_state_bytes(module, factory),
            "bucket_bytes": int(engine.config.parallel.bucket_mb * 2**20), "dp": dp,
            "on_device_mesh": engine.groups is not None and engine.groups.mesh is not None}


def _unsharded_state_bytes(module: PipelineModule, factory: Any) -> int:
    """State bytes the plain optimizer would hold for this rank's parameters."""
    params = [nn.Parameter(p.detach().clone()) for p in
              dict.fromkeys(q for q in module.parameters() if q.requires_grad)]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer = factory(params)
    optimizer.step()
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))
