"""MoE load balancing chosen per model (`pipeline.moe.balancing`): Megatron-Core's
per-microbatch Switch loss, DeepSeek's sequence-level loss and ST-MoE's router z-loss of a
tiny HF model's layers against oracles written here from their definitions (value and
gradients), DeepSeek-V3's aux-free bias (top-k choice only) and its update, Mixtral's router
jitter against HF's own block, and the refusals; planted bugs fail the same checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from pipeline import PipelineModule
from pipeline.errors import PipelineConfigError
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_weights import load_hf_weights
from pipeline.moe import router_losses
from pipeline.moe.balancing import MoEBalancing
from pipeline.moe.expert_bias import updated_expert_bias
from pipeline.moe.layer import MoEFeedForward
from pipeline.runtime.two_batch import two_batch_problem
from tests.support.hf_models import token_batch
from tests.support.hf_moe_models import tiny_moe_config, tiny_moe_model

COEF, Z_COEF = 0.5, 0.01


# -- oracles, from the definitions -----------------------------------------------------------

def switch_oracle(logits: torch.Tensor, top_k: int, coef: float,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron-Core's per-microbatch Switch loss of one layer: coef · E · Σ_i f_i · P_i,
    f_i = (tokens choosing i among their top-k) / (T · k), P_i = mean router probability
    of i, over the T real tokens."""
    probs = torch.softmax(logits.float(), -1)
    num_experts = probs.shape[1]
    real = torch.ones(probs.shape[0]) if mask is None else mask.reshape(-1).float()
    tokens = real.sum()
    chosen = F.one_hot(probs.topk(top_k, -1).indices, num_experts).sum(1).float()
    f = (chosen * real[:, None]).sum(0) / (tokens * top_k)
    p = (probs * real[:, None]).sum(0) / tokens
    return coef * num_experts * (f * p).sum()


