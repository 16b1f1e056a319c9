"""What a search found, for people and tools: the ranked table with why each loser loses,
the pick as engine arguments, a JSON document, and the time-against-memory plot."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.launch import LaunchTarget, launch_lines, run_arguments
from pipeline.planner.predict import Prediction
from pipeline.planner.search import PlanResult, format_counts

__all__ = ["LEANER_SAVING", "LEANER_WITHIN", "format_breakdown", "format_table", "gap_parts",
           "leaner_alternative", "leaner_line", "loss_reason", "plan_document", "plot_plan",
           "zero_line"]

GIB = 2**30
# cause of a step's time -> the word the table uses for it
_CAUSES = {"bubble": "bubble", "tp_comm": "communication", "ep_comm": "communication",
           "dp_comm": "communication", "tied_comm": "communication",
           "cp_comm": "communication",
           "recomputation": "recomputation",
           "compute": "compute", "optimizer": "optimizer"}


def gap_parts(loser: Prediction, pick: Prediction) -> dict[str, float]:
    """Seconds by which each cause of `loser`'s step exceeds the pick's (negative: it is
    smaller), causes named as the table names them. The parts sum to the net gap
    `loser.step_seconds - pick.step_seconds`: both breakdowns sum to their steps."""
    parts: dict[str, float] = {}
    for key, word in _CAUSES.items():
        parts[word] = parts.get(word, 0.0) + loser.breakdown.get(key, 0.0) \
            - pick.breakdown.get(key, 0.0)  # cp_comm: only where cp > 1
    return parts


def loss_reason(loser: Prediction, pick: Prediction) -> str:
    """Why `loser` is slower than `pick`: the net gap, then its decomposition by cause,
    largest first ("+21.0 ms: bubble +30.2 ms, communication -9.2 ms"); causes under 1% of
    the largest are left out of the text."""
    if loser is pick:
        return "pick"
    gap = loser.step_seconds - pick.step_seconds
    parts = sorted(gap_parts(loser, pick).items(), key=lambda item: -abs(item[1]))
    largest = abs(parts[0][1])
    shown = [f"{word} {_signed(value)}" for word, value in parts
             if largest and abs(value) >= 0.01 * largest]
    if not shown:
        return "ties the pick"
    return f"{_signed(gap)}: {', '.join(shown)}"


def _signed(value: float) -> str:
    return ("+" if value >= 0 else "-") + _seconds(abs(value))


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


LEANER_WITHIN = 0.01
"""A configuration at most this much slower than the pick is named beside it when it holds
`LEANER_SAVING` less memory: inside what the model's prices can tell apart."""
LEANER_SAVING = 0.10


def leaner_alternative(result: PlanResult, top: int = 10) -> tuple[int, Prediction] | None:
    """(row, prediction) of the leanest of the top `top` configurations at most
    `LEANER_WITHIN` slower than the pick and holding at least `LEANER_SAVING` less memory
    per rank; None when the pick has no such runner-up."""
    pick = result.best
    close = [(row, p) for row, p in enumerate(result.predictions[:top], start=1)
             if p is not pick and p.step_seconds <= pick.step_seconds * (1 + LEANER_WITHIN)
             and p.memory.total <= pick.memory.total * (1 - LEANER_SAVING)]
    return min(close, key=lambda item: (item[1].memory.total, item[0]), default=None)


def zero_line(result: PlanResult, cluster: ClusterSpec) -> str | None:
    """Why the pick shards gradients or weights (ZeRO-2/3), which costs collectives every
    microbatch: faster than the best at a lower stage, or nothing at a lower stage both fits
    and runs faster (memory). None below ZeRO-2."""
    z = result.best.config.zero_stage
    if z < 2:
        return None
    lower = [p for p in result.predictions if p.config.zero_stage < z]
    if lower:
        best = lower[0]
        return (f"why z{z}: faster than the best at ZeRO 0-{z - 1}, {best.config.label()}, "
                f"by {_seconds(best.step_seconds - result.best.step_seconds)}")
    return (f"why z{z}: memory: no configuration at ZeRO 0-{z - 1} both fits in "
            f"{cluster.device_memory / GIB:.1f} GiB and runs faster")


def leaner_line(result: PlanResult, top: int = 10) -> str | None:
    """Why the pick is the pick when a nearly-as-fast runner-up holds much less memory."""
    found = leaner_alternative(result, top)
    if found is None:
        return None
    row, leaner = found
    pick = result.best
    slower = leaner.step_seconds / pick.step_seconds - 1
    return (f"leaner: #{row} {leaner.config.label()} is {slower:.1%} slower and holds "
            f"{(pick.memory.total - leaner.memory.total) / GIB:.1f} GiB less a rank "
            f"({leaner.memory.total / GIB:.1f} GiB): the pick is the fastest predicted, but "
            f"within {LEANER_WITHIN:.0%} the prices cannot tell them apart; prefer #{row} for "
            "memory headroom")


