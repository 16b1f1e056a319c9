"""How close each covered HF family trains to HF itself: max differences, pipelined vs HF.

One SGD step (lr 0.1) of each tiny family (tests/support/hf_models.py: 2 layers, hidden 32,
sliding windows of 4, Gemma's soft-capping) on 2 gloo ranks, 4 microbatches of 1F1B, against
HF's ``model(labels=)``, ``backward()`` and the same step on one process; then the
pipeline's export, reloaded by ``from_pretrained``. Prints a markdown table of the max
absolute differences (the test, tests/interop/test_hf_adapters.py, bounds the same figures).

    PYTHONPATH=. python benchmarks/hf_equivalence.py
"""

from __future__ import annotations

import argparse

from pipeline import launch
from tests.support.hf_equivalence import step_differences
from tests.support.hf_models import FAMILIES

__all__: list[str] = []


def _run(families: list[str], schedule: str) -> list[tuple[str, bool, dict[str, float]]]:
    return [(family, tied, step_differences(family, schedule, tied=tied))
            for family in families for tied in ((True,) if family == "gpt2" else (True, False))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()
    rows = launch(_run, 2, args.families, args.schedule, timeout=900)[0]
    print(f"max |pipelined - HF| after one SGD step ({args.schedule}, 2 ranks, m=4, fp32)\n")
    print("| family | lm_head | loss | gradients | weights after the step | "
          "logits of the exported checkpoint |")
    print("|---|---|---|---|---|---|")
    for family, tied, found in rows:
        print(f"| {family} | {'tied' if tied else 'untied'} | {found['loss']:.1e} | "
              f"{found['grad']:.1e} | {found['param']:.1e} | {found['logits']:.1e} |")


if __name__ == "__main__":
    main()
