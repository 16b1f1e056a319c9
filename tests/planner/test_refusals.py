"""Every refusal of the planner, fed a case that reaches it: its message names the binding
constraint with its figures. The oracle is each case's own construction (the figures written
here from the definition); the two messages issue 33 quoted as wrong are regression cases."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from pipeline.cli import main
from pipeline.planner import (
    PRESETS,
    PlanConfig,
    PlanError,
    SearchOptions,
    load_model,
    plan,
    profile_from_cost_json,
)
from pipeline.planner.engines import engine_options
from pipeline.planner.limits import check_plan_work
from pipeline.planner.search import price

__all__: list[str] = []

GIB = 2**30
SMALL = load_model("layers=8,hidden=512,heads=8,vocab=1000,seq=256")
A100 = PRESETS["a100-80g"]
ONE = PlanConfig(pp=2, tp=1, dp=4, schedule="1f1b", chunks=1, microbatch_size=1,
                 num_microbatches=4, zero_stage=0, recompute="none")


def _plan(model_text: str, nodes: int, batch: int, **options: object) -> Callable[[], object]:
    cluster = replace(A100, nodes=nodes)
    return lambda: plan(load_model(model_text), cluster, batch, options=SearchOptions(**options))


def test_issue_33_memory_names_the_schedules_peak_not_the_floor() -> None:
    # tp 8 · pp 16 on 128 A100s, no recomputation, s = 16384: 64 layers / 16 stages = 4
    # blocks a stage; 1F1B's first rank holds 16 microbatches of them: 16 · 4 · s·h·(34 +
    # ...)/8 bytes ≈ 104 GiB. The old message named the one-microbatch floor ("needs at
    # least 15.3 GiB per device; use devices with at least that much") on 79 GiB devices.
    case = _plan("layers=64,hidden=8192,heads=64,vocab=51200,seq=16384", 16, 512,
                 tensor_parallel=(8,), pipeline_parallel=(16,), recompute_choices=("none",))
    with pytest.raises(PlanError) as caught:
        case()
    message = str(caught.value)
    assert "at its schedule's peak" in message and "> 79.3 GiB" in message
    needed = float(message.split("needs ")[1].split(" GiB")[0])
    assert needed > 79.3  # the figure named is over the device, unlike the floor
    assert "activations are the largest part" in message
    assert "allow recomputation" in message
    assert "use devices with at least that much" not in message


def test_issue_33_megatron_even_split_is_named_not_the_global_batch() -> None:
    # 70 blocks on 384 devices: pp must divide 70 and 384/tp, so pp ∈ {1, 2}, leaving dp =
    # 384/(tp·pp) ∈ {24, 48, 96, 192, 384}, each a multiple of 3, none dividing 2048. The old
    # message asked for "a global batch divisible by 1 or 2", which 2048 is.
    options = engine_options("megatron-2021")
    case = _plan("layers=70,hidden=8192,heads=64,vocab=51200,seq=2048", 48, 2048, **options)
    with pytest.raises(PlanError) as caught:
        case()
    message = str(caught.value)
    assert "splits the 70 blocks evenly" in message
    assert "only 1, 2 divide it" in message
    assert "data-parallel sizes 24, 48, 96, 192, 384, none of which divides the global " \
           "batch 2048" in message
    assert "divisible by 1 or 2" not in message


# (case, words the message must hold): one per refusal path of the planner
CASES: list[tuple[str, Callable[[], object], list[str]]] = [
    ("batch not a whole number", lambda: plan(SMALL, A100, 0), ["global batch 0"]),
    ("tp on measured layers", lambda: plan(profile_from_cost_json(
        {"layers": [{"forward": 1.0, "params": 4}] * 2}), A100, 8,
        options=SearchOptions(tensor_parallel=(2,))), ["measured or cost-file layers"]),
    ("tp does not divide heads", _plan("layers=4,hidden=768,heads=12,vocab=100,seq=64", 1,
                                       8, tensor_parallel=(8,)),
     ["tensor-parallel size 8", "12 attention heads", "use one of 1, 2, 4"]),
    ("tp does not divide kv heads", _plan("layers=4,hidden=1024,heads=16,kv_heads=2,"
                                          "vocab=100,seq=64", 1, 8, tensor_parallel=(4,)),
     ["tensor-parallel size 4", "2 key/value heads"]),
    ("pp does not divide devices", lambda: plan(SMALL, A100, 8, options=SearchOptions(
        pipeline_parallel=(3,))), ["pipeline-parallel size 3", "8 devices"]),
    ("dp does not divide the batch", lambda: plan(SMALL, A100, 6, options=SearchOptions(
        data_parallel=(4,))), ["data-parallel size 4", "global batch 6"]),
    ("no dp divides the batch", lambda: plan(profile_from_cost_json(
        {"layers": [{"forward": 1.0, "params": 4}]}), replace(A100, devices_per_node=3), 7),
     ["(devices / (tp · pp): 3)", "global batch 7", "none do"]),
    ("the floor is over memory", lambda: plan(
        load_model("layers=96,hidden=12288,heads=96,vocab=51200,seq=2048"),
        replace(A100, nodes=1, device_memory=10 * GIB), 8, options=SearchOptions(
            recompute=False, zero_stages=(0,))),
     ["even holding one microbatch per stage", "> 10.0 GiB", "model's state",
      "allow ZeRO-1"]),
    ("every fitting one refused by its schedule", lambda: plan(
        SMALL, replace(A100, devices_per_node=2), 2, options=SearchOptions(
            schedules=("dualpipev",), pipeline_parallel=(2,))),
     ["refused by its schedule", "dualpipev"]),
    ("filters exclude everything", lambda: plan(SMALL, A100, 8, options=SearchOptions(
        microbatch_sizes=(16,))), ["the filters microbatch_sizes"]),
    ("the engine's interleaving rule", lambda: plan(SMALL, replace(A100, devices_per_node=2),
                                                    2, options=SearchOptions(**engine_options(
                                                        "megatron-2021",
                                                        schedules=("interleaved",)),
                                                        pipeline_parallel=(2,))),
     ["interleaves only at p >= 3"]),
    ("price: devices", lambda: price(SMALL, replace(A100, devices_per_node=4), 16, ONE),
     ["uses 8 devices", "has 4"]),
    ("price: batch", lambda: price(SMALL, A100, 32, ONE), ["dp · b · m = 16", "32"]),
    ("price: stages over layers", lambda: price(
        load_model("layers=1,hidden=64,heads=2,vocab=10,seq=8"), A100, 16,
        replace(ONE, schedule="interleaved", chunks=2)), ["4 stages need as many layers"]),
    ("price: even split", lambda: price(
        load_model("layers=7,hidden=64,heads=2,vocab=10,seq=8"), A100, 16, ONE,
        options=SearchOptions(**engine_options("megatron-2021"))),
     ["p·v = 2 must divide the 7 blocks"]),
    ("price: outside the engine", lambda: price(SMALL, A100, 16, replace(ONE, zero_stage=1),
                                                options=SearchOptions(**engine_options(
                                                    "megatron-2021"))), ["ZeRO stage 1"]),
    ("price: the schedule refuses", lambda: price(SMALL, replace(A100, devices_per_node=2),
                                                  2, replace(ONE, dp=1, num_microbatches=2,
                                                             schedule="dualpipev", chunks=2)),
     ["schedule dualpipev refuses"]),
    ("an unknown engine", lambda: engine_options("torchtitan"), ["engine 'torchtitan'"]),
    ("a filter widening the engine", lambda: engine_options("megatron-2021",
                                                            zero_stages=(1,)),
     ["megatron-2021 cannot run zero_stages 1"]),
    ("work: layers", lambda: check_plan_work(10**6, 1, 8, (1,), 8, ("1f1b",), 1),
     ["1,000,000 layers"]),
    ("work: devices", lambda: check_plan_work(8, 10**6, 8, (1,), 8, ("1f1b",), 1),
     ["8,000,000 devices"]),
    ("work: global batch", lambda: check_plan_work(8, 1, 8, (1,), 2**31, ("1f1b",), 1),
     ["--global-batch 2,147,483,648"]),
]


@pytest.mark.parametrize(("case", "words"), [(run, words) for _, run, words in CASES],
                         ids=[name for name, _, _ in CASES])
def test_every_refusal_names_its_cause(case: Callable[[], object], words: list[str]) -> None:
    with pytest.raises(PlanError) as caught:
        case()
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


@pytest.mark.parametrize(("flags", "words"), [
    (["--context-parallel", "2", "--engine", "deepspeed"], "context parallelism"),
    (["--precision", "fp8"], "FP8"),
])
def test_features_outside_the_search_are_refused_plainly(
        flags: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "layers=4,hidden=256,heads=4,vocab=100,seq=64",
                 "--cluster", "a100-80g", "--global-batch", "8", *flags])
    error = capsys.readouterr().err
    assert code == 2
    assert f"{words} (" in error and "is outside pipesched plan's space" in error


@pytest.mark.parametrize(("flags", "words"), [
    (["--zero", "0,4"], "--zero 0,4: ZeRO stages are 0, 1, 2 and 3"),
    (["--fsdp", "--zero", "0,1"], "--fsdp is ZeRO-3, but --zero 0,1 leaves 3 out"),
])
def test_zero_stages_outside_0_to_3_are_refused_by_value(
        flags: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "layers=4,hidden=256,heads=4,vocab=100,seq=64",
                 "--cluster", "a100-80g", "--global-batch", "8", *flags])
    assert code == 2
    assert words in capsys.readouterr().err
