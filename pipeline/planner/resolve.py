"""Turn the planner's CLUSTER argument into a `ClusterSpec`: a preset, a JSON file, or `local`
(measured by `pipeline.planner.calibrate`, which imports torch, only when asked)."""

from __future__ import annotations

import os
from dataclasses import replace

from pipeline.planner.cluster import PRESETS, ClusterSpec, cluster_from_json
from pipeline.planner.errors import PlanError

__all__ = ["resolve_cluster"]


def resolve_cluster(text: str, *, nodes: int | None = None) -> ClusterSpec:
    """A preset name, or a JSON file path; `nodes` overrides the node count. `local` is
    calibrated on this machine (a few seconds, torch imported then)."""
    if text == "local":
        from pipeline.planner.calibrate import calibrate_local

        spec = calibrate_local()
    elif text in PRESETS:
        spec = PRESETS[text]
    elif text.endswith(".json") or os.path.exists(text):
        if not os.path.exists(text):
            raise PlanError(f"cluster file {text!r} does not exist")
        spec = cluster_from_json(text)
    else:
        raise PlanError(f"unknown cluster {text!r}; use a preset ({', '.join(PRESETS)}, "
                        f"local) or a JSON file")
    if nodes is not None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise PlanError(f"nodes={nodes!r} must be a whole number >= 1")
        spec = replace(spec, nodes=nodes)
    return spec
