"""Plant known bugs in `schedules/` one at a time, on a copy of the tree; report which tests catch.

A check of the test suite itself (issue 22): a test that passes with the check it guards
disabled proves nothing. Each bug below is a small textual edit of one source line; the
script copies the packages and tests to a temporary directory, applies one edit there
(never to the working tree), runs the tests that guard that behaviour and counts the bug
as caught when they fail. Every bug must be caught.

    PYTHONPATH=$PWD python tests/support/planted_bugs.py [--only NAME] [--list]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BUGS", "PlantedBug", "main", "plant_and_test"]

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("schedules", "partition", "viz", "pipeline", "tests", "pyproject.toml")


@dataclass(frozen=True)
class PlantedBug:
    """One edit: in `path`, replace the single occurrence of `old` by `new`; `tests` guard it."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


_SCHEDULE_TESTS = ("tests/schedules/test_golden.py", "tests/schedules/test_properties.py",
                   "tests/schedules/test_zero_bubble_properties.py",
                   "tests/schedules/test_zb_golden.py")
_VALIDATOR_TESTS = ("tests/schedules/test_validator.py",
                    "tests/schedules/test_validator_mutations.py",
                    "tests/schedules/test_validator_mutations_targeted.py")

_ZERO_TESTS = ("tests/parallel/test_zero_stages.py::test_loss_gradients_and_weights_equal_hf",)
"""A node id: named, a full-tier test runs in the default tier (a named file runs only its
fast-tier tests when it has any, and test_zero_stages.py has)."""
_ZERO_EP_TESTS = ("tests/parallel/test_zero_stages_moe.py",)
_ZERO_EP_SPLIT = ("tests/parallel/test_zero_stages_moe.py::"
                  "test_expert_shards_split_over_two_ranks_step_as_hf",)
"""pp2 × dp4 × ep2: expert-dp groups of two ranks, so a wrong group of the same size runs."""

