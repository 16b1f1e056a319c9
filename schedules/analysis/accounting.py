"""One memory accounting: model-state bytes per parameter, a transformer layer's activation bytes
per recompute mode, and the activations a rank holds at its peak under a schedule's order.

Pure (no torch, nothing of ours but instruction kinds): the schedule search, the simulator,
`rehearse` and the planner all count with these functions.

Legend: s sequence length, b microbatch size, h hidden size, a attention heads, t tensor-
parallel size, d data-parallel replicas, L layers of a stage, k layers of it recomputed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
from numpy.typing import ArrayLike

from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import Kind
from schedules.ir.schedule import Schedule

__all__ = ["AttentionKind", "HeldTrace", "ParameterBytes", "Precision", "RecomputeKind",
           "StreamPeak", "expert_parallel_state_bytes", "expert_state_bytes", "held_peaks",
           "layer_activation_bytes", "model_state_bytes", "stage_activation_bytes",
           "stream_peak"]

Precision = Literal["fp32", "bf16", "fp16"]
RecomputeKind = Literal["none", "selective", "full"]
AttentionKind = Literal["eager", "fused"]
"""eager keeps the s × s softmax scores for the backward; fused (FlashAttention-style,
every current stack's default) keeps none."""


@dataclass(frozen=True)
class ParameterBytes:
    """Bytes per parameter at the optimizer step, by part (Megatron-Core's distributed
    optimizer; Adam: two fp32 moments)."""

    parameters: float
    """The model's own weights (fp32: 4; bf16/fp16: 2)."""
    gradients: float
    """Gradients the backward accumulates into (fp32 main grads: 4; fp16 keeps fp16 grads
    here and its fp32 copy with the optimizer's shard)."""
    optimizer: float
    """fp32 master weights where the parameters are half precision, Adam's moments and (fp16)
    the fp32 gradient copy: all of it sharded over d under ZeRO-1."""

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


# (parameters, gradients, unsharded optimizer part) per precision, without ZeRO; ZeRO-1
# shards the last part over d: fp32 16 -> 8 + 8/d, bf16 18 -> 6 + 12/d, fp16 20 -> 4 + 16/d
# (Megatron-Core's distributed-optimizer docs; Rajbhandari et al. 2020, section 3.1)
_STATES: dict[str, tuple[float, float, float]] = {
    "fp32": (4.0, 4.0, 8.0), "bf16": (2.0, 4.0, 12.0), "fp16": (2.0, 2.0, 16.0)}


def model_state_bytes(precision: Precision = "fp32", *, zero_stage: int = 0,
                      data_parallel: int = 1, optimizer_factor: float = 2.0
                      ) -> ParameterBytes:
    """Bytes per parameter of `precision` training under ZeRO `zero_stage` (0-3) over
    `data_parallel` replicas. `optimizer_factor`: fp32 optimizer-state words per parameter
    (Adam 2, SGD with momentum 1, plain SGD 0).

    Each stage shards one more part over d (Rajbhandari et al. 2020, §5 and Figure 1, whose
    mixed-precision Adam reads (2 + 2 + K)Ψ with K = 12): ZeRO-1 the optimizer part
    (2 + 2 + K/d), ZeRO-2 also the gradients (2 + (2 + K)/d), ZeRO-3 also the parameters
    ((2 + 2 + K)/d). In fp32 (4, 4, 8): 16, 8 + 8/d, 4 + 12/d, 16/d. ZeRO-3's gathered
    layers come and go: they are activations-like workspace, not model state.

    "bf16" / "fp16" mean half-precision parameters with fp32 masters (the engine's
    ``half_parameters=True``); autocast over fp32 parameters is priced as "fp32". ZeRO-2 / 3
    keep half gradient shards there (2 + 14/d, DeepSpeed's figure) and ZeRO-3 no half copy
    of the weights between uses (14/d, under DeepSpeed's 16/d)."""
    if precision not in _STATES:
        raise ScheduleConfigError(f"precision must be one of {sorted(_STATES)}, got "
                                  f"{precision!r}")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ScheduleConfigError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) \
            or data_parallel < 1:
        raise ScheduleConfigError(f"data_parallel must be an int >= 1, got {data_parallel!r}")
    if isinstance(optimizer_factor, bool) or not isinstance(optimizer_factor, int | float) \
            or optimizer_factor < 0:
        raise ScheduleConfigError(f"optimizer_factor must be a number >= 0, got "
                                  f"{optimizer_factor!r}")
    parameters, gradients, sharded = _STATES[precision]
    if precision != "fp32" and zero_stage >= 2:
        # half gradient shards, their fp32 copy only through the step (DeepSpeed's 2 + 14/d);
        # ZeRO-3 gathers from the fp32 master: no half shard of the weights persists
        parameters, gradients, sharded = (0.0 if zero_stage == 3 else 2.0), 2.0, 12.0
    sharded += 4.0 * (optimizer_factor - 2.0)  # the table's Adam moments are 8 of it
    d = data_parallel
    return ParameterBytes(parameters / d if zero_stage >= 3 else parameters,
                          gradients / d if zero_stage >= 2 else gradients,
                          sharded / d if zero_stage >= 1 else sharded)


