"""`eager_layer_activation_bytes`: the per-tensor sum, what sequence parallelism divides, and
refusals of bad shapes (the counted bytes are compared in tests/interop/test_hf_tp_memory.py)."""

from __future__ import annotations

import pytest

from schedules.analysis.eager_activations import eager_layer_activation_bytes
from schedules.ir.errors import ScheduleConfigError

S, B, H, A, D, T = 16, 2, 32, 4, 8, 2
Q, K, F = A * D, 2 * D, 64


def _llama(sequence_parallel: bool) -> float:
    return eager_layer_activation_bytes(S, B, H, A, q_width=Q, kv_width=K, ffn=F,
                                        head_dim=D, t=T, sequence_parallel=sequence_parallel)


def test_a_llama_layer_is_the_sum_of_its_saved_tensors() -> None:
    tokens = S * B
    norms = 2 * (2 * tokens * H + tokens)      # input and normalized, rsqrt, twice
    column_inputs = 2 * tokens * H             # q/k/v's and gate/up's input
    rotary = 2 * tokens * D                    # cos, sin
    attention = tokens * (Q + K + K + Q) // T + tokens * A // T  # q, k, v, out; lse
    mlp = 4 * tokens * F // T                  # gate, silu(gate), up, product
    assert _llama(False) == 4 * (norms + column_inputs + rotary + attention + mlp)
    assert _llama(False) == 49664  # what tiny Llama's layer saves at tp 2 (benchmarks.md)


def test_sequence_parallelism_divides_the_norms_and_the_column_inputs() -> None:
    norms = 2 * (2 * S * B * H + S * B)
    column_inputs = 2 * S * B * H              # the slice kept, gathered again backward
    assert _llama(False) - _llama(True) == 4 * (norms + column_inputs) * (1 - 1 / T)
    gpt2 = {sp: eager_layer_activation_bytes(
        S, B, H, A, q_width=H, kv_width=H, ffn=4 * H, head_dim=D, norm="layernorm",
        rotary=False, mlp_tensors=5, t=T, sequence_parallel=sp) for sp in (False, True)}
    assert gpt2[False] == 66304 and gpt2[True] == 57856  # tiny GPT-2 at tp 2 (benchmarks.md)


@pytest.mark.parametrize("bad", [{"t": 0}, {"s": True}, {"ffn": 1.5}, {"norm": "batchnorm"},
                                 {"mlp_tensors": -1}])
def test_bad_shapes_are_refused_by_name(bad: dict[str, object]) -> None:
    values: dict[str, object] = dict(s=S, b=B, h=H, a=A, q_width=Q, kv_width=K, ffn=F,
                                     head_dim=D) | bad
    name = next(iter(bad))
    with pytest.raises(ScheduleConfigError, match=name):
        eager_layer_activation_bytes(**values)  # type: ignore[arg-type]
