"""Checkpoints of MoE models trained at tensor × expert parallelism reshard across (tp, ep):
saved at pp 1 × tp 2 × dp 2 × ep 2 after an Adam step, loaded at (tp 1, ep 2) and at
(tp 2, ep 1) (or tp 4), the next step's loss and updated weights equal those of the run that
continued at the saved layout (fp32, within 1e-5 relative). Tiny Mixtral (HF's whole-batch
balancing loss) and tiny DeepSeek-V3 (latent attention split by heads, its aux-free bias in
the checkpoint), one launch of 4 ranks for every case. Experts split over tp
(expert_tensor_parallel = tp = 2, ep 1) reload with whole experts at tp 2, at tp 1 and split
at tp 4, and whole experts reload split; experts split over both tp and ep refuse to save.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.support.rank_harness import run_ranks
from tests.support.reshard_cases import Layout, ReshardCase, reshard_differences, save_refusal

TOLERANCE = 1e-5
TP_EP = Layout(pp=1, tp=2, dp=2, ep=2)
EXPERT_TP = Layout(pp=1, tp=2, dp=2, etp=2)  # experts split over tp (expert_tensor_parallel)
CASES = [
    ReshardCase("mixtral", EXPERT_TP, (Layout(pp=1, tp=2, dp=2), Layout(pp=2, dp=2),
                                       Layout(pp=1, tp=4, etp=4))),
    ReshardCase("mixtral", Layout(pp=1, tp=2, dp=2), (EXPERT_TP,)),
    ReshardCase("mixtral", TP_EP, (Layout(pp=2, dp=2, ep=2), Layout(pp=2, tp=2))),
    ReshardCase("mixtral", Layout(pp=2, dp=2, ep=2), (TP_EP,)),
    ReshardCase("mixtral", Layout(pp=1, tp=2, dp=2, ep=2, zero=True),
                (Layout(pp=2, dp=2, ep=2, zero=True), Layout(pp=1, tp=4))),
    ReshardCase("deepseek_v3", TP_EP, (Layout(pp=2, dp=2, ep=2), Layout(pp=1, tp=4))),
]


def _run(rank: int, world_size: int, root: str) -> None:
    failures = []
    for case in CASES:
        for result in reshard_differences(case, root):
            label = f"{case.model} {case.saved.label()} -> {result['layout']}"
            if rank == 0:  # shown with pytest -s
                print(f"{label}: loss {result['loss']:.1e}, weights {result['param']:.1e}")
            assert result["step"] == 1 and result["compared"] > 0, (label, result)
            if max(result["loss"], result["param"]) > TOLERANCE:
                failures.append(f"{label}: {result}")
    assert not failures, "\n".join(failures)
    # experts split over both tp and ep: refused in one line, not saved wrong
    refusal = save_refusal("mixtral", Layout(pp=1, tp=2, dp=2, ep=2, etp=2), root)
    assert "split over both tp and ep cannot be checkpointed" in refusal, refusal


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tp_x_ep_checkpoints_reshard_to_other_tp_and_ep_and_continue_as_saved(
        tmp_path: Path) -> None:
    run_ranks(_run, 4, str(tmp_path), timeout=600)
