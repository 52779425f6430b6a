"""Activation offloading applied to a built GPT, the recipe's step after recompute (``megatron.parallelize_gpt``):
which parts of which decoder layers send what they save for the backward to host memory
(``megatron.ops.offload``: the saved-tensor hooks, the copies, the prefetch).

- ``cpu_offloading_num_layers`` N (Megatron-LM's ``--cpu-offloading-num-layers``): the first N decoder layers of
  each model chunk, whole (the ``"layer"`` region around the layer's forward);
- ``offload_modules`` (``--fine-grained-activation-offloading --offload-modules``): in every decoder layer, the parts
  named, Megatron Core's: ``attn_norm`` and ``mlp_norm`` (the two norms, their input among their saves),
  ``qkv_linear`` (the QKV projection's input; multi-latent attention's down and up projections), ``core_attn``
  (softmax(QK^T)V: q, k, v, its output and statistics), ``attn_proj`` (the output projection's input),
  ``expert_fc1`` (the experts' input) and ``moe_act`` (what the experts' activation saves). Every layer then
  gets a group-only ``"layer"`` region too, whose backward prefetches the layer before it.

A part the recompute covers gets no region (a checkpoint keeps nothing of it to offload; it keeps its inputs by
reference): a ``full`` layer or a unit of several, ``only_attn`` / ``full_attn``'s norm and attention, selective
recompute's ``core_attn``, ``layernorm``, ``moe`` and ``moe_act``. Multi-token prediction's layers are not
offloaded. Each chunk gets its own offloader, ``chunk.activation_offload`` (its ``packed_bytes`` count what it has
sent to host).
"""

from __future__ import annotations

from torch import nn

from megatron.ops.offload import ActivationOffload

_ATTENTION_PARTS = ("qkv_linear", "core_attn", "attn_proj")
_EXPERT_PARTS = ("expert_fc1", "moe_act")


def apply_offload(chunk: nn.Module, num_layers: int = 0, modules: list[str] | None = None,
                  min_elements: int = 1 << 20, trace: bool = False) -> nn.Module:
    """Give the decoder layers of ``chunk`` (a GPT or one pipeline chunk of it, its recompute already set) their
    offload regions: the first ``num_layers`` whole, or the parts ``modules`` names in every layer; returns it.
    ``trace`` (tests): the offloader lists every tensor it packs."""
    chunk.activation_offload = None
    if not num_layers and not modules:
        return chunk
    offload = chunk.activation_offload = ActivationOffload(min_elements, trace)
    in_units = {key for unit in getattr(chunk, "recompute_units", None) or [] if len(unit) > 1 for key in unit}
    for position, (key, layer) in enumerate(chunk.layers.items()):
        if key in in_units or layer.recompute == "full":
            continue
        number = int(key)
        if num_layers:
            if position < num_layers:
                layer.offload = {"layer": offload.region("layer", number)}
            continue
        parts = set(modules) - _recomputed(layer)
        layer.offload = {"layer": offload.region("layer", number, packs=False),
                         **{p: offload.region(p, number) for p in parts & {"attn_norm", "mlp_norm"}}}
        if layer.self_attention is not None:  # (a hybrid model's layer may have none)
            layer.self_attention.offload = {p: offload.region(p, number) for p in parts & set(_ATTENTION_PARTS)}
        for module in layer.mlp.modules() if layer.mlp is not None else ():  # a MoE layer's experts
            if hasattr(type(module), "recompute_activation"):
                module.offload = {p: offload.region(p, number) for p in parts & set(_EXPERT_PARTS)}
    return chunk


def _recomputed(layer: nn.Module) -> set[str]:
    """The offload parts of ``layer`` that its recompute covers."""
    covered = set()
    if layer.recompute in ("only_attn", "full_attn"):
        covered |= {"attn_norm", *_ATTENTION_PARTS}
    parts = layer.recompute_parts
    if "core_attn" in parts:
        covered.add("core_attn")
    if "layernorm" in parts:
        covered |= {"attn_norm", "mlp_norm"}
    if "moe" in parts:
        covered |= set(_EXPERT_PARTS)
    if "moe_act" in parts:
        covered.add("moe_act")
    return covered
