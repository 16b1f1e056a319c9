"""PaLM's model FLOPs per token against a parameter count written out by hand, and the
per-step record (log line, JSONL) that `pipesched run` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.jobs.step_metrics import FlopModel, StepMeter, device_peak_flops, flop_model


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_are_6n_plus_12lhqt_with_n_counted_by_hand(tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    h, f, layers, heads, kv, vocab, seq = 32, 64, 3, 4, 2, 100, 16
    config = transformers.LlamaConfig(hidden_size=h, intermediate_size=f,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv, vocab_size=vocab,
                                      tie_word_embeddings=tied)
    q = h // heads
    block = h * h + 2 * h * kv * q + h * h + 3 * h * f + 2 * h  # q, k, v, o; MLP; 2 norms
    n = layers * block + h + vocab * h  # the final norm and the LM head, not the embedding
    model = flop_model(config, seq)
    assert model == FlopModel(parameters=n, layers=layers, attention_width=h, seq_len=seq)
    assert model.per_token() == 6 * n + 12 * layers * h * seq


def test_a_step_record_is_logged_and_appended_as_json(tmp_path: Path) -> None:
    flops = FlopModel(parameters=1000, layers=2, attention_width=8, seq_len=4)
    meter = StepMeter(flops, tokens_per_step=64, devices=2, peak_flops=1e9, writer=True,
                      metrics=tmp_path / "run" / "metrics.jsonl", tensorboard=None)
    meter.start()
    record = meter.stop(1, 2.5, 3 * 2**20, 16)
    meter.close()
    assert record.tokens_per_second == pytest.approx(64 / record.seconds)
    achieved = flops.per_token() * record.tokens_per_second / 2
    assert record.tflops_per_device == pytest.approx(achieved / 1e12)
    assert record.mfu == pytest.approx(achieved / 1e9)
    line = record.line(10)
    assert line.startswith("step 1/10  loss 2.5000") and "tokens/s" in line
    assert "TFLOP/s/device  MFU" in line and "peak mem 3 MiB" in line
    (saved,) = map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert saved["step"] == 1 and saved["data_position"] == 16 and saved["mfu"] == record.mfu


def test_the_peak_is_the_flag_or_on_a_cpu_a_measured_rate() -> None:
    assert device_peak_flops(torch.device("cpu"), "fp32", 5e12) == (5e12, "--peak-tflops")
    measured, source = device_peak_flops(torch.device("cpu"), "fp32", None)
    assert measured is not None and measured > 0 and "measured" in source
