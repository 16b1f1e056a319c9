"""Emulated devices: our engine against the simulator and against torch.distributed.pipelining.

Layers wait their F, I and W times (`pipeline.rehearsal.emulated`), so four ranks on two cores
behave like four accelerators and a bubble is real idle time. For p in {4, 8}, m in
{p, 2p, 4p}, every schedule and three cost cases (F=I=W; F<I with a light W; an uneven
partition), ours and torch (every schedule torch has a class for) run in the same processes,
one timed step each per round. Per row: our measured makespan over the simulated one (nominal
costs, and with this run's host work and ping-pong link: `schedules.analysis.host`), ours over
torch, and memory per rank predicted (`schedules.analysis.memory`) against measured (saved-tensor
accounting). A last section runs zero-cost layers to get the host overhead per instruction.
Prints markdown tables and the issue's targets as met / not met.

    python benchmarks/bench_emulated.py                  # the full sweep (~15 min here)
    python benchmarks/bench_emulated.py --ranks 4 --microbatches 8 --schedules 1f1b zb-v
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from bench_common import torch_schedule_step
from bench_runtime import TORCH_CLASSES

from pipeline import launch, torch_stages
from pipeline.model.module import PipelineModule
from pipeline.parallel.local_p2p import open_local_link
from pipeline.parallel.pingpong import ping_pong
from pipeline.rehearsal.emulated import EmulatedCost, emulated_layers, emulated_loss
from pipeline.rehearsal.rehearse import RehearsalSpec, build_engine, metered_step
from schedules import SCHEDULES, build_schedule, figures, simulate
from schedules.analysis.host import measure_host_costs, with_host_costs
from schedules.analysis.memory import predict_memory

__all__ = ["main"]

ALL_SCHEDULES = [n for n in SCHEDULES if n != "forward-only"]
CASES = ("F=I=W", "F<I, light W", "uneven partition")
LAYERS_PER_RANK = 4
ELEMENTS = 1024  # 4 KiB activations, 16 KiB of weights per layer


def _spec(case: str, schedule: str, p: int, m: int, layer_ms: float) -> RehearsalSpec:
    """4 layers per rank; a case sets each layer's F/I/W and where the stages cut."""
    v = SCHEDULES[schedule].default_chunks
    n, t = LAYERS_PER_RANK * p, layer_ms / 1e3
    f, i, w = (t, t, t) if case != "F<I, light W" else (t, 1.5 * t, 0.5 * t)
    layers = tuple(EmulatedCost(forward=f, input_grad=0.0 if k == 0 else i, weight_grad=w,
                                output_elements=ELEMENTS, param_elements=4 * ELEMENTS)
                   for k in range(n))
    size = n // (p * v)
    sizes = [size] * (p * v)
    if case == "uneven partition":  # stages alternately one layer short and one over
        sizes = [size - 1 if s % 2 == 0 else size + 1 for s in range(p * v)]
    boundaries = [0]
    for count in sizes:
        boundaries.append(boundaries[-1] + count)
    return RehearsalSpec(layers=layers, boundaries=tuple(boundaries), schedule=schedule,
                         stages=p, chunks=v, microbatches=m)


