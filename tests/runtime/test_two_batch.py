"""Two-batch overlap's pieces: cutting a microbatch in two and joining the halves, the turn
order of the halves, the zero-bubble captures of the halves merged, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.model.layers import LayerSpec
from pipeline.model.module import PipelineModule
from pipeline.moe.interleave import hand_over, run_interleaved
from pipeline.rehearsal.emulated import EmulatedCost
from pipeline.rehearsal.emulated_moe import EmulatedAllToAll
from pipeline.runtime.config import EngineConfig
from pipeline.runtime.split_backward import LayerGrads, forward_capturing
from pipeline.runtime.two_batch import (
    join_halves,
    split_rows,
    two_batch_forward,
    two_batch_problem,
)
from schedules.analysis.all_to_all import TWO_BATCH_ORDER
from tests.support.rank_harness import run_ranks


def test_rows_are_cut_sums_go_to_half_0_and_the_rest_to_both() -> None:
    hidden, mask = torch.arange(10.0).reshape(5, 2), torch.ones(5, 3)
    balance, positions = torch.tensor([0.5]), torch.arange(3).unsqueeze(0)
    halves = split_rows((hidden, balance, positions, mask), frozenset({1}))
    assert halves is not None
    first, second = halves
    assert torch.equal(first[0], hidden[:2]) and torch.equal(second[0], hidden[2:])
    assert first[1] is balance and torch.equal(second[1], torch.zeros(1))
    assert first[2] is positions and second[2] is positions
    assert torch.equal(first[3], mask[:2]) and torch.equal(second[3], mask[2:])
    # a declared sum whose input has the microbatch's rows (an embedding's attention mask
    # at the position its output carries the loss) is cut as rows
    ids = torch.zeros(4, 3, dtype=torch.long)
    cut = split_rows((ids, torch.ones(4, 3)), frozenset({1}))
    assert cut is not None and cut[1][1].shape == (2, 3)
    assert split_rows(torch.zeros(1, 4), frozenset()) is None  # one row: nothing to cut
    lone = split_rows(torch.arange(4.0), frozenset())
    assert lone is not None and [t.tolist() for t in lone] == [[0.0, 1.0], [2.0, 3.0]]


def test_halves_join_as_rows_sums_and_shared_values() -> None:
    positions = torch.arange(3).unsqueeze(0)
    a = (torch.ones(2, 4), torch.tensor([0.25]), positions)
    b = (torch.zeros(3, 4), torch.tensor([0.5]), positions)
    joined = join_halves(a, b, (2, 3), frozenset({1}), "stage 1")
    assert isinstance(joined, tuple)
    assert torch.equal(joined[0], torch.cat((a[0], b[0])))
    assert joined[1].item() == 0.75 and joined[2] is positions
    # equal values recomputed by each half (not rows): half 0's
    same = join_halves((torch.ones(2, 4), torch.ones(7)), (torch.ones(2, 4), torch.ones(7)),
                       (2, 2), frozenset(), "stage 1")
    assert isinstance(same, tuple) and same[0].shape == (4, 4) and same[1].shape == (7,)
    # a 0-d loss the layers did not declare a row sum: refused, naming the fix
    with pytest.raises(PipelineConfigError, match=r"output 1 of stage 3 .*row_sums = \(1,\)"):
        join_halves((torch.ones(1, 2), torch.tensor(1.0)), (torch.ones(1, 2), torch.tensor(2.0)),
                    (1, 1), frozenset(), "stage 3")
    with pytest.raises(PipelineConfigError, match="different structure"):
        join_halves((torch.ones(1, 2),), torch.ones(1, 2), (1, 1), frozenset(), "stage 0")


class _Done:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def _block(log: list[str]) -> object:
    """A microbatch's forward: attention, dispatch, experts, combine, logging each part
    with the half (its rows' first value) it ran for."""
    def run(x: torch.Tensor) -> torch.Tensor:
        half = "XY"[int(x[0])]
        for part in ("attention", "a2a dispatch", "experts", "a2a combine"):
            if part.startswith("a2a"):
                log.append(f"launch {half}.{part[4:]}")
                hand_over(_Done(log, f"{half}.{part[4:]}"))
            else:
                log.append(f"{half}.{part}")
        return x * 2
    return run


def test_the_halves_take_turns_in_the_order_the_simulator_prices() -> None:
    """Half 0 (X) starts; each hands over when it launches an all-to-all: compute X, Y, X, Y
    and the lane X, Y, X, Y (`schedules.analysis.all_to_all.TWO_BATCH_ORDER`)."""
    log: list[str] = []
    x = torch.tensor([0.0, 0.0, 1.0, 1.0])
    done = two_batch_forward(_block(log), x, frozenset(),  # type: ignore[arg-type]
                             lambda a, b, rows: join_halves(a, b, rows, frozenset(), "s"))
    assert done is not None
    out, handovers = done
    assert torch.equal(out, x * 2)
    assert log == [
        "X.attention", "launch X.dispatch", "Y.attention", "launch Y.dispatch",
        "wait X.dispatch", "X.experts", "launch X.combine",
        "wait Y.dispatch", "Y.experts", "launch Y.combine",
        "wait X.combine", "wait Y.combine"]
    assert handovers == 4
    computed = [entry.split(".")[0] for entry in log if " " not in entry]
    launched = [entry.split()[1][0] for entry in log if entry.startswith("launch")]
    assert computed == [half for half, resource, _ in TWO_BATCH_ORDER if resource == "compute"]
    assert launched == [half for half, resource, _ in TWO_BATCH_ORDER if resource == "lane"]


def test_inside_a_pair_the_halves_run_in_order_on_the_forward_thread() -> None:
    """In an overlapped pair the forward's halves run one after the other on its thread,
    each handing the turn to the pair's backward at its own all-to-alls."""
    log: list[str] = []
    x = torch.tensor([0.0, 1.0])

    def forward() -> None:
        done = two_batch_forward(_block(log), x, frozenset(),  # type: ignore[arg-type]
                                 lambda a, b, rows: join_halves(a, b, rows, frozenset(), "s"),
                                 interleaved=False)
        assert done is not None and torch.equal(done[0], x * 2) and done[1] == 0

    def backward() -> None:
        for part in ("a2a one", "compute", "a2a two"):
            if part.startswith("a2a"):
                hand_over(_Done(log, f"B.{part}"))
            else:
                log.append("B.compute")

    assert run_interleaved(backward, forward) == 4  # B ends after its second: F goes on alone
    forward_parts = [e for e in log if e.startswith(("X.", "Y.", "launch"))]
    assert forward_parts == [
        "X.attention", "launch X.dispatch", "X.experts", "launch X.combine",
        "Y.attention", "launch Y.dispatch", "Y.experts", "launch Y.combine"]
    # B (which starts, launching its first all-to-all) computes while X's dispatch flies
    assert log.index("B.compute") == log.index("launch X.dispatch") + 2


def _stage(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    specs = [LayerSpec(nn.Linear, 3, 5), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 5, 2)]
    module = PipelineModule(specs, num_stages=1, loss_fn=nn.functional.mse_loss)
    module.materialize([0])
    return module.stage(0)


@pytest.mark.parametrize("first_stage", [True, False])
def test_merged_captures_of_the_halves_give_the_whole_microbatchs_gradients(
        first_stage: bool) -> None:
    """I then W on a forward run as two halves (`LayerGrads.merged`) accumulate the same
    input and weight gradients as one backward of the whole microbatch; on a first stage
    (no input gradient) I carries the gradient to each half's first layer."""
    x = torch.randn(6, 3)
    grad_out = torch.randn(6, 2)
    reference = _stage(0)
    whole_x = x.clone().requires_grad_(not first_stage)
    reference(whole_x).backward(grad_out)

    stage = _stage(0)
    leaf = x.clone().requires_grad_(not first_stage)
    parts = [forward_capturing(stage, leaf[:3]), forward_capturing(stage, leaf[3:])]
    captures = LayerGrads.merged([p[1] for p in parts])
    assert captures is not None and captures.starts == [0, 2]
    roots = [torch.cat([p[0] for p in parts])]
    if first_stage:
        captures.backward_inputs(roots, [grad_out])
    else:
        torch.autograd.backward(roots, [grad_out], inputs=[leaf], retain_graph=True)
        assert leaf.grad is not None and whole_x.grad is not None
        assert torch.allclose(leaf.grad, whole_x.grad, atol=1e-6)
    assert all(p.grad is None for p in stage.parameters())  # I left the weights to W
    assert captures.complete()
    captures.backward_weights()
    for mine, theirs in zip(stage.parameters(), reference.parameters()):
        assert mine.grad is not None and theirs.grad is not None
        assert torch.allclose(mine.grad, theirs.grad, atol=1e-6)
    assert LayerGrads.merged([parts[0][1], None]) is None


def test_what_two_batch_cannot_do_exactly_is_refused() -> None:
    from pipeline.moe.layer import RouterConfig

    class _Routed(nn.Module):
        def __init__(self, factor: float | None) -> None:
            super().__init__()
            self.config = RouterConfig(num_experts=4, top_k=2, normalize_top_k=True,
                                       capacity_factor=factor)
            self.dispatcher = object()

    assert two_batch_problem(nn.Sequential(_Routed(None), nn.Dropout(0.0))) is None
    assert "capacity factor (1.5)" in str(two_batch_problem(nn.Sequential(_Routed(1.5))))
    assert "dropout of p=0.1" in str(two_batch_problem(nn.Sequential(nn.Dropout(0.1))))
    attention = nn.Linear(2, 2)
    attention.attention_dropout = 0.2  # type: ignore[assignment]  (HF's functional dropout)
    assert "attention_dropout=0.2" in str(two_batch_problem(nn.Sequential(attention)))
    with pytest.raises(PipelineConfigError, match="two_batch_overlap must be True or False"):
        EngineConfig(two_batch_overlap="yes")  # type: ignore[arg-type]


def test_emulated_parts_cost_their_rows_share() -> None:
    cost = EmulatedCost(forward=0.02, input_grad=0.01, weight_grad=0.004, rows=4)
    assert cost.share(4) is cost
    half = cost.share(2)
    assert (half.forward, half.input_grad, half.weight_grad) == (0.01, 0.005, 0.002)
    assert EmulatedCost(forward=0.02, input_grad=0.0, weight_grad=0.0).share(1).forward == 0.02
    with pytest.raises(PipelineConfigError, match="rows must be an int >= 1"):
        EmulatedCost(forward=0.0, input_grad=0.0, weight_grad=0.0, rows=0)
    with pytest.raises(PipelineConfigError, match="rows must be an int >= 1 or None"):
        EmulatedAllToAll(0.01, 0.01, rows=-1)


class _CappedExperts(nn.Linear):
    """Stands for an MoE layer dropping tokens past a capacity factor, with an all-to-all."""

    all_to_all_inside = True

    def __init__(self) -> None:
        from pipeline.moe.layer import RouterConfig

        super().__init__(2, 2)
        self.config = RouterConfig(num_experts=4, top_k=2, normalize_top_k=True,
                                   capacity_factor=1.0)
        self.dispatcher = object()


def _engine_refuses_a_model_without_all_to_all(rank: int, world_size: int) -> None:
    from pipeline import PipelineEngine
    from pipeline.rehearsal.emulated import emulated_loss
    from pipeline.rehearsal.emulated_moe import emulated_moe_blocks

    torch.set_num_threads(1)
    dense = PipelineModule([LayerSpec(nn.Linear, 2, 2)] * 2, num_stages=2,
                           loss_fn=nn.functional.mse_loss)
    with pytest.raises(PipelineConfigError, match="no stage runs an expert all-to-all"):
        PipelineEngine(dense, schedule="1f1b", num_microbatches=2, two_batch_overlap=True)
    # only rank 1's stage is refused; rank 0 (a dense stage) learns it in the same all-reduce
    capped = PipelineModule([LayerSpec(nn.Linear, 2, 2), LayerSpec(_CappedExperts)],
                            num_stages=2, loss_fn=nn.functional.mse_loss)
    expected = "stage 1: .* capacity factor" if rank == 1 else "another rank's stage cannot"
    with pytest.raises(PipelineConfigError, match=expected):
        PipelineEngine(capped, schedule="1f1b", num_microbatches=2, two_batch_overlap=True)
    moe = PipelineModule(emulated_moe_blocks(2, 0.0, backward_part=0.0, rows=2), num_stages=2,
                         loss_fn=emulated_loss, partition_method=[0, 4, 8])
    engine = PipelineEngine(moe, schedule="1f1b", num_microbatches=2, two_batch_overlap=True)
    engine.train_batch(torch.zeros(4, 1), torch.zeros(4, 1))
    # each rank holds one block: both its forwards ran as halves, handing over 4 times each
    assert engine._interpreter.two_batch_handovers == 2 * 4, rank


@pytest.mark.multiprocess
def test_the_engine_refuses_two_batch_overlap_with_nothing_to_hide() -> None:
    """No stage on any rank has an expert all-to-all, or one rank's stage drops tokens past a
    capacity factor: refused on every rank alike (not a silent no-op, no rank left
    waiting); emulated MoE blocks (an all-to-all lane) run it."""
    run_ranks(_engine_refuses_a_model_without_all_to_all, 2, timeout=120)


def _failing_block(log: list[str], failing: str) -> object:
    """`_block`, with half `failing` raising where its experts would run."""
    def run(x: torch.Tensor) -> torch.Tensor:
        half = "XY"[int(x[0])]
        for part in ("attention", "a2a dispatch", "experts", "a2a combine"):
            if part == "experts" and half == failing:
                log.append(f"{half} raises")
                raise ValueError(f"planted error in half {half}")
            if part.startswith("a2a"):
                log.append(f"launch {half}.{part[4:]}")
                hand_over(_Done(log, f"{half}.{part[4:]}"))
            else:
                log.append(f"{half}.{part}")
        return x * 2
    return run


@pytest.mark.parametrize("failing", ["X", "Y"])
def test_a_raise_in_one_half_stops_the_other_before_its_next_all_to_all(failing: str) -> None:
    # regression: a raise on the helper thread let the other half go on issuing all-to-alls
    # that met the peers' next ones; gloo aborted the process ("killed by signal 6 without
    # reporting an error") before the error could surface
    log: list[str] = []
    x = torch.tensor([0.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=f"planted error in half {failing}"):
        two_batch_forward(_failing_block(log, failing), x, frozenset(),  # type: ignore[arg-type]
                          lambda a, b, rows: join_halves(a, b, rows, frozenset(), "s"))
    raised = log.index(f"{failing} raises")
    assert not [entry for entry in log[raised:] if entry.startswith("launch")], log
    assert log[:4] == ["X.attention", "launch X.dispatch", "Y.attention", "launch Y.dispatch"]
