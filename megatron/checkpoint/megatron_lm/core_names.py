"""Our GPT parameters <-> NVIDIA Megatron Core's ``GPTModel`` (``megatron.core.models.gpt``, built from the local
layer spec ``get_gpt_layer_local_spec`` / ``get_gpt_decoder_block_spec(..., use_transformer_engine=False)``):
names and layouts, for the GPT-2 shape (learned positions, LayerNorm, GELU, biases, tied head) and the Llama shape
(rope, RMSNorm, SwiGLU, grouped-query attention, no biases, untied head), mixture-of-experts layers included, and
gpt-oss's (attention sinks, quick GeGLU, a router bias).

Both models are the same network: Megatron Core is where our layout comes from. ``i`` is a layer's global index,
``e`` an expert's global index (Megatron Core's ``local_experts.{e}`` index is global when its expert-parallel size
is 1, as in a full, gathered state dict); ``*`` is ``weight`` and ``bias`` (a bias only with linear biases):

===================================================  =====================================================
ours                                                 Megatron Core
===================================================  =====================================================
``embedding.word_embeddings.weight``                 ``embedding.word_embeddings.weight``
``embedding.position_embeddings.weight``             ``embedding.position_embeddings.weight``
``layers.{i}.input_layernorm.*``                     ``decoder.layers.{i}.input_layernorm.*``
``layers.{i}.self_attention.softmax_offset``         ``decoder.layers.{i}.self_attention.core_attention.softmax_offset``
``layers.{i}.self_attention.query_key_value.*``      ``decoder.layers.{i}.self_attention.linear_qkv.*``
``layers.{i}.self_attention.dense.*``                ``decoder.layers.{i}.self_attention.linear_proj.*``
``layers.{i}.post_attention_layernorm.*``            ``decoder.layers.{i}.pre_mlp_layernorm.*``
``layers.{i}.mlp.dense_h_to_4h.*`` (gated: rows)     ``decoder.layers.{i}.mlp.linear_fc1.*``
``layers.{i}.mlp.dense_4h_to_h.*``                   ``decoder.layers.{i}.mlp.linear_fc2.*``
``layers.{i}.mlp.router.*``                          ``decoder.layers.{i}.mlp.router.*``
``layers.{i}.mlp.experts.{e}.dense_h_to_4h.*``       ``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.*``
``layers.{i}.mlp.experts.{e}.dense_4h_to_h.*``       ``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.*``
``layers.{i}.mlp.shared_expert.dense_h_to_4h.*``     ``decoder.layers.{i}.mlp.shared_experts.linear_fc1.*``
``layers.{i}.mlp.shared_expert.dense_4h_to_h.*``     ``decoder.layers.{i}.mlp.shared_experts.linear_fc2.*``
``layers.{i}.mlp.shared_expert_gate.weight`` [1, h]  ``decoder.layers.{i}.mlp.shared_experts.gate_weight``
``final_layernorm.*``                                ``decoder.final_layernorm.*``
``output_layer.weight`` (untied only)                ``output_layer.weight``
``mtp.layers.{k}.enorm.*``, ``hnorm.*``              ``mtp.layers.{k}.enorm.*``, ``hnorm.*``
``mtp.layers.{k}.eh_proj.weight`` [h, 2h]            ``mtp.layers.{k}.eh_proj.weight``
``mtp.layers.{k}.transformer_layer.X``               ``mtp.layers.{k}.transformer_layer.Y``
``mtp.layers.{k}.final_layernorm.*``                 ``mtp.layers.{k}.final_layernorm.*``
===================================================  =====================================================

Multi-latent attention's modules keep Megatron Core's names on both sides (``self_attention.linear_q_proj``, or
``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj``; ``linear_kv_down_proj``, ``kv_layernorm``,
``linear_kv_up_proj``; its output projection is ours ``dense``, theirs ``linear_proj``), in the same layouts (the
queries' rows ``[a, (dn + dr)]``, ``linear_kv_up_proj``'s ``[a, (dn + dv)]``, ``linear_kv_down_proj``'s
``[kv_lora_rank; dr]``). A multi-token prediction module ``k`` (``mtp.layers.{k}``, after the decoder) holds a
decoder layer, ``transformer_layer``, whose names ``X`` / ``Y`` are a decoder layer's after ``layers.{i}.`` /
``decoder.layers.{i}.``; ``eh_proj`` reads ``[enorm(embedding); hnorm(hidden)]`` on both sides.

gpt-oss's attention sinks (``softmax_type`` learnable) are a parameter of the attention's core in Megatron Core
(``DotProductAttention.softmax_offset``, one logit per head, in the heads' order on both sides); the router's bias
(with linear biases) is ``mlp.router.bias`` on both sides.

Layouts: the fused QKV rows are the same, ``[ng, (nq/ng queries, key, value), hd]``; the padded vocabulary rows
are the same (both pad to a multiple of ``make_vocab_size_divisible_by x tp``). The one change is a gated MLP's
(SwiGLU's, quick GeGLU's) first matmul (the MLP's, each expert's, the shared expert's; weight and bias): our rows
interleave ``gate_j, up_j`` (row ``2j`` and ``2j + 1``), Megatron Core's are ``[gate; up]`` (``torch.chunk(2)`` of
``linear_fc1``'s output). The functions' ``swiglu`` argument says whether the MLP is gated (``is_gated``).

Megatron Core's state dict also holds ``*._extra_state`` entries (Transformer Engine's metadata, None in the local
spec), skipped here, and with a tied head no ``output_layer.weight``. Its router's ``expert_bias`` (aux-loss-free
balancing) is a buffer of its state dict (``...mlp.router.expert_bias``); ours is no parameter but the checkpoint's
train state (``moe_expert_bias``: {global layer index: values}, an MTP module's layer numbered ``num_layers + k``):
``expert_bias_names`` pairs the two, and the parameter mappings skip it.
"""

