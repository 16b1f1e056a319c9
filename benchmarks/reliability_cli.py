"""Bad input on every `pipesched` subcommand: each argument list runs through the real
`pipeline.cli.main` in a worker process (torch imported once) under an 8 GiB address-space
limit and a per-input alarm, and is classed as the reliability report counts it:

- clean: exit 2 with one line naming the problem (or exit 0: the value was valid after all,
  and the command did its job with output);
- hang: still running when the alarm fired;
- traceback: an exception escaped `main` (exit 1 with a traceback);
- out of memory: a MemoryError;
- silent: any other ending (an exit code other than 0, 2, 3, or exit 0 with no output).

    python benchmarks/reliability_cli.py            # every input, a table and the tally
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["cli_inputs", "input_cases"]

Tally = tuple[int, int, int, int, int, int]
"""tried, clean, hang, traceback, out of memory, silent"""
_ADDRESS_SPACE = 8 * 2**30
_MARK = "@@verdict "
_COSTS = str(Path(__file__).resolve().parent / "costs" / "uniform16.json")
_SHAPE = "layers=4,hidden=64,heads=4,vocab=128,seq=32"
_NUMBERS = ("0", "-1", "1.5", "nan", "inf", "-inf", "1e308", "1e-308", "1000000000000",
            "9" * 5000, "abc", "", "0x10", "1e999")


def _files(root: Path) -> dict[str, str]:
    """Hostile paths: a FIFO, a device, a directory, nothing, huge, deep, binary, and
    JSON of the wrong shape."""
    root.mkdir(parents=True, exist_ok=True)
    fifo = root / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    huge = root / "huge.json"
    with open(huge, "wb") as handle:
        handle.truncate(200 << 20)
    (root / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    (root / "binary.json").write_bytes(bytes(range(256)) * 64)
    (root / "list.json").write_text("[1, 2, 3]")
    (root / "dup.json").write_text('{"layers": [], "layers": [{"forward": 1}]}')
    (root / "nan.json").write_text('{"layers": [{"forward": NaN, "backward": 1}]}')
    (root / "empty.json").write_text("")
    checkpoint = root / "ckpt"
    (checkpoint / "step_000001").mkdir(parents=True, exist_ok=True)
    if not (checkpoint / "latest").exists():
        os.mkfifo(checkpoint / "latest")
    return {"fifo": str(fifo), "device": "/dev/zero", "directory": str(root),
            "missing": str(root / "missing.json"), "huge": str(huge),
            "deep": str(root / "deep.json"), "binary": str(root / "binary.json"),
            "list": str(root / "list.json"), "dup": str(root / "dup.json"),
            "nan": str(root / "nan.json"), "empty": str(root / "empty.json"),
            "fifo-latest": str(checkpoint), "torn": str(checkpoint / "step_000001")}


def input_cases(root: Path) -> list[list[str]]:
    """At least 500 bad argument lists over every subcommand."""
    files = _files(root)
    out = str(root / "out")
    bases: dict[str, tuple[list[str], tuple[str, ...]]] = {
        "simulate": (["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"],
                     ("--stages", "--microbatches", "--chunks", "--memory-limit", "--forward",
                      "--backward", "--weight", "--comm", "--activation-bytes", "--overlap",
                      "--params-bytes", "--data-parallel", "--optimizer-factor")),
        "schedule": (["schedule", "--schedule", "interleaved", "--stages", "4",
                      "--microbatches", "8"], ("--stages", "--microbatches", "--chunks",
                                               "--memory-limit")),
        "compare": (["compare", "--stages", "4", "--microbatches", "8"],
                    ("--stages", "--microbatches", "--chunks", "--forward", "--comm",
                     "--overlap")),
        "partition": (["partition", "--costs", _COSTS, "--stages", "4"],
                      ("--stages", "--microbatches", "--memory-cap", "--speeds",
                       "--bandwidth", "--boundaries")),
        "simulate-overlap": (["simulate", "--schedule", "dualpipev-overlap", "--stages", "2",
                              "--microbatches", "4"], ("--overlap",)),
        "plan": (["plan", "--model", _SHAPE, "--cluster", "a100-80g", "--global-batch", "8"],
                 ("--global-batch", "--nodes", "--seq", "--cost-batch", "--top",
                  "--tensor-parallel")),
        "rehearse": (["rehearse", "--costs", _COSTS, "--schedule", "1f1b", "--stages", "2",
                      "--microbatches", "2", "--steps", "1", "--out", out],
                     ("--stages", "--microbatches", "--data-parallel", "--time-scale",
                      "--bytes-scale", "--steps", "--weight-fraction")),
        "train": (["train", "--stages", "2", "--microbatches", "2", "--steps", "1",
                   "--batch-size", "4", "--blocks", "2", "--out", out],
                  ("--stages", "--microbatches", "--data-parallel", "--steps", "--batch-size",
                   "--blocks", "--width", "--seq-len", "--timeout")),
    }
    cases: list[list[str]] = []
    for base, flags in bases.values():
        for flag in flags:
            cases.extend([*base, flag, value] for value in _NUMBERS)
    for path in files.values():
        cases.append(["partition", "--costs", path, "--stages", "2"])
        cases.append(["plan", "--model", path, "--cluster", "a100-80g", "--global-batch", "8"])
        cases.append(["plan", "--model", _SHAPE, "--cluster", path, "--global-batch", "8"])
        cases.append(["validate", path])
        cases.append(["verify-checkpoint", path])
        cases.append(["rehearse", "--costs", path, "--schedule", "1f1b", "--stages", "2",
                      "--microbatches", "2", "--out", out])
        cases.append(["train", "--model", f"{path}:build", "--out", out, "--steps", "1"])
        cases.append(["plan", "--model", _SHAPE, "--cluster", "a100-80g", "--global-batch",
                      "8", "--device-profile", path])
        cases.append(["profile-device", "--output", path, "--sizes", "8", "--repeats", "1",
                      "--ranks", "1"])
    for flag, values in (("--repeats", ("1000000", "1000000000000")),
                         ("--sizes", ("20000", "100000", "8,8,8,8,8,8,8,8,8", "0,1"))):
        for value in values:
            cases.append(["profile-device", "--output", os.path.join(out, "dev.json"),
                          "--ranks", "1", flag, value])
    for extra in (["--seed", str(-10**30)], ["--timeout", "1e-9"],
                  ["--schedule", "forward-only"]):
        cases.append(["train", "--stages", "2", "--microbatches", "2", "--steps", "1",
                      "--batch-size", "4", "--blocks", "2", "--out", out, *extra])
    cases.append(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                  "--optimizer-factor", "1e308", "--json"])
    cases.append(["partition", "--costs", _COSTS, "--stages", "4", "--bandwidth", "1e-300"])
    cases.append(["plan", "--model", _SHAPE, "--cluster", "a100-80g", "--global-batch", "8",
                  "--price", "pp2,rc,rc2"])
    for shape in ("layers=2,hidden=64,heads=4,vocab=100,seq=32,ffn=0",
                  "layers=2,layers=3,hidden=64,heads=4,vocab=100,seq=32",
                  "layers=1000000000000,hidden=64,heads=4,vocab=100,seq=32",
                  "layers=2,hidden=63,heads=4,vocab=100,seq=32", "layers=x", "=", ",,,"):
        cases.append(["plan", "--model", shape, "--cluster", "a100-80g", "--global-batch", "8"])
    for name in ("nope", "1F1B", "", "zb-auto" * 50):
        cases.append(["simulate", "--schedule", name, "--stages", "4", "--microbatches", "8"])
    cases.append(["simulate", "--schedule", "interleaved-zb", "--stages", "64",
                  "--microbatches", "512"])
    cases.append(["plan", "--model", _SHAPE, "--cluster", "a100-80g", "--global-batch",
                  "720720"])
    return cases


class _Alarm(Exception):
    pass


def _on_alarm(number: int, frame: Any) -> None:
    raise _Alarm


def _worker(timeout: int) -> None:
    """Read argument lists (JSON, one a line) on stdin; write one verdict a line."""
    resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, _ADDRESS_SPACE))
    from pipeline.cli import main

    signal.signal(signal.SIGALRM, _on_alarm)
    for line in sys.stdin:
        argv = json.loads(line)
        out, err = io.StringIO(), io.StringIO()
        verdict, code = "", None
        signal.alarm(timeout)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(argv)
                except SystemExit as stop:
                    code = stop.code if isinstance(stop.code, int) else 1
        except _Alarm:
            verdict = "hang"
        except MemoryError:
            verdict = "out of memory"
        except BaseException as error:  # what escaped main: a traceback for the user
            verdict = f"traceback: {type(error).__name__}: {str(error)[:120]}"
        finally:
            signal.alarm(0)
        lines = err.getvalue().strip().splitlines()
        if not verdict:
            one_line = len(lines) >= 1 and lines[-1].startswith(f"pipesched {argv[0]}")
            if code in (2, 3) and one_line and "Traceback" not in err.getvalue():
                verdict = "clean"
            elif code == 0 and (out.getvalue().strip() or lines):
                verdict = "clean"
            else:
                verdict = f"silent: exit {code}"
        # ranks a launch starts share this stdout: the verdict line carries a marker
        print(_MARK + json.dumps([verdict, lines[-1][:120] if lines else ""]), flush=True)


def cli_inputs(timeout: int = 60) -> Tally:
    """Run every case; print a table of the ones not clean and return the tally."""
    counts = {"clean": 0, "hang": 0, "traceback": 0, "out of memory": 0, "silent": 0}
    with tempfile.TemporaryDirectory() as root:
        cases = input_cases(Path(root))
        env = {**os.environ, "TMPDIR": root}
        worker = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                   str(timeout)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env, cwd=root)
        assert worker.stdin is not None and worker.stdout is not None
        print("| command | verdict | last line |\n|---|---|---|")
        for argv in cases:
            worker.stdin.write(json.dumps(argv) + "\n")
            worker.stdin.flush()
            reply = worker.stdout.readline()
            while reply and not reply.startswith(_MARK):
                reply = worker.stdout.readline()
            if not reply:  # the worker died (a crash counts as a traceback); start another
                counts["traceback"] += 1
                print(f"| {' '.join(argv)[:100]} | worker died | |", flush=True)
                worker = subprocess.Popen(worker.args, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env, cwd=root)
                assert worker.stdin is not None and worker.stdout is not None
                continue
            verdict, last = json.loads(reply[len(_MARK):])
            kind = verdict.split(":")[0]
            counts[kind] += 1
            if kind != "clean":
                print(f"| {' '.join(argv)[:100]} | {verdict} | {last} |", flush=True)
        worker.stdin.close()
        worker.wait(timeout=60)
    return (len(cases), counts["clean"], counts["hang"], counts["traceback"],
            counts["out of memory"], counts["silent"])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]))
    else:
        tally = cli_inputs()
        print(f"\ntried {tally[0]}, clean {tally[1]}, hang {tally[2]}, traceback {tally[3]}, "
              f"out of memory {tally[4]}, silent {tally[5]}")
