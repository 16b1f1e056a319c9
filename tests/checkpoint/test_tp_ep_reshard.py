"""Checkpoints reshard across tensor- and expert-parallel sizes: saved at one (pp, tp, dp, ep)
after an Adam step, loaded at another, the next step's loss and updated weights equal those of
the run that continued at the saved layout (fp32, within 1e-5 relative).

One launch of 4 ranks runs every case one after another (process start-up paid once):
tiny HF Llama (GQA: 2 key/value heads, replicated per pair of ranks at tp 4) from
(pp, tp, dp) = (2, 2, 1) to (1, 4, 1) and to ZeRO-1 at (2, 1, 2); GPT-2's fused Q|K|V
``c_attn`` from tp 2 to 1; the engine's own tp layers (fused qkv, vocab-parallel embedding)
under ZeRO-1 from (1, 2, 2) to (2, 1, 2); tiny Mixtral from ep 2 (ZeRO-1) to ep 1 and from
ep 1 to ep 2 (ZeRO-1 states over the expert-data-parallel group), pp changing with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from tests.support.rank_harness import run_ranks
from tests.support.reshard_cases import (
    Layout,
    ReshardCase,
    hf_refusal,
    reshard_differences,
)

TOLERANCE = 1e-5

CASES = [
    ReshardCase("llama", Layout(pp=2, tp=2),
                (Layout(pp=1, tp=4), Layout(pp=2, dp=2, zero=True))),
    ReshardCase("gpt2", Layout(pp=2, tp=2), (Layout(pp=2, dp=2),)),
    ReshardCase("tp", Layout(pp=1, tp=2, dp=2, zero=True), (Layout(pp=2, dp=2, zero=True),)),
    ReshardCase("mixtral", Layout(pp=2, dp=2, ep=2, zero=True), (Layout(pp=1, dp=4),)),
    ReshardCase("mixtral", Layout(pp=1, dp=4), (Layout(pp=2, dp=2, ep=2, zero=True),)),
]


def _narrower_ffn(config: Any) -> None:
    config.intermediate_size = 32


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
    # another model (a narrower FFN) is refused by name, not loaded into wrong shapes
    refusal = hf_refusal(root, _narrower_ffn, Layout(pp=1, tp=4))
    assert "mlp.gate_proj.weight" in refusal and "same model" in refusal, refusal


@pytest.mark.multiprocess
@pytest.mark.slow
def test_checkpoints_reshard_across_tp_and_ep_and_continue_as_the_saved_layout(
        tmp_path: Path) -> None:
    run_ranks(_run, 4, str(tmp_path), timeout=400)