def expert_state_bytes(precision: Precision = "fp32", *, expert_parallel: int,
                       data_parallel: int, zero_stage: int = 0,
                       optimizer_factor: float = 2.0) -> ParameterBytes:
    """Bytes one rank holds per expert parameter of the model (all E experts counted) when
    e = `expert_parallel` of the d data-parallel replicas split the experts: 1/e of each
    part, ZeRO-1 sharding the optimizer state over the expert-data-parallel group (d / e
    ranks holding the same experts)."""
    if isinstance(expert_parallel, bool) or not isinstance(expert_parallel, int) \
            or expert_parallel < 1 or data_parallel % expert_parallel:
        raise ScheduleConfigError(f"expert_parallel must be an int >= 1 dividing "
                                  f"data_parallel={data_parallel}, got {expert_parallel!r}")
    own = model_state_bytes(precision, zero_stage=zero_stage,
                            data_parallel=data_parallel // expert_parallel,
                            optimizer_factor=optimizer_factor)
    return ParameterBytes(own.parameters / expert_parallel, own.gradients / expert_parallel,
                          own.optimizer / expert_parallel)


def expert_parallel_state_bytes(dense_parameters: int, expert_parameters: int, *,
                                expert_parallel: int, data_parallel: int,
                                precision: Precision = "fp32", zero_stage: int = 0,
                                optimizer_factor: float = 2.0) -> float:
    """Model-state bytes of one rank whose stages hold `dense_parameters` (replicated over
    the d data-parallel replicas) and MoE layers of `expert_parameters` experts' weights in
    all, split over e = `expert_parallel` of those replicas: it holds 1/e of the experts,
    each replicated over d / e ranks, and ZeRO-1 shards each part's optimizer state over its
    own group (dense over d, experts over d / e; `expert_state_bytes`)."""
    experts = expert_state_bytes(precision, expert_parallel=expert_parallel,
                                 data_parallel=data_parallel, zero_stage=zero_stage,
                                 optimizer_factor=optimizer_factor)
    dense = model_state_bytes(precision, zero_stage=zero_stage, data_parallel=data_parallel,
                              optimizer_factor=optimizer_factor)
    return dense_parameters * dense.total + expert_parameters * experts.total


