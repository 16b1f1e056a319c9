"""Per-layer random streams: a layer's random draws (dropout masks) in a forward depend only on
(base_seed, global layer index, optimizer step, global microbatch index).

Why keyed seeds and not a generator per stage that advances with every draw: such a stage
generator's state depends on which layers share the stage (the partition), on how many
microbatches it already ran, and on the process it started in. A seed derived from the key
has none of those dependencies, so

- two runs with the same `base_seed` draw the same masks, whatever process start method or
  earlier work left in the global generators;
- any partition (another cut, more stages, chunks v > 1), any schedule and the split
  backward (I/W) draw the same masks, because layer k at microbatch i of step t is seeded
  the same way wherever it runs;
- activation checkpointing replays the same mask: the key is an argument of the checkpointed
  segment, so the recompute in the backward reseeds identically (torch's
  ``preserve_rng_state`` restores the global state only; this does not even need that);
- a resumed run draws what the uninterrupted run drew: the step is the engine's
  `global_step`, which the checkpoint restores.

Megatron keeps named CUDA generator states (`CudaRNGStatesTracker`) and forks them around
tensor-parallel regions; DeepSpeed's `seed_layers` seeds layer *construction* only. Here a
layer's forward runs with the CPU generator (and the current accelerator's) seeded from the
key (`call_seeded`); the process's generators are as they were afterwards.

Notation: t optimizer step (`engine.global_step` before the step), i microbatch index within
a data-parallel replica, m microbatches per replica, r data-parallel rank; the key's
microbatch is the global index r·m + i, so dp = 2 with m = 2 draws what dp = 1 with m = 4
draws on the same concatenated batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple, TypeVar

import torch

from pipeline.device import seed_accelerator_rng

__all__ = ["ForwardKey", "call_seeded", "current_forward_key", "forward_key", "layer_seed",
           "tensor_parallel_rank_stream"]

_T = TypeVar("_T")
_SEED_BITS = 63  # torch.manual_seed takes any int64; keep it non-negative


class ForwardKey(NamedTuple):
    """Which forward a layer runs in: the part of its seed that is not the layer."""

    step: int
    """Optimizer steps taken before this forward (the engine's `global_step`)."""
    microbatch: int
    """Global microbatch index: data-parallel rank · m + microbatch within the replica."""
    device: torch.device
    """Where the layers run: its generator is seeded too (the CPU one always)."""


# A context variable (like `build_context`): the key is scoped to one instruction's
# forward, set by the engine, and gone afterwards.
_KEY: ContextVar[ForwardKey | None] = ContextVar("pipesched_forward_key", default=None)
_SEED: ContextVar[tuple[int, torch.device] | None] = ContextVar("pipesched_layer_seed",
                                                               default=None)
"""The seed and device of the layer running now (`call_seeded`, also in a recompute, which
runs outside the forward's key), for `tensor_parallel_rank_stream`."""


@contextmanager
def forward_key(step: int, microbatch: int, device: torch.device) -> Iterator[None]:
    """Run forwards inside this block as microbatch `microbatch` of step `step`."""
    token = _KEY.set(ForwardKey(step, microbatch, device))
    try:
        yield
    finally:
        _KEY.reset(token)


def current_forward_key() -> ForwardKey | None:
    """The key set by `forward_key` (None outside one: layers draw from the global
    generators, as plain PyTorch does)."""
    return _KEY.get()


def layer_seed(base_seed: int, layer: int, step: int, microbatch: int) -> int:
    """The seed of layer `layer`'s draws at microbatch `microbatch` of step `step`.

    A cryptographic hash of the four numbers, not a sum: ``base_seed + layer`` would give
    layer 1 of one run the stream of layer 0 of a run seeded one higher, and nearby seeds of
    a linear mix give correlated Mersenne Twister streams. (Stable across processes and
    Python versions, unlike `hash`.)
    """
    text = f"pipesched-layer-rng:{base_seed}:{layer}:{step}:{microbatch}".encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def call_seeded(seed: int, device: torch.device, fn: Callable[[Any], _T], x: Any) -> _T:
    """``fn(x)`` with the CPU generator (and `device`'s, if an accelerator) seeded to `seed`;
    every generator is as before once it returns, even on an exception.

    Saves and restores the generator states directly rather than through
    `torch.random.fork_rng`: this runs once per layer and microbatch, and fork_rng's
    bookkeeping costs ~10 µs a call on this CPU, the direct way ~2 µs.
    """
    cpu = torch.default_generator
    saved = cpu.get_state()
    restore_accelerator = seed_accelerator_rng(device, seed)
    cpu.manual_seed(seed)
    token = _SEED.set((seed, device))
    try:
        return fn(x)
    finally:
        _SEED.reset(token)
        cpu.set_state(saved)
        restore_accelerator()


@contextmanager
def tensor_parallel_rank_stream(tp_rank: int) -> Iterator[None]:
    """Inside, the layer's draws come from a stream of its own per tp rank (seeded from the
    layer's seed and `tp_rank`); afterwards the layer's stream is as before.

    For a region where each tp rank holds a different part of the activations (a sequence-
    parallel slice): one seed on every rank would give token t on rank 0 the
    mask of token t + s/t on rank 1. Megatron forks its tensor-model-parallel generator
    (``get_cuda_rng_tracker().fork()``, seed + 2718 + tp rank) around such dropouts. Outside
    a seeded layer (no engine key, no `base_seed`) the global generators are left alone."""
    current = _SEED.get()
    if current is None:
        yield
        return
    seed, device = current
    text = f"pipesched-tp-rank-rng:{seed}:{tp_rank}".encode()
    forked = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(),
                            "little") >> (64 - _SEED_BITS)
    cpu = torch.default_generator
    saved = cpu.get_state()
    restore_accelerator = seed_accelerator_rng(device, forked)
    cpu.manual_seed(forked)
    try:
        yield
    finally:
        cpu.set_state(saved)
        restore_accelerator()