from __future__ import annotations

import re

import torch

from megatron.checkpoint.hf.common import ConversionError

_LAYER, _CORE_LAYER = "layers.{}.", "decoder.layers.{}."
_MTP_LAYER = "mtp.layers.{}.transformer_layer."  # a multi-token prediction module's decoder layer, on both sides
_MTP_OWN = ("enorm", "hnorm", "eh_proj", "final_layernorm")  # its other modules, named alike on both sides
# modules named as Megatron Core names them: QK-norm, multi-latent attention's projections and norms
_SAME_NAMES = tuple(f"self_attention.{name}" for name in (
    "q_layernorm", "k_layernorm", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
    "linear_kv_up_proj", "kv_layernorm"))
# our name after "layers.{i}." -> Megatron Core's after "decoder.layers.{i}." ("{}" a global expert index)
_IN_LAYER = {
    "input_layernorm": "input_layernorm",
    "self_attention": "self_attention.core_attention",  # its softmax_offset only (the sinks)
    "self_attention.query_key_value": "self_attention.linear_qkv",
    "self_attention.dense": "self_attention.linear_proj",
    "post_attention_layernorm": "pre_mlp_layernorm",
    "mlp.dense_h_to_4h": "mlp.linear_fc1",
    "mlp.dense_4h_to_h": "mlp.linear_fc2",
    "mlp.router": "mlp.router",
    "mlp.experts.{}.dense_h_to_4h": "mlp.experts.local_experts.{}.linear_fc1",
    "mlp.experts.{}.dense_4h_to_h": "mlp.experts.local_experts.{}.linear_fc2",
    "mlp.shared_expert.dense_h_to_4h": "mlp.shared_experts.linear_fc1",
    "mlp.shared_expert.dense_4h_to_h": "mlp.shared_experts.linear_fc2",
    **{name: name for name in _SAME_NAMES},
}
# whole names, outside the layers (the suffix ".weight"/".bias" kept)
_OUTSIDE = {
    "embedding.word_embeddings": "embedding.word_embeddings",
    "embedding.position_embeddings": "embedding.position_embeddings",
    "final_layernorm": "decoder.final_layernorm",
    "output_layer": "output_layer",
}
_SUFFIX = re.compile(r"^(?P<module>.+)\.(?P<param>weight|bias|softmax_offset)$")
_SINKS = "softmax_offset"  # the one parameter of the attention's core (ours: of the attention)


def _rules(inside: dict[str, str], reverse: bool) -> list[tuple[re.Pattern, str, bool, bool]]:
    """(pattern of a module path, its replacement template, whether it is a gated MLP's first matmul, whether it
    is the attention's core: its one parameter the sinks, a module's weight and bias elsewhere)."""
    rules = []
    for ours_prefix, core_prefix in ((_LAYER, _CORE_LAYER), (_MTP_LAYER, _MTP_LAYER)):
        for ours, core in inside.items():
            src, dst = (core_prefix + core, ours_prefix + ours) if reverse else (ours_prefix + ours, core_prefix + core)
            pattern = re.escape(src).replace(r"\{\}", r"(\d+)")
            rules.append((re.compile(pattern + "$"), dst, ours.endswith("dense_h_to_4h"), ours == "self_attention"))
    for ours, core in [*_OUTSIDE.items(), *((f"mtp.layers.{{}}.{m}",) * 2 for m in _MTP_OWN)]:
        src, dst = (core, ours) if reverse else (ours, core)
        rules.append((re.compile(re.escape(src).replace(r"\{\}", r"(\d+)") + "$"), dst, False, False))
    return rules


_TO_CORE, _FROM_CORE = _rules(_IN_LAYER, reverse=False), _rules(_IN_LAYER, reverse=True)


