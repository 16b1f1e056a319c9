"""Census-free MoE balancing at tensor × expert parallelism: Megatron-Core's per-microbatch
loss, DeepSeek's sequence loss and ST-MoE's router z-loss on tiny Mixtral from a
`save_pretrained` directory at pp 2 × tp 2 × ep 2 (8 ranks, dp 2, one launch), with and
without sequence parallelism and padding, equal HF's model stepped on a loss written here
from each definition over each microbatch's tokens (loss, every gradient slice, updated
weights; 1e-5); the statistics not summed over tp, or summed twice, fail."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")

from pipeline.moe import router_losses
from pipeline.moe.balancing import MoEBalancing
from tests.interop.test_moe_balancing import sequence_oracle, switch_oracle, z_oracle
from tests.support.hf_moe_equivalence import moe_step_differences
from tests.support.rank_harness import run_ranks

TOLERANCE, COEF, Z_COEF, TOP_K, ROWS_PER_MICROBATCH = 1e-5, 0.5, 0.01, 2, 2
LAYOUT = {"pp": 2, "dp": 2, "ep": 2, "tp": 2}

CASES: dict[str, tuple[str, float, dict[str, Any]]] = {
    "microbatch sp": ("microbatch", 0.0, {"sequence_parallel": True}),
    "microbatch + z, padded": ("microbatch", Z_COEF, {"padded": True}),
    "sequence sp, padded": ("sequence", 0.0, {"sequence_parallel": True, "padded": True}),
    "z alone sp": ("none", Z_COEF, {"sequence_parallel": True}),
}


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           labels[:, 1:].reshape(-1), ignore_index=-100)


def reference_of(method: str, z_coef: float) -> Callable[..., torch.Tensor]:
    """The step's loss from the definitions, on HF's model: the cross entropy of the whole
    batch (mean over its real targets) plus, for each microbatch (2 consecutive rows; dp 2
    replicas × 4), per MoE layer, the loss over that microbatch's real tokens, averaged over
    the microbatches (Megatron-Core's 1 / (m · dp))."""
    def reference(model: Any, ids: torch.Tensor, mask: torch.Tensor | None,
                  labels: torch.Tensor) -> torch.Tensor:
        loss = _cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels)
        balancing = []
        for rows in torch.split(torch.arange(ids.shape[0]), ROWS_PER_MICROBATCH):
            own = None if mask is None else mask[rows]
            routes = model(input_ids=ids[rows], attention_mask=own,
                           output_router_logits=True).router_logits
            for logits in routes:
                if method == "microbatch":
                    balancing.append(switch_oracle(logits, TOP_K, COEF, own))
                if method == "sequence":
                    balancing.append(sequence_oracle(logits, TOP_K, COEF, len(rows), own))
                if z_coef:
                    balancing.append(z_oracle(logits, z_coef, own))
        microbatches = ids.shape[0] // ROWS_PER_MICROBATCH
        return loss + torch.stack(balancing).sum() / microbatches
    return reference


def _step(method: str, z_coef: float, options: dict[str, Any]) -> float:
    """The worst relative difference (loss, gradient, weights) over every rank."""
    balancing = MoEBalancing(method=method, aux_loss_coef=COEF,  # type: ignore[arg-type]
                             router_z_loss_coef=z_coef)
    found = moe_step_differences("mixtral", **LAYOUT, balancing=balancing,
                                 reference=reference_of(method, z_coef), **options)
    worst = torch.tensor(max(found["loss"], found["grad"], found["param"]))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


_REDUCE = router_losses.reduce_token_statistics


def _not_reduced(statistics: torch.Tensor, group: Any) -> torch.Tensor:
    """Planted bug: each tp rank's loss from its own slice's counts and token totals."""
    return statistics


def _reduced_twice(statistics: torch.Tensor, group: Any) -> torch.Tensor:
    """Planted bug: the statistics summed over tp twice (t times too large)."""
    return _REDUCE(_REDUCE(statistics, group), group)


PLANTED = {"not reduced over tp": ("microbatch sp", _not_reduced),
           "reduced twice": ("sequence sp, padded", _reduced_twice)}


def _ranks(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    results = {label: _step(*case) for label, case in CASES.items()}
    for bug, (label, replacement) in PLANTED.items():
        router_losses.reduce_token_statistics = replacement  # type: ignore[assignment]
        try:
            results[f"planted: {bug}"] = _step(*CASES[label])
        finally:
            router_losses.reduce_token_statistics = _REDUCE
    if rank == 0:
        torch.save(results, out)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_census_free_balancing_at_pp2_tp2_ep2_equals_its_definition(tmp_path: Path) -> None:
    out = str(tmp_path / "found.pt")
    run_ranks(_ranks, 8, out, timeout=900)
    found = torch.load(out)
    print(found)  # shown with pytest -s
    for label in CASES:
        assert found[label] <= TOLERANCE, (label, found)
    for bug in PLANTED:
        assert found[f"planted: {bug}"] > 1e-3, (bug, found)
