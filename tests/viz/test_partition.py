"""Partition plot: per-stage cost bars and memory from plain per-stage numbers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.support.viz_helpers import png_size, svg_size_points
from viz import plot_partition

if TYPE_CHECKING:  # matplotlib is imported where a test draws, not while collecting
    from matplotlib.axes import Axes


def heights(figure_axes: list[Axes], label: str) -> list[float]:
    for ax in figure_axes:
        for container in ax.containers:
            if container.get_label() == label:
                return [bar.get_height() for bar in container]
    raise AssertionError(f"no bars labelled {label!r}")


def test_stacked_cost_bars_memory_and_the_bottleneck(tmp_path: Path) -> None:
    compute, comm, memory = [1.0, 1.2, 0.9, 1.1], [0.1, 0.3, 0.2, 0.1], [3e9, 2e9, 2e9, 1e9]
    figure = plot_partition(compute, comm, memory, memory_cap=2.5e9,
                            names=["embed", "blocks 0-3", "blocks 4-7", "head"],
                            path=tmp_path / "p.png")
    assert heights(figure.axes, "compute") == compute
    assert heights(figure.axes, "comm") == pytest.approx(comm)
    assert heights(figure.axes, "memory") == memory
    title = figure.axes[-1].get_title(loc="left")
    assert "bottleneck 1.5 s (stage 1)" in title and "p=4" in title
    labels = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert labels == ["embed", "blocks 0-3", "blocks 4-7", "head"]
    width, height = figure.get_size_inches()
    assert png_size(tmp_path / "p.png") == (round(width * 100), round(height * 100))


def test_compute_alone_as_svg_for_many_stages(tmp_path: Path) -> None:
    figure = plot_partition([1.0 + (s % 3) / 10 for s in range(64)], path=tmp_path / "p.svg")
    assert len(figure.axes) == 1
    width, height = figure.get_size_inches()
    assert svg_size_points(tmp_path / "p.svg") == pytest.approx((width * 72, height * 72))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"compute": []}, "at least one stage"),
    ({"compute": [1.0, 2.0], "comm": [0.1]}, "comm has 1 values but compute has 2"),
    ({"compute": [1.0, float("nan")]}, "finite"),
    ({"compute": [1.0], "names": ["a", "b"]}, "names has 2 entries for 1 stages"),
])
def test_bad_inputs_name_the_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plot_partition(**kwargs)
