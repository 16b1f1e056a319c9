"""The prepared GPU check (issue 32): the `cuda` test tier, a 1.1B Llama-shaped training step
through our engine against plain PyTorch, measured kernels against the planner's H100 model,
and the step's peak memory against the planner's prediction; one JSON and one Markdown table.

    python benchmarks/gpu_check.py --out gpu-check          # on one GPU, under 8 minutes
    python benchmarks/gpu_check.py --rehearse --out /tmp/x  # the same path on CPU, tiny sizes

Step times: the same model (seeded alike), optimizer (AdamW) and bf16 autocast, one
microbatch of b × s tokens per step, our `PipelineEngine` at pp = 1 first, then plain
PyTorch in the same process after the engine's memory is released; the medians of the timed
steps. Kernels: `profile_device`'s bf16 GEMM grid (what ``pipesched profile-device`` writes)
against `gemm_seconds`, an element-wise add against `elementwise_seconds`, and
`scaled_dot_product_attention` against `attention_core_seconds`, each for the ``h100-80g``
preset (measured ÷ modelled: above 1 the device is slower than the model says).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn.functional as F
from llama_layers import TINYLLAMA_1B, LlamaShape, llama_layers, token_loss

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.device import (
    default_device,
    peak_memory_allocated,
    release_cached_memory,
    reset_peak_memory,
    synchronize,
)
from pipeline.model.reference import build_reference, reference_forward

REHEARSAL_SHAPE = LlamaShape(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128,
                             seq=32)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _timed(step: Any, device: torch.device, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def _engine_times(shape: LlamaShape, inputs: torch.Tensor, targets: torch.Tensor, warmup: int,
                  steps: int, precision: str, device: torch.device
                  ) -> tuple[list[float], int | None]:
    """Our engine at pp = 1: its step times and the peak bytes the allocator held."""
    reset_peak_memory(device)
    module = PipelineModule(llama_layers(shape), num_stages=1, loss_fn=token_loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=1, optimizer=_adamw,
                            precision=precision, device=device, timeout=600)
    times = _timed(lambda: engine.train_batch(inputs, targets), device, warmup, steps)
    engine.stop_watchdog()
    return times, peak_memory_allocated(device)


def _step_times(shape: LlamaShape, batch: int, warmup: int, steps: int,
                precision: str) -> dict[str, Any]:
    """On one rank: our engine's step times and peak memory, then plain PyTorch's."""
    device = default_device()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab, (batch, shape.seq + 1), generator=generator)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    ours, peak = _engine_times(shape, inputs, targets, warmup, steps, precision, device)
    release_cached_memory(device)  # the engine is gone: plain PyTorch starts from empty
    model = build_reference(llama_layers(shape)).to(device)
    optimizer = _adamw(model.parameters())
    on_device = inputs.to(device), targets.to(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def plain_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = token_loss(reference_forward(model, on_device[0]), on_device[1])
        loss.backward()
        optimizer.step()

    plain = _timed(plain_step, device, warmup, steps)
    return {"ours_seconds": ours, "plain_seconds": plain, "peak_bytes": peak,
            "device": str(device)}


def _least(run: Any, device: torch.device, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats + 1):  # the first is a warm-up
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _kernels(sizes: tuple[int, ...], repeats: int, attention: tuple[int, int, int, int],
             elements: int, precision: str) -> dict[str, Any]:
    """Measured ÷ modelled seconds per kernel class, against the H100 preset."""
    from pipeline.planner.calibrate import profile_device
    from pipeline.planner.cluster import PRESETS
    from pipeline.planner.kernels import (
        LayerShape,
        attention_core_seconds,
        elementwise_seconds,
        gemm_seconds,
    )

    cluster, device = PRESETS["h100-80g"], default_device()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    profile = profile_device(gemm_sizes=sizes, repeats=repeats, ranks=1, precision=precision)
    gemm = [seconds / gemm_seconds(m, n, k, cluster, precision) for m, n, k, seconds
            in profile["gemms"]]
    a, b = (torch.randn(elements, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty_like(a)
    added = _least(lambda: torch.add(a, b, out=out), device, repeats)
    element = a.element_size()
    elementwise = added / elementwise_seconds(3 * elements * element, cluster)
    batch, heads, seq, head = attention
    q, k, v = (torch.randn(batch, heads, seq, head, device=device, dtype=dtype)
               for _ in range(3))
    core = _least(lambda: F.scaled_dot_product_attention(q, k, v), device, repeats)
    causal = _least(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device,
                    repeats)
    shape = LayerShape("block", seq, heads * head, heads, heads * head, 4 * heads * head, 1,
                       element)
    modelled = attention_core_seconds(shape, batch, 1, cluster, precision)
    return {"gemm": {"geometric_mean": math.exp(statistics.fmean(math.log(r) for r in gemm)),
                     "min": min(gemm), "max": max(gemm), "shapes": len(gemm)},
            "elementwise": {"ratio": elementwise, "measured_seconds": added,
                            "bytes": 3 * elements * element},
            "attention": {"ratio": core / modelled, "measured_seconds": core,
                          "causal_ratio": causal / modelled, "shape": list(attention)},
            "device": profile["device"]}


def _predicted_bytes(shape: LlamaShape, batch: int) -> dict[str, Any]:
    """The planner's memory for this run: pp = tp = dp = 1, b = batch, m = 1, no ZeRO."""
    from pipeline.planner.cluster import PRESETS
    from pipeline.planner.errors import PlanError
    from pipeline.planner.load import load_model
    from pipeline.planner.predict import PlanConfig
    from pipeline.planner.search import price

    cluster = dataclasses.replace(PRESETS["h100-80g"], devices_per_node=1)
    try:
        model = load_model(shape.planner_model(), precision="bf16")
        config = PlanConfig(pp=1, tp=1, dp=1, schedule="1f1b", chunks=1,
                            microbatch_size=batch, num_microbatches=1, zero_stage=0,
                            recompute="none")
        prediction = price(model, cluster, batch, config)
    except PlanError as error:
        return {"error": str(error)}
    return {"bytes": prediction.memory.total, "breakdown": prediction.memory.to_dict()}