def layer_activation_bytes(s: int, b: int, h: int, a: int, *,
                           attention: AttentionKind = "eager",
                           recompute: RecomputeKind = "none", t: int = 1,
                           sequence_parallel: bool = False,
                           dropout_mask_bytes: float = 1.0, ffn: int | None = None,
                           kv_width: int | None = None) -> float:
    """Activation bytes one transformer layer keeps for its backward, 16-bit activations
    with dropout (Korthikanti et al. 2022, section 4, table 2):

    - none, eager attention: sbh(34 + 5as/h); with a fused attention the 5as²b of softmax
      scores, their dropout mask and output are never stored: 34sbh, plus the kernel's fp32
      log-sum-exp per row and head (4asb, a share 4a/(34h) of it: counted here);
    - selective (attention's core recomputed): 34sbh;
    - full: the layer's input only, 2sbh.

    Tensor parallelism over t splits the attention and MLP inside (sbh(10 + 24/t + 5as/(ht)));
    sequence parallelism also splits the layer norms and dropouts: everything / t.

    `dropout_mask_bytes`: bytes of one dropout-mask element, 1 in the paper (CUDA keeps bool
    masks); torch's CPU dropout keeps the mask in the activation dtype (2); 0 without
    dropout. The paper's 34 is 32 + 2 masks of sbh, its 5as/h is 4as/h + one mask of as²b.

    `ffn` (f, default 4h) and `kv_width` (k, default h: grouped-query attention has less)
    generalise the split part: 4sbh + 4sbk + 4sbf (24sbh at f = 4h, k = h).
    """
    f, k = 4 * h if ffn is None else ffn, h if kv_width is None else kv_width
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t), ("ffn", f),
                        ("kv_width", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleConfigError(f"{name} must be an int >= 1, got {value!r}")
    if attention not in get_args(AttentionKind):
        raise ScheduleConfigError(f"attention must be one of {get_args(AttentionKind)}, got "
                                  f"{attention!r}")
    if recompute not in get_args(RecomputeKind):
        raise ScheduleConfigError(f"recompute must be one of {get_args(RecomputeKind)}, got "
                                  f"{recompute!r}")
    if isinstance(dropout_mask_bytes, bool) or not isinstance(dropout_mask_bytes, int | float) \
            or dropout_mask_bytes < 0:
        raise ScheduleConfigError(f"dropout_mask_bytes must be a number >= 0, got "
                                  f"{dropout_mask_bytes!r}")
    sbh, mask = float(s * b * h), float(dropout_mask_bytes)
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    # the paper's split: layer norms and the two dropouts after the attention and the MLP
    # (10 = 2·2 + 2·2 + 2·1 bytes per sbh at 16 bits) are replicated over t without sequence
    # parallelism, the rest (24) is split
    replicated, split = 8 + 2 * mask, 4 + 4 * k / h + 4 * f / h
    scores = (4 + mask) * a * s / h if attention == "eager" and recompute == "none" else 0.0
    log_sum_exp = 4 * a / h if attention == "fused" and recompute == "none" else 0.0
    inside = split + scores + log_sum_exp
    if sequence_parallel:
        return sbh * (replicated + inside) / t
    return sbh * (replicated + inside / t)


def stage_activation_bytes(layer_bytes: Sequence[float], recomputed_bytes: Sequence[float],
                           recomputed: int) -> float:
    """One microbatch's activation bytes on a stage whose first `recomputed` layers
    (partial recomputation, k of L) keep `recomputed_bytes[i]` and the rest `layer_bytes[i]`."""
    if len(layer_bytes) != len(recomputed_bytes):
        raise ScheduleConfigError(f"{len(layer_bytes)} layer sizes but "
                                  f"{len(recomputed_bytes)} recomputed sizes; give one each")
    k = max(0, min(recomputed, len(layer_bytes)))
    return float(sum(recomputed_bytes[:k]) + sum(layer_bytes[k:]))


@dataclass(frozen=True)
class StreamPeak:
    """The activations one rank holds at its peak."""

    bytes: float
    count: int
    """(stage, microbatch) pairs held then."""


_RELEASES = (Kind.B, Kind.OVERLAP_B, Kind.W)


def stream_peak(stream: Iterable[tuple[Kind, int, int]], saved: Sequence[float],
                output: Sequence[float] | None = None, *, sends: Sequence[bool] | None = None,
                free_sent_outputs: bool = True) -> StreamPeak:
    """Peak of one rank's compute stream (kind, stage, microbatch), the canonical count.

    A stage's microbatch is allocated at its F (`saved[stage]` bytes, plus `output[stage]`,
    the stage output kept as the backward's root) and freed by its last backward op (B, or W
    when split: I leaves what W reads). A rank runs one op at a time, so the peak depends on
    the order only (never on the clock: ops that take no time still run in stream order).
    With `free_sent_outputs`, an output the stage sends (`sends[stage]`) is freed as soon as
    it is sent, right after its F: at most the newest one is held. An I whose W never comes
    frees like a B; an F with no backward op at all (inference) holds its activations only
    while it runs. `HeldTrace` is the same count, vectorised over every rank for the
    planner's search and for `schedules.figures`.
    """
    stages = len(saved)
    out = [0.0] * stages if output is None else [float(x) for x in output]
    sent = [False] * stages if sends is None else list(sends)
    kept = [float(saved[st]) + (0.0 if free_sent_outputs and sent[st] else out[st])
            for st in range(stages)]
    transient = [out[st] if free_sent_outputs and sent[st] else 0.0 for st in range(stages)]
    ops = list(stream)
    split = {(stage, i) for kind, stage, i in ops if kind is Kind.W}  # I then W: W frees
    freed = {(stage, i) for kind, stage, i in ops
             if kind in _RELEASES or (kind is Kind.I and (stage, i) not in split)}
    held, count, peak, peak_count = 0.0, 0, 0.0, 0
    for kind, stage, i in ops:
        if kind is Kind.F:
            now = held + kept[stage] + transient[stage]  # the newest output, until its send
            if now > peak or (now == peak and count + 1 > peak_count):
                peak, peak_count = now, count + 1
            if (stage, i) in freed:  # else: no backward will read it, gone when F ends
                held += kept[stage]
                count += 1
        elif kind in _RELEASES or (kind is Kind.I and (stage, i) not in split):
            held -= kept[stage]
            count -= 1
    return StreamPeak(peak, peak_count)


@dataclass(frozen=True)
class HeldTrace:
    """Every rank's ops in the rank's own order as +1 (F: a microbatch's activations of a
    stage arrive) or -1 (its last backward op, B, or W when the backward is split: they
    leave), so the activations held are a running sum under any costs: `stream_peak`'s
    count, which `schedules.figures` reads too. An F with no backward op (inference) is a
    `spike`: held while it runs, 0 in `delta`."""

    stage: np.ndarray
    delta: np.ndarray
    lengths: np.ndarray
    """Ops per rank (the arrays hold rank 0's, then rank 1's, ...)."""
    spike: np.ndarray | None = None
    """1 on an F that nothing frees (held only while it runs); None: no such F."""

    @classmethod
    def of(cls, schedule: Schedule) -> HeldTrace:
        lengths = np.array([len(stream) for stream in schedule.streams], dtype=np.int64)
        ops = [op for stream in schedule.streams for op in stream]
        if not ops:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), lengths)
        columns = list(zip(*ops))  # kind, stage, microbatch columns, transposed in C
        # enum members are singletons: their ids are the fastest exact codes (no hashing)
        kind = np.fromiter(map(id, columns[0]), dtype=np.int64, count=len(ops))
        return cls.of_columns(lengths, kind, np.asarray(columns[1], dtype=np.int64),
                              np.asarray(columns[2], dtype=np.int64),
                              schedule.num_stages, schedule.num_microbatches)

    @classmethod
    def of_columns(cls, lengths: np.ndarray, kind_ids: np.ndarray, stage: np.ndarray,
                   microbatch: np.ndarray, num_stages: int, num_microbatches: int) -> HeldTrace:
        """From columns of every rank's ops in order (rank 0's first, `lengths[r]` each);
        `kind_ids[k]` is `id()` of the op's `Kind`."""
        rank = np.repeat(np.arange(len(lengths)), lengths)
        key = (rank * num_stages + stage) * num_microbatches + microbatch
        is_w = kind_ids == id(Kind.W)
        # membership by a lookup table over the keys' range (<= 32 MB), not by sorting
        kind: Literal["table"] | None = "table" if len(key) and int(key.max()) < 2**25 else None
        release = (kind_ids == id(Kind.B)) | (kind_ids == id(Kind.OVERLAP_B)) | is_w | (
            (kind_ids == id(Kind.I)) & ~np.isin(key, key[is_w], kind=kind))
        forward = kind_ids == id(Kind.F)
        spike = forward & ~np.isin(key, key[release], kind=kind)
        delta = (forward & ~spike).astype(np.int64) - release
        return cls(stage, delta, np.asarray(lengths, dtype=np.int64),
                   spike.astype(np.int64) if spike.any() else None)

    def _peaks(self, steps: np.ndarray, spikes: np.ndarray | None) -> np.ndarray:
        """Per rank, the largest running sum of `steps` (one value per op), plus `spikes`
        where they are."""
        peaks = np.zeros(len(self.lengths))
        busy = self.lengths > 0
        if not busy.any():
            return peaks
        ends = np.cumsum(self.lengths)
        running = np.cumsum(steps)
        # every rank's running sum restarts at 0: subtract where the ranks before it ended
        before = np.concatenate([[0.0], running[ends[:-1] - 1]]) if len(ends) > 1 else \
            np.zeros(1)
        level = running - np.repeat(before, self.lengths)
        if spikes is not None:
            level = level + spikes
        peaks[busy] = np.maximum.reduceat(level, (ends - self.lengths)[busy])
        return peaks

    def peaks(self) -> tuple[int, ...]:
        """Most (stage, microbatch) activations each rank holds at once."""
        return tuple(int(x) for x in np.rint(self._peaks(self.delta.astype(float), self.spike)))

    def peak_bytes(self, stage_bytes: ArrayLike) -> np.ndarray:
        """Most activation bytes each rank holds at once, one microbatch of stage s being
        `stage_bytes[s]`: exact with several chunks per rank too."""
        size = np.asarray(stage_bytes, dtype=float)[self.stage]
        return self._peaks(self.delta * size, None if self.spike is None else self.spike * size)


def held_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Most (stage, microbatch) activations each rank of `schedule` holds at once."""
    return HeldTrace.of(schedule).peaks()
