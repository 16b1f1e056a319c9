"""`pipesched plan --price`'s configuration string, parsed into a `PlanConfig`."""

from __future__ import annotations

from typing import Any

__all__ = ["parse_config"]


def _price_setting(item: str, schedules: Any) -> str:
    """What a --price item sets: 'schedule', 'recomputation' or its size's prefix."""
    if item in schedules:
        return "schedule"
    if item in ("rc", "recompute", "rs", "selective") or item.startswith("rc"):
        return "recomputation"
    return next((prefix for prefix in ("pp", "tp", "dp", "ep", "cp", "b", "v", "z")
                 if item.startswith(prefix)), item)


def parse_config(text: str, devices: int, global_batch: int) -> Any:
    """`pp4,tp1,dp16,1f1b,b1[,v2][,z1][,ep4][,cp2][,rc|rs|rcK]` as a `PlanConfig`: two of pp,
    tp, dp fix the third (their product with cp is the devices); b defaults to 1, the
    schedule to 1f1b; m = global batch / (dp · b); z0-z3 the ZeRO stage; rc full
    recomputation, rs selective, rcK full on the first K layers of each stage (partial)."""
    from pipeline.planner import PlanConfig
    from schedules import SCHEDULES

    sizes: dict[str, int] = {}
    schedule, recompute, recompute_layers = "1f1b", "none", 0
    seen: dict[str, str] = {}  # what each item sets -> the item that set it
    for item in (part.strip() for part in text.split(",") if part.strip()):
        setting = _price_setting(item, SCHEDULES)
        if setting in seen:  # "rc,rc2" or "pp4,pp8": which one was meant?
            raise ValueError(f"--price {text!r}: {seen[setting]!r} and {item!r} both set the "
                             f"{setting}; give it once")
        seen[setting] = item
        if item in SCHEDULES:
            schedule = item
            continue
        if item in ("rc", "recompute", "rs", "selective"):
            recompute = "full" if item in ("rc", "recompute") else "selective"
            continue
        if item.startswith("rc") and item[2:].isdigit() and int(item[2:]) >= 1:
            recompute, recompute_layers = "full", int(item[2:])
            continue
        for prefix in ("pp", "tp", "dp", "ep", "cp", "b", "v", "z"):
            if item.startswith(prefix) and item[len(prefix):].isdigit() \
                    and int(item[len(prefix):]) >= (0 if prefix == "z" else 1):
                sizes[prefix] = int(item[len(prefix):])
                break
        else:
            raise ValueError(f"--price {text!r}: item {item!r} is none of ppN, tpN, dpN, epN, "
                             f"cpN, bN, vN, z0-z3, rc, rs, rcK or a schedule "
                             f"({', '.join(SCHEDULES)})")
    if len([key for key in ("pp", "tp", "dp") if key in sizes]) < 2:
        raise ValueError(f"--price {text!r} needs at least two of ppN, tpN, dpN")
    for key in ("pp", "tp", "dp"):
        if key not in sizes:
            first, second = (sizes[k] for k in ("pp", "tp", "dp") if k != key)
            first *= sizes.get("cp", 1)  # devices = pp · tp · dp · cp
            if devices % (first * second):
                raise ValueError(f"--price {text!r}: {first} × {second} does not divide the "
                                 f"{devices} devices")
            sizes[key] = devices // (first * second)
    b = sizes.get("b", 1)
    if global_batch % (sizes["dp"] * b):
        raise ValueError(f"--price {text!r}: dp {sizes['dp']} × b {b} does not divide the "
                         f"global batch {global_batch}")
    if sizes.get("z", 0) > 3:
        raise ValueError(f"--price {text!r}: ZeRO stages are 0 to 3")
    low, high = SCHEDULES[schedule].chunks
    chunks = sizes.get("v", low if high is not None else max(low, 2))
    return PlanConfig(pp=sizes["pp"], tp=sizes["tp"], dp=sizes["dp"], schedule=schedule,
                      chunks=chunks, microbatch_size=b,
                      num_microbatches=global_batch // (sizes["dp"] * b),
                      zero_stage=sizes.get("z", 0), recompute=recompute,
                      recompute_layers=recompute_layers, ep=sizes.get("ep", 1),
                      cp=sizes.get("cp", 1))
