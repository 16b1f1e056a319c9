"""Re-cutting saved slices (`pipeline.checkpoint.reshard`) against an oracle written from the
definition: rank r of t holds, of each fused block of n rows, rows
[r·⌊n/t⌋ + min(r, n mod t), +⌊n/t⌋ + (r < n mod t)), blocks in order. Weights and optimizer
pieces (cut at arbitrary ZeRO boundaries) from any saved size to any other, replicated
(unsplit) on either side included; a tensor of another model is refused by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.checkpoint.manifest import SavedSplit
from pipeline.checkpoint.optimizer_state import make_piece
from pipeline.checkpoint.reshard import Cut, SavedGrid, assemble_resharded, reshard_layer
from pipeline.errors import CheckpointError
from pipeline.parallel.tensor.shard_layout import ShardLayout


def _rows(n: int, t: int, r: int) -> range:
    base, extra = divmod(n, t)
    start = r * base + min(r, extra)
    return range(start, start + base + (r < extra))


def _oracle(full: torch.Tensor, dim: int, blocks: list[int], t: int, r: int) -> torch.Tensor:
    """Rank r's part of `full` by the definition (index lists, not `ShardLayout`)."""
    index, offset = [], 0
    for n in blocks:
        index += [offset + i for i in _rows(n, t, r)]
        offset += n
    return full.index_select(dim, torch.tensor(index, dtype=torch.long))


cases = st.fixed_dictionaries({
    "blocks": st.lists(st.integers(4, 9), min_size=1, max_size=3),  # no empty part at t <= 4
    "dim": st.integers(0, 1),
    "saved": st.integers(0, 4),  # 0: whole on every saving rank (replicated)
    "loaded": st.integers(0, 4),
    "axis": st.sampled_from(["tp", "ep"]),
})


def _setup(case: dict[str, object]) -> tuple[torch.Tensor, SavedGrid, int, int, list[int], int]:
    blocks, dim = list(case["blocks"]), int(case["dim"])  # type: ignore[call-overload]
    shape = [sum(blocks), 3] if dim == 0 else [3, sum(blocks)]
    full = torch.randn(shape)
    saved = int(case["saved"])  # type: ignore[call-overload]
    splits = {} if saved == 0 else {(0, "w"): SavedSplit(0, "w", str(case["axis"]), dim,
                                                         tuple(blocks), saved)}
    return full, SavedGrid(splits, base_tp=0), saved, dim, blocks, int(case["loaded"])  # type: ignore[call-overload]


@settings(max_examples=60, deadline=None)
@given(case=cases)
def test_weights_recut_from_any_saved_size_to_any_other(case: dict[str, object]) -> None:
    full, grid, saved, dim, blocks, loaded = _setup(case)
    axis = str(case["axis"])

    def read(slice_: tuple[int, int]) -> dict[str, torch.Tensor]:
        coordinate = slice_[0] if axis == "tp" else slice_[1]
        return {"w": full if saved == 0 else _oracle(full, dim, blocks, saved, coordinate)}

    for rank in range(max(loaded, 1)):
        cut = None if loaded == 0 else Cut(axis, ShardLayout(dim, tuple(blocks), rank, loaded))
        want = full if loaded == 0 else _oracle(full, dim, blocks, loaded, rank)
        got = reshard_layer(0, {"w": want}, {"w": cut}, grid, read, where="test")["w"]
        assert torch.equal(got, want), (saved, loaded, rank)


@settings(max_examples=60, deadline=None)
@given(case=cases, data=st.data())
def test_optimizer_state_recuts_like_its_parameter(case: dict[str, object],
                                                   data: st.DataObject) -> None:
    full, grid, saved, dim, blocks, loaded = _setup(case)
    axis = str(case["axis"])
    moments = {"exp_avg": full, "exp_avg_sq": full * full}
    pieces = []
    for coordinate in range(max(saved, 1)):
        mine = {n: v if saved == 0 else _oracle(v, dim, blocks, saved, coordinate)
                for n, v in moments.items()}
        numel = mine["exp_avg"].numel()
        # ZeRO-like: the slice's flattened elements in pieces at arbitrary boundaries
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(numel - 1, 1)), max_size=3))))
        for start, stop in zip([0, *cuts], [*cuts, numel]):
            if start < stop:
                piece = make_piece((0, "w"), mine["exp_avg"].shape, start, stop,
                                   {n: v.reshape(-1)[start:stop] for n, v in mine.items()},
                                   {"step": torch.tensor(2.0)})
                slice_ = (coordinate, 0) if axis == "tp" else (0, coordinate)
                pieces.append((slice_, piece))
    for rank in range(max(loaded, 1)):
        cut = None if loaded == 0 else Cut(axis, ShardLayout(dim, tuple(blocks), rank, loaded))
        want = {n: v if loaded == 0 else _oracle(v, dim, blocks, loaded, rank)
                for n, v in moments.items()}
        numel = want["exp_avg"].numel()
        start = data.draw(st.integers(0, numel - 1))
        stop = data.draw(st.integers(start + 1, numel))
        state = assemble_resharded(pieces, {(0, "w"): (start, stop)}, {(0, "w"): cut},
                                   {(0, "w"): tuple(want["exp_avg"].shape)}, grid, where="t")
        entry = state[(0, "w")]
        for name, value in want.items():
            assert torch.equal(entry.sliced[name], value.reshape(-1)[start:stop]), name
        assert float(entry.whole["step"]) == 2.0


def test_a_tensor_of_another_model_is_refused_by_name() -> None:
    grid = SavedGrid({(3, "mlp.up.weight"): SavedSplit(3, "mlp.up.weight", "tp", 0, (8,), 2)},
                     base_tp=0)
    cut = Cut("tp", ShardLayout(0, (6,), 0, 3))  # this model's up projection has 6 rows

    def read(slice_: tuple[int, int]) -> dict[str, torch.Tensor]:
        return {"mlp.up.weight": torch.zeros(4, 2)}

    with pytest.raises(CheckpointError, match=r"layer 3 'mlp.up.weight' cannot be re-cut .*"
                                              r"same model"):
        reshard_layer(3, {"mlp.up.weight": torch.zeros(2, 2)}, {"mlp.up.weight": cut}, grid,
                      read, where="step_000001")


def test_a_checkpoint_saved_before_splits_were_recorded_loads_its_own_slices_as_they_are() -> None:
    """tp 2 without recorded splits (an older pipesched): tp rank 1 reads its own file's
    slice unchanged (a re-cut would take its half of the half)."""
    grid = SavedGrid({}, base_tp=1, recorded=False)
    saved = torch.arange(6.0).reshape(3, 2)
    cut = Cut("tp", ShardLayout(0, (6,), 1, 2))
    got = reshard_layer(0, {"w": saved}, {"w": cut}, grid, lambda s: {"w": saved},
                        where="old")
    assert torch.equal(got["w"], saved)