BUGS: tuple[PlantedBug, ...] = (
    PlantedBug("1F1B warm-up count one too many", "schedules/generators/classic.py",
               "        num_warmup_microbatches = min(p - r - 1, m)\n        forwards",
               "        num_warmup_microbatches = min(p - r, m)\n        forwards",
               _SCHEDULE_TESTS),
    PlantedBug("GPipe backwards in reverse microbatch order", "schedules/generators/classic.py",
               "tuple(_op(_B, r, i) for i in range(m))",
               "tuple(_op(_B, r, i) for i in reversed(range(m)))", _SCHEDULE_TESTS),
    PlantedBug("ZB-H1/H2 drop each rank's last W", "schedules/generators/zb_h1_h2.py",
               "*weights[m - held_back:]))", "*weights[m - held_back:-1]))",
               _SCHEDULE_TESTS),
    PlantedBug("simulator ignores the comm delay of forwards", "schedules/analysis/dataflow.py",
               "                        dep += delay[s - 1]\n                    if dep > ready:\n"
               "                        idle += dep - ready",
               "                        dep += 0.0\n                    if dep > ready:\n"
               "                        idle += dep - ready",
               ("tests/schedules/test_properties.py", "tests/schedules/test_overlap.py",
                "tests/schedules/test_zb_golden.py", "tests/schedules/test_zb_optimal.py")),
    PlantedBug("validator skips the rendezvous deadlock check", "schedules/analysis/rendezvous.py",
               "        if blocked:\n            chain", "        if False:\n            chain",
               _VALIDATOR_TESTS),
    PlantedBug("peak activations off by one", "schedules/analysis/accounting.py",
               "                peak, peak_count = now, count + 1\n",
               "                peak, peak_count = now, count + 2\n",
               ("tests/schedules/test_accounting.py", "tests/schedules/test_zb_auto.py",
                "tests/schedules/test_cost_aware.py")),
    PlantedBug("zb-optimal drops the cross-stage delay", "schedules/search/zb_optimal_model.py",
               "cross = self.delay[s] if s + 1 < S and placement[s + 1] != placement[s] else 0",
               "cross = 0", ("tests/schedules/test_zb_optimal.py",)),
    PlantedBug("validator's W-before-I check disabled", "schedules/analysis/rendezvous.py",
               "            if not self.g_done[index]:\n                raise _fail(self.schedule, "
               "rank, step, f\"W(",
               "            if False:\n                raise _fail(self.schedule, "
               "rank, step, f\"W(",
               _VALIDATOR_TESTS),
    PlantedBug("validator accepts a rank without STEP", "schedules/analysis/rendezvous.py",
               "        if not stepped and not self.reduced:\n            return",
               "        if True:\n            return", _VALIDATOR_TESTS),
    PlantedBug("validator accepts a duplicated REDUCE_GRAD", "schedules/analysis/rendezvous.py",
               "            if s in self.reduced:", "            if False:", _VALIDATOR_TESTS),
    PlantedBug("zb-optimal rounds costs to 1/1000 again",
               "schedules/search/zb_optimal_model.py",
               "    if scale <= _EXACT_SCALE:\n        return scale, exact",
               "    if False:\n        return scale, exact",
               ("tests/schedules/test_zb_optimal.py",)),
    PlantedBug("lowering loads no targets on the last stage", "schedules/passes/lowering.py",
               "if kind is kind_f and (s == 0 or (loads_targets and s == last_stage)):",
               "if kind is kind_f and s == 0:", _SCHEDULE_TESTS),
    PlantedBug("V greedy ignores its extra warm-up rounds", "schedules/search/authors_v_greedy.py",
               "                        extra -= 1  # a round beyond the time rule",
               "                        break", ("tests/schedules/test_cost_aware.py",)),
    PlantedBug("validator lets a stray op into a compute-only schedule",
               "schedules/analysis/validate.py",
               "    if not schedule.lowered:\n        _check_compute_only(schedule)",
               "    if False:\n        _check_compute_only(schedule)",
               ("tests/schedules/test_stray_ops.py",)),
    PlantedBug("validator runs a pair's F before its B's inputs",
               "schedules/analysis/rendezvous.py",
               "            self._check_pair_inputs(rank, step)\n", "",
               ("tests/schedules/test_overlap.py", "tests/schedules/test_validator_mutations.py",
                "tests/schedules/test_validator_mutations_targeted.py")),
    PlantedBug("figures counts peaks from the clock (frees first at ties)",
               "schedules/analysis/timeline.py",
               "order = np.lexsort((np.arange(len(rank)), start, rank))",
               "order = np.lexsort((kind == _F, np.where(kind == _F, start, end), rank))",
               ("tests/schedules/test_one_peak_count.py",)),
    PlantedBug("zb-optimal lets ops of no time at one instant run in any order",
               "schedules/search/zb_optimal_model.py",
               "            model.Add(self.tick[after] >= self.tick[before] + 1)",
               "            pass", ("tests/schedules/test_zb_optimal_zero_chains.py",)),
    PlantedBug("zb-v-auto leaves out the authors' zbv.py plans", "schedules/search/zb_v_auto.py",
               "    for feeding, fed in feedings.items():",
               "    for feeding, fed in {}.items():", ("tests/schedules/test_authors_zbv.py",)),
    PlantedBug("critical-path priorities ignore cross-rank delays",
               "schedules/search/list_scheduler.py",
               "    hop = [delay[s] if s < last", "    hop = [0.0 if s < last",
               ("tests/schedules/test_list_scheduler.py",)),
    PlantedBug("ZeRO-2 reads another rank's piece of a reduced bucket",
               "pipeline/parallel/zero_grad_store.py",
               "buffer[self.dp_rank * piece:(self.dp_rank + 1) * piece]",
               "buffer[(1 - self.dp_rank) * piece:(2 - self.dp_rank) * piece]", _ZERO_TESTS),
    PlantedBug("ZeRO-2 reduces a gradient bucket twice", "pipeline/parallel/zero_grad_store.py",
               "self._in_flight.append((b, buffer, self._launch(b, buffer)))",
               "self._in_flight.append((b, buffer, self._launch(b, buffer)"
               " + self._launch(b, buffer)))", _ZERO_TESTS),
    PlantedBug("ZeRO-3 takes back a gathered layer's shard from the wrong rank",
               "pipeline/parallel/zero3.py",
               "mine = region.layout.shard(region.flat_param, self.dp_rank)",
               "mine = region.layout.shard(region.flat_param, 1 - self.dp_rank)", _ZERO_TESTS),
    PlantedBug("ZeRO-3 gathers a layer's buckets out of rank order", "pipeline/parallel/zero3.py",
               "                mine = region.master.detach()[b].to(flat.dtype)",
               "                mine = region.master.detach()[b].to(flat.dtype).flip(0)",
               _ZERO_TESTS),
    PlantedBug("ZeRO-3 computes with a prefetched layer before its gather arrived",
               "pipeline/parallel/zero3.py",
               "        self.prefetch(key)\n        self._wait_gather(key)\n",
               "        self.prefetch(key)\n", _ZERO_TESTS),
    PlantedBug("ZeRO-3 with ep shards and reduces expert parameters over dp as dense ones",
               "pipeline/parallel/expert_zero3.py", "    return expert_shard(param) is None",
               "    return True", _ZERO_EP_TESTS),
    PlantedBug("ZeRO-3 with ep gathers expert shards from the ranks holding other experts",
               "pipeline/runtime/zero_setup.py",
               "expert_gather_group=create_expert_gather_group(groups),",
               "expert_gather_group=groups.ep_group or create_expert_gather_group(groups),",
               _ZERO_EP_SPLIT),
    PlantedBug("ZeRO-3 with ep reduces expert gradients over the ep group",
               "pipeline/runtime/zero_setup.py", "groups.dp_group, groups.expert_dp_group,",
               "groups.dp_group, groups.ep_group or groups.expert_dp_group,", _ZERO_EP_SPLIT),
)


