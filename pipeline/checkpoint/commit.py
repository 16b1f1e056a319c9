"""Rank 0's part of a save: commit a complete staging directory, or abandon a failed one, and
sweep what earlier saves left; every failure says exactly what is on disk afterwards.

Steps 3-5 of `pipeline.checkpoint.save` (manifest, rename, `latest`). Only the holder of the
root's lock (`pipeline.checkpoint.root_lock`) runs these, so a sweep never removes another
job's save in progress.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from collections.abc import Callable

from pipeline.checkpoint.atomic_files import atomic_write, read_pointer, remove_quietly
from pipeline.checkpoint.manifest import LATEST, MANIFEST, resolve_checkpoint
from pipeline.checkpoint.pointer import write_latest
from pipeline.checkpoint.staging import StagingDirectory
from pipeline.errors import CheckpointError

__all__ = ["abandon", "commit", "latest_name", "latest_status", "sweep"]

_LEFTOVER = re.compile(r"step_\d{6,}\.(partial|old)-[0-9a-f]+|\.latest\.tmp-\d+(-[0-9a-f]+)?")


def latest_name(root: str) -> str | None:
    """What `root/latest` names now (None if absent or unreadable)."""
    try:
        return read_pointer(os.path.join(root, LATEST))
    except (OSError, ValueError):  # UnicodeDecodeError, or not a small regular file
        return None


def latest_status(root: str) -> str:
    """What `latest` names now, as a clause for an error message."""
    return _names(latest_name(root))


def _names(name: str | None) -> str:
    return f"'{LATEST}' still names {name}" if name else f"there is no '{LATEST}' yet"


def commit(staging: StagingDirectory, final_name: str, manifest: bytes, token: str,
           reach: Callable[[str], None], run_id: str) -> CheckpointError | None:
    """Write the manifest, rename the staging directory to `final_name`, point `latest` at it
    (signed for `run_id` with a key: `pipeline.checkpoint.pointer`), sweep; every step through
    the descriptors `staging` holds (`pipeline.checkpoint.staging`).
    None on success; otherwise the error to report, with the disk already cleaned up.
    `reach` fires the owner's armed fault points (`pipeline.supervision.faults`)."""
    root = staging.root
    previous = latest_name(root)
    final = os.path.join(root, final_name)
    try:
        _publish(staging, final_name, manifest, token, reach)
    except OSError as error:
        abandon(staging)
        return CheckpointError(
            f"cannot commit {staging.path} ({error}): nothing was committed, the staging "
            f"directory is removed and {_names(previous)}; free space and save again",
            path=staging.path)
    except CheckpointError as error:
        abandon(staging)
        return CheckpointError(f"{error}; nothing was committed and {_names(previous)}",
                               path=error.path)
    try:
        reach("checkpoint.latest")
        write_latest(LATEST, final_name, run_id, manifest, dir_fd=staging.root_fd)
    except OSError as error:
        if previous == final_name:  # a re-saved step: `latest` already names the new copy
            sweep(root)
            return None
        sweep(root)
        return CheckpointError(
            f"{final} is complete on disk (manifest and every file written and synced) but "
            f"pointing '{LATEST}' at it failed ({error}); {_names(previous)}: load {final} "
            "directly, or free space and save again", path=os.path.join(root, LATEST))
    sweep(root)
    return None


def _publish(staging: StagingDirectory, final_name: str, manifest: bytes, token: str,
             reach: Callable[[str], None]) -> None:
    """Manifest last into the staging directory, then the rename that commits it."""
    reach("checkpoint.manifest")
    atomic_write(MANIFEST, manifest, dir_fd=staging.fd)
    reach("checkpoint.commit")
    staging.check_named(staging.name)
    replaced = None
    if staging.exists(final_name):
        # Re-saving a step (e.g. after rolling back): keep the old copy until `latest` can
        # name the new one. A crash between the two renames leaves both complete copies
        # under suffixed names, which `resolve_checkpoint` looks for.
        replaced = f"{final_name}.old-{token}"
        staging.rename(final_name, replaced)
        reach("checkpoint.swap")
    try:
        staging.rename(staging.name, final_name)
        # the name was checked above, but a swap can land between the check and the
        # rename: what now carries the final name must be the directory held open
        swapped = not staging.holds(final_name)
        if swapped:
            staging.rename(final_name, staging.name)  # `abandon` removes it (never through it)
    except OSError:
        if replaced is not None:
            staging.rename(replaced, final_name)  # put the old copy back under its name
        raise
    if swapped:
        if replaced is not None:
            staging.rename(replaced, final_name)
        staging.check_named(staging.name)  # raises: it is not the staging directory
    try:
        staging.fsync_root()
    except OSError:
        pass  # the rename is done; a failed directory sync loses it only on a power cut


def abandon(staging: StagingDirectory) -> None:
    """Remove a failed save's staging directory (every rank has stopped writing into it),
    then sweep."""
    staging.remove()
    sweep(staging.root)


def sweep(root: str) -> None:
    """Remove what earlier failed or crashed saves (and a replaced copy) left behind, unless
    `latest` depends on it."""
    try:
        resolved = resolve_checkpoint(root) if os.path.exists(os.path.join(root, LATEST)) \
            else None
    except CheckpointError:
        resolved = ""  # `latest` is dangling: a suffixed copy may be the only complete one
    for path in glob.glob(os.path.join(root, "*")) + glob.glob(os.path.join(root, ".*")):
        name = os.path.basename(path)
        if not _LEFTOVER.fullmatch(name) or path == resolved:
            continue
        if name.startswith(".latest.tmp-") or os.path.islink(path):
            remove_quietly(path)  # a symlink goes itself: nothing is removed through it
        elif resolved != "":
            shutil.rmtree(path, ignore_errors=True)
