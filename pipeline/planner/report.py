"""What a search found, for people and tools: the ranked table with why each loser loses,
the pick as engine arguments, a JSON document, and the time-against-memory plot."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.predict import Prediction
from pipeline.planner.search import PlanResult, format_counts

__all__ = ["format_table", "loss_reason", "plan_document", "plot_plan"]

GIB = 2**30
# cause of a step's time -> the word the table uses for it
_CAUSES = {"bubble": "bubble", "tp_comm": "communication", "dp_comm": "communication",
           "recomputation": "recomputation", "compute": "compute", "optimizer": "optimizer"}


def loss_reason(loser: Prediction, pick: Prediction) -> str:
    """Why `loser` is slower than `pick`: the cause whose seconds grew the most, with its
    share of the difference ("bubble +0.21 s")."""
    if loser is pick:
        return "pick"
    grown: dict[str, float] = {}
    for key, word in _CAUSES.items():
        grown[word] = grown.get(word, 0.0) + loser.breakdown[key] - pick.breakdown[key]
    word, seconds = max(grown.items(), key=lambda item: item[1])
    if seconds <= 0:
        return "ties the pick"
    return f"{word} +{_seconds(seconds)}"


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def format_table(result: PlanResult, cluster: ClusterSpec, global_batch: int, *,
                 top: int = 10) -> str:
    """The top `top` configurations, fastest first, then the pick's arguments."""
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
    arguments = ", ".join(f"{key}={value!r}" for key, value in config.engine_arguments().items())
    lines += [
        "",
        f"{format_counts(result)}; device memory {cluster.device_memory / GIB:.1f} GiB",
        f"pick: {config.label()}  (memory: rank {pick.memory_rank} holds the most, "
        + ", ".join(f"{key} {value / scale:.1f}" for key, value in pick.memory.to_dict().items()
                    if key != "total") + f" {unit})",
        f"  PipelineModule/PipelineEngine: {arguments}",
        f"  {config.train_command(global_batch)}",
    ]
    return "\n".join(lines)


def plan_document(result: PlanResult, cluster: ClusterSpec, global_batch: int, *,
                  top: int = 10) -> dict[str, Any]:
    """The search as one JSON-ready mapping."""
    pick = result.best
    return {
        "cluster": cluster.name, "devices": cluster.num_devices,
        "device_memory": cluster.device_memory, "global_batch": global_batch,
        "pick": pick.to_dict() | {"engine_arguments": pick.config.engine_arguments(),
                                  "train_command": pick.config.train_command(global_batch)},
        "ranked": [p.to_dict() | {"why_slower": loss_reason(p, pick)}
                   for p in result.predictions[:top]],
        "pareto": [p.config.label() for p in result.pareto()],
        "counts": {"considered": result.considered, "simulated": len(result.predictions),
                   "over_memory": result.over_memory,
                   "refused_by_schedule": result.refused_by_schedule,
                   "skipped_by_bound": result.skipped_by_bound},
        "search_seconds": result.seconds,
    }


def plot_plan(result: PlanResult, cluster: ClusterSpec, path: str | os.PathLike[str]) -> Path:
    """Predicted step time against memory per rank for every simulated configuration; the
    Pareto front joined and marked, the pick starred, the device memory as a line."""
    from viz.output import new_figure, save_figure

    figure = new_figure(8, 5)
    axes = figure.add_subplot(1, 1, 1)
    largest = max(p.memory.total for p in result.predictions)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    memory = [p.memory.total / scale for p in result.predictions]
    seconds = [p.step_seconds for p in result.predictions]
    axes.scatter(memory, seconds, s=10, color="#9aa7b8", label="feasible configuration")
    front = result.pareto()
    axes.plot([p.memory.total / scale for p in front], [p.step_seconds for p in front],
              "o-", color="#d1495b", markersize=5, label="Pareto front")
    pick = result.best
    axes.scatter([pick.memory.total / scale], [pick.step_seconds], marker="*", s=220,
                 color="#edae49", edgecolors="black", zorder=5,
                 label=f"pick: {pick.config.label()}")
    device = f"device memory {cluster.device_memory / scale:,.1f} {unit}"
    if cluster.device_memory <= 2 * largest:  # else the line would squash every point
        axes.axvline(cluster.device_memory / scale, color="black", linestyle="--",
                     linewidth=1, label=device)
    else:
        device += " (off the chart)"
    axes.set_xlabel(f"memory per rank ({unit}, the largest rank); {device}")
    axes.set_ylabel("predicted step time (s)")
    axes.set_title(f"{len(result.predictions)} simulated configurations on "
                   f"{cluster.num_devices} × {cluster.name} ({result.skipped_by_bound} more fit "
                   f"but are beaten in time and memory by a bound)", fontsize=10)
    axes.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    return save_figure(figure, path)