# the shared expert's gate (--moe-shared-expert-gate): a parameter of Megatron Core's SharedExpertMLP itself
_GATE, _CORE_GATE = "mlp.shared_expert_gate.weight", "mlp.shared_experts.gate_weight"
_GATE_NAME = re.compile(r"^(?P<layer>(?:decoder\.)?layers\.\d+\.|mtp\.layers\.\d+\.transformer_layer\.)"
                        r"(?P<param>mlp\.shared_expert_gate\.weight|mlp\.shared_experts\.gate_weight)$")


def _rename_gate(name: str, rules) -> str | None:
    """The other side's name of a shared-expert gate ``name`` (either side's), or None for another parameter."""
    found, to_core = _GATE_NAME.match(name), rules is _TO_CORE
    if found is None or (found["param"] == _GATE) != to_core:
        return None
    layer, ours_side = found["layer"], not found["layer"].startswith("decoder.")
    if layer.startswith("mtp."):  # a multi-token prediction module's layer: named alike on both sides
        return layer + (_CORE_GATE if to_core else _GATE)
    if ours_side != to_core:
        return None
    return ("decoder." + layer + _CORE_GATE) if to_core else layer.removeprefix("decoder.") + _GATE


def _rename(name: str, rules, what: str) -> tuple[str, bool]:
    gate = _rename_gate(name, rules)
    if gate is not None:
        return gate, False
    match = _SUFFIX.match(name)
    for pattern, template, fc1, sinks in rules if match else ():
        found = pattern.match(match["module"])
        if found and sinks == (match["param"] == _SINKS):
            return template.format(*found.groups()) + "." + match["param"], fc1  # layer, then expert index
    raise ConversionError(f"{name!r} is not a parameter of {what}; only GPTModel's decoder (local layer spec, "
                          "MLP or MoE with SequentialMLP experts) and multi-token prediction modules are mapped.")


def is_gated(model) -> bool:
    """Whether the MLP of ``model`` (our ``ModelConfig``, or a Megatron-LM ``args`` Namespace) is gated: SwiGLU or
    quick GeGLU, whose first matmul is ``[gate; up]`` in Megatron Core."""
    return bool(getattr(model, "swiglu", False) or getattr(model, "quick_geglu", False))


def interleaved_to_halves(t: torch.Tensor) -> torch.Tensor:
    """Gated MLP rows ``gate_0, up_0, gate_1, up_1, ...`` (ours) -> ``[gate; up]`` (Megatron Core's)."""
    return torch.cat((t[0::2], t[1::2]))


def halves_to_interleaved(t: torch.Tensor) -> torch.Tensor:
    """``[gate; up]`` (Megatron Core's) -> rows ``gate_0, up_0, gate_1, up_1, ...`` (ours)."""
    if t.shape[0] % 2:
        raise ConversionError(f"a gated MLP's linear_fc1 has an even number of rows, not {t.shape[0]}.")
    gate, up = t.chunk(2)
    return torch.stack((gate, up), dim=1).flatten(0, 1)


def to_megatron_core(name: str, tensor: torch.Tensor, swiglu: bool) -> tuple[str, torch.Tensor]:
    """(Megatron Core's name, tensor in its layout) of our parameter ``name`` (global name)."""
    core, fc1 = _rename(name, _TO_CORE, "our GPT model")
    return core, interleaved_to_halves(tensor) if fc1 and swiglu else tensor


def from_megatron_core(name: str, tensor: torch.Tensor, swiglu: bool) -> tuple[str, torch.Tensor]:
    """(our global name, tensor in our layout) of Megatron Core's parameter ``name``."""
    ours, fc1 = _rename(name, _FROM_CORE, "Megatron Core's GPTModel")
    return ours, halves_to_interleaved(tensor) if fc1 and swiglu else tensor


def to_megatron_core_state(state: dict[str, torch.Tensor], swiglu: bool) -> dict[str, torch.Tensor]:
    """Our whole model's state (global names) -> Megatron Core's state dict (without its ``_extra_state``)."""
    return dict(to_megatron_core(name, t, swiglu) for name, t in state.items())


def from_megatron_core_state(state: dict, swiglu: bool) -> dict[str, torch.Tensor]:
    """Megatron Core's ``GPTModel`` state dict -> our global names; ``_extra_state`` entries (None in the local
    spec) are skipped, and so are the router's buffers (``expert_bias``: ``expert_biases_from_core``;
    ``local_tokens_per_expert``)."""
    skipped = ("._extra_state", EXPERT_BIAS, ".router.local_tokens_per_expert")
    return dict(from_megatron_core(name, t, swiglu) for name, t in state.items() if not name.endswith(skipped))


EXPERT_BIAS = ".mlp.router.expert_bias"
_ROUTER = re.compile(r"^(?:layers\.(\d+)|mtp\.layers\.(\d+)\.transformer_layer)\.mlp\.router\.weight$")


