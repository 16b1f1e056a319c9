"""The tp sum of partial gradients (SP norms, MoE routers and experts) runs once a step.

A tiny Llama from a `save_pretrained` directory with sequence parallelism at tp 2, 4
microbatches: each rank counts the tp all-reduces of partial gradients in one step, the
tensor hooks' (`sum_gradient_over_tensor_parallel`, synchronous, one per norm per backward)
and the engine's deferred ones (`PartialGradSums`, one coalesced per group per stage), and
the step must still equal HF. ZeRO-2 keeps the hooks (it reduce-scatters every backward).
Planted bugs: deferred but never summed; summed twice."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from pipeline.parallel.tensor import partial_grads, sequence
from tests.support.hf_tp_equivalence import TPCase, tp_step_errors
from tests.support.rank_harness import run_ranks

__all__: list[str] = []

M = 4
NORMS = 5
"""Marked parameters of tiny Llama (2 layers × 2 norms + the final norm), all on one stage."""
TOLERANCE = 1e-5


def _case(zero: int, *, overlap: bool = False, dp: int = 2, stages: int = 1) -> TPCase:
    return TPCase("llama", 2, dp=dp, zero=zero, sequence_parallel=True, stages=stages,
                  microbatches=M, engine={"overlap_grad_reduce": overlap})


CASES = [  # (case, hook all-reduces a step, deferred all-reduces a step), per rank
    (_case(0), 0, 1),
    (_case(0, overlap=True), 0, 1),
    (_case(1), 0, 1),
    (_case(1, overlap=True), 0, 1),
    (_case(0, dp=1, stages=2), 0, 1),  # no dp: summed at REDUCE_GRAD all the same
    (_case(2), NORMS * M, 0),  # before this change, every case counted these
]


class _Counting:
    """Counts the hooks' synchronous all-reduces and the deferred sums' calls."""

    def __init__(self) -> None:
        self.hooks = 0
        self.sums: list[partial_grads.PartialGradSums] = []

    def __enter__(self) -> _Counting:
        self._start, self._init = sequence.start_all_reduce, partial_grads.PartialGradSums.__init__
        start, init = self._start, self._init

        def counting_start(tensor: torch.Tensor, group: Any, *, async_op: bool = True) -> Any:
            self.hooks += not async_op
            return start(tensor, group, async_op=async_op)

        def recording_init(sums: Any, *args: Any, **kwargs: Any) -> None:
            init(sums, *args, **kwargs)
            self.sums.append(sums)

        sequence.start_all_reduce = counting_start  # type: ignore[assignment]
        partial_grads.PartialGradSums.__init__ = recording_init  # type: ignore[method-assign]
        return self

    def __exit__(self, *args: object) -> None:
        sequence.start_all_reduce = self._start  # type: ignore[assignment]
        partial_grads.PartialGradSums.__init__ = self._init  # type: ignore[method-assign]

    @property
    def deferred(self) -> int:
        return sum(sums.calls for sums in self.sums)


def _never_summed(original: Any) -> Any:
    def sum_(self: Any, params: Any) -> None:
        self._done.update(id(p) for p in params)
    return sum_


def _summed_twice(original: Any) -> Any:
    def sum_(self: Any, params: Any) -> None:
        before = set(self._done)
        original(self, params)
        self._done.intersection_update(before)  # forget them: the next call sums them again
        original(self, params)
    return sum_


PLANTED = {"deferred, never summed": _never_summed, "summed twice": _summed_twice}


def _check(errors: dict[str, float], label: str) -> None:
    for what in ("loss", "grad", "param"):
        assert errors[what] < TOLERANCE, f"{label}: {what} relative error {errors}"


def _ranks(rank: int, world_size: int, planted: list[str]) -> None:
    for case, hooks, deferred in CASES:
        with _Counting() as counted:
            errors = tp_step_errors(case)
        _check(errors, case.label())
        assert (counted.hooks, counted.deferred) == (hooks, deferred), (
            f"{case.label()}: {counted.hooks} hook and {counted.deferred} deferred tp "
            f"all-reduces a step, expected {hooks} and {deferred}")
    for name in planted:
        original = partial_grads.PartialGradSums.sum
        partial_grads.PartialGradSums.sum = PLANTED[name](original)  # type: ignore[method-assign]
        try:
            errors = tp_step_errors(_case(1, overlap=True))
        finally:
            partial_grads.PartialGradSums.sum = original  # type: ignore[method-assign]
        assert max(errors["grad"], errors["param"]) > 1e-3, f"planted {name} passed: {errors}"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sp_norm_gradients_are_summed_over_tp_once_a_step_and_equal_hf() -> None:
    run_ranks(_ranks, 4, list(PLANTED), timeout=600)


MOE_CASES = [  # (zero, overlap, deferred all-reduces a step): the stage's, or with overlap
    (0, False, 1),  # the dense bucket's (norms, router) and then the experts' at REDUCE_GRAD
    (0, True, 2),
    (1, False, 1),
    (1, True, 2),
]


def _moe_ranks(rank: int, world_size: int) -> None:
    from tests.support.hf_moe_equivalence import moe_step_differences

    torch.set_num_threads(1)
    for zero, overlap, deferred in MOE_CASES:
        label = f"mixtral tp2 ep2 sp zero{zero}{' overlap' if overlap else ''}"
        with _Counting() as counted:
            found = moe_step_differences("mixtral", pp=1, dp=2, ep=2, tp=2, zero=zero,
                                         sequence_parallel=True, overlap_grad_reduce=overlap)
        worst = max(found["loss"], found["grad"], found["param"])
        assert worst < TOLERANCE, f"{label}: {found}"
        assert (counted.hooks, counted.deferred) == (0, deferred), (
            f"{label}: {counted.hooks} hook and {counted.deferred} deferred tp all-reduces a "
            f"step, expected 0 and {deferred}")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_router_and_whole_experts_at_tp2_ep2_are_summed_once_a_step() -> None:
    """A tiny Mixtral at tp 2 × ep 2 (dp 2) with sequence parallelism: its norms, router and
    whole experts (expert tensor parallelism 1) summed over tp once a step, equal to HF."""
    run_ranks(_moe_ranks, 4, timeout=600)
