"""No Python file of the house at its limit: 400 lines at most (STYLE.md; a file near the cap
wants splitting), product, tests and benchmarks alike."""

from __future__ import annotations

from pathlib import Path

__all__: list[str] = []

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("pipeline", "schedules", "partition", "viz", "tests", "benchmarks")
LIMIT = 400


def too_long(root: Path, rooms: tuple[str, ...] = ROOMS, limit: int = LIMIT) -> list[str]:
    """'path: lines' for each .py file under `rooms` longer than `limit` lines."""
    found = []
    for room in rooms:
        for path in sorted((root / room).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                found.append(f"{path.relative_to(root)}: {lines}")
    return found


def test_no_python_file_is_over_400_lines() -> None:
    assert too_long(ROOT) == []


def test_a_planted_long_file_is_found(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "short.py").write_text("x = 1\n" * LIMIT)
    (tmp_path / "tests" / "long.py").write_text("x = 1\n" * (LIMIT + 1))
    assert too_long(tmp_path, ("tests",)) == [f"tests/long.py: {LIMIT + 1}"]
