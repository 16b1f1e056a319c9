"""The manifest fuzz (`benchmarks/fuzz_manifests.py`), bounded: every 9th field × value case
and every CLI mistake, each in a forked child under a memory limit and a timeout."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_manifests.py"


@pytest.mark.slow
def test_a_sample_of_the_manifest_fuzz_has_no_hang_traceback_or_unbounded_allocation(
) -> None:
    spec = importlib.util.spec_from_file_location("fuzz_manifests", _SCRIPT)
    assert spec is not None and spec.loader is not None
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    tally = fuzz.fuzz(every=9, show=False)
    assert sum(tally.values()) > 40, tally
    bad = {kind: count for kind, count in tally.items()
           if kind.split()[-1] in ("hang", "traceback", "unbounded")}
    assert not bad, tally
    assert tally["refused"] > tally["accepted"], tally  # the edits reach the checks
