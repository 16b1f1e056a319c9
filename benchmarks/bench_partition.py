"""Benchmark the partitioner: speed at n=100,000 / p=128 and bottleneck quality against peers."""

from __future__ import annotations

import itertools
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partition import (
    LayerCost,
    ModelGraph,
    chain_graph,
    graph_from_json,
    partition_graph,
    partition_weights,
    uniform_boundaries,
)

__all__ = ["block_partition_torchgpipe_style", "cli_table", "main", "transformer_costs",
           "write_cost_file"]

REPO = Path(__file__).resolve().parents[1]

Boundaries = Sequence[int]


def block_partition_torchgpipe_style(sequence: Sequence[float], partitions: int) -> list[int]:
    """Re-implementation of the semantics of torchgpipe's ``balance.blockpartition.solve``
    (Barany & Grinberg, "Block partitions of sequences", arXiv:1308.2452), returning
    boundaries: normalise the costs to [0, 1] by (x - min) / (max - min), start from equal
    counts, then repeatedly move one layer from the block next to a smallest block (on the
    side of a largest block) into it, until largest <= smallest + 1 in normalised units."""
    n = len(sequence)
    low, span = min(sequence), max(sequence) - min(sequence)
    normal = [0.0] * n if span == 0 else [(x - low) / span for x in sequence]
    ends = [n // partitions * (i + 1) for i in range(partitions - 1)] + [n]

    def block(i: int) -> float:
        return sum(normal[(ends[i - 1] if i > 0 else 0) : ends[i]])

    while True:
        largest, p = max((block(i), i) for i in range(partitions))
        while True:
            smallest, q = min((block(i), i) for i in range(partitions))
            if largest <= smallest + 1:
                return [0, *ends]
            if p < q:
                ends[q - 1] -= 1
                h = q - 1
            else:
                ends[q] += 1
                h = q + 1
            if p == h:
                break


def _deepspeed_partition_balanced() -> tuple[Callable[[Sequence[float], int], Boundaries], str]:
    """DeepSpeed's own partition_balanced if it is installed, else a re-implementation of its
    semantics (a DP minimising max - min over stages, ties to the later split)."""
    try:
        from deepspeed.runtime.utils import partition_balanced
    except ImportError:
        return _min_spread_partition, "re-implemented (deepspeed not installed)"
    import deepspeed

    return partition_balanced, f"deepspeed {deepspeed.__version__}"


def _min_spread_partition(weights: Sequence[float], num_parts: int) -> list[int]:
    """The objective of DeepSpeed's partition_balanced: for each prefix and part count, the
    split minimising (largest - smallest part), tracking both along the DP."""
    n, m = len(weights), num_parts
    if n <= m:
        return [min(k, n) for k in range(m + 1)]
    prefix = np.concatenate(([0.0], np.cumsum(weights)))
    spread = np.full((n + 1, m + 1), np.inf)
    largest = np.full((n + 1, m + 1), np.inf)
    smallest = np.full((n + 1, m + 1), np.inf)
    choice = np.zeros((n + 1, m + 1), dtype=int)
    spread[0, 0] = largest[0, 0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                high, low = max(largest[k, j - 1], part), min(smallest[k, j - 1], part)
                if spread[i, j] >= high - low:
                    spread[i, j], largest[i, j], smallest[i, j] = high - low, high, low
                    choice[i, j] = k
    cuts = [n]
    for j in range(m, 0, -1):
        cuts.append(int(choice[cuts[-1], j]))
    return cuts[::-1]


def transformer_costs(num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Layer times of a decoder: a heavy embedding, blocks split into (norm, attention,
    norm, MLP), a final norm and a heavy LM head (large vocabulary), with 5% noise."""
    block = [0.02, 0.35, 0.02, 0.61]
    costs = [1.5] + block * num_blocks + [0.02, 3.0]
    return np.asarray(costs) * rng.uniform(0.95, 1.05, len(costs))


def random_costs(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.lognormal(0.0, 1.0, n)


def bottleneck(weights: np.ndarray, cuts: Boundaries) -> float:
    prefix = np.concatenate(([0.0], np.cumsum(weights)))
    return float(max(prefix[b] - prefix[a] for a, b in itertools.pairwise(cuts)))


def timed(function: Callable[[], object], repeats: int = 3) -> tuple[float, object]:
    """Best wall time of ``repeats`` calls, and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - started)
    return best, result


def speed_table() -> list[str]:
    rng = np.random.default_rng(0)
    n, p = 100_000, 128
    rows = ["| case | n | p | time |", "|---|---:|---:|---:|"]
    weights = random_costs(n, rng)
    seconds, _ = timed(lambda: partition_weights(weights, p))
    rows.append(f"| `partition_weights`, random | {n:,} | {p} | {seconds * 1e3:.0f} ms |")
    blocks = transformer_costs((n - 4) // 4, rng)
    seconds, _ = timed(lambda: partition_weights(blocks, p))
    label = "`partition_weights`, transformer-like"
    rows.append(f"| {label} | {len(blocks):,} | {p} | {seconds * 1e3:.0f} ms |")
    layers = [
        LayerCost(f"l{i}", forward=w / 3, backward=2 * w / 3, params=1e6, activation=1e5)
        for i, w in enumerate(weights)
    ]
    build, graph = timed(lambda: chain_graph(layers), repeats=1)
    assert isinstance(graph, ModelGraph)
    seconds, _ = timed(lambda: partition_graph(graph, p))
    rows.append(
        f"| `partition_graph`, chain (graph built in {build:.2f} s) | {n:,} | {p} | "
        f"{seconds * 1e3:.0f} ms |"
    )
    linked = chain_graph(layers, bandwidth=1e9)
    speeds = [1.0 + (k % 2) for k in range(p)]
    seconds, _ = timed(lambda: partition_graph(linked, p, speeds=speeds), repeats=1)
    rows.append(
        f"| `partition_graph`, chain + comm + unequal speeds | {n:,} | {p} | {seconds:.2f} s |"
    )
    seconds, _ = timed(lambda: partition_graph(linked, p, speeds=speeds, memory_cap=9e9), repeats=1)
    rows.append(
        f"| `partition_graph`, chain + comm + speeds + 1F1B memory cap | {n:,} | {p} | "
        f"{seconds:.2f} s |"
    )
    dag = _skip_dag(2_000, rng)
    seconds, _ = timed(lambda: partition_graph(dag, 16), repeats=1)
    rows.append(f"| `partition_graph`, DAG with skip edges (DP) | 2,000 | 16 | {seconds:.2f} s |")
    deepspeed, which = _deepspeed_partition_balanced()
    small = [float(w) for w in random_costs(256, rng)]
    seconds, _ = timed(lambda: deepspeed(small, 16), repeats=1)
    rows.append(f"| peer: DeepSpeed `partition_balanced` ({which}) | 256 | 16 | {seconds:.2f} s |")
    seconds, _ = timed(lambda: block_partition_torchgpipe_style(small, 16), repeats=1)
    rows.append(f"| peer: torchgpipe-style block partition | 256 | 16 | {seconds:.2f} s |")
    return rows


def write_cost_file(path: Path, weights: np.ndarray) -> None:
    """The README's JSON cost format, one layer per weight: the speed table's chain (forward
    a third of the weight, backward two thirds, 1 MB of parameters, 100 kB activations)."""
    layers = [{"name": f"l{i}", "forward": w / 3, "backward": 2 * w / 3, "params": 1e6,
               "activation": 1e5} for i, w in enumerate(weights.tolist())]
    path.write_text(json.dumps({"layers": layers}))


def cli_table(n: int = 100_000, p: int = 128) -> list[str]:
    """End to end: `pipesched partition --costs FILE --stages P` in a fresh process (startup,
    reading and checking the file, partitioning, printing), against the parts in-process."""
    rng = np.random.default_rng(0)
    rows = ["| case | n | p | time |", "|---|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory, f"costs_{n}.json")
        write_cost_file(path, random_costs(n, rng))
        command = [sys.executable, "-m", "pipeline.cli", "partition", "--costs", str(path),
                   "--stages", str(p)]
        seconds, cpu = _cli_seconds(command)
        rows.append(f"| `pipesched partition --costs FILE --stages {p}`, end to end "
                    f"({path.stat().st_size / 1e6:.0f} MB file; CPU time {cpu:.2f} s) | "
                    f"{n:,} | {p} | {seconds:.2f} s |")
        seconds, graph = timed(lambda: graph_from_json(path))
        rows.append(f"| of which `graph_from_json` (read, parse, check) | {n:,} | - | "
                    f"{seconds * 1e3:.0f} ms |")
        assert isinstance(graph, ModelGraph)
        seconds, _ = timed(lambda: partition_graph(graph, p))
        rows.append(f"| of which `partition_graph` | {n:,} | {p} | {seconds * 1e3:.0f} ms |")
    return rows


def _cli_seconds(command: list[str], repeats: int = 3) -> tuple[float, float]:
    """Best wall time of `repeats` runs of `command`, and the CPU time (user + system) of
    that run: on a shared machine the wall time also counts waiting for a core."""
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run(command, cwd=REPO, check=True, capture_output=True)
        seconds = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        if seconds < best:
            best, best_cpu = seconds, cpu
    return best, best_cpu


def _skip_dag(n: int, rng: np.random.Generator) -> ModelGraph:
    """A residual network: a chain plus a skip edge over every pair of layers."""
    layers = [LayerCost(f"l{i}", forward=float(w)) for i, w in enumerate(random_costs(n, rng))]
    edges = [(i, i + 1, 1e6) for i in range(n - 1)] + [(i, i + 2, 1e6) for i in range(0, n - 2, 2)]
    return ModelGraph(layers, edges, bandwidth=1e9)


def quality_table(deepspeed: Callable[[Sequence[float], int], Boundaries]) -> list[str]:
    rows = [
        "| costs | n | p | ours / DeepSpeed (mean, min) | ours / torchgpipe (mean, min) "
        "| ours / uniform (mean) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    cases = [("random", 64, 4), ("random", 128, 8), ("random", 256, 16)]
    cases += [("transformer", 66, 4), ("transformer", 130, 8), ("transformer", 258, 16)]
    for kind, n, p in cases:
        versus_ds, versus_tg, versus_uniform = [], [], []
        for seed in range(5):
            rng = np.random.default_rng(seed)
            weights = (
                random_costs(n, rng) if kind == "random" else transformer_costs((n - 3) // 4, rng)
            )
            ours = bottleneck(weights, partition_weights(weights, p))
            plain = [float(w) for w in weights]
            versus_ds.append(ours / bottleneck(weights, [int(c) for c in deepspeed(plain, p)]))
            versus_tg.append(ours / bottleneck(weights, block_partition_torchgpipe_style(plain, p)))
            versus_uniform.append(ours / bottleneck(weights, uniform_boundaries(len(weights), p)))
        rows.append(
            f"| {kind} | {len(weights)} | {p} | {statistics.mean(versus_ds):.3f}, "
            f"{min(versus_ds):.3f} | {statistics.mean(versus_tg):.3f}, {min(versus_tg):.3f} "
            f"| {statistics.mean(versus_uniform):.3f} |"
        )
    return rows


def main() -> None:
    """Print the speed table and the quality table (ratios below 1: ours is faster)."""
    deepspeed, which = _deepspeed_partition_balanced()
    print("## Speed (best of 3 where the time is short; CPU, numpy)\n")
    print("\n".join(speed_table()))
    print("\n## The command line on a 100,000-layer cost file (best of 3)\n")
    print("\n".join(cli_table()))
    print(f"\n## Bottleneck vs peers (5 seeds each; DeepSpeed: {which})\n")
    print("Ratio = our bottleneck / theirs; below 1.000 means our slowest stage is faster.\n")
    print("\n".join(quality_table(deepspeed)))


if __name__ == "__main__":
    main()
