"""How many examples each fuzz test ran (read by `benchmarks/reliability_report.py`)."""

from __future__ import annotations

from collections import Counter

__all__ = ["COUNTS", "FUZZ_EXAMPLES"]

COUNTS: Counter[str] = Counter()
"""Fuzz target name -> examples executed in this process."""

FUZZ_EXAMPLES = 400
"""max_examples per fuzz target (each test scales it); the README's figure is their sum."""
