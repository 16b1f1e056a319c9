"""`pipesched run` over data-parallel replicas and tensor-parallel ranks trains as one HF
process does: each replica reads its own rows of the batch, each tp rank its replica's rows,
and the targets shifted already (`tensor_parallel_hf(shift_labels=False)`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import main
from tests.support.token_runs import SEQ, hf_losses, metrics, model_dir, token_file


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("data_parallel", "tp"), [(2, 1), (1, 2)])
def test_a_run_over_replicas_or_tp_ranks_equals_single_process_hf(
        tmp_path: Path, data_parallel: int, tp: int) -> None:
    model, data = model_dir(tmp_path), token_file(tmp_path)
    assert main(["run", "--model", str(model), "--data", str(data), "--steps", "2",
                 "--data-parallel", str(data_parallel), "--tp", str(tp), "--microbatches",
                 "2", "--batch-size", "4", "--seq-len", str(SEQ),
                 "--metrics", str(tmp_path / "metrics.jsonl")]) == 0
    logged = metrics(tmp_path)
    assert [logged[step]["loss"] for step in (1, 2)] == pytest.approx(
        hf_losses(model, data, 2), rel=1e-5, abs=1e-6)
