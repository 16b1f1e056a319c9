"""`pipesched verify-checkpoint`: check a checkpoint's manifest and every file's sha256
without loading it (no torch needed)."""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.checkpoint.manifest import read_manifest, resolve_checkpoint, verify_files

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "verify-checkpoint", help="check a checkpoint's manifest and file checksums",
        description="Resolve a checkpoint root (following `latest`) or a step directory, "
                    "read its manifest and check every listed file's size and sha256: exit "
                    "0 if it is complete, 2 naming the first missing, torn or corrupt file.")
    parser.add_argument("path", help="checkpoint root or step directory")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    step_dir = resolve_checkpoint(args.path)
    manifest = read_manifest(step_dir)
    verify_files(step_dir, manifest.files)
    pp, dp, tp = manifest.topology
    total = sum(entry.size for entry in manifest.files)
    experts = f" ep={manifest.ep}" if manifest.ep > 1 else ""
    print(f"{step_dir}: complete — step {manifest.step}, pp={pp} dp={dp} tp={tp}{experts}, "
          f"{len(manifest.files)} files, {total} bytes verified")
    return 0
