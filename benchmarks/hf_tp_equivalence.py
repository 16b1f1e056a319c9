"""How close each HF family split over tp trains to HF itself: relative errors, pp 2 × tp.

The cases of tests/interop/test_hf_tensor_parallel.py (every family at tp 2 or 4 inside 2
pipeline stages; sequence parallelism, ZeRO-1 at dp 2, selective recomputation, zb-h1,
untied heads), one SGD step (lr 0.1, m = 2, fp32, gloo) against HF's ``model(labels=)``,
``backward()`` and the same step on one process. Prints a markdown table of relative errors
(||pipelined - HF|| / ||HF||): the loss, every gradient (each rank's slice against the same
slice of HF's), the updated weights merged back into whole HF tensors, and the logits of the
exported checkpoint reloaded by ``from_pretrained`` where the case exports.

    PYTHONPATH=. python benchmarks/hf_tp_equivalence.py
"""

from __future__ import annotations

import torch.distributed as dist

from pipeline import launch
from tests.interop.test_hf_tensor_parallel import WORLD_4, WORLD_8
from tests.support.hf_tp_equivalence import TPCase, tp_step_errors

__all__: list[str] = []


def _run(cases: list[TPCase]) -> list[tuple[str, dict[str, float]]] | None:
    rows = [(case.label(), tp_step_errors(case)) for case in cases]
    return rows if dist.get_rank() == 0 else None


def main() -> None:
    rows = []
    for cases in (WORLD_4, WORLD_8):
        found = launch(_run, cases[0].world, cases, timeout=900)[0]
        rows += found or []
    print("relative error against HF after one SGD step (pp 2, m = 2, fp32, gloo)\n")
    print("| case | ranks | loss | gradients | weights after the step | exported logits |")
    print("|---|---|---|---|---|---|")
    cases = {case.label(): case for case in WORLD_4 + WORLD_8}
    for label, errors in rows:
        export = f"{errors['export']:.1e}" if cases[label].export else "-"
        print(f"| {label} | {cases[label].world} | {errors['loss']:.1e} | {errors['grad']:.1e} | "
              f"{errors['param']:.1e} | {export} |")


if __name__ == "__main__":
    main()