def _torch_step(spec: RehearsalSpec, scratch: str) -> Any:
    """torch's step over the same emulated layers, or None (no torch class, or refused)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    class_name = TORCH_CLASSES.get(spec.schedule)
    if class_name is None:
        return None
    module = PipelineModule(emulated_layers(spec.layers), num_stages=spec.stages,
                            chunks=spec.chunks, loss_fn=emulated_loss,
                            partition_method=list(spec.boundaries), base_seed=None)
    placed = build_schedule(spec.schedule, spec.stages, spec.microbatches, spec.chunks)
    try:
        stages = torch_stages(module, placed)
        cls = getattr(torch_schedules, class_name)
        single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
        runner = cls(stages[0] if single else stages, n_microbatches=spec.microbatches,
                     loss_fn=emulated_loss)
    except (ValueError, RuntimeError, NotImplementedError):
        return None
    optimizer = torch.optim.Adam([q for s in stages for q in s.submod.parameters()], lr=1e-3)
    x = torch.zeros(spec.microbatches, 1)
    step = torch_schedule_step(runner, stages, optimizer)
    return lambda: step(x, x)


def _timed(step: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def _run_case(spec: RehearsalSpec, steps: int, warmup: int, link: Any,
              scratch: str) -> dict[str, Any]:
    engine = build_engine(spec)
    x = torch.zeros(spec.microbatches, 1)
    mine = metered_step(engine, x)  # memory on an untimed step: the meters cost host time

    def ours() -> None:
        engine.train_batch(x, x)

    theirs = _torch_step(spec, scratch)
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    timelines = []
    for round_index in range(warmup + steps):
        elapsed = _timed(ours)
        timeline = engine.last_timeline()
        if round_index >= warmup:
            times["ours"].append(elapsed)
            timelines.append(timeline)
        if theirs is not None:
            elapsed = _timed(theirs)
            if round_index >= warmup:
                times["torch"].append(elapsed)
    memory: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(memory, mine)
    schedule = engine.schedule
    nominal = spec.cost_model()
    measured, simulated, machine = [], [], []
    for timeline in timelines:
        host = measure_host_costs(timeline, nominal)
        measured.append(figures(timeline).makespan)
        simulated.append(figures(simulate(schedule, nominal)).makespan)
        machine.append(figures(simulate(schedule, with_host_costs(nominal, host, schedule,
                                                                  link))).makespan)
    predicted = predict_memory(schedule, spec.memory_model())
    errors = [abs(m.total / pr.total - 1) for m, pr in zip(memory, predicted)]
    return {"schedule": spec.schedule, "p": spec.stages, "m": spec.microbatches,
            "ours": statistics.median(times["ours"]),
            "torch": statistics.median(times["torch"]) if times["torch"] else None,
            "measured": statistics.median(measured), "nominal": statistics.median(simulated),
            "machine": statistics.median(machine), "memory_error": max(errors)}


def _host_overhead(p: int, m: int, steps: int) -> dict[str, Any]:
    """Zero-cost layers: step time per instruction of our lowered stream, ours and torch."""
    zero = RehearsalSpec(layers=tuple(EmulatedCost(forward=0.0, input_grad=0.0,
                                                   weight_grad=0.0) for _ in range(p)),
                         boundaries=tuple(range(p + 1)), schedule="1f1b", stages=p, chunks=1,
                         microbatches=m)
    engine = build_engine(zero)
    with tempfile.TemporaryDirectory() as scratch:
        theirs = _torch_step(zero, scratch)
    x = torch.zeros(m, 1)
    ours: list[float] = []
    torch_times: list[float] = []
    for _ in range(steps + 2):
        ours.append(_timed(lambda: engine.train_batch(x, x)))
        torch_times.append(_timed(theirs))
    per_rank = max(len(stream) for stream in engine.schedule.streams)
    return {"instructions": per_rank,
            "ours": statistics.median(ours[2:]) / per_rank,
            "torch": statistics.median(torch_times[2:]) / per_rank}


def _bench_rank(schedules: list[str], microbatches: list[int] | None, cases: list[str],
                steps: int, warmup: int, layer_ms: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    p = dist.get_world_size()
    local = open_local_link(None, 300.0)  # the engines' own transport for small messages
    link = ping_pong(0, 1, ELEMENTS * 4, link=local)
    if local is not None:
        local.close()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-emulated-") as scratch:
        for m in microbatches or [p, 2 * p, 4 * p]:
            for case in cases:
                for schedule in schedules:
                    try:
                        build_schedule(schedule, p, m)
                    except ValueError:
                        continue  # e.g. dualpipev needs m >= 2p
                    spec = _spec(case, schedule, p, m, layer_ms)
                    rows.append({"case": case, **_run_case(spec, steps, warmup, link,
                                                             scratch)})
    return {"rows": rows, "host": _host_overhead(p, 2 * p, steps), "link": link}


def _cell(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| p | m | case | schedule | ours (ms) | torch (ms) | ours/torch | measured/"
             "simulated (nominal) | measured/simulated (+machine) | ours ÷ 1F1B | memory "
             "error (max rank) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        base = next((r["ours"] for r in rows if r["schedule"] == "1f1b" and
                     (r["p"], r["m"], r["case"]) == (row["p"], row["m"], row["case"])), None)
        ratio = row["ours"] / row["torch"] if row["torch"] else None
        lines.append(
            f"| {row['p']} | {row['m']} | {row['case']} | {row['schedule']} | "
            f"{row['ours'] * 1e3:.1f} | {_cell(row['torch'] and row['torch'] * 1e3)} | "
            f"{_cell(ratio, 2)} | {row['measured'] / row['nominal']:.2f} | "
            f"{row['measured'] / row['machine']:.2f} | {_cell(base and row['ours'] / base, 2)} | "
            f"{row['memory_error']:.1%} |")
    return "\n".join(lines)


def _targets(rows: list[dict[str, Any]], hosts: list[dict[str, Any]]) -> list[str]:
    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    fit = [r["measured"] / r["machine"] for r in rows]
    lines = [f"- ours measured ÷ simulated (+machine), median {statistics.median(fit):.3f} ≤ "
             f"1.05: {mark(statistics.median(fit) <= 1.05)}; worst {max(fit):.3f} ≤ 1.10: "
             f"{mark(max(fit) <= 1.10)}"]
    nominal = [r["measured"] / r["nominal"] for r in rows]
    lines.append(f"  (against nominal costs: median {statistics.median(nominal):.3f}, worst "
                 f"{max(nominal):.3f})")
    versus = [(r, r["ours"] / r["torch"]) for r in rows if r["torch"]]
    if versus:
        worst_row, worst = max(versus, key=lambda x: x[1])
        lines.append(f"- ours ÷ torch ≤ 0.95 on every schedule torch has: worst {worst:.2f} "
                     f"({worst_row['schedule']}, p={worst_row['p']}, m={worst_row['m']}, "
                     f"{worst_row['case']}): {mark(worst <= 0.95)}")
    for name in ("zb-v", "zb-h2"):
        at = [r for r in rows if (r["p"], r["m"], r["case"]) == (4, 8, "F=I=W")]
        one, zb = (next((r["ours"] for r in at if r["schedule"] == s), None)
                   for s in ("1f1b", name))
        if one and zb:
            lines.append(f"- {name} ≤ 0.80 × 1F1B at p=4, m=8, F=I=W: {zb / one:.2f}: "
                         f"{mark(zb / one <= 0.80)}")
    for host in hosts:
        lines.append(f"- host overhead per instruction (p={host['p']}, zero-cost layers, "
                     f"1F1B, m=2p): ours {host['ours'] * 1e6:.0f} µs, torch "
                     f"{host['torch'] * 1e6:.0f} µs; below half of torch's: "
                     f"{mark(host['ours'] < host['torch'] / 2)}")
    memory = max(r["memory_error"] for r in rows)
    lines.append(f"- predicted peak memory per rank within 10% of measured: worst "
                 f"{memory:.1%}: {mark(memory <= 0.10)}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=None,
                        help="default p, 2p and 4p")
    parser.add_argument("--schedules", nargs="+", default=ALL_SCHEDULES, choices=ALL_SCHEDULES,
                        metavar="NAME")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per framework")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layer-ms", type=float, default=1.0,
                        help="F (and I, W) of one layer in ms; 4 layers per rank")
    args = parser.parse_args(argv)
    started = time.time()
    rows, hosts = [], []
    for p in args.ranks:
        result = launch(_bench_rank, p, args.schedules, args.microbatches, args.cases,
                        args.steps, args.warmup, args.layer_ms, timeout=600,
                        threads_per_rank=1)[0]
        rows += result["rows"]
        hosts.append({"p": p, **result["host"]})
        print(f"p={p}: link latency {result['link'].latency * 1e6:.0f} µs", file=sys.stderr)
    print(f"emulated layers ({LAYERS_PER_RANK} per rank, {args.layer_ms:g} ms per F/I/W), "
          f"gloo, 1 thread per rank, medians of {args.steps} steps; torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.1f} at the end; {time.time() - started:.0f} s")
    print(_table(rows))
    print()
    print("\n".join(_targets(rows, hosts)))


if __name__ == "__main__":
    main()