def format_table(result: PlanResult, cluster: ClusterSpec, global_batch: int, *,
                 top: int = 10, engine: str = "pipesched", blocks: int = 0,
                 target: LaunchTarget | None = None) -> str:
    """The top `top` configurations, fastest first, then how to run the pick on `engine`
    (`launch.launch_lines`; `blocks`: the model's transformer layers; `target`: where)."""
    pick = result.best
    header = ("  # configuration                                  step      tokens/s  "
              "TFLOP/s/dev  memory GiB  why slower")
    lines = [header, "-" * len(header)]
    for index, prediction in enumerate(result.predictions[:top], start=1):
        flops = (f"{prediction.flops_per_device / 1e12:>11.1f}" if prediction.flops_per_device
                 else f"{'n/a':>11}")  # a cost file gives times, not FLOPs
        lines.append(
            f"{index:>3} {prediction.config.label():<44} {_seconds(prediction.step_seconds):>9}"
            f" {prediction.tokens_per_second:>12,.0f} {flops}"
            f" {prediction.memory.total / GIB:>11.2f}  {loss_reason(prediction, pick)}")
    config = pick.config
    unit, scale = ("GiB", GIB) if pick.memory.total >= GIB else ("MiB", 2**20)
    lines += [
        "",
        f"{format_counts(result)}; device memory {cluster.device_memory / GIB:.1f} GiB",
        f"pick: {config.label()}  (memory: rank {pick.memory_rank} holds the most, "
        + ", ".join(f"{key} {value / scale:.1f}" for key, value in pick.memory.to_dict().items()
                    if key != "total") + f" {unit})",
        *filter(None, [zero_line(result, cluster), leaner_line(result, top)]),
        *(f"  {line}" for line in launch_lines(engine, config, global_batch, blocks,
                                               target=target, boundaries=pick.boundaries)),
    ]
    return "\n".join(lines)


def plan_document(result: PlanResult, cluster: ClusterSpec, global_batch: int, *,
                  top: int = 10, engine: str = "pipesched", blocks: int = 0,
                  target: LaunchTarget | None = None) -> dict[str, Any]:
    """The search as one JSON-ready mapping."""
    pick = result.best
    return {
        "cluster": cluster.name, "devices": cluster.num_devices,
        "device_memory": cluster.device_memory, "global_batch": global_batch,
        "engine": engine,
        "pick": pick.to_dict() | {"engine_arguments": pick.config.engine_arguments(),
                                  "train_command": pick.config.train_command(global_batch),
                                  "launch": launch_lines(engine, pick.config, global_batch,
                                                         blocks, target=target,
                                                         boundaries=pick.boundaries)}
        | ({"run_arguments": run_arguments(pick.config, global_batch, target,
                                           pick.boundaries)}
           if engine == "pipesched" and target is not None and target.hf is not None
           and pick.config.cp == 1 else {}),  # `pipesched run` has no context parallelism
        "ranked": [p.to_dict() | {"why_slower": loss_reason(p, pick),
                                  "gap_parts": gap_parts(p, pick)}
                   for p in result.predictions[:top]],
        "pareto": [p.config.label() for p in result.pareto()],
        "counts": {"considered": result.considered, "simulated": len(result.predictions),
                   "over_memory": result.over_memory,
                   "refused_by_schedule": result.refused_by_schedule,
                   "skipped_by_bound": result.skipped_by_bound,
                   "stopped_early": result.stopped_early},
        "search_seconds": result.seconds,  # CPU
        "search_wall_seconds": result.wall_seconds,
    }


