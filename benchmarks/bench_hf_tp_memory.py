"""Counted memory of HF models split over tp in pipeline stages against the one accounting.

    PYTHONPATH=$PWD python benchmarks/bench_hf_tp_memory.py

pp 2 × dp 2 × tp 2 (8 gloo ranks), a tiny grouped-query Llama and GPT-2 (tied embeddings),
sequence parallelism on: per rank, the model-state bytes `count_model_states` finds after one
Adam step (parameters, gradients, optimizer state, ZeRO-1's flat buffers and shards) against
the planner's tp-sharded parameters × `model_state_bytes`; then the activation bytes one
decoder layer saves (`SavedTensorMeter`) against `eager_layer_activation_bytes` and
Korthikanti's `layer_activation_bytes` (Megatron's kernels). Counts are exact and
repeatable (no timing).
"""

from __future__ import annotations

from typing import Any

from pipeline import launch
from tests.support.hf_tp_memory import memory_rows


def _error(counted: float, predicted: float) -> str:
    return f"{(counted - predicted) / predicted:+.2%}"


def main() -> None:
    rows: list[dict[str, Any]] = [row for rank_rows in launch(memory_rows, 8, timeout=120,
                                                              join_timeout=900)
                                  for row in rank_rows]
    print("model states per rank after one Adam step (bytes), pp 2 × dp 2 × tp 2")
    print(f"{'family':<7}{'ZeRO':>5}{'stage':>6}{'params':>8}{'counted':>10}"
          f"{'predicted':>11}{'error':>9}")
    shown = set()
    for row in sorted((r for r in rows if r["kind"] == "states"),
                      key=lambda r: (r["family"], r["zero"], r["stage"], -r["counted"])):
        key = (row["family"], row["zero"], row["stage"])
        if key in shown:  # the stage's ranks differ by ZeRO padding only: show the largest
            continue
        shown.add(key)
        print(f"{row['family']:<7}{row['zero']:>5}{row['stage']:>6}"
              f"{row['counted_params']:>8}{row['counted']:>10}{row['predicted']:>11.0f}"
              f"{_error(row['counted'], row['predicted']):>9}")
    print("\nactivation bytes one decoder layer saves per tp rank (fp32, s 16, b 2, tp 2)")
    print(f"{'family':<7}{'SP':>4}{'counted':>9}{'eager HF':>10}{'error':>9}"
          f"{'Korthikanti':>12}{'error':>9}")
    layers = {(r["family"], r["sequence_parallel"]): r for r in rows  # each tp group's rank 0
              if r["kind"] == "activations" and r["rank"] == 0}
    for row in layers.values():
        print(f"{row['family']:<7}{'on' if row['sequence_parallel'] else 'off':>4}"
              f"{row['counted']:>9}{row['predicted']:>10.0f}"
              f"{_error(row['counted'], row['predicted']):>9}{row['korthikanti']:>12.0f}"
              f"{_error(row['counted'], row['korthikanti']):>9}")


if __name__ == "__main__":
    main()
