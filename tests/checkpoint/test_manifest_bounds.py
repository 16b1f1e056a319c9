"""An edited (unsigned) manifest cannot make a load allocate or loop without bound: every number
in it is checked against the files it lists first, and a refusal names the field and value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.checkpoint.atomic_files import sha256_bytes
from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.manifest import MANIFEST, SavedSplit, parse_manifest
from pipeline.checkpoint.root_lock import release_root
from pipeline.checkpoint.save import save_checkpoint
from pipeline.errors import CheckpointError
from tests.support.checkpoint_cases import Job

_REPO = str(Path(__file__).resolve().parents[2])
_MEMORY_LIMIT = 3 << 30  # a load of a 16-layer MLP needs a few hundred MB


def _saved(root: Path) -> Path:
    job = Job()
    job.train(1)
    try:
        return Path(save_checkpoint(str(root), job.parts()).directory)
    finally:
        release_root(str(root))


def edit_manifest(step_dir: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply `change` to the manifest and recompute its checksum (no key: it is unsigned)."""
    path = step_dir / MANIFEST
    document = json.loads(path.read_bytes())
    del document["checksum"]
    change(document)
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
    document["checksum"] = sha256_bytes(canonical.encode())
    path.write_text(json.dumps(document, sort_keys=True, indent=1))


def _split(**fields: Any) -> dict[str, Any]:
    return {"layer": 0, "name": "weight", "axis": "tp", "dim": 0, "blocks": [16], "size": 1,
            **fields}


def _add_splits(*splits: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda document: document["splits"].extend(splits)


def _topology(pp: int, dp: int, tp: int) -> Callable[[dict[str, Any]], None]:
    return lambda document: document.update(topology=[pp, dp, tp], world_size=pp * dp * tp)


EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "split size 10^9": (_add_splits(_split(size=10 ** 9)),
                        r"splits\[0\] \(layer 0 'weight'\): size=1000000000 is not the saved "
                        r"tp=1"),
    "10^6 zero blocks": (_add_splits(_split(blocks=[0] * 10 ** 6)),
                         r"splits\[0\] .*blocks holds a 0"),
    "10^6 blocks of one": (_add_splits(_split(blocks=[1] * 10 ** 6)),
                           r"blocks sum to 1,000,000 elements, more than the 2,021 bytes"),
    "a split given twice": (_add_splits(_split(), _split()),
                            r"splits\[1\] \(layer 0 'weight'\) is given twice"),
    "a split of a layer that does not exist": (
        _add_splits(_split(layer=99)), r"layer=99 is not a layer with weights"),
    "a split of a parameter-free layer": (
        _add_splits(_split(layer=1)), r"layer=1 is not a layer with weights"),
    "a split of a parameter that does not exist": (
        _add_splits(_split(name="nope")), r"split of layer 0 names 'nope', which is not a "
                                          r"parameter of that layer"),
    "a split with dim 10^9": (_add_splits(_split(dim=10 ** 9)), r"dim=1000000000 is not below"),
    "topology edited to tp 2": (_topology(1, 1, 2),
                                r"topology=\[1, 1, 2\] \(world_size 2\) does not match the "
                                r"files listed: rank 1's rng_rank_0001.pt"),
    "topology edited to pp 10^6": (_topology(10 ** 6, 1, 1),
                                   r"topology=\[1000000, 1, 1\] .*rank 1's rng_rank_0001.pt"),
    "ep edited to 10^9": (lambda document: document.update(ep=10 ** 9),
                          r"ep=1000000000 does not divide dp=1"),
    "version true (== 1 in Python; found by the fuzz)": (
        lambda document: document.update(version=True), r"version True; this pipesched reads"),
}

_UNBOUNDED_BEFORE = {"split size 10^9", "10^6 zero blocks", "10^6 blocks of one"}
"""Edits that allocated or looped without bound: loaded in a limited subprocess."""


def _load_in_subprocess(step_dir: Path, message: str) -> subprocess.CompletedProcess[str]:
    """Load under an address-space limit and a timeout: an unbounded allocation is a
    MemoryError there, not a machine swapping."""
    script = textwrap.dedent(f"""
        import re, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({_MEMORY_LIMIT}, {_MEMORY_LIMIT}))
        from pipeline.checkpoint.load import load_checkpoint
        from pipeline.errors import CheckpointError
        from tests.support.checkpoint_cases import Job
        try:
            load_checkpoint({str(step_dir)!r}, Job(base_seed=3).parts())
        except CheckpointError as error:
            print("REFUSED", error)
            sys.exit(0 if re.search({message!r}, str(error)) else 5)
        print("LOADED")
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=_REPO, env={**os.environ, "PYTHONPATH": _REPO})


@pytest.mark.parametrize("case", sorted(EDITS))
def test_an_edited_manifest_is_refused_by_field_and_value_within_bounds(
        tmp_path: Path, case: str) -> None:
    # regression: a split size of 10^9 built a list of 10^9 slices per rank (a bare
    # MemoryError), 10^6 zero blocks looped for over 10 minutes, a duplicated split silently
    # kept the last, an edited topology said only "a file is missing"
    step_dir = _saved(tmp_path)
    change, message = EDITS[case]
    edit_manifest(step_dir, change)
    if case in _UNBOUNDED_BEFORE:
        try:
            done = _load_in_subprocess(step_dir, message)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{case}: the load ran past 120 s")
        assert done.returncode == 0, f"{case}: {done.stderr[-2000:]}"
        assert done.stdout.startswith("REFUSED"), done.stdout
        assert "is not a valid manifest" in done.stdout
        return
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(str(step_dir), Job(base_seed=3).parts())


def test_blocks_that_pass_the_manifest_but_not_the_saved_tensors_are_refused() -> None:
    import torch

    from pipeline.checkpoint.reshard import _recut
    split = SavedSplit(0, "weight", "tp", 0, (1,) * 7, 2)
    parts = [torch.zeros(4, 3), torch.zeros(4, 3)]
    with pytest.raises(CheckpointError, match=r"7 blocks summing to 7.*8 along that dim"):
        _recut(split, parts, None, "layer 0 'weight'", "here")


def test_the_bounds_pass_every_checkpoint_a_save_writes(tmp_path: Path) -> None:
    step_dir = _saved(tmp_path)
    parse_manifest((step_dir / MANIFEST).read_bytes())  # no problem raised
    assert load_checkpoint(str(step_dir), Job(base_seed=3).parts()).step == 1
