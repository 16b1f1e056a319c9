"""Which tier (fast or full) each test belongs to: from markers, tests/tiers.txt and a rule.

Precedence, first that applies:
1. a `fast` or `full` marker on the test, its class or module (`pytestmark`), nearest first;
2. the longest entry of tests/tiers.txt that is the test's node id or a prefix of it ending at
   `/`, `::` or `[` (a folder, a file, a test function, or one parametrized case);
3. the rule for unlisted tests: `multiprocess`, `slow` and `cuda` tests go to the full tier
   (they cost seconds each and the fast tier has a time budget); everything else is fast.
Hypothesis property tests of the fast tier also run in the full tier, with the larger budget.
Entries that match nothing are tolerated (a test was renamed on another branch) and listed
in the summary of a run that collected the whole suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["TIERS", "Tier", "TierList", "default_tier", "named_on_command_line", "read_tier_list",
           "tier_of"]

Tier = Literal["fast", "full"]
TIERS: tuple[Tier, ...] = ("fast", "full")
LIST_PATH = Path(__file__).resolve().parents[1] / "tiers.txt"


@dataclass(frozen=True, slots=True)
class TierList:
    """The entries of tests/tiers.txt: node id (or prefix) -> tier."""

    entries: dict[str, Tier]
    """Each entry's node id relative to the repository root, e.g. `tests/cli/test_train.py`."""

    def lookup(self, nodeid: str) -> tuple[str, Tier] | None:
        """The longest entry that names `nodeid` or a prefix of it, with its tier."""
        for end in sorted(_prefix_ends(nodeid), reverse=True):
            prefix = nodeid[:end]
            if prefix in self.entries:
                return prefix, self.entries[prefix]
        return None


def _prefix_ends(nodeid: str) -> set[int]:
    ends = {len(nodeid)}
    ends.update(index for index in range(len(nodeid)) if nodeid.startswith(("/", "::", "["), index))
    return ends


def read_tier_list(path: Path = LIST_PATH) -> TierList:
    """Parse `TIER NODEID  # why` lines; blank lines and `#` comments are skipped."""
    entries: dict[str, Tier] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        tier, _, nodeid = line.partition(" ")
        nodeid = nodeid.strip()
        if tier not in TIERS or not nodeid.startswith("tests"):
            raise ValueError(f"{path.name}:{number}: {raw!r} is not `fast|full NODEID  # why`")
        if nodeid in entries:
            raise ValueError(f"{path.name}:{number}: {nodeid} is listed twice")
        entries[nodeid] = "fast" if tier == "fast" else "full"
    return TierList(entries)


def default_tier(keywords: set[str]) -> Tier:
    """The tier of a test that no marker and no list entry names."""
    return "full" if keywords & {"multiprocess", "slow", "cuda"} else "fast"


def tier_of(item_keywords: set[str], nearest_marker: str | None, nodeid: str,
            tier_list: TierList) -> Tier:
    """The tier of one test: its nearest `fast`/`full` marker, else the list, else the rule."""
    if nearest_marker in TIERS:
        return "fast" if nearest_marker == "fast" else "full"
    listed = tier_list.lookup(nodeid)
    return listed[1] if listed is not None else default_tier(item_keywords)


def named_on_command_line(nodeid: str, path: Path, named: list[tuple[Path, str]]) -> list[int]:
    """Indexes of the command-line arguments (path, `::`-suffix) that select this test."""
    inside = nodeid.partition("::")[2]
    found = []
    for index, (arg_path, suffix) in enumerate(named):
        if path != arg_path and arg_path not in path.parents:
            continue
        if suffix and not (inside == suffix or inside.startswith((suffix + "::", suffix + "["))):
            continue
        found.append(index)
    return found
