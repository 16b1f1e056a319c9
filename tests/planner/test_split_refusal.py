"""Issue 48's defect: `--engine megatron-core` refused a Llama-3-405B shape (126 blocks)
blaming memory, when its even layer split was the cause (126 over p stages leaves p 1, 2 on
1,024 devices). The refusal names the split, with a configuration only the split refuses."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

import pipeline.planner.search as search
from pipeline.planner import PRESETS, PlanError, SearchOptions, load_model, plan
from pipeline.planner.engines import engine_options

__all__: list[str] = []

GIB = 2**30
LLAMA_405B = ("layers=126,hidden=16384,heads=128,kv_heads=8,vocab=128256,seq=8192,mlp=swiglu,"
              "norm=rmsnorm,bias=none,learned_positions=false,ffn=53248")
CLUSTER = replace(PRESETS["h100-80g"], nodes=128)
FAST = {"schedules": ("1f1b",), "recompute_choices": ("full",)}


def _megatron_core(**given: object) -> SearchOptions:
    return SearchOptions(**(engine_options("megatron-core") | FAST | given))


def test_megatron_core_refusal_of_405b_names_the_even_layer_split() -> None:
    with pytest.raises(PlanError) as caught:
        plan(load_model(LLAMA_405B), CLUSTER, 1024, options=_megatron_core())
    text = str(caught.value)
    assert "even layer split, not the model's size" in text
    assert "126 blocks" in text and "leaves pipeline sizes 1, 2" in text
    named = re.search(r"while (pp(\d+) tp\d+ dp\d+ \S+ b\d+ m\d+ z\d+ ?\S*), refused only",
                      text)
    assert named is not None, text
    needed = float(re.search(r"would need ([\d.]+) GiB", text).group(1))  # type: ignore[union-attr]
    assert needed * GIB <= CLUSTER.device_memory
    # the configuration it names is one the balanced split runs within the device
    pp = int(named.group(2))
    assert 126 % pp
    free = plan(load_model(LLAMA_405B), CLUSTER, 1024, options=_megatron_core(
        uniform_layers=False, pipeline_parallel=(pp,)))
    assert free.best.memory.total <= CLUSTER.device_memory
    # and the same shape with 128 blocks, which the split accepts, is planned
    assert plan(load_model(LLAMA_405B.replace("126", "128")), CLUSTER, 1024,
                options=_megatron_core()).best.config.pp > 2


def test_a_model_too_large_for_any_split_is_still_refused_for_its_memory() -> None:
    # 8 devices: even the split the engine refuses would not fit, so memory is the cause
    small = replace(PRESETS["h100-80g"], nodes=1)
    with pytest.raises(PlanError) as caught:
        plan(load_model(LLAMA_405B), small, 8, options=_megatron_core())
    assert "even layer split" not in str(caught.value)
    assert "does not fit" in str(caught.value)


def test_split_refusal_catches_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    # planted: the split's check skipped (the refusal before the fix): memory is blamed
    monkeypatch.setattr(search, "_refuse_for_split", lambda *args: None)
    with pytest.raises(PlanError) as caught:
        plan(load_model(LLAMA_405B), CLUSTER, 1024, options=_megatron_core())
    assert "even layer split" not in str(caught.value)
