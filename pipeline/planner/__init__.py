"""The planner: the fastest pp × tp × dp × ZeRO × schedule × microbatching for a model on a
cluster, predicted with the partitioner, the simulator and a memory model (no torch)."""

from pipeline.planner.cluster import PRESETS, ClusterSpec, cluster_from_json
from pipeline.planner.errors import PlanError
from pipeline.planner.load import load_model
from pipeline.planner.memory import HeldTrace, MemoryBreakdown, held_peaks, peak_rank_memory
from pipeline.planner.predict import PlanConfig, PlanContext, Prediction
from pipeline.planner.profile import LayerProfile, ModelProfile, profile_from_cost_json
from pipeline.planner.resolve import resolve_cluster
from pipeline.planner.search import PlanResult, SearchOptions, format_counts, plan
from pipeline.planner.shape_parse import parse_shape
from pipeline.planner.transformer import TransformerShape
from pipeline.planner.transformer_layers import transformer_profile

__all__ = [
    "PRESETS",
    "ClusterSpec",
    "HeldTrace",
    "LayerProfile",
    "MemoryBreakdown",
    "ModelProfile",
    "PlanConfig",
    "PlanContext",
    "PlanError",
    "PlanResult",
    "Prediction",
    "SearchOptions",
    "TransformerShape",
    "cluster_from_json",
    "format_counts",
    "held_peaks",
    "load_model",
    "parse_shape",
    "peak_rank_memory",
    "plan",
    "profile_from_cost_json",
    "resolve_cluster",
    "transformer_profile",
]
