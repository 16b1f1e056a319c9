"""What each MoE load-balancing method costs a training step, timed side by side in one run.

One rank trains a small Mixtral (from its config, no download) with the engine, one engine
per balancing method (`pipeline.moe.balancing`), all built from the same weights; the steps
alternate between the methods (round r runs every method once, in a rotated order), so a
host that other work slows down slows every method alike. Reported: the median step of each
method and its ratio to ``none`` (no auxiliary loss), in wall-clock time and in the CPU
time of the thread that runs the step (one torch thread: the step's compute), which other
processes on a loaded host disturb less. ``hf-batch`` runs HF's exact
whole-batch loss with its routing census (`train_batch_balanced`: an extra forward);
``microbatch`` (Megatron-Core's per-microbatch loss), ``sequence`` and ``aux-free`` need none.

    python benchmarks/bench_moe_balancing.py                     # 15 rounds after 2 warm-up
    python benchmarks/bench_moe_balancing.py --rounds 31 --hidden 128

The claim checked: a step with the per-microbatch loss costs at most 1.03x the same step
without one. On a shared CPU host the medians still wander by a few per cent between runs:
read the ratio with that caveat (and run more rounds when it matters).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from pipeline import PipelineEngine, PipelineModule, launch

__all__ = ["main"]

METHODS = ("none", "none (2nd engine)", "microbatch", "sequence", "aux-free", "hf-batch")
"""The timed rows; the second ``none`` engine shows the noise floor of the comparison."""


def _config(args: argparse.Namespace) -> Any:
    import transformers

    return transformers.MixtralConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=args.experts,
        num_experts_per_tok=2, vocab_size=512, max_position_embeddings=args.sequence,
        output_router_logits=False, router_aux_loss_coef=0.01)


def _engine(args: argparse.Namespace, method: str, state: dict[str, torch.Tensor] | None
            ) -> tuple[PipelineEngine, Any]:
    from pipeline.interop.hf_layers import layers_from_hf
    from pipeline.interop.hf_weights import load_hf_weights

    hf = layers_from_hf(_config(args), balancing=method.split()[0])  # type: ignore[arg-type]
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=args.microbatches,
                            optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), timeout=600)
    if state is not None:
        load_hf_weights(module, hf, state)
    return engine, hf


def _bench_rank(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    import transformers

    from pipeline.interop.hf_layers import causal_lm_targets
    from pipeline.moe.balance_loss import train_batch_balanced

    torch.manual_seed(0)
    state = transformers.AutoModelForCausalLM.from_config(_config(args)).state_dict()
    engines = {method: _engine(args, method, state) for method in METHODS}
    ids = torch.randint(0, 512, (args.batch, args.sequence),
                        generator=torch.Generator().manual_seed(1))
    labels = causal_lm_targets(ids)
    times: dict[str, dict[str, list[float]]] = {
        clock: {method: [] for method in METHODS} for clock in ("wall", "cpu")}
    for step in range(args.warmup + args.rounds):
        shift = step % len(METHODS)
        for method in METHODS[shift:] + METHODS[:shift]:
            engine, hf = engines[method]
            start, start_cpu = time.perf_counter(), time.thread_time()
            train_batch_balanced(engine, hf.balance, ids, labels)  # plain train_batch if None
            if step >= args.warmup:
                times["wall"][method].append(time.perf_counter() - start)
                times["cpu"][method].append(time.thread_time() - start_cpu)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the rank")
    args = parser.parse_args(argv)
    times = launch(_bench_rank, 1, args, timeout=1800, threads_per_rank=args.threads)[0]
    wall, cpu = times["wall"], times["cpu"]
    print(f"Mixtral h={args.hidden}, {args.layers} layers, {args.experts} experts top-2, batch "
          f"{args.batch} x {args.sequence} tokens in {args.microbatches} microbatches, one "
          f"rank, {args.threads} thread(s); {args.rounds} alternating rounds")
    print("| balancing | median step (ms) | ÷ none | median CPU of the step's thread (ms) "
          "| ÷ none | fastest CPU (ms) | ÷ none |")
    print("|---|---|---|---|---|---|---|")
    for method in METHODS:
        median, median_cpu = statistics.median(wall[method]), statistics.median(cpu[method])
        print(f"| {method} | {median * 1e3:.1f} | {median / statistics.median(wall['none']):.3f}"
              f" | {median_cpu * 1e3:.1f} | {median_cpu / statistics.median(cpu['none']):.3f}"
              f" | {min(cpu[method]) * 1e3:.1f} | {min(cpu[method]) / min(cpu['none']):.3f} |")
    for clock, label in ((wall, "wall"), (cpu, "CPU")):
        for method in ("microbatch", "none (2nd engine)"):
            ratios = [a / b for a, b in zip(clock[method], clock["none"], strict=True)]
            print(f"- {method} ÷ none ({label}), median of the per-round ratios: "
                  f"{statistics.median(ratios):.3f}")
    print("(target <= 1.03; other work on a shared host moves wall-clock medians by several "
          "per cent between runs, the thread's CPU time less)")


if __name__ == "__main__":
    main()