def plant_and_test(bug: PlantedBug, workdir: Path) -> str:
    """'caught', 'MISSED', or 'ERROR: ...' (the edit did not apply or pytest could not run)."""
    target = workdir / bug.path
    text = target.read_text()
    if text.count(bug.old) != 1:
        return f"ERROR: the text to replace occurs {text.count(bug.old)} times in {bug.path}"
    target.write_text(text.replace(bug.old, bug.new))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *bug.tests],
            cwd=workdir, env={"PYTHONPATH": str(workdir), "PATH": "/usr/bin:/bin",
                              "HOME": str(workdir)},
            capture_output=True, text=True, timeout=1800, check=False)
    finally:
        target.write_text(text)
    if done.returncode == 1:
        return "caught"
    if done.returncode == 0:
        return "MISSED"
    return f"ERROR: pytest exit {done.returncode}: {done.stdout[-300:]}{done.stderr[-300:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the bugs whose name contains this text")
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    args = parser.parse_args()
    bugs = [bug for bug in BUGS if not args.only or args.only in bug.name]
    if args.list:
        for bug in bugs:
            print(f"{bug.name}  ({bug.path}; tests: {' '.join(bug.tests)})")
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        workdir = Path(tmp)
        for name in COPIED:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, workdir / name,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(source, workdir / name)
        for bug in bugs:
            verdict = plant_and_test(bug, workdir)
            results.append((bug.name, verdict))
            print(f"{verdict:8} {bug.name}", flush=True)
    caught = sum(verdict == "caught" for _, verdict in results)
    print(f"\ncaught {caught}/{len(results)}")
    sys.exit(0 if caught == len(results) else 1)


if __name__ == "__main__":
    main()
