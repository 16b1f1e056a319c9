"""Greedy generation speed: pipesched with and without its per-stage KV cache against HF's own
``generate(do_sample=False)`` (with and without its cache), in one run.

Each family is a demo-size causal LM built from a config (random weights, nothing
downloads). Our side runs on `--ranks` gloo ranks, one thread each, the model split into as
many stages; HF runs on rank 0 in a single process (one thread) while the other ranks wait.
Every configuration generates the same left-padded batch: tokens/s = rows x new tokens /
median seconds of `--repeats` timed runs (after one warm-up). The last column says whether
all four produced the same tokens.

    PYTHONPATH=. python benchmarks/bench_generate.py
    PYTHONPATH=. python benchmarks/bench_generate.py --families llama gemma2 --new-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.interop.hf_layers import layers_from_hf
from pipeline.interop.hf_weights import load_hf_weights
from pipeline.runtime.generation import greedy_generate
from pipeline.runtime.inference import Inference

__all__: list[str] = []

COLUMNS = ("ours, cache", "ours, no cache", "HF, cache", "HF, no cache")


def demo_config(family: str, layers: int) -> Any:
    """Hidden 256, 8 heads (4 KV heads), vocab 2048, sliding windows of 64 where the family
    has them."""
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(n_embd=256, n_layer=layers, n_head=8, vocab_size=2048,
                                       n_positions=512, embd_pdrop=0.0, resid_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    shape: dict[str, Any] = dict(hidden_size=256, intermediate_size=704,
                                 num_hidden_layers=layers, num_attention_heads=8,
                                 num_key_value_heads=4, vocab_size=2048,
                                 max_position_embeddings=512, pad_token_id=0)
    extra: dict[str, dict[str, Any]] = {
        "qwen3": dict(head_dim=32), "mistral": dict(sliding_window=64),
        "gemma2": dict(head_dim=32, sliding_window=64, query_pre_attn_scalar=32),
        "gemma3_text": dict(head_dim=32, sliding_window=64, query_pre_attn_scalar=32),
    }
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
               "qwen3": "Qwen3Config", "phi3": "Phi3Config", "gemma2": "Gemma2Config",
               "gemma3_text": "Gemma3TextConfig"}
    return getattr(transformers, classes[family])(**shape, **extra.get(family, {}))


def _prompts(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths from `length` down to half of it."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 2048, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(batch):
        pad = row * (length // 2) // max(batch - 1, 1)
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def _time(run: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    """Median seconds over `repeats` runs after a warm-up, and the last run's tokens."""
    tokens = run()
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        tokens = run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), tokens


def _measure(family: str, args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    config = demo_config(family, args.layers)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf_model.generation_config.eos_token_id = None  # both sides run all new tokens
    hf = layers_from_hf(config)
    module = PipelineModule(hf.layers, num_stages=dist.get_world_size(), loss_fn=hf.loss_fn,
                            partition_method="uniform")
    load_hf_weights(module, hf, hf_model.state_dict())
    inference = Inference(PipelineEngine(module, schedule="1f1b", num_microbatches=1,
                                         timeout=600))
    ids, mask = _prompts(args.batch, args.prompt)
    results: dict[str, Any] = {}
    tokens: dict[str, torch.Tensor] = {}
    for use_cache, column in ((True, COLUMNS[0]), (False, COLUMNS[1])):
        def ours(use_cache: bool = use_cache) -> torch.Tensor:
            return greedy_generate(inference, ids, args.new_tokens, attention_mask=mask,
                                   use_cache=use_cache, num_microbatches=args.microbatches)
        results[column], tokens[column] = _time(ours, args.repeats)
    for use_cache, column in ((True, COLUMNS[2]), (False, COLUMNS[3])):
        def hf_run(use_cache: bool = use_cache) -> torch.Tensor:
            if dist.get_rank() != 0:
                return tokens[COLUMNS[0]]
            with torch.no_grad():
                out: torch.Tensor = hf_model.generate(
                    ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                    do_sample=False, use_cache=use_cache,
                    pad_token_id=0)
            return out
        results[column], tokens[column] = _time(hf_run, args.repeats)
    results["same"] = all(torch.equal(t, tokens[COLUMNS[0]]) for t in tokens.values())
    return results


def _run(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    return [(family, _measure(family, args)) for family in args.families]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["gpt2", "llama", "gemma2"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = launch(_run, args.ranks, args, timeout=1800)[0]
    generated = args.batch * args.new_tokens
    print(f"greedy generation, tokens/s ({args.batch} left-padded prompts of <= {args.prompt} "
          f"tokens, {args.new_tokens} new tokens each, {args.layers} layers, hidden 256; "
          f"ours on {args.ranks} ranks x 1 thread, m={args.microbatches}; HF in one process, "
          "1 thread)\n")
    print("| family | " + " | ".join(COLUMNS) + " | cache speed-up (ours) | ours/HF (cache) "
          "| same tokens |")
    print("|---" * (len(COLUMNS) + 4) + "|")
    for family, found in rows:
        rates = [generated / found[column] for column in COLUMNS]
        print(f"| {family} | " + " | ".join(f"{rate:.0f}" for rate in rates) +
              f" | {rates[0] / rates[1]:.1f}x | {rates[0] / rates[2]:.2f} | {found['same']} |")


if __name__ == "__main__":
    main()