def _tier(rehearse: bool) -> dict[str, Any]:
    env = dict(os.environ, **({"PIPESCHED_DEVICE_TIER": "cpu"} if rehearse else {}))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/cuda",
                           "-p", "no:cacheprovider"], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          timeout=420)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"exit": done.returncode, "summary": lines[-1] if lines else "",
            "seconds": time.perf_counter() - started,
            "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))]}


def _markdown(report: dict[str, Any]) -> str:
    step, kernels, memory = report["step"], report["kernels"], report["memory"]
    ratio = step["ratio"]
    rows = [("cuda tier", report["tier"]["summary"], "all pass"),
            ("step ours ÷ plain PyTorch",
             f"{ratio:.3f} ({step['ours_median']:.4f} s vs {step['plain_median']:.4f} s)",
             "≤ 1.03"),
            ("GEMM measured ÷ model (geo. mean, min–max)",
             f"{kernels['gemm']['geometric_mean']:.2f} ({kernels['gemm']['min']:.2f}–"
             f"{kernels['gemm']['max']:.2f})", "≈ 1"),
            ("element-wise measured ÷ model", f"{kernels['elementwise']['ratio']:.2f}", "≈ 1"),
            ("attention measured ÷ model (causal)",
             f"{kernels['attention']['ratio']:.2f} ({kernels['attention']['causal_ratio']:.2f})",
             "≈ 1"),
            ("peak memory measured ÷ predicted", memory.get("ratio_text", "n/a"), "≈ 1")]
    lines = [f"GPU check on {report['device']} ({report['shape']}, {report['when']})", "",
             "| check | figure | target |", "|---|---|---|"]
    lines += [f"| {name} | {figure} | {target} |" for name, figure, target in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for JSON and Markdown")
    parser.add_argument("--rehearse", action="store_true",
                        help="run the same path on CPU with tiny sizes (no GPU needed)")
    parser.add_argument("--skip-tier", action="store_true", help="leave out the cuda tier")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each engine")
    args = parser.parse_args()
    if not args.rehearse and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --rehearse to run the check's path on CPU")
    shape = REHEARSAL_SHAPE if args.rehearse else TINYLLAMA_1B
    precision = "fp32" if args.rehearse else "bf16"
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "shape": f"{shape.parameters() / 1e9:.2f}B parameters, "
                                       f"b{args.batch} s{shape.seq}",
                              "torch": torch.__version__}
    report["tier"] = _tier(args.rehearse) if not args.skip_tier else {"summary": "skipped"}
    options = {"backend": "gloo"} if args.rehearse else {}
    timed = launch(_step_times, 1, shape, args.batch, 2, args.steps, precision, timeout=600,
                   **options)[0]
    ours, plain = statistics.median(timed["ours_seconds"]), statistics.median(
        timed["plain_seconds"])
    report["device"] = timed["device"]
    report["step"] = {**timed, "ours_median": ours, "plain_median": plain,
                      "ratio": ours / plain}
    sizes = (64, 128) if args.rehearse else (2048, 4096, 8192)
    attention = (1, 2, 64, 32) if args.rehearse else (4, 32, 2048, 64)
    report["kernels"] = _kernels(sizes, 3 if args.rehearse else 10, attention,
                                 2**16 if args.rehearse else 2**27,
                                 "fp32" if args.rehearse else "bf16")
    memory = _predicted_bytes(shape, args.batch)
    if "bytes" in memory and timed["peak_bytes"] is not None:
        memory["measured_bytes"] = timed["peak_bytes"]
        memory["ratio"] = timed["peak_bytes"] / memory["bytes"]
        memory["ratio_text"] = (f"{memory['ratio']:.3f} ({timed['peak_bytes'] / 2**30:.2f} vs "
                                f"{memory['bytes'] / 2**30:.2f} GiB)")
    elif "error" in memory:
        memory["ratio_text"] = f"planner: {memory['error'][:80]}"
    report["memory"] = memory
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    table = _markdown(report)
    (args.out / "gpu_check.md").write_text(table)
    print(table)
    return 0 if report["tier"].get("exit", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
