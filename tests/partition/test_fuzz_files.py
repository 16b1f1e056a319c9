"""Fuzz the JSON readers: the cost file (`graph_from_json`, as parsed documents and as raw
bytes on disk) and the checkpoint manifest (raw bytes, and valid manifests with one field
replaced and the checksum recomputed so the schema check itself is exercised), and the
`latest` pointer. Nothing escapes but our typed errors; nothing hangs."""

from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partition import PartitionError, graph_from_json, partition_graph
from pipeline.checkpoint.atomic_files import sha256_bytes
from pipeline.checkpoint.manifest import (
    FileEntry,
    Manifest,
    dump_manifest,
    parse_manifest,
    resolve_checkpoint,
)
from pipeline.errors import CheckpointError
from tests.support.fuzz_counts import COUNTS, FUZZ_EXAMPLES

_FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=timedelta(seconds=5),
                 suppress_health_check=list(HealthCheck))

_KEYS = ["layers", "edges", "bandwidth", "name", "forward", "backward", "params", "activation",
         "type", "extra_memory", "format", "version", "step", "files", "path", "sha256", "size",
         "role", "rank", "topology", "checksum", "x"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.sampled_from(_KEYS), inner,
                                                                 max_size=6),
    max_leaves=25)
_NUMBER = st.one_of(st.floats(), st.integers(-5, 10**30), st.none(), st.text(max_size=3))
layers = st.fixed_dictionaries({"forward": _NUMBER}, optional={
    "name": st.one_of(st.sampled_from(["a", "b", "c"]), st.integers()), "params": _NUMBER,
    "backward": _NUMBER, "activation": _NUMBER, "type": st.text(max_size=4), "bogus": _NUMBER})
edges = st.lists(st.one_of(st.integers(-1, 6), st.sampled_from(["a", "b"]), st.floats()),
                 min_size=2, max_size=4)
cost_documents = st.one_of(
    st.fixed_dictionaries({"layers": st.lists(layers, max_size=6)},
                          optional={"edges": st.lists(edges, max_size=6), "bandwidth": _NUMBER}),
    st.dictionaries(st.sampled_from(["layers", "edges", "bandwidth", "x"]), json_values))


@_FUZZ
@given(cost_documents, st.integers(1, 4))
def test_fuzz_cost_json_documents(document: dict[str, Any], stages: int) -> None:
    COUNTS["graph_from_json (documents)"] += 1
    try:
        partition_graph(graph_from_json(document), stages)
    except PartitionError:
        pass


@settings(_FUZZ, max_examples=FUZZ_EXAMPLES // 2)
@given(st.one_of(st.binary(max_size=300),
                 cost_documents.map(lambda d: json.dumps(d).encode()),
                 st.integers(1, 3000).map(lambda depth: b"[" * depth + b"]" * depth)))
def test_fuzz_cost_json_bytes(data: bytes) -> None:
    COUNTS["graph_from_json (file bytes)"] += 1
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "costs.json")
        with open(path, "wb") as handle:
            handle.write(data)
        try:
            graph_from_json(path)
        except PartitionError:
            pass


_VALID = Manifest(
    step=7, world_size=2, topology=(2, 1, 1), num_layers=4, boundaries=(0, 2, 4),
    schedule="1f1b", num_microbatches=4, optimizer="torch", optimizer_class="Adam",
    loss_scaler={"scale": 65536.0, "clean_steps": 3.0, "skipped_steps": 0.0},
    files=(FileEntry("layer_00-model_states.pt", "a" * 64, 10, "layer", 0, (0,)),
           FileEntry("optim_rank_0001.pt", "b" * 64, 20, "optimizer", 1, (2, 3))))


def _with_checksum(document: dict[str, Any]) -> bytes:
    document.pop("checksum", None)
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
    document["checksum"] = sha256_bytes(canonical.encode())
    return json.dumps(document).encode()


def _mutate(key: str, index: int, value: Any, in_file: bool, delete: bool) -> bytes:
    document = json.loads(dump_manifest(_VALID))
    target = document["files"][index % 2] if in_file else document
    if delete:
        target.pop(key, None)
    else:
        target[key] = value
    return _with_checksum(document)


mutated_manifests = st.builds(_mutate, st.sampled_from(
    ["step", "world_size", "topology", "num_layers", "boundaries", "schedule", "optimizer",
     "optimizer_class", "loss_scaler", "files", "path", "sha256", "size", "role", "rank",
     "layers", "format", "version"]), st.integers(0, 1), json_values, st.booleans(),
    st.booleans())


@_FUZZ
@given(st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode()),
                 mutated_manifests))
def test_fuzz_manifest(data: bytes) -> None:
    COUNTS["manifest reader"] += 1
    try:
        manifest = parse_manifest(data, where="fuzz/manifest.json")
    except CheckpointError as error:
        assert "fuzz/manifest.json" in str(error)  # the refusal names the file
        return
    # anything accepted is consistent enough to load from
    assert manifest.world_size == math.prod(manifest.topology)
    assert all("/" not in entry.path and entry.size >= 0 for entry in manifest.files)


@settings(_FUZZ, max_examples=FUZZ_EXAMPLES // 2)
@given(st.binary(max_size=80), st.booleans())
def test_fuzz_latest_pointer(data: bytes, make_target: bool) -> None:
    COUNTS["latest pointer"] += 1
    with tempfile.TemporaryDirectory() as root:
        with open(os.path.join(root, "latest"), "wb") as handle:
            handle.write(data)
        if make_target:
            os.mkdir(os.path.join(root, "step_000001"))
        try:
            step_dir = resolve_checkpoint(root)
        except CheckpointError:
            return
        assert os.path.dirname(step_dir) == root  # never outside the checkpoint root
