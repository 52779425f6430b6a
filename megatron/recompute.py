"""Activation recompute applied to a built GPT, the recipe's step (torchtitan's ``apply_ac``): which decoder layers
recompute what in the backward instead of keeping their activations (``recompute_granularity``, Megatron-LM's
``recompute_method`` / ``recompute_num_layers`` and ``no_recompute_layers``: ``config.layer_split.recompute_plan``).

Per layer (``TransformerDecoderLayer.recompute``): ``full`` (the whole layer), ``only_attn`` / ``full_attn`` (norm
and attention block) or ``core_attn``, Megatron-LM's selective granularity: the parts of the layer its
``recompute_modules`` name (``TransformerDecoderLayer.recompute_parts``; default core_attn, softmax(QK^T)V only: the
attention's ``recompute_core``; mlp or moe, the layer's MLP or mixture; layernorm, its two norms; mla_up_proj,
multi-latent attention's up projections; shared_experts and moe_act, inside the MoE layer); units of several
layers (``uniform``) are checkpointed as one by the model (``GPTModel.recompute_units``). Multi-token prediction's
layers recompute at the granularity itself. The recompute function is the model's ``Seams.checkpoint`` (the
tracker's streams replayed: ``tensor_parallel.random.checkpoint``).
"""

from __future__ import annotations

from torch import nn

from megatron.config.layer_split import recompute_plan
from megatron.config.schema import RECOMPUTE_MODULES

GRANULARITIES = ("full", "only_attn", "full_attn", "core_attn")


def apply_recompute(model: nn.Module, granularity: str | None, skip: list[int] | None = None,
                    method: str | None = None, num_layers: int | None = None,
                    modules: list[str] | None = None) -> nn.Module:
    """Set what each decoder layer of ``model`` (a GPT or one pipeline chunk of it) recomputes; returns it.
    ``modules``: the parts a selective (``core_attn``) recompute covers (default core_attn alone)."""
    if granularity is not None and granularity not in GRANULARITIES:
        raise ValueError(f"unknown recompute granularity {granularity!r}")
    parts = frozenset(modules or ("core_attn",))
    if not parts <= set(RECOMPUTE_MODULES):
        raise ValueError(f"unknown recompute modules {sorted(parts - set(RECOMPUTE_MODULES))}")
    indices = [int(key) for key in model.layers]
    per_layer, units = recompute_plan(indices, granularity, skip, method if granularity else None, num_layers)
    for key, layer in model.layers.items():
        _set(layer, per_layer[int(key)], parts)
    model.recompute_units = [[str(i) for i in unit] for unit in units]
    for module in model.mtp.layers if getattr(model, "mtp", None) is not None else []:
        _set(module.transformer_layer, granularity, parts)
    return model


def _set(layer: nn.Module, granularity: str | None, parts: frozenset[str]) -> None:
    """One layer's recompute: its granularity, and under a selective one (``core_attn``) the parts it covers."""
    selective = parts if granularity == "core_attn" else frozenset()
    layer.recompute = granularity
    layer.recompute_parts = selective
    if layer.self_attention is not None:  # (a hybrid model's layer may have none)
        layer.self_attention.recompute_core = "core_attn" in selective
        layer.self_attention.recompute_up_proj = "mla_up_proj" in selective
    for module in layer.mlp.modules() if layer.mlp is not None else ():  # a MoE layer's shared expert and experts
        if hasattr(type(module), "recompute_shared"):
            module.recompute_shared = "shared_experts" in selective
        if hasattr(type(module), "recompute_activation"):
            module.recompute_activation = "moe_act" in selective
