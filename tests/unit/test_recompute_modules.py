"""Megatron-LM's selective recompute of chosen parts of a layer (--recompute-modules, --moe-layer-recompute): each
part runs again in the backward, and the loss and gradients equal those without recompute (dropout on: the RNG
streams replay)."""

from __future__ import annotations

import pytest
import torch

from megatron.config import ConfigError, parse_config, validate
from megatron.moe import experts as moe_experts
from megatron.parallelize_gpt import build_model
from tests.grads import assert_grads_close

TINY = ("--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--vocab-size", "96", "--max-seq-len", "16", "--max-position-embeddings", "16", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear")
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[1,0]", "--moe-aux-loss-coeff", "0.01",
       "--moe-shared-expert-intermediate-size", "16")
MLA = ("--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8", "--qk-layernorm")


ACTIVATE = moe_experts.activate


def config_of(*flags: str):
    config = parse_config([*TINY, *flags])
    validate(config)
    return config


def _count(calls: dict, key: str):
    return lambda *_: calls.__setitem__(key, calls.get(key, 0) + 1)


def counted_run(flags: tuple[str, ...], monkeypatch) -> tuple[torch.Tensor, dict, dict]:
    """(loss, gradients, forward calls per part) of one training step's forward and backward (pre-hooks count: a
    recompute stops once it has what the backward needs, before a module's forward hooks)."""
    config = config_of(*flags)
    model = build_model(config).train()
    calls: dict[str, int] = {}
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in ("input_layernorm", "post_attention_layernorm", "shared_expert", "linear_kv_up_proj"):
            module.register_forward_pre_hook(_count(calls, kind))
        elif kind == "mlp":
            module.register_forward_pre_hook(_count(calls, "moe" if hasattr(module, "router") else "mlp"))
    for attention in (m for n, m in model.named_modules() if n.endswith("self_attention")):
        core = attention.core_attention
        monkeypatch.setattr(attention, "core_attention", lambda *a, _core=core, **k: (_count(calls, "core")(),
                                                                                      _core(*a, **k))[1])
    monkeypatch.setattr(moe_experts, "activate", lambda *a: (_count(calls, "moe_act")(), ACTIVATE(*a))[1])
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(1234)
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, calls


@pytest.mark.parametrize("shape, modules, twice", [
    ((), ("mlp", "layernorm"), {"mlp", "input_layernorm", "post_attention_layernorm"}),
    ((), ("core_attn",), {"core"}),
    (MOE, ("moe",), {"moe", "moe_act", "shared_expert"}),  # the whole mixture
    (MOE, ("shared_experts", "moe_act"), {"shared_expert", "moe_act"}),
    (MLA, ("mla_up_proj", "core_attn"), {"linear_kv_up_proj", "core"}),
], ids=["mlp-layernorm", "core-attn", "moe", "shared-experts-moe-act", "mla-up-proj"])
def test_recomputed_modules_run_twice_and_change_nothing(shape, modules, twice, monkeypatch):
    ref_loss, ref_grads, ref_calls = counted_run(shape, monkeypatch)
    loss, grads, calls = counted_run((*shape, "--recompute-granularity", "selective", "--recompute-modules",
                                      *modules), monkeypatch)
    assert twice, "the case names what it recomputes"
    for part, count in ref_calls.items():  # each named part runs again in the backward; the others once
        assert calls[part] == (2 * count if part in twice else count), (part, calls, ref_calls)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_grads_close(grads, ref_grads)


def test_moe_layer_recompute_is_selective_with_moe_added():
    config = config_of(*MOE, "--moe-layer-recompute")
    assert (config.use_recompute, config.recompute_granularity, config.recompute_modules) == (
        True, "core_attn", ["core_attn", "moe"])
    model = build_model(config)
    assert model.layers["0"].recompute_parts == {"core_attn", "moe"}
    assert model.layers["0"].self_attention.recompute_core


@pytest.mark.parametrize("flags, message", [
    (("--recompute-modules", "mlp"), "recompute_modules (mlp) choose what a selective recompute recomputes, but "
                                     "recompute is off"),
    (("--recompute-granularity", "full", "--recompute-modules", "mlp"), "but recompute is full"),
    (("--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"),
     "mla_up_proj recomputes multi-latent attention's up projections, which the model does not have"),
    (("--recompute-modules", "attention"), "recompute_modules: attention not among core_attn"),
    ((*MOE, "--recompute-granularity", "full", "--moe-layer-recompute"),
     "moe_layer_recompute recomputes the MoE layers within a selective recompute, but the granularity is full"),
], ids=["without-recompute", "with-full", "mla-without-mla", "unknown", "moe-layer-with-full"])
def test_bad_recompute_modules_are_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_of(*flags)
