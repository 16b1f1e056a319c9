"""HF families split over tp inside pipeline stages equal HF itself (loss, gradients, updated
weights within 1e-5 relative, fp32, gloo), and planted bugs in the split are caught.

The matrix covers every family and every feature at least once, in two launches (4 and 8
ranks) that run their cases one after another, so process start-up is paid twice."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")

from pipeline.errors import PipelineConfigError
from pipeline.interop import hf_tensor_parallel, hf_tp_split
from pipeline.interop.hf_modules_tp import Region
from pipeline.interop.hf_tensor_parallel import (
    check_tensor_parallel_size,
    valid_tensor_parallel_sizes,
)
from pipeline.parallel.tensor import overlap
from pipeline.parallel.tensor.shard_layout import ShardLayout
from tests.support.hf_models import tiny_config
from tests.support.hf_tp_equivalence import TPCase, tp_checkpoint_resume_errors, tp_step_errors
from tests.support.rank_harness import run_ranks

TOLERANCE = 1e-5

WORLD_4 = [  # pp 2 × tp 2
    TPCase("gpt2", 2, sequence_parallel=True, export=True),
    TPCase("phi3", 2, sequence_parallel=True),
    TPCase("gemma2", 2, schedule="zb-h1"),
    TPCase("qwen3", 2, recompute="selective", tied=False, from_model=True),
    TPCase("qwen2", 2, tied=False, schedule="zb-h1", sequence_parallel=True),
    # two chunks per rank: GPT-2's tied embedding and head on stages 0 and 3, on two ranks
    # (interleaved's loop) and on one rank (zb-v's V, split backward)
    TPCase("gpt2", 2, schedule="interleaved", chunks=2),
    TPCase("gpt2", 2, schedule="zb-v", chunks=2, sequence_parallel=True),
    # the tp collectives beside the GEMMs (fused q;k;v and gate;up; GPT-2's fused c_attn)
    TPCase("llama", 2, overlap=True),
    TPCase("llama", 2, sequence_parallel=True, overlap=True),
    TPCase("gpt2", 2, overlap=True),
    TPCase("gpt2", 2, sequence_parallel=True, overlap=True),
]
WORLD_8 = [  # pp 2 × tp 4 (the kv heads, 2, replicated per pair of ranks), pp 2 × dp 2 × tp 2
    TPCase("llama", 4),
    TPCase("mistral", 4, sequence_parallel=True, recompute="selective"),
    TPCase("gemma3_text", 2, dp=2, zero=True, sequence_parallel=True, tied=False,
           export=True),
    # bf16 parameters with fp32 masters under ZeRO-1, against the fp32 reference at the
    # bf16 tolerance (as tests/parallel/test_model_states.py's half_parameters case)
    TPCase("llama", 2, dp=2, zero=True, sequence_parallel=True,
           engine={"precision": "bf16", "half_parameters": True}),
]
HALF_TOLERANCE = 2e-2
"""bf16 parameters against the fp32 reference (the engine's stated bf16 tolerance)."""


def _fused_as_one_block(original: Any) -> Any:
    """Planted bug: a fused projection (GPT-2's c_attn, Q;K;V) cut as one block, so rank 0
    gets all of Q and half of K instead of half of each."""
    def column(linear: Any, blocks: tuple[int, ...], region: Any, **kwargs: Any) -> None:
        original(linear, (sum(blocks),), region, **kwargs)
    return column


def _without_reduction(self: Region, y: torch.Tensor) -> torch.Tensor:
    """Planted bug: the row-parallel output is not all-reduced (g is missing)."""
    return y


def _first_chunk_twice(original: Any) -> Any:
    """Planted bug in the overlapped layers: every chunk is the first one, so the others
    are skipped (and the first computed, gathered and reduced twice); one chunk (no
    overlap) is unchanged."""
    def slices(size: int, chunks: int) -> list[slice]:
        parts = original(size, chunks)
        return [parts[0]] * len(parts)
    return slices


def _reduced_twice(original: Any) -> Any:
    """Planted bug in the overlapped layers: each all-reduce runs twice (t× the sum)."""
    def launch(ops: Any, overlapped: bool, collective: Any, tensor: torch.Tensor,
               group: Any, dim: int) -> Any:
        pending = original(ops, overlapped, collective, tensor, group, dim)
        if collective is not overlap.Collective.ALL_REDUCE:
            return pending
        return original(ops, overlapped, collective, pending.wait(), group, dim)
    return launch


PLANTED: dict[str, tuple[Any, str, Any, TPCase]] = {
    "fused-as-one-block": (hf_tp_split, "_column", _fused_as_one_block,
                           TPCase("gpt2", 2)),
    "missing-all-reduce": (Region, "leave", lambda original: _without_reduction,
                           TPCase("gpt2", 2)),
    "overlap-chunk-skipped": (overlap, "_slices", _first_chunk_twice,
                              TPCase("llama", 2, sequence_parallel=True, overlap=True)),
    "overlap-chunk-reduced-twice": (overlap, "_launch", _reduced_twice,
                                    TPCase("gpt2", 2, overlap=True)),
}


def _check(errors: dict[str, float], case: TPCase) -> None:
    assert errors["sharded"] == 1.0, f"{case.label()}: nothing was split"
    tolerance = HALF_TOLERANCE if case.engine.get("half_parameters") else TOLERANCE
    for what in ("loss", "grad", "param", "export"):
        assert errors[what] < tolerance, f"{case.label()}: {what} relative error {errors}"


def _run_cases(rank: int, world_size: int, cases: list[TPCase], planted: list[str]) -> None:
    for case in cases:
        _check(tp_step_errors(case), case)
    if world_size == 4:  # Adam under ZeRO-1 at tp 2 with sequence parallelism, checkpointed
        resumed, against_hf = tp_checkpoint_resume_errors()
        assert resumed == 0.0 and against_hf < TOLERANCE, (resumed, against_hf)
    for name in planted:  # the same comparison must fail with a bug planted in the split
        owner, attribute, make, case = PLANTED[name]
        original = getattr(owner, attribute)
        setattr(owner, attribute, make(original))
        try:
            errors = tp_step_errors(case)
        finally:
            setattr(owner, attribute, original)
        assert max(errors["loss"], errors["grad"]) > 1e-3, f"planted {name} passed: {errors}"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_family_at_tp2_pp2_equals_hf_and_planted_bugs_fail() -> None:
    run_ranks(_run_cases, 4, WORLD_4, list(PLANTED), timeout=600)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tp4_and_zero1_dp2_with_sequence_parallelism_equal_hf() -> None:
    run_ranks(_run_cases, 8, WORLD_8, [], timeout=600)


def test_every_family_and_feature_is_in_the_matrix() -> None:
    from tests.support.hf_models import FAMILIES

    cases = WORLD_4 + WORLD_8
    assert {case.family for case in cases} == set(FAMILIES)
    assert {4, 2} <= {case.tp for case in cases}
    assert any(c.sequence_parallel for c in cases) and any(not c.sequence_parallel
                                                           for c in cases)
    assert any(c.zero and c.dp == 2 for c in cases)
    assert {(c.family, c.sequence_parallel) for c in cases if c.overlap} == {
        (family, sp) for family in ("llama", "gpt2") for sp in (False, True)}
    assert any(c.recompute == "selective" for c in cases)
    assert any(c.schedule == "zb-h1" for c in cases) and any(c.from_model for c in cases)
    assert {"interleaved", "zb-v"} <= {c.schedule for c in cases if c.chunks == 2}
    assert any(c.engine.get("half_parameters") for c in cases)
    assert all(c.world <= 8 for c in cases)


def _valid_by_definition(config: Any, tp: int) -> bool:
    """A tp splits heads, FFN columns and either splits or evenly replicates kv heads."""
    heads = config.num_attention_heads if config.model_type != "gpt2" else config.n_head
    kv = getattr(config, "num_key_value_heads", heads) if config.model_type != "gpt2" else heads
    ffn = config.intermediate_size if config.model_type != "gpt2" else 4 * config.n_embd
    kv_ok = kv % tp == 0 or (tp % kv == 0 and config.model_type != "phi3")
    return heads % tp == 0 and ffn % tp == 0 and kv_ok


@pytest.mark.parametrize("family", ["llama", "phi3", "gpt2"])
def test_valid_tensor_parallel_sizes_follow_the_definition(family: str) -> None:
    config = tiny_config(family)  # 4 heads, 2 kv heads (GPT-2: 4), FFN 64 (GPT-2: 128)
    valid = valid_tensor_parallel_sizes(config, up_to=16)
    assert valid == [tp for tp in range(1, 17) if _valid_by_definition(config, tp)]
    assert valid == ([1, 2] if family == "phi3" else [1, 2, 4])
    with pytest.raises(PipelineConfigError, match=r"^tensor parallel size 3 does not divide "
                       rf"{family}'s 4 attention heads.*valid tensor parallel sizes: 1, 2"):
        check_tensor_parallel_size(config, 3)
    with pytest.raises(PipelineConfigError) as caught:
        check_tensor_parallel_size(config, 8)
    assert "\n" not in str(caught.value) and "tensor parallel size 8" in str(caught.value)


@given(blocks=st.lists(st.integers(1, 40), min_size=1, max_size=3), size=st.integers(1, 8),
       dim=st.integers(0, 1))
def test_shard_layout_parts_tile_the_full_tensor(blocks: list[int], size: int,
                                                 dim: int) -> None:
    full = torch.arange(float(sum(blocks) * 3)).reshape(
        (sum(blocks), 3) if dim == 0 else (3, sum(blocks)))
    layouts = [ShardLayout(dim, tuple(blocks), rank, size) for rank in range(size)]
    shards = [layout.shard(full) for layout in layouts]
    assert torch.equal(layouts[0].merge(shards), full)
    for layout, shard in zip(layouts, shards):  # ranges name exactly the shard's pieces
        pieces = [full.narrow(dim, lo, hi - lo) for lo, hi in layout.ranges()]
        assert torch.equal(torch.cat(pieces, dim=dim), shard)
        # each block's parts differ by at most one row (tensor_split)
        for (lo, hi), block in zip(layout.ranges(), blocks):
            assert hi - lo in (block // size, -(-block // size))


def test_a_tensor_parallel_slice_is_read_from_safetensors_without_the_whole_tensor(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors
    from safetensors.torch import save_file

    from pipeline.interop.hf_weights import read_hf_tensors

    full = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)  # a fused (6; 6) block
    save_file({"w": full, "b": full[0].clone()}, str(tmp_path / "model.safetensors"))
    whole_reads: list[str] = []
    opened = safetensors.safe_open

    class Recording:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.handle = opened(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *args: Any) -> None:
            self.handle.__exit__(*args)

        def keys(self) -> Any:
            return self.inner.keys()

        def get_tensor(self, key: str) -> torch.Tensor:
            whole_reads.append(key)
            return self.inner.get_tensor(key)

        def get_slice(self, key: str) -> Any:
            return self.inner.get_slice(key)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    layout = ShardLayout(0, (6, 6), 1, 2)
    tensors = read_hf_tensors(tmp_path, ["w", "b"], {"w": layout})
    assert torch.equal(tensors["w"], layout.shard(full))  # rows 3-5 and 9-11
    assert torch.equal(tensors["w"], torch.cat([full[3:6], full[9:12]]))
    assert whole_reads == ["b"]  # only the replicated tensor was read whole


class _Projections(torch.nn.Module):
    """Three projections of one input, as HF's attention calls them."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(6, 4)
        self.k_proj = torch.nn.Linear(6, 2, bias=False)
        self.v_proj = torch.nn.Linear(6, 2)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        width = hidden_states.shape[:-1]  # HF reads the input's shape, then projects it
        parts = (self.q_proj(hidden_states), self.k_proj(hidden_states),
                 self.v_proj(hidden_states))
        return torch.cat(parts, dim=-1).view(*width, -1)


def test_fused_column_projections_equal_the_separate_ones_and_refuse_another_input() -> None:
    import copy

    from pipeline.interop.hf_overlap import fuse_columns_on_call

    torch.manual_seed(0)
    fused, separate = _Projections(), _Projections()
    separate.load_state_dict(fused.state_dict())
    fuse_columns_on_call(fused, ("q_proj", "k_proj", "v_proj"),
                         Region(None, False, overlap=True))
    assert list(fused.state_dict()) == list(separate.state_dict())  # HF's names kept
    x = torch.randn(2, 3, 6)
    for model in (fused, separate):
        model(x).pow(2).sum().backward()
    assert torch.allclose(fused(x), separate(x), atol=1e-6)
    for (name, got), want in zip(fused.named_parameters(), separate.parameters()):
        assert got.grad is not None and torch.allclose(got.grad, want.grad, atol=1e-6), name
    with pytest.raises(PipelineConfigError, match="called outside its module's forward"):
        fused.q_proj(copy.deepcopy(x))


@pytest.mark.parametrize(("option", "value"), [("overlap", "yes"), ("overlap_chunks", 0),
                                               ("overlap_chunks", True)])
def test_bad_overlap_options_are_refused_by_name(option: str, value: Any) -> None:
    from pipeline.interop.hf_layers import layers_from_hf

    with pytest.raises(PipelineConfigError, match=rf"^{option} must be .*got {value!r}"):
        hf_tensor_parallel.tensor_parallel_hf(layers_from_hf(tiny_config("llama")),
                                              **{option: value})
