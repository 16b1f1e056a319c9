"""From a model and a cluster to a running job: `pipesched plan` prints a torchrun line, which
runs unchanged on a HF directory and a token file, checkpoints, resumes, and matches an
uninterrupted run (on local ranks, no torchrun) and single-process HF training."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import main
from tests.support.token_runs import BATCH, SEQ, hf_losses, metrics, model_dir, token_file

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"step (\d+)/\d+  loss [\d.]+  \d+ ms  [\d,]+ tokens/s  [\d.e+-]+ "
                       r"TFLOP/s/device  MFU [\d.]+%  peak mem \d+ MiB")


def _torchrun(line: str, env: dict[str, str]) -> str:
    """Run the printed line as a shell would, with the variables its text says to set."""
    done = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True,
                          timeout=400, env=os.environ | {"PYTHONPATH": str(ROOT)} | env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _kill_after_step(line: str, env: dict[str, str], metrics_file: Path, step: int) -> None:
    """Start the printed line and SIGKILL its whole process group once `metrics_file` holds a
    record of `step` (a crash after the last checkpoint, whose step must be run again)."""
    import signal
    import time

    started = subprocess.Popen(["bash", "-c", line], cwd=ROOT, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=os.environ | {"PYTHONPATH": str(ROOT)} | env)
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline and started.poll() is None:
            text = metrics_file.read_text() if metrics_file.exists() else ""
            done = [json.loads(record)["step"] for record in text.splitlines()
                    if record.endswith("}")]  # a line being written is not read yet
            if any(logged >= step for logged in done):
                break
            time.sleep(0.05)
        assert started.poll() is None, "the run ended before it could be killed"
    finally:
        os.killpg(started.pid, signal.SIGKILL)
        started.wait(timeout=60)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_printed_plan_runs_under_torchrun_resumes_and_equals_an_uninterrupted_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, data = model_dir(tmp_path), token_file(tmp_path)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # `local` calibrates one rank per core
    assert main(["plan", "--model", str(model), "--cluster", "local", "--global-batch",
                 str(BATCH), "--seq", str(SEQ), "--pp", "2", "--microbatch-size", "2"]) == 0
    out = capsys.readouterr().out
    line = next(text.strip() for text in out.splitlines() if text.strip().startswith("torchrun"))
    assert line.startswith("torchrun --standalone --nproc-per-node 2 -m pipeline.cli run ")
    assert "set DATA" in out and "STEPS" in out and "CHECKPOINT_DIR" in out
    assert "HEAD_NODE" not in line

    # interrupted: 2 steps and a checkpoint; the same line for 4 steps killed (SIGKILL, every
    # process) once it has logged step 3, past the checkpoint; then it resumes to step 4
    interrupted = tmp_path / "interrupted"
    env = {"DATA": str(data), "CHECKPOINT_DIR": str(interrupted)}
    first = _torchrun(line, env | {"STEPS": "2"})
    # (asked for 100 steps, so no step's end can race the kill to a final checkpoint)
    _kill_after_step(line, env | {"STEPS": "100"}, interrupted / "metrics.jsonl", step=3)
    second = _torchrun(line, env | {"STEPS": "4"})
    assert "from the HF weights" in first and "resumed at step 2" in second
    logged = [int(m.group(1)) for m in STEP_LINE.finditer(first + second)]
    assert logged == [1, 2, 3, 4], first + second  # rank 0 alone, one line a step
    resumed = metrics(interrupted)
    assert set(resumed) >= {1, 2, 3, 4}  # the killed run's later steps may be logged too
    assert all(resumed[s]["tokens_per_second"] > 0 and resumed[s]["mfu"] > 0 and
               resumed[s]["tflops_per_device"] > 0 for s in resumed)
    assert [resumed[s]["data_position"] for s in range(1, 5)] == [4, 8, 12, 16]

    # uninterrupted, the same arguments on local ranks (no torchrun)
    plain = tmp_path / "plain"
    arguments = line.split(" -m pipeline.cli ", 1)[1]
    for name, value in {"DATA": str(data), "STEPS": "4", "CHECKPOINT_DIR": str(plain)}.items():
        arguments = arguments.replace(f"${name}", value)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert main(shlex.split(arguments)) == 0
    uninterrupted = metrics(plain)
    for step in range(1, 5):
        assert resumed[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], rel=1e-6,
                                                      abs=1e-7), step
    expected = hf_losses(model, data, 4)
    got = [uninterrupted[step]["loss"] for step in range(1, 5)]
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert got[3] != pytest.approx(got[0], abs=1e-4)  # it trains: the steps differ


@pytest.mark.slow
def test_run_reads_its_sizes_from_plan_json_and_refuses_a_bad_partition(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, data = model_dir(tmp_path), token_file(tmp_path)
    cluster = tmp_path / "two.json"
    cluster.write_text(json.dumps({"preset": "h100-80g", "devices_per_node": 2}))
    assert main(["plan", "--model", str(model), "--cluster", str(cluster), "--global-batch",
                 "8", "--seq", str(SEQ), "--pp", "2", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    arguments = document["pick"]["run_arguments"]
    assert arguments["stages"] == 2 and arguments["batch_size"] == 8
    assert arguments["seq_len"] == SEQ and arguments["partition"].startswith("0,")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(document))
    import argparse

    from pipeline.cli.run_cmd import _config, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["run", "--model", str(model), "--data", str(data), "--plan",
                              str(plan), "--steps", "1", "--seq-len", "8"])
    config, world = _config(args)
    assert (config.stages, config.microbatches, config.batch_size, world) == (
        2, arguments["microbatches"], 8, 2)
    assert config.seq_len == 8  # a flag given overrides the plan
    cuts = tuple(int(cut) for cut in arguments["partition"].split(","))
    assert config.partition == cuts and cuts[-1] == 6  # embedding, 3 blocks, norm, head
    assert main(["run", "--model", str(model), "--data", str(data), "--steps", "1",
                 "--stages", "2", "--batch-size", "4", "--seq-len", str(SEQ),
                 "--partition", "0,9,6"]) == 2
    assert "need 3 rising cuts from 0 to 6" in capsys.readouterr().err
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:  # not installed here: refused before any rank starts, naming the fix
        assert main(["run", "--model", str(model), "--data", str(data), "--steps", "1",
                     "--batch-size", "4", "--seq-len", str(SEQ), "--tensorboard",
                     str(tmp_path / "tb")]) == 2
        assert "pip install tensorboard" in capsys.readouterr().err
    assert sys.modules.get("pipeline.jobs.hf_run") is not None  # imported, never launched
