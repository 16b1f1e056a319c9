"""Fuzz checkpoint manifests (every field × hostile values) and a handful of CLI mistakes.

A real checkpoint (the 16-layer MLP with Adam of `tests.support.checkpoint_cases.Job`, plus
one recorded split so the split fields are reached) is saved once; each case edits one field
of its manifest, recomputes the checksum (an unsigned manifest is one checksum away from any
edit) and, in a forked child (torch imported once) under an address-space limit of its size
+ 2 GiB and a timeout, loads it into a fresh job and runs `pipesched verify-checkpoint` on
it. Values: negative, zero, huge (10^9, 2^63), a float, a string, null, a bool, an empty
list and object, a list of 10^6 entries, the key missing, the key given twice. Each case is
classed as

- refused: a `CheckpointError` (load) and exit 2 without a traceback (verify-checkpoint);
- accepted: loaded and verified (the edit did not matter, e.g. the schedule's name);
- hang: past the timeout; traceback: any other exception or exit code; unbounded: a
  MemoryError or a child killed for memory.

The CLI mistakes run `python -m pipeline.cli` in a subprocess under the same limits: clean
is exit 0, 2 or 3 without a traceback.

    python benchmarks/fuzz_manifests.py             # every case, the tally at the end
    python benchmarks/fuzz_manifests.py --every 9   # every 9th manifest case (the slow test)
    python benchmarks/fuzz_manifests.py --only splits.0.size   # one field
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

__all__ = ["cli_cases", "fuzz", "manifest_cases"]

_HEADROOM = 2 << 30
_TIMEOUT = 60.0
_VALUES: dict[str, Any] = {
    "negative": -1, "zero": 0, "huge": 10 ** 9, "2^63": 2 ** 63, "float": 1.5,
    "string": "x", "null": None, "bool": True, "empty list": [], "empty object": {},
    "10^6 zeros": [0] * 10 ** 6}
_DUPLICATE = "@@duplicate@@"
Edit = Callable[[dict[str, Any]], None]


def _set(path: tuple[str | int, ...], value: Any) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        target: Any = document
        for key in path[:-1]:
            target = target[key]
        if value is _MISSING:
            del target[path[-1]]
        elif value is _DUPLICATE_KEY:
            target[_DUPLICATE + str(path[-1])] = target[path[-1]]
        else:
            target[path[-1]] = copy.deepcopy(value)
    return edit


_MISSING, _DUPLICATE_KEY = object(), object()


def manifest_cases(document: dict[str, Any]) -> list[tuple[str, Edit]]:
    """(name, edit) of every field of `document` (top level, files[0], splits[0]) × value,
    missing and given twice; and each record duplicated."""
    paths: list[tuple[str | int, ...]] = [(key,) for key in sorted(document)
                                          if key != "checksum"]
    paths += [("files", 0, key) for key in sorted(document["files"][0])]
    paths += [("splits", 0, key) for key in sorted(document["splits"][0])]
    cases = []
    for path in paths:
        shown = ".".join(str(part) for part in path)
        cases += [(f"{shown} = {name}", _set(path, value)) for name, value in _VALUES.items()]
        cases += [(f"{shown} missing", _set(path, _MISSING)),
                  (f"{shown} given twice", _set(path, _DUPLICATE_KEY))]
    for field in ("files", "splits"):
        cases.append((f"{field}[0] listed twice",
                      lambda d, f=field: d[f].append(copy.deepcopy(d[f][0]))))
        cases.append((f"{field}[0] listed 10^5 times",
                      lambda d, f=field: d[f].extend([d[f][0]] * 10 ** 5)))
    return cases


def _write(step_dir: Path, document: dict[str, Any]) -> None:
    """The manifest with its checksum recomputed; a key given twice written as JSON text
    (`"step": 1, "step": 1`: a dict cannot hold it, the reader must refuse it)."""
    from pipeline.checkpoint.atomic_files import sha256_bytes

    body = {key: value for key, value in document.items() if key != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = sha256_bytes(canonical.encode())
    text = json.dumps(body, sort_keys=True, indent=1).replace(f'"{_DUPLICATE}', '"')
    (step_dir / "manifest.json").write_text(text)


def _base(root: Path) -> tuple[Path, dict[str, Any]]:
    """A saved checkpoint with one recorded split (layer 0's weight, whole: tp 1)."""
    from pipeline.checkpoint.root_lock import release_root
    from pipeline.checkpoint.save import save_checkpoint
    from tests.support.checkpoint_cases import Job

    job = Job()
    job.train(1)
    step_dir = Path(save_checkpoint(str(root), job.parts()).directory)
    release_root(str(root))
    document = json.loads((step_dir / "manifest.json").read_bytes())
    rows = dict(job.module.named_layer_parameters())[(0, "weight")].shape[0]
    document["splits"] = [{"layer": 0, "name": "weight", "axis": "tp", "dim": 0,
                           "blocks": [rows], "size": 1}]
    return step_dir, document


def _child(step_dir: Path) -> str:
    """In the forked child: load, then verify-checkpoint; the verdict."""
    import contextlib
    import io

    from pipeline.checkpoint.load import load_checkpoint
    from pipeline.cli import main
    from pipeline.errors import CheckpointError
    from tests.support.checkpoint_cases import Job

    try:
        load_checkpoint(str(step_dir), Job(base_seed=3).parts())
        loaded = True
    except CheckpointError:
        loaded = False
    errors = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
        code = main(["verify-checkpoint", str(step_dir)])
    if code not in (0, 2) or "Traceback" in errors.getvalue():
        return f"traceback: verify-checkpoint exit {code}"
    return "accepted" if loaded and code == 0 else "refused"


def _limit_memory() -> None:
    with open("/proc/self/status") as handle:
        size = next(int(line.split()[1]) << 10 for line in handle if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (size + _HEADROOM, size + _HEADROOM))


def _run_forked(step_dir: Path) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        try:
            _limit_memory()
            verdict = _child(step_dir)
        except MemoryError:
            verdict = "unbounded: MemoryError"
        except BaseException as error:  # classed, not raised: the fuzz goes on
            verdict = f"traceback: {type(error).__name__}: {str(error)[:200]}"
        os.write(write, verdict.encode()[:4000])
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + _TIMEOUT
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            with os.fdopen(read, "rb") as handle:
                verdict = handle.read().decode()
            if not verdict:
                signalled = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
                return "unbounded: killed" if signalled else f"traceback: status {status}"
            return verdict
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(read)
    return "hang"


def cli_cases(scratch: Path, step_dir: Path) -> list[tuple[str, list[str]]]:
    """A handful of command-line mistakes a user makes."""
    fifo = scratch / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    out = ["--out", str(scratch / "out")]
    return [
        ("verify-checkpoint of nothing", ["verify-checkpoint", str(scratch / "absent")]),
        ("verify-checkpoint of a FIFO", ["verify-checkpoint", str(fifo)]),
        ("verify-checkpoint of a file", ["verify-checkpoint", str(step_dir / "manifest.json")]),
        ("verify-checkpoint without a path", ["verify-checkpoint"]),
        ("a misspelt command", ["trian", "--steps", "2"]),
        ("train --steps 0", ["train", "--steps", "0", *out]),
        ("train --stages 0", ["train", "--stages", "0", *out]),
        ("train --tp 3 on 2 blocks", ["train", "--tp", "3", "--blocks", "2", *out]),
        ("train --batch-size 5 over 2 microbatches",
         ["train", "--batch-size", "5", "--microbatches", "2", *out]),
        ("train --out under a file", ["train", "--out", str(step_dir / "manifest.json" / "x")]),
        ("schedule with 10^13 microbatches",
         ["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", str(10 ** 13)]),
    ]


def _run_cli(arguments: list[str]) -> str:
    try:
        done = subprocess.run([sys.executable, "-m", "pipeline.cli", *arguments], cwd=_REPO,
                              capture_output=True, text=True, timeout=120,
                              preexec_fn=_limit_memory, check=False,
                              env={**os.environ, "PYTHONPATH": str(_REPO)})
    except subprocess.TimeoutExpired:
        return "hang"
    if "MemoryError" in done.stderr:
        return "unbounded: MemoryError"
    if done.returncode not in (0, 2, 3) or "Traceback" in done.stderr:
        return f"traceback: exit {done.returncode}: {done.stderr.strip()[-200:]}"
    return "clean" if done.returncode else "accepted"


def fuzz(every: int = 1, *, only: str = "", show: bool = True) -> Counter[str]:
    """Run every `every`-th manifest case (whose name holds `only`) and every CLI case; the
    tally by verdict kind."""
    import torch

    torch.set_num_threads(1)  # a forked child must not wait on the parent's thread pool
    tally: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as scratch:
        step_dir, document = _base(Path(scratch) / "ckpt")
        cases = [case for case in manifest_cases(document) if only in case[0]][::every]
        for name, edit in cases:
            edited = copy.deepcopy(document)
            edit(edited)
            _write(step_dir, edited)
            verdict = _run_forked(step_dir)
            tally[verdict.split(":")[0]] += 1
            if show and verdict != "refused":
                print(f"  {name}: {verdict}")
        _write(step_dir, document)
        for name, arguments in cli_cases(Path(scratch), step_dir):
            verdict = _run_cli(arguments)
            tally["cli " + verdict.split(":")[0]] += 1
            if show and verdict not in ("clean", "accepted"):
                print(f"  CLI {name}: {verdict}")
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=1, help="run every N-th manifest case")
    parser.add_argument("--only", default="", help="only manifest cases whose name holds this")
    args = parser.parse_args()
    started = time.monotonic()
    tally = fuzz(max(1, args.every), only=args.only)
    manifest = sum(count for kind, count in tally.items() if not kind.startswith("cli"))
    cli = sum(count for kind, count in tally.items() if kind.startswith("cli"))
    print(f"manifest cases: {manifest} tried, {tally['refused']} refused, "
          f"{tally['accepted']} accepted, {tally['hang']} hangs, {tally['traceback']} "
          f"tracebacks, {tally['unbounded']} unbounded allocations")
    print(f"CLI mistakes: {cli} tried, {tally['cli clean']} clean, {tally['cli accepted']} "
          f"accepted, {tally['cli hang']} hangs, {tally['cli traceback']} tracebacks, "
          f"{tally['cli unbounded']} unbounded allocations")
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