def expert_bias_names(names, num_layers: int) -> dict[int, str]:
    """{our global layer index: Megatron Core's name of that layer's ``expert_bias`` buffer} for the MoE layers among
    our parameter ``names`` (those with a router): ``decoder.layers.{i}.mlp.router.expert_bias``, or for multi-token
    prediction module ``k`` (our layer ``num_layers + k``) ``mtp.layers.{k}.transformer_layer.`` and the same."""
    out = {}
    for name in names:
        found = _ROUTER.match(name)
        if found and found[1] is not None:
            out[int(found[1])] = f"{_CORE_LAYER.format(found[1])[:-1]}{EXPERT_BIAS}"
        elif found:
            out[num_layers + int(found[2])] = f"{_MTP_LAYER.format(found[2])[:-1]}{EXPERT_BIAS}"
    return out


def expert_bias_state(names, num_layers: int, num_experts: int,
                      saved: dict[str, list[float]] | None) -> dict[str, torch.Tensor]:
    """Megatron Core's ``expert_bias`` buffers (fp32, as it keeps them) of our MoE layers among ``names``, from the
    train state's ``moe_expert_bias`` (``saved``: {str(global layer): values}); zeros where it has none."""
    saved = saved or {}
    return {core: torch.tensor(saved[str(i)], dtype=torch.float32) if str(i) in saved else
            torch.zeros(num_experts, dtype=torch.float32) for i, core in expert_bias_names(names, num_layers).items()}


def expert_biases_from_core(state: dict, names, num_layers: int, num_experts: int) -> dict[str, list[float]]:
    """The train state's ``moe_expert_bias`` ({str(global layer): values}) of the ``expert_bias`` buffers in
    Megatron Core's ``state`` for our MoE layers among ``names``; ConversionError for one of another size."""
    out = {}
    for i, core in expert_bias_names(names, num_layers).items():
        t = state.get(core)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (num_experts,) or not bool(torch.isfinite(t).all()):
            raise ConversionError(f"{core} is not {num_experts} finite values (one per expert); the checkpoint does "
                                  f"not match its args.")
        out[str(i)] = [float(v) for v in t.double()]
    return out


# Megatron-LM's legacy GPT model (``megatron.legacy.model``, before Megatron Core; ``--use-legacy-models``): its
# state dict is nested (``language_model`` -> ``embedding`` / ``encoder`` / ``output_layer``), its names the ones
# ours took (older checkpoints say ``input_layernorm`` where newer ones say ``input_norm``). Same layouts as
# Megatron Core's (QKV per query group, SwiGLU ``[gate; up]`` per tensor-parallel rank, checkpoint_version 3).
_LEGACY_LAYER = {"input_norm": "input_layernorm", "input_layernorm": "input_layernorm",
                 "self_attention.query_key_value": "self_attention.linear_qkv",
                 "self_attention.dense": "self_attention.linear_proj",
                 "post_attention_norm": "pre_mlp_layernorm", "post_attention_layernorm": "pre_mlp_layernorm",
                 "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
_LEGACY_OUTSIDE = {"language_model.embedding.word_embeddings": "embedding.word_embeddings",
                   "language_model.embedding.position_embeddings": "embedding.position_embeddings",
                   "language_model.encoder.final_norm": "decoder.final_layernorm",
                   "language_model.encoder.final_layernorm": "decoder.final_layernorm",
                   "language_model.output_layer": "output_layer",
                   "word_embeddings_for_head": "output_layer"}  # the last stage's copy of a tied embedding
_LEGACY_IN_LAYER = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.+)$")


def is_legacy_model_state(state: dict) -> bool:
    """Whether a saved ``model`` entry is Megatron-LM's legacy GPT model's (nested under ``language_model``)."""
    return "language_model" in state


def _flatten(state: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def legacy_to_core_state(state: dict) -> dict:
    """One rank's legacy GPT model state dict -> the same tensors under Megatron Core's names."""
    core = {}
    for name, value in _flatten(state).items():
        match = _SUFFIX.match(name)
        if match is None or not isinstance(value, torch.Tensor):
            continue  # _extra_state and other non-parameters
        module, param = match["module"], match["param"]
        layer = _LEGACY_IN_LAYER.match(module)
        if layer and layer[2] in _LEGACY_LAYER:
            core[f"{_CORE_LAYER.format(layer[1])}{_LEGACY_LAYER[layer[2]]}.{param}"] = value
        elif module in _LEGACY_OUTSIDE:
            core[f"{_LEGACY_OUTSIDE[module]}.{param}"] = value
        else:
            raise ConversionError(f"{name!r} is not a parameter of Megatron-LM's legacy GPT model (dense, local "
                                  f"layers) that this tool converts.")
    return core
