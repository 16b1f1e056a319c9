"""A HF module's column-parallel projections run as one GEMM whose tp collectives overlap it.

HF's attention calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same input, its MLP
``gate_proj`` and ``up_proj``; each would be its own column-parallel layer with its own
collectives (under sequence parallelism three all-gathers of one input). Megatron-Core and
this engine's own block fuse them (one q;k;v and one gate;up weight), so one all-gather
forward and one reduction of the input gradient backward, each overlapped with the fused
GEMM by `pipeline.parallel.tensor.overlap.column_parallel_linear` (the rule that prices it,
`schedules.analysis.tp_overlap`, sees the block's four linears, as here). Sequence
parallelism without overlap runs the same fusion (that function's sequential baseline), so
the column layer keeps this rank's slice of the input for the weight gradient, not the
gathered whole.

HF modules are reused, not rewritten, so the fusion happens around them:

    module pre-hook:  Y = column_parallel_linear(x, [W_q; W_k; W_v])   (x: this rank's
                      sequence slice under sequence parallelism), split into Y_q, Y_k, Y_v;
                      the module is called with a stand-in of the whole input's shape
    q_proj(stand-in) -> Y_q + b_q,  k_proj(stand-in) -> Y_k + b_k, ...

Each projection becomes a `FusedColumn` that keeps its own ``weight`` / ``bias`` under HF's
names (loads, exports and checkpoints map as before) and hands out its part. HF's attention
reads only the input's shape besides the projections; a projection called with anything
but the stand-in raises rather than silently using a stale output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_modules_tp import Region

__all__ = ["FusedColumn", "fuse_columns_on_call"]


class FusedColumn(nn.Module):
    """A column-parallel projection (a sliced Linear, a GPT-2 Conv1D if `transposed`, or a
    `HeadRows`) whose output its module's pre-hook computed in one fused GEMM."""

    def __init__(self, projection: Any, fusion: _Fusion, *, transposed: bool = False) -> None:
        super().__init__()
        self.weight: nn.Parameter = projection.weight
        self.bias: nn.Parameter | None = projection.bias
        self.rows: slice | None = getattr(projection, "rows", None)  # a HeadRows' kv head
        self.transposed = transposed
        self._fusion = [fusion]  # in a list: not a submodule, never a second parameter owner

    def fused_weight(self) -> torch.Tensor:
        """This rank's rows of the weight in Linear's (out, in) layout."""
        weight = self.weight.t() if self.transposed else self.weight
        return weight if self.rows is None else weight[self.rows]

    def fused_bias(self) -> torch.Tensor | None:
        if self.bias is None:
            return None
        return self.bias if self.rows is None else self.bias[self.rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fusion[0].take(self, x)


class _Fusion:
    """The fused GEMM of one module's `FusedColumn`s and its per-call outputs."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self.members: list[FusedColumn] = []
        self.stand_in: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """Compute every member's output from `x`; the stand-in to call the module with."""
        weights = [member.fused_weight() for member in self.members]
        fused = self.region.column(x, weights)  # one GEMM; the blocks kept, not their copy
        parts = fused.split([w.shape[0] for w in weights], dim=-1)
        self.outputs = {}
        for member, part in zip(self.members, parts, strict=True):
            # its own storage, as HF's own projection's output: a view would keep the whole
            # fused output alive wherever one part is saved (attention's v)
            part = part.contiguous()
            bias = member.fused_bias()
            self.outputs[id(member)] = part if bias is None else part + bias
        # shape, dtype and device of the whole input, no storage (HF reads only the shape)
        self.stand_in = fused.new_zeros(()).expand(*fused.shape[:-1], x.shape[-1])
        return self.stand_in

    def take(self, member: FusedColumn, x: torch.Tensor) -> torch.Tensor:
        if x is not self.stand_in or id(member) not in self.outputs:
            raise PipelineConfigError(
                "a fused column-parallel projection was called outside its module's forward "
                "or on another input (tensor_parallel_hf with overlap=True or "
                "sequence_parallel=True fuses q/k/v and gate/up and expects HF's modules to "
                "call them on their input); build the layers without both for this model")
        return self.outputs.pop(id(member))


def fuse_columns_on_call(module: nn.Module, names: tuple[str, ...], region: Region, *,
                         transposed: bool = False) -> None:
    """Replace `module`'s column-parallel projections `names` by `FusedColumn`s computed
    together, from `module`'s hidden-states input (first positional or ``hidden_states=``),
    by ``region.column`` on every call."""
    fusion = _Fusion(region)
    for name in names:
        member = FusedColumn(getattr(module, name), fusion, transposed=transposed)
        fusion.members.append(member)
        setattr(module, name, member)

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (fusion.run(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fusion.run(kwargs["hidden_states"])}

    module.register_forward_pre_hook(hook, with_kwargs=True)
