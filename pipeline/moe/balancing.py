"""How a mixture-of-experts model balances its experts' load: the typed setting, per model.

Four ways, as teams run them (each layer's share rides with the activations to the loss):

- ``"hf-batch"``: HF's Switch loss over the whole step's tokens, exact to HF; needs a routing
  census forward before each step (`pipeline.moe.balance_loss.train_batch_balanced`).
- ``"microbatch"``: Megatron-Core's ``aux_loss``: the Switch loss of each MoE layer on each
  microbatch's own tokens (`router_losses.switch_loss`), summed over layers; the engine's
  ``1 / m`` per microbatch and its mean over replicas make the step's term the mean over
  microbatches and replicas, the final scaling Megatron-Core gives it. No census.
- ``"sequence"``: DeepSeek-V2/V3's ``seq_aux``: the same product per sequence, averaged over
  the microbatch's sequences (`router_losses.sequence_loss`). No census.
- ``"aux-free"``: DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the
  routing scores for the top-k choice only, moved after every optimizer step by
  ``rate · sign(mean load - load)`` (`pipeline.moe.expert_bias`). No loss.
- ``"none"``: nothing (HF's own choice when ``output_router_logits`` is off).

Any of them may add ST-MoE's router z-loss (``router_z_loss_coef``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

__all__ = ["BalancingMethod", "MoEBalancing", "resolve_balancing"]

BalancingMethod = Literal["hf-batch", "microbatch", "sequence", "aux-free", "none"]
"""The load-balancing methods (module docstring)."""

METHODS: tuple[str, ...] = get_args(BalancingMethod)


def _non_negative(name: str, value: object, fix: str) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        return [f"{name} must be a finite number >= 0, got {value!r}; {fix}"]
    return []


@dataclass(frozen=True, kw_only=True)
class MoEBalancing:
    """A model's load balancing (``layers_from_hf(config, balancing=...)``)."""

    method: BalancingMethod | None = None
    """One of `BalancingMethod`; None: as the HF config says ("hf-batch" when it sets
    ``output_router_logits``, else "none")."""
    aux_loss_coef: float | None = None
    """The auxiliary loss's coefficient (hf-batch, microbatch, sequence); None: the config's
    ``router_aux_loss_coef``."""
    router_z_loss_coef: float = 0.0
    """ST-MoE's router z-loss: coef · the mean over tokens of logsumexp(logits)², per MoE
    layer and microbatch, summed over layers (Megatron-Core's ``--moe-z-loss-coeff``; 0: off;
    ST-MoE uses 1e-3)."""
    bias_update_rate: float = 1e-3
    """aux-free: the step u of the expert bias per optimizer step (DeepSeek-V3's bias update
    speed; Megatron-Core's ``--moe-router-bias-update-rate``, default 1e-3)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.method is not None and self.method not in METHODS:
            problems.append(f"balancing method must be one of {list(METHODS)}, got "
                            f"{self.method!r}")
        if self.aux_loss_coef is not None:
            problems += _non_negative("aux_loss_coef", self.aux_loss_coef,
                                      "None takes the config's router_aux_loss_coef")
        problems += _non_negative("router_z_loss_coef", self.router_z_loss_coef,
                                  "0 turns the z-loss off, ST-MoE uses 1e-3")
        problems += _non_negative("bias_update_rate", self.bias_update_rate,
                                  "DeepSeek-V3 and Megatron-Core use 1e-3")
        if self.method == "aux-free" and not self.bias_update_rate > 0:
            problems.append("aux-free balancing needs bias_update_rate > 0 (the bias never "
                            "moves at 0); DeepSeek-V3 and Megatron-Core use 1e-3")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def adds_aux_loss(self) -> bool:
        """Whether the layers add a census-free auxiliary loss (microbatch, sequence)."""
        return self.method in ("microbatch", "sequence")


def resolve_balancing(setting: MoEBalancing | BalancingMethod | None, config: Any
                      ) -> MoEBalancing:
    """`setting` (a `MoEBalancing`, a method's name, or None) with its method and
    coefficient filled in from the HF `config`."""
    if setting is None or isinstance(setting, str):
        setting = MoEBalancing(method=setting)
    elif not isinstance(setting, MoEBalancing):
        raise TypeError(f"balancing must be a MoEBalancing, one of {list(METHODS)} or None, "
                        f"got {type(setting).__name__}")
    method = setting.method
    if method is None:
        method = "hf-batch" if getattr(config, "output_router_logits", False) else "none"
    coefficient = setting.aux_loss_coef
    if coefficient is None:
        coefficient = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    return replace(setting, method=method, aux_loss_coef=coefficient)