def format_breakdown(prediction: Prediction, cluster: ClusterSpec, global_batch: int, *,
                     engine: str = "pipesched", blocks: int = 0,
                     target: LaunchTarget | None = None) -> str:
    """One configuration in full: step, throughput, the step by cause (summing to it), the
    memory of its fullest rank, and its engine arguments."""
    config = prediction.config
    fits = prediction.memory.total <= cluster.device_memory
    lines = [f"{config.label()}: step {_seconds(prediction.step_seconds)}, "
             f"{prediction.tokens_per_second:,.0f} tokens/s, "
             f"{prediction.flops_per_device / 1e12:.1f} model TFLOP/s per device", "",
             "  step by cause (the rank that finishes last):"]
    for key, value in prediction.breakdown.items():
        share = value / prediction.step_seconds if prediction.step_seconds else 0.0
        lines.append(f"    {key:<14} {_seconds(value):>10}  {share:6.1%}")
    lines.append(f"    {'total':<14} {_seconds(prediction.step_seconds):>10}")
    lines += ["", f"  memory (rank {prediction.memory_rank} holds the most), GiB:"]
    for key, value in prediction.memory.to_dict().items():
        lines.append(f"    {key:<14} {value / GIB:>10.2f}")
    lines.append(f"    device         {cluster.device_memory / GIB:>10.2f}  "
                 + ("fits" if fits else "DOES NOT FIT"))
    lines += ["", f"  stage boundaries: {list(prediction.boundaries)}",
              *(f"  {line}" for line in launch_lines(engine, config, global_batch, blocks,
                                                     target=target,
                                                     boundaries=prediction.boundaries))]
    return "\n".join(lines)


def plot_plan(result: PlanResult, cluster: ClusterSpec, path: str | os.PathLike[str], *,
              top: int = 10) -> Path:
    """Predicted step time against memory per rank for every simulated configuration; the
    Pareto front joined and marked, the top `top` numbered and named in the legend, the
    pick starred, the device memory as a line. The y-axis spans the top configurations
    (often all within a few percent of each other), not the slowest."""
    import textwrap

    from viz.output import new_figure, save_figure

    figure = new_figure(11.5, 6)
    axes = figure.add_subplot(1, 1, 1)
    largest = max(p.memory.total for p in result.predictions)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    memory = [p.memory.total / scale for p in result.predictions]
    seconds = [p.step_seconds for p in result.predictions]
    axes.scatter(memory, seconds, s=10, color="#9aa7b8", label="feasible configuration")
    front = result.pareto()
    axes.plot([p.memory.total / scale for p in front], [p.step_seconds for p in front],
              "o-", color="#d1495b", markersize=5, label="Pareto front")
    best = result.predictions[:top]
    for rank, prediction in enumerate(best, start=1):
        x, y = prediction.memory.total / scale, prediction.step_seconds
        axes.scatter([x], [y], s=28, color="#00798c", zorder=4)
        axes.annotate(str(rank), (x, y), textcoords="offset points", xytext=(4, 3),
                      fontsize=8, color="#00798c")
    pick = result.best
    axes.scatter([pick.memory.total / scale], [pick.step_seconds], marker="*", s=220,
                 color="#edae49", edgecolors="black", zorder=5, label="pick (1)")
    leaner = leaner_alternative(result, top)
    if leaner is not None:
        row, lean = leaner
        axes.scatter([lean.memory.total / scale], [lean.step_seconds], marker="D", s=90,
                     facecolors="none", edgecolors="#2e7d32", linewidths=1.5, zorder=5,
                     label=f"leaner within {LEANER_WITHIN:.0%} ({row}): "
                           f"{(pick.memory.total - lean.memory.total) / scale:.1f} {unit} less")
    low, high = best[0].step_seconds, best[-1].step_seconds
    margin = max(high - low, 0.01 * low) * 0.15
    hidden = sum(1 for p in result.predictions if p.step_seconds > high + margin)
    axes.set_ylim(low - margin, high + margin)
    device = f"device memory {cluster.device_memory / scale:,.1f} {unit}"
    if cluster.device_memory <= 2 * largest:  # else the line would squash every point
        axes.axvline(cluster.device_memory / scale, color="black", linestyle="--",
                     linewidth=1, label=device)
    else:
        device += " (off the chart)"
    axes.set_xlabel(f"memory per rank ({unit}, the largest rank); {device}")
    axes.set_ylabel("predicted step time (s)")
    title = (f"{len(result.predictions)} simulated configurations on {cluster.num_devices} × "
             f"{cluster.name}; the top {len(best)} numbered"
             + (f", {hidden} slower ones above the chart" if hidden else "")
             + f"; {result.skipped_by_bound + result.stopped_early} more fit but are beaten in "
               "time and memory (by a bound, or partway through their simulation)")
    axes.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    names = [f"{rank:>2}  {p.config.label()}  {_seconds(p.step_seconds)}"
             for rank, p in enumerate(best, start=1)]
    axes.text(1.02, 0.62, "\n".join(names), transform=axes.transAxes, fontsize=7,
              va="top", ha="left", family="monospace")
    figure.subplots_adjust(left=0.08, right=0.64, top=0.88, bottom=0.1)
    return save_figure(figure, path)
