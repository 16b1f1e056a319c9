"""Checkpoints saved at one (pp, tp, dp, ep) and resumed at another, against the run that
continues at the saved layout (test helper; every function runs on every rank of 4)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule
from pipeline.errors import CheckpointError
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf
from pipeline.interop.hf_weights import gather_hf_state_dict, load_hf_weights
from pipeline.moe.balance_loss import train_batch_balanced
from pipeline.parallel.param_marks import tensor_parallel_dim
from tests.support.engine3d_models import FUSED_PARTS, MODELS
from tests.support.hf_models import tiny_config, tiny_model, token_batch
from tests.support.hf_moe_models import tiny_moe_config, tiny_moe_model

__all__ = ["Layout", "ReshardCase", "hf_refusal", "reshard_differences"]

BATCH = 8
MOE_MODELS = ("mixtral", "deepseek_v3")


def _adam(params: Any) -> torch.optim.Optimizer:
    # eps well above rounding noise (see tests.support.engine3d_models._adam)
    return torch.optim.Adam(params, lr=1e-2, eps=1e-4)


@dataclass(frozen=True)
class Layout:
    """(pp, tp, dp, ep) and the ZeRO stage (True: ZeRO-1)."""

    pp: int
    tp: int = 1
    dp: int = 1
    ep: int = 1
    zero: int = 0
    etp: int = 1

    def label(self) -> str:
        return (f"pp{self.pp}-tp{self.tp}-dp{self.dp}-ep{self.ep}"
                + (f"-zero{int(self.zero)}" if self.zero else "")
                + (f"-etp{self.etp}" if self.etp > 1 else ""))

    def engine_options(self) -> dict[str, Any]:
        return {"tensor_parallel": self.tp, "data_parallel": self.dp,
                "expert_parallel": self.ep, "zero_stage": int(self.zero),
                "expert_tensor_parallel": self.etp}


@dataclass(frozen=True)
class ReshardCase:
    """A model saved at `saved` after one Adam step, resumed at each of `loads`."""

    model: str
    """'gpt2', 'llama' (HF, tensor_parallel_hf), 'mixtral' or 'deepseek_v3' (HF MoE,
    tensor_parallel_hf where the layout has tp) or 'tp' (the engine's own tensor-parallel
    layers)."""
    saved: Layout
    loads: tuple[Layout, ...] = field(default_factory=tuple)


class _Run:
    """One engine of a case: built, stepped, its whole weights gathered."""

    def __init__(self, model: str, layout: Layout, seed: int) -> None:
        self.model = model
        self.hf: Any = None
        if model == "tp":
            spec = MODELS["tp"]
            module = PipelineModule(spec.layers(), num_stages=layout.pp, loss_fn=spec.loss,
                                    partition_method="uniform", base_seed=seed)
        else:
            moe = model in MOE_MODELS
            config = tiny_moe_config(model) if moe else tiny_config(model)
            # an MoE model split over tp only where the layout has tp (its checkpoint names
            # are the same either way)
            self.hf = layers_from_hf(config) if moe and layout.tp == 1 \
                else tensor_parallel_hf(layers_from_hf(config))
            module = PipelineModule(self.hf.layers, num_stages=layout.pp, loss_fn=self.hf.loss_fn,
                                    partition_method="uniform")
            weights = (tiny_moe_model(model, seed=seed) if moe else tiny_model(model, seed=seed))
            load_hf_weights(module, self.hf, weights.state_dict())
        self.module = module
        self.engine = PipelineEngine(module, num_microbatches=2, optimizer=_adam, timeout=60,
                                     **layout.engine_options())

    def step(self, seed: int) -> float:
        engine = self.engine
        dp, dp_rank = engine.topology.dp, engine.position.dp_rank
        rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        if self.model == "tp":
            inputs, targets = MODELS["tp"].batch(seed, BATCH)
            return engine.train_batch(inputs[rows], targets[rows])
        ids, _ = token_batch(BATCH, 8, seed=seed)
        labels = causal_lm_targets(ids)
        if self.model in MOE_MODELS:  # DeepSeek-V3's aux-free balancing needs no census
            return train_batch_balanced(engine, self.hf.balance, ids[rows], labels[rows])
        return engine.train_batch(ids[rows], labels[rows])

    def weights(self) -> dict[str, torch.Tensor]:
        self.engine.finish_param_gather()
        if self.hf is not None:
            return gather_hf_state_dict(self.module, self.hf)
        return _gathered_engine_weights(self.engine)


def _gathered_engine_weights(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    """The engine's own tp layers' whole tensors, joined from every rank's slices by the
    definition of the split (each fused block cut into tp equal parts along its dim,
    `FUSED_PARTS`), independently of `ShardLayout`."""
    tp_rank = engine.position.tp_rank
    mine = {f"{layer}.{name}": (tp_rank, tensor_parallel_dim(param), param.detach().clone())
            for (layer, name), param in engine.module.named_layer_parameters()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    slices: dict[str, dict[int, tuple[int | None, torch.Tensor]]] = {}
    for part in gathered:
        for key, (rank, dim, value) in part.items():
            slices.setdefault(key, {})[rank] = (dim, value)
    whole = {}
    for key, by_rank in slices.items():
        dim, first = by_rank[0]
        if dim is None or len(by_rank) == 1:
            whole[key] = first
            continue
        fused = next((n for layer, n in FUSED_PARTS.items() if f".{layer}." in f".{key}"), 1)
        blocks = [by_rank[r][1].chunk(fused, dim) for r in range(len(by_rank))]
        whole[key] = torch.cat([blocks[r][b] for b in range(fused)
                                for r in range(len(by_rank))], dim)
    return whole


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def reshard_differences(case: ReshardCase, root: str) -> list[dict[str, Any]]:
    """Save `case.saved` after one step, take a second step there; for each load layout, a
    fresh engine (other initial weights) loads the checkpoint and takes the second step. Per
    load: the relative differences of its loss and (worst) weight against the saved
    layout's second step, and how many weights were compared."""
    torch.set_num_threads(1)
    directory = f"{root}/{case.model}-{case.saved.label()}"
    original = _Run(case.model, case.saved, seed=3)
    original.step(0)
    original.engine.save_checkpoint(directory)
    expected_loss = original.step(1)
    expected = original.weights()
    del original
    results = []
    for layout in case.loads:
        resumed = _Run(case.model, layout, seed=11)
        info = resumed.engine.load_checkpoint(directory)
        loss = resumed.step(1)
        weights = resumed.weights()
        if sorted(weights) != sorted(expected):
            raise AssertionError(f"{case.model} at {layout}: weights {sorted(weights)} vs "
                                 f"{sorted(expected)}")
        results.append({"layout": layout.label(), "step": info.step,
                        "loss": abs(loss - expected_loss) / abs(expected_loss),
                        "param": max(_relative(weights[k], expected[k]) for k in expected),
                        "compared": len(expected)})
        del resumed
    dist.barrier()
    return results


def hf_refusal(root: str, edit: Callable[[Any], None], layout: Layout) -> str:
    """The `CheckpointError` that loading the Llama case's checkpoint into a Llama whose
    config `edit` changed raises at `layout` ('' if none)."""
    config = tiny_config("llama")
    edit(config)
    hf = tensor_parallel_hf(layers_from_hf(config))
    module = PipelineModule(hf.layers, num_stages=layout.pp, loss_fn=hf.loss_fn,
                            partition_method="uniform")
    engine = PipelineEngine(module, num_microbatches=2, optimizer=_adam, timeout=60,
                            **layout.engine_options())
    saved = ReshardCase("llama", Layout(pp=2, tp=2))
    try:
        engine.load_checkpoint(f"{root}/{saved.model}-{saved.saved.label()}")
    except CheckpointError as error:
        return str(error)
    return ""


def save_refusal(model: str, layout: Layout, root: str) -> str:
    """The `CheckpointError` that saving `model` after one step at `layout` raises ('' if
    none)."""
    run = _Run(model, layout, seed=1)
    run.step(seed=2)
    try:
        run.engine.save_checkpoint(f"{root}/{model}-{layout.label()}-refused")
    except CheckpointError as error:
        return str(error)
    return ""