def sequence_oracle(logits: torch.Tensor, top_k: int, coef: float, rows: int,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek's seq_aux: per sequence, f_i = E / (k · T_j) · (its tokens choosing i),
    P_i = its mean probability of i; coef · the mean over sequences of Σ_i f_i · P_i."""
    probs = torch.softmax(logits.float(), -1).reshape(rows, -1, logits.shape[-1])
    num_experts = probs.shape[-1]
    real = (torch.ones(probs.shape[:2]) if mask is None else mask.float())
    losses = []
    for j in range(rows):
        keep = real[j] > 0
        seq = probs[j][keep]
        if seq.shape[0] == 0:
            continue
        chosen = F.one_hot(seq.topk(top_k, -1).indices, num_experts).sum(1).float()
        f = chosen.sum(0) * num_experts / (top_k * seq.shape[0])
        losses.append((f * seq.mean(0)).sum())
    return coef * torch.stack(losses).mean()


def z_oracle(logits: torch.Tensor, coef: float, mask: torch.Tensor | None = None
             ) -> torch.Tensor:
    """ST-MoE: coef · mean over real tokens of (log Σ_i exp(logit_i))²."""
    per_token = torch.log(torch.exp(logits.float()).sum(-1)) ** 2
    real = torch.ones_like(per_token) if mask is None else mask.reshape(-1).float()
    return coef * (per_token * real).sum() / real.sum()


Oracle = Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]
"""(one layer's router logits, the [b, s] mask, b) -> its loss on that microbatch."""


def _oracle_of(method: str, z_coef: float) -> Oracle:
    def oracle(logits: torch.Tensor, mask: torch.Tensor | None, rows: int) -> torch.Tensor:
        loss = logits.new_zeros(())
        if method == "microbatch":
            loss = loss + switch_oracle(logits, 2, COEF, mask)
        if method == "sequence":
            loss = loss + sequence_oracle(logits, 2, COEF, rows, mask)
        if z_coef:
            loss = loss + z_oracle(logits, z_coef, mask)
        return loss
    return oracle


# -- the model's layers against HF plus the oracle ---------------------------------------------

def _differences(family: str, balancing: MoEBalancing, oracle: Oracle, padded: bool
                 ) -> tuple[float, float]:
    """One microbatch through the pipeline layers (one stage, HF's weights) against HF's
    model: loss = cross entropy + Σ over MoE layers of `oracle` on HF's router logits;
    relative differences of the loss and of the worst parameter gradient."""
    model = tiny_moe_model(family, seed=3)
    ids, mask = token_batch(4, 8, seed=5, padded=padded)
    labels = causal_lm_targets(ids, mask if padded else None)
    out = model(input_ids=ids, attention_mask=mask if padded else None,
                output_router_logits=True)
    vocab = out.logits.shape[-1]
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
    for logits in out.router_logits:
        expected = expected + oracle(logits, mask if padded else None, ids.shape[0])
    expected.backward()
    hf = layers_from_hf(tiny_moe_config(family), balancing=balancing)
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn)
    module.materialize([0])
    # from HF's state dict: loading a save_pretrained directory of an MoE model is being
    # fixed on another branch (hf_weights lacks the stacked expert keys today)
    load_hf_weights(module, hf, model.state_dict())
    found = hf.loss_fn(module.stage(0)((ids, mask) if padded else ids), labels)
    found.backward()
    reference = dict(model.named_parameters())
    worst = 0.0
    for key, param in module.named_layer_parameters():
        grad, want = param.grad, reference[hf.hf_name(*key)].grad
        assert grad is not None and want is not None, key
        worst = max(worst, float((grad - want).abs().max() / want.abs().max().clamp_min(1e-12)))
    return float(abs(found.detach() - expected.detach()) / expected.abs()), worst


CASES = [("mixtral", "microbatch", 0.0, False), ("qwen2_moe", "microbatch", 0.0, True),
         ("mixtral", "sequence", 0.0, True), ("qwen3_moe", "sequence", Z_COEF, False),
         ("olmoe", "none", Z_COEF, True), ("mixtral", "aux-free", Z_COEF, False)]


@pytest.mark.parametrize(("family", "method", "z_coef", "padded"), CASES)
def test_layer_losses_equal_their_definition(family: str, method: str, z_coef: float,
                                             padded: bool) -> None:
    """Loss and every gradient within 1e-5 of HF's model plus the oracle (padding counted in
    none of the losses; aux-free at a zero bias routes as HF and adds no loss)."""
    balancing = MoEBalancing(method=method, router_z_loss_coef=z_coef)  # type: ignore[arg-type]
    loss, grad = _differences(family, balancing, _oracle_of(method, z_coef), padded)
    assert loss <= 1e-5 and grad <= 1e-5, (loss, grad)


_SEQUENCE_LOSS, _SWITCH_LOSS = router_losses.sequence_loss, router_losses.switch_loss


def _whole_microbatch_sequence_loss(probs: torch.Tensor, experts: torch.Tensor,
                                    weights: torch.Tensor, sequences: int,
                                    coefficient: float, group: Any = None) -> torch.Tensor:
    """Planted bug: the sequence loss's fractions over the microbatch, not per sequence."""
    return _SEQUENCE_LOSS(probs, experts, weights, 1, coefficient, group)


def _without_top_k(probs: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                   coefficient: float, group: Any = None) -> torch.Tensor:
    """Planted bug: HF's scaling (no division by k) in Megatron-Core's loss."""
    return _SWITCH_LOSS(probs, experts, weights, coefficient, group) * experts.shape[1]


def _z_summed(logits: torch.Tensor, weights: torch.Tensor, coefficient: float,
              group: Any = None) -> torch.Tensor:
    """Planted bug: the z-loss summed over tokens, not averaged."""
    return coefficient * (torch.logsumexp(logits.float(), -1) ** 2 * weights).sum()


@pytest.mark.parametrize(("name", "bug", "method", "z_coef"), [
    ("sequence_loss", _whole_microbatch_sequence_loss, "sequence", 0.0),
    ("switch_loss", _without_top_k, "microbatch", 0.0),
    ("z_loss", _z_summed, "none", Z_COEF)])
def test_planted_loss_bugs_fail(monkeypatch: pytest.MonkeyPatch, name: str, bug: Any,
                                method: str, z_coef: float) -> None:
    monkeypatch.setattr(router_losses, name, bug)
    balancing = MoEBalancing(method=method, router_z_loss_coef=z_coef)  # type: ignore[arg-type]
    loss, grad = _differences("mixtral", balancing, _oracle_of(method, z_coef), True)
    assert loss > 1e-4 or grad > 1e-4, (name, loss, grad)


# -- aux-free: the bias chooses, the probabilities weigh --------------------------------------

def _mixtral_layer(balancing: MoEBalancing, jitter: float = 0.0) -> tuple[MoEFeedForward, Any]:
    """Our MoE layer over the weights of HF's Mixtral block (returned too)."""
    import transformers

    config = tiny_moe_config("mixtral")
    config.router_jitter_noise = jitter
    torch.manual_seed(1)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for weight in (block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight):
            weight.normal_(0.0, 0.5)
    from pipeline.interop.hf_moe import router_config

    layer = MoEFeedForward(router_config(config), block.gate, block.experts,
                           balancing=balancing, jitter_noise=jitter)
    return layer, block


def _biased_oracle(layer: MoEFeedForward, x: torch.Tensor, bias: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: the top-2 of probs + bias choose; the chosen experts' unbiased probs,
    renormalised (Mixtral), weigh their outputs. Also the choices."""
    gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
    out, choices = [], []
    for token in x.reshape(-1, x.shape[-1]):
        probs = torch.softmax(layer.gate.weight @ token, -1)
        chosen = (probs + bias).topk(2).indices
        weights = probs[chosen] / probs[chosen].sum()
        mixed = torch.zeros_like(token)
        for w, e in zip(weights, chosen, strict=True):
            gate, up = (gate_up[e] @ token).chunk(2)
            mixed = mixed + w * (down[e] @ (F.silu(gate) * up))
        out.append(mixed)
        choices.append(chosen)
    return torch.stack(out).reshape(x.shape), torch.stack(choices)


def _route_with_biased_weights(logits: torch.Tensor, top_k: int, *, normalize: bool,
                               bias: torch.Tensor | None = None) -> Any:
    """Planted bug: the bias added to the gate weights too (the combine uses probs + bias)."""
    from pipeline.moe.routing import Routing

    probs = torch.softmax(logits.float(), -1)
    biased = probs if bias is None else probs + bias
    weights, experts = biased.topk(top_k, -1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return Routing(probs, weights.to(logits.dtype), experts)


@pytest.mark.parametrize("planted", [False, True])
def test_aux_free_bias_chooses_but_does_not_weigh(monkeypatch: pytest.MonkeyPatch,
                                                  planted: bool) -> None:
    """With a bias that changes some tokens' experts, the output equals the oracle (and a
    bias planted into the combine weights does not); training forwards count each chosen
    (token, expert) once into the load, evaluation forwards do not."""
    from pipeline.moe import layer as layer_module

    if planted:
        monkeypatch.setattr(layer_module, "route", _route_with_biased_weights)
    layer, _ = _mixtral_layer(MoEBalancing(method="aux-free"))
    bias = torch.tensor([0.3, -0.2, 0.0, 0.15])
    layer.bias.copy_(bias)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected, choices = _biased_oracle(layer, x, bias)
        unbiased = _biased_oracle(layer, x, torch.zeros(4))[1]
        assert not torch.equal(choices, unbiased)  # the bias moves some tokens
        layer.eval()
        found, share = layer(x, None)
        assert float(layer.load.abs().sum()) == 0.0  # evaluation counts nothing
        layer.train()
        layer(x, None)
    close = torch.allclose(found, expected, atol=1e-5, rtol=1e-5)
    assert close != planted, (found - expected).abs().max()
    assert float(share) == 0.0
    counts = torch.bincount(choices.reshape(-1), minlength=4).float()
    assert torch.equal(layer.load, counts)


def test_bias_update_follows_its_definition() -> None:
    """b_e += u · sign(mean load - load_e): overloaded experts down, underloaded up, an expert
    exactly at the mean unchanged."""
    bias = torch.tensor([0.0, 0.01, -0.02, 0.5])
    loads = torch.tensor([10.0, 2.0, 4.0, 4.0])  # mean 5
    expected = torch.tensor([0.0 - 1e-3, 0.01 + 1e-3, -0.02 + 1e-3, 0.5 + 1e-3])
    assert torch.allclose(updated_expert_bias(bias, loads, 1e-3), expected)
    even = torch.tensor([3.0, 3.0, 3.0, 3.0])
    assert torch.equal(updated_expert_bias(bias, even, 1e-3), bias)


def test_aux_free_bias_is_a_checkpointed_fp32_buffer() -> None:
    """The bias is in the layer's state dict (the engine checkpoint saves layer state
    dicts), the load is not; a cast to bf16 keeps both in fp32."""
    layer, _ = _mixtral_layer(MoEBalancing(method="aux-free"))
    assert "expert_bias" in layer.state_dict() and "expert_load" not in layer.state_dict()
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.float32 and layer.load.dtype == torch.float32
    plain, _ = _mixtral_layer(MoEBalancing(method="microbatch"))
    assert "expert_bias" not in plain.state_dict()


# -- Mixtral's router jitter ----------------------------------------------------------------

def test_router_jitter_is_applied_in_training_as_hf() -> None:
    """With router_jitter_noise, training forwards equal HF's block under the same seed and
    differ from the noiseless output; evaluation forwards have no noise."""
    layer, block = _mixtral_layer(MoEBalancing(method="microbatch"), jitter=0.2)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        block.train(), layer.train()
        torch.manual_seed(9)
        expected = block(x.clone())
        torch.manual_seed(9)
        found, _ = layer(x, None)
        torch.testing.assert_close(found, expected, atol=1e-5, rtol=1e-5)
        block.eval(), layer.eval()
        quiet, _ = layer(x, None)
        torch.testing.assert_close(quiet, block(x.clone()), atol=1e-5, rtol=1e-5)
        assert (quiet - found).abs().max() > 1e-3


def test_router_jitter_is_refused_only_where_a_census_needs_it() -> None:
    config = tiny_moe_config("mixtral")
    config.router_jitter_noise = 0.1
    with pytest.raises(PipelineConfigError, match=r"router_jitter_noise.*census.*microbatch"):
        layers_from_hf(config)  # output_router_logits=True: hf-batch
    for method in ("microbatch", "sequence", "aux-free", "none"):
        layers_from_hf(config, balancing=method)  # type: ignore[arg-type]


# -- refusals -------------------------------------------------------------------------------

def test_bad_settings_are_one_line_naming_the_fix() -> None:
    with pytest.raises(PipelineConfigError, match=r"must be one of \['hf-batch', "
                                                  r"'microbatch'.*got 'global'"):
        layers_from_hf(tiny_moe_config("mixtral"), balancing="global")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"router_z_loss_coef must be a finite number >= 0"):
        MoEBalancing(method="microbatch", router_z_loss_coef=-1.0)
    with pytest.raises(ValueError, match=r"aux-free balancing needs bias_update_rate > 0"):
        MoEBalancing(method="aux-free", bias_update_rate=0.0)
    from tests.support.hf_models import tiny_model

    with pytest.raises(PipelineConfigError, match=r"balancing='microbatch' applies to "
                                                  r"mixture-of-experts"):
        layers_from_hf(tiny_model("llama").config, balancing="microbatch")


def test_method_and_coefficient_default_to_the_config() -> None:
    config = tiny_moe_config("mixtral", coefficient=0.25)
    assert layers_from_hf(config).balancing == MoEBalancing(method="hf-batch",
                                                            aux_loss_coef=0.25)
    config.output_router_logits = False
    hf = layers_from_hf(config)
    assert hf.balancing is not None and hf.balancing.method == "none" and hf.balance is None
    hf = layers_from_hf(config, balancing=MoEBalancing(method="microbatch", aux_loss_coef=0.1))
    assert hf.balancing is not None and hf.balancing.aux_loss_coef == 0.1


def test_two_batch_overlap_refuses_per_microbatch_losses() -> None:
    """Halves of a microbatch would each compute a per-microbatch loss on their own rows."""
    for method, refused in (("microbatch", True), ("sequence", True), ("aux-free", False),
                            ("hf-batch", False)):
        layer, _ = _mixtral_layer(MoEBalancing(method=method))  # type: ignore[arg-type]
        problem = two_batch_problem(torch.nn.Sequential(layer))
        assert (problem is not None) == refused, (method, problem)
    layer, _ = _mixtral_layer(MoEBalancing(method="none", router_z_loss_coef=1e-3))
    assert "per microbatch" in str(two_batch_problem(torch.nn.Sequential(layer)))
