"""The right rank named when every rank raises the same refusal: a row-count mismatch
between the first stage's inputs and the last stage's targets, and NaN in the first stage's
inputs, name pipeline rank 0 (whose data it is), not whichever rank reported first."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline import PipelineEngine, PipelineModule, RankFailedError, launch
from tests.support.pipeline_models import mlp_batch, mlp_layers


def _step(bad: str) -> None:
    torch.set_num_threads(1)
    module = PipelineModule(mlp_layers(), num_stages=4, loss_fn=F.mse_loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=2,
                            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                            timeout=60)
    inputs, targets = mlp_batch(0, batch=8)
    if bad == "rows":
        targets = targets[:6]  # the last stage's targets: 6 rows for 8 inputs
    else:
        inputs[3, 0] = float("nan")  # in the first stage's inputs
    first, last = dist.get_rank() == 0, dist.get_rank() == dist.get_world_size() - 1
    engine.train_batch(inputs if first else None, targets if last else None)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("bad", "message"), [
    ("rows", "inputs hold 8 samples but targets 6"),  # named a middle rank
    ("nan", "first inf/NaN appeared in the output of stage 0"),  # named rank 3
])
def test_a_refusal_every_rank_raises_names_the_rank_whose_data_it_is(bad: str,
                                                                       message: str) -> None:
    with pytest.raises(RankFailedError, match=message) as caught:
        launch(_step, 4, bad, timeout=60, join_timeout=240)
    assert caught.value.rank == 0, str(caught.value)
