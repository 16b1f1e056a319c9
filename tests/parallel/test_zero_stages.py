"""ZeRO-2 and ZeRO-3 inside pipeline stages equal one process (a tiny HF Llama from a
save_pretrained directory, pp2 × dp2, 1F1B / interleaved / ZB-V), hold the bytes they claim,
and refuse what they do not run with."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline import PipelineConfigError, launch
from pipeline.parallel.config import ParallelConfig, ZeroStage
from tests.support.engine3d_models import Case, run_case
from tests.support.zero_equivalence import zero_differences

TOLERANCE = 1e-5
"""Absolute: loss, every reduced gradient and every updated weight (fp32, two SGD steps)."""

RUNS = [(2, "1f1b", 1, True), (2, "interleaved", 2, True), (2, "zb-v", 2, True),
        (3, "1f1b", 1, True), (3, "interleaved", 2, True), (3, "zb-v", 2, True),
        (3, "1f1b", 1, False), (3, "zb-v", 2, False)]
"""(zero_stage, schedule, chunks per rank, reshard_after_forward); ZeRO-3 prefetches."""

UNPREFETCHED = [(3, "1f1b", 1, True), (3, "zb-v", 2, True)]
"""ZeRO-3 runs again with prefetch_next_unit=False."""


COMPOSED = [
    Case("pp2×dp2 ZeRO-2 Adam +clip", "mlp", {"data_parallel": 2, "zero_stage": 2,
                                              "gradient_clipping": 0.05, "bucket_mb": 2**-10},
         optimizer="adam"),
    Case("tied pp2×dp2 ZeRO-3 Adam +clip", "tied",
         {"data_parallel": 2, "zero_stage": 3, "gradient_clipping": 0.05}, optimizer="adam"),
    Case("interleaved pp2×dp2 ZeRO-3 +clip", "mlp",
         {"data_parallel": 2, "zero_stage": 3, "gradient_clipping": 0.05, "bucket_mb": 2**-10},
         schedule="interleaved", chunks=2),
    Case("zb-h1 pp2×dp2 ZeRO-2 overlap_param_gather", "tied",
         {"data_parallel": 2, "zero_stage": 2, "overlap_param_gather": True}, schedule="zb-h1",
         optimizer="adam"),
]
"""Composition with Adam, clipping, tied layers and the other ZeRO options, against
`reference_step` (the engine3d harness: two steps, every reduced gradient and weight)."""


def _every_run() -> dict[str, list[dict[str, Any]]]:
    return {"hf": [{"run": run, **zero_differences(run[0], run[1], run[2],
                                                   reshard_after_forward=run[3])}
                   for run in RUNS],
            "unprefetched": [{"run": run, **zero_differences(
                run[0], run[1], run[2], reshard_after_forward=run[3], prefetch_next_unit=False)}
                for run in UNPREFETCHED],
            "composed": [run_case(case) for case in COMPOSED]}


@pytest.fixture(scope="module")
def launched() -> list[dict[str, list[dict[str, Any]]]]:
    """One 4-process launch (pp2 × dp2) running every configuration."""
    return launch(_every_run, 4, timeout=60, join_timeout=900)


@pytest.fixture(scope="module")
def per_rank(launched: list[dict[str, list[dict[str, Any]]]]) -> list[list[dict[str, Any]]]:
    return [outcome["hf"] + outcome["unprefetched"] for outcome in launched]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero_2_and_3_compose_with_adam_clipping_tied_layers_and_schedules(
        launched: list[dict[str, list[dict[str, Any]]]]) -> None:
    for outcome in launched:
        for result in outcome["composed"]:
            case = next(c for c in COMPOSED if c.name == result["case"])
            for what in ("loss", "grad", "param", "norm"):
                assert result.get(what, 0.0) < 2e-5, (case.name, what, result.get(what))
            if "gradient_clipping" in case.engine:
                assert result["clipped"], f"{case.name}: the clipping threshold never bit"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_loss_gradients_and_weights_equal_hf(per_rank: list[list[dict[str, Any]]]) -> None:
    for rank, results in enumerate(per_rank):
        for result in results:
            for what in ("loss", "grad", "param"):
                assert result[what] < TOLERANCE, (rank, result["run"], what, result[what])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gradients_held_after_the_step_are_the_shard(per_rank: list[list[dict[str, Any]]]
                                                     ) -> None:
    """Counted exactly: the reduced (k, s) shards (fp32) and nothing else: no bucket buffer
    alive, no `.grad` on a model parameter, and d shards make the whole padded regions."""
    for results in per_rank:
        for result in results:
            assert result["model_grads"] == 0, result["run"]
            assert result["grad_bytes"] == result["shard_bytes"], result["run"]
            assert result["shard_bytes"] * result["dp"] == result["whole_bytes"], result["run"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero3_frees_layers_and_reshard_after_forward_trades_gathers_for_memory(
        launched: list[dict[str, list[dict[str, Any]]]]) -> None:
    """Gathers and the most layers gathered at once in the first step (m = 4 microbatches):
    prefetching the next layer keeps one more gathered, never adds a gather."""
    for outcome in launched:
        by_run = {result["run"]: result for result in outcome["hf"]}
        alone = {result["run"]: result for result in outcome["unprefetched"]}
        assert by_run[(3, "1f1b", 1, True)]["units"] >= 3  # several layers per stage
        for run, result in [*by_run.items(), *alone.items()]:
            if run[0] != 3:
                continue
            assert result["unit_storage_bytes"] == 0, run  # after the step: shards only
            assert result["gathered_bytes"] == 0, run
        m = 4
        for runs, extra in ((by_run, 1), (alone, 0)):  # prefetched: one more layer gathered
            for run, result in runs.items():
                units = result.get("units", 0)
                if run[0] != 3:
                    continue
                if run[3] and run[1] != "zb-v":  # one layer at a time for each F and B
                    assert result["step_peak"] == 1 + extra, run
                    assert result["step_gathers"] == 2 * m * units, run
                elif run[3]:  # ZB-V: I leaves its last layer gathered until that stage's W
                    assert result["step_peak"] <= 2 + extra and (
                        2 * m * units <= result["step_gathers"] <= 3 * m * units), run
                else:  # every layer gathered once, kept until the step
                    assert result["step_gathers"] == units == result["step_peak"], run
        for run, result in alone.items():  # prefetching moves gathers earlier, adds none
            assert result["step_gathers"] == by_run[run]["step_gathers"], run
        for schedule, chunks in (("1f1b", 1), ("zb-v", 2)):
            resharded = by_run[(3, schedule, chunks, True)]["step_gathers"]
            kept = by_run[(3, schedule, chunks, False)]["step_gathers"]
            assert resharded > kept, (schedule, resharded, kept)


@pytest.mark.parametrize("options, match", [
    ({"zero_stage": 4}, "GRADIENTS=2, PARAMETERS=3"),
    ({"zero_stage": 3, "overlap_param_gather": True}, "overlap_param_gather"),
    ({"zero_stage": 3, "reshard_after_forward": 1}, "reshard_after_forward"),
    ({"zero_stage": 0, "precision": "bf16", "half_parameters": True}, "zero_stage=1, 2 or 3"),
])
def test_what_zero_2_and_3_do_not_run_with_is_refused(options: dict[str, Any],
                                                      match: str) -> None:
    with pytest.raises(PipelineConfigError, match=match):
        ParallelConfig(**options)


def test_zero_stages_2_and_3_are_accepted() -> None:
    assert ParallelConfig(zero_stage=2).zero_stage is ZeroStage.GRADIENTS
    assert ParallelConfig(zero_stage=3, precision="bf16", half_parameters=True).zero_stage \
        is ZeroStage.PARAMETERS
    assert ParallelConfig(zero_stage=3, reshard_after_forward=False).zero_stage \
        is ZeroStage.PARAMETERS
