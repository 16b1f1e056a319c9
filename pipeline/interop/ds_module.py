"""DeepSpeed's `PipelineModule`: this rank's stage is built at construction, as DeepSpeed builds it.

DeepSpeed's ``PipelineModule.__init__`` builds only the layers of its own stage, so a script
can pass ``model.parameters()`` to ``initialize(model_parameters=...)`` or to its own
optimizer (``torch.optim.SGD(net.parameters())``) before the engine exists. Ours builds
lazily (the engine calls `materialize`); this subclass builds at once when the process
group is up and the stage of each rank is known (one stage per rank: DeepSpeed's layout,
``rank = stage · dp + replica``), and otherwise stays lazy.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from pipeline.device import default_device
from pipeline.model.module import PipelineModule as LazyPipelineModule

__all__ = ["PipelineModule", "built_early"]


class PipelineModule(LazyPipelineModule):
    """`pipeline.PipelineModule` with DeepSpeed's construction: after
    ``deepspeed.init_distributed()`` it holds this rank's stage at once, so
    ``model.parameters()`` are the parameters this rank trains."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.built_at_construction = False
        """Whether this rank's stage was built here (not by the engine)."""
        if not dist.is_initialized() or self.chunks != 1:
            return
        world = dist.get_world_size()
        if world % self.num_stages:
            return  # initialize() names the problem
        stage = dist.get_rank() // (world // self.num_stages)
        self.materialize([stage], default_device())
        self.built_at_construction = True


def built_early(module: LazyPipelineModule) -> bool:
    """Whether `module` held this rank's stage before the engine was built."""
    return bool(getattr(module, "built_at_construction", False))
