"""Hugging Face Nemotron-H (``NemotronHForCausalLM``, transformers 5) to and from our hybrid models
(``--hybrid-override-pattern``, docs/hybrid.md): each layer one mixer with its norm, ``layers_block_type`` our
pattern (``mamba`` M, ``attention`` *, ``mlp`` -, and Nemotron 3's ``moe`` E).

=============================================================  ==================================================
ours                                                           Hugging Face
=============================================================  ==================================================
``embedding.word_embeddings.weight``                           ``backbone.embeddings.weight`` (vocabulary padding)
``layers.{i}.input_layernorm.weight`` (M, *)                   ``backbone.layers.{i}.norm.weight``
``layers.{i}.post_attention_layernorm.weight`` (-)             ``backbone.layers.{i}.norm.weight``
``layers.{i}.mixer.in_proj.weight``: per group (z, x, B, C,    ``mixer.in_proj.weight``: all z, all x, all B, all
dt)                                                            C, all dt
``layers.{i}.mixer.conv1d_weight [C, 4]``, ``conv1d_bias``:    ``mixer.conv1d.weight [C, 1, 4]``,
channels per group (x, B, C)                                   ``mixer.conv1d.bias``: all x, all B, all C
``layers.{i}.mixer.{dt_bias,A_log,D}``, ``norm_weight``,       ``mixer.{dt_bias,A_log,D}``, ``mixer.norm.weight``,
``out_proj.weight``                                            ``mixer.out_proj.weight``
``layers.{i}.self_attention.query_key_value.weight``           ``mixer.{q,k,v}_proj.weight``
``layers.{i}.self_attention.dense.weight``                     ``mixer.o_proj.weight``
``layers.{i}.mlp.dense_h_to_4h.weight``, ``dense_4h_to_h``     ``mixer.up_proj.weight``, ``mixer.down_proj.weight``
``final_layernorm.weight``, ``output_layer.weight`` (untied)   ``backbone.norm_f.weight``, ``lm_head.weight``
=============================================================  ==================================================

A MoE layer (E): ``mixer.gate.weight`` our router's, ``mixer.experts.{e}.{up,down}_proj.weight`` each expert's (not
gated: squared ReLU), ``mixer.shared_experts.{up,down}_proj.weight`` the shared expert's, and
``mixer.gate.e_score_correction_bias`` our expert bias (the checkpoint's train state; zeros without it). The router is
DeepSeek-V3's: sigmoid scores, the bias for the choice only, group-limited (transformers scores a group by its top 2,
ours by its top ``topk // group_topk``: refused where they differ), normalised for k > 1, scaled by
``routed_scaling_factor``.

A model of ours exports here when it is a hybrid with RMSNorm, squared-ReLU MLPs and experts, attention without
positions or QK-norm, no linear biases and (with experts) that router and a shared expert without a gate.
transformers' mixer clamps each step ``dt`` to at least ``time_step_min`` (0.001 by default), where Megatron-LM's
(and ours) does not: the export writes ``time_step_min`` 0, the same model; an imported model with a positive
``time_step_min`` computes what Megatron-LM's does, which differs from transformers' wherever a step falls under it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron.checkpoint.hf import llama as hf_llama
from megatron.checkpoint.hf.common import ConversionError, to_flags
from megatron.checkpoint.hf.mapping import (
    Extra,
    Family,
    Key,
    Transform,
    config_in,
    config_out,
    layers_where,
    renames,
    rule,
)
from megatron.checkpoint.hf.transforms import QKV_GROUPS, VOCAB
from megatron.config.schema import ModelConfig

ARCHITECTURE = "NemotronHForCausalLM"
_ARCH = f"Hugging Face Nemotron-H ({ARCHITECTURE})"
_HINT = "check num_hidden_layers, layers_block_type and tie_word_embeddings"
HF_WTE = "backbone.embeddings.weight"  # the Hub's names (transformers 5 reads them as model.*, and writes them)
KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}  # our pattern's characters -> layers_block_type
KIND_OF = {**{v: k for k, v in KINDS.items()}, "linear_attention": "M", "full_attention": "*"}  # either spelling


def _pattern(m) -> str:
    return m.hybrid_override_pattern or ""


def _kind_layers(*kinds: str):
    return layers_where(lambda m: [kind in kinds for kind in _pattern(m)])


mamba, attention, mixing = _kind_layers("M"), _kind_layers("*"), _kind_layers("M", "*")
mlp, moe, feed_forward = _kind_layers("-"), _kind_layers("E"), _kind_layers("-", "E")


def check_model(model_cfg: ModelConfig) -> None:
    """ConversionError, naming the setting, unless our ``ModelConfig`` is a Nemotron-H."""
    m = model_cfg
    for differs, setting, theirs in (
            (not m.hybrid_override_pattern, "a model that is not a hybrid (no hybrid_override_pattern)",
             "a pattern of Mamba-2, attention and MLP layers"),

            (m.normalization != "RMSNorm" or m.apply_layernorm_1p, f"normalization {m.normalization}",
             "RMSNorm scaling by w"),
            (not m.squared_relu, "an MLP other than squared ReLU", "squared ReLU MLPs"),
            (m.position_embedding_type != "none", f"position_embedding_type {m.position_embedding_type}",
             "no position embeddings"),
            (m.qk_layernorm or m.attention_output_gate or m.multi_latent_attention, "QK-norm, an attention gate or "
             "multi-latent attention", "plain grouped-query attention"),
            (not m.disable_bias_linear or m.add_qkv_bias, "linear biases", "none")):
        if differs:
            raise ConversionError(f"{setting} has no {_ARCH} equivalent (it has {theirs}), so this checkpoint cannot "
                                  f"be exported.")
    if "E" in _pattern(m):
        _check_router(m)


def _groups(m: ModelConfig) -> tuple[int, int]:
    """(n_group, topk_group) of our router: (1, 1) when every group is always chosen."""
    if not m.moe_router_group_topk or m.moe_router_group_topk == m.moe_router_num_groups:
        return 1, 1
    return m.moe_router_num_groups, m.moe_router_group_topk


def _check_router(m: ModelConfig) -> None:
    n_group, topk_group = _groups(m)
    k = m.moe_router_topk
    for differs, setting, theirs in (
            (m.moe_router_score_function != "sigmoid", f"moe_router_score_function {m.moe_router_score_function}",
             "a sigmoid router"),
            (m.moe_expert_capacity_factor is not None, f"moe_expert_capacity_factor {m.moe_expert_capacity_factor}",
             "no dropped tokens"),
            (not m.moe_shared_expert_intermediate_size or m.moe_shared_expert_gate,
             "MoE layers without a shared expert, or with a gate on it", "a shared expert, ungated"),
            (n_group > 1 and k // topk_group != 2, f"group-limited routing with moe_router_topk {k} and "
             f"moe_router_group_topk {topk_group}", f"a group scored by its top 2 experts, ours by the top {k} // "
             f"{topk_group}")):
        if differs:
            raise ConversionError(f"{setting} has no {_ARCH} equivalent (it has {theirs}), so this checkpoint cannot "
                                  f"be exported.")


def _dims(m) -> tuple[int, int, int, int]:
    from megatron.hybrid.mamba import mamba_shape

    return mamba_shape(m)


def _regroup(parts_of_group, groups: int, t: torch.Tensor) -> list[torch.Tensor]:
    """Rows ``[G, (parts)]`` -> each part's rows of every group, in group order."""
    cut = t.reshape(groups, sum(parts_of_group), *t.shape[1:]).split(parts_of_group, dim=1)
    return [part.reshape(-1, *t.shape[1:]) for part in cut]


def _ungroup(parts_of_group, groups: int, parts: list[torch.Tensor]) -> torch.Tensor:
    rest = parts[0].shape[1:]
    return torch.cat([p.reshape(groups, size, *rest) for p, size in zip(parts, parts_of_group)], dim=1) \
        .reshape(-1, *rest)


def _in_proj_parts(m) -> list[int]:
    heads, width, groups, state = _dims(m)
    per = heads // groups
    return [per * width, per * width, state, state, per]  # z, x, B, C, dt of a group


def _conv_parts(m) -> list[int]:
    heads, width, groups, state = _dims(m)
    return [heads // groups * width, state, state]  # x, B, C of a group


def _by_group(parts: Callable, conv: bool = False) -> Transform:
    """Ours per group -> Hugging Face's component-major (its convolution weight ``[C, 1, K]``)."""
    def to_hf(t, ctx, ours):
        groups = _dims(ctx.m)[2]
        whole = torch.cat(_regroup(parts(ctx.m), groups, t))
        return [whole[:, None] if conv and whole.dim() == 2 else whole]

    def from_hf(hf_parts, ctx):
        t = hf_parts[0][:, 0] if conv and hf_parts[0].dim() == 3 else hf_parts[0]
        groups, sizes = _dims(ctx.m)[2], parts(ctx.m)
        return _ungroup(sizes, groups, list(t.split([s * groups for s in sizes])))

    return Transform("per group", to_hf, from_hf)


L, HL = "layers.{}.", "backbone.layers.{}."
RULES = (
    rule("embedding.word_embeddings.weight", HF_WTE, VOCAB),
    rule(L + "input_layernorm.weight", HL + "norm.weight", layers=mixing),
    rule(L + "post_attention_layernorm.weight", HL + "norm.weight", layers=feed_forward),
    rule(L + "mixer.in_proj.weight", HL + "mixer.in_proj.weight", _by_group(_in_proj_parts), layers=mamba),
    rule(L + "mixer.conv1d_weight", HL + "mixer.conv1d.weight", _by_group(_conv_parts, conv=True), layers=mamba),
    rule(L + "mixer.conv1d_bias", HL + "mixer.conv1d.bias", _by_group(_conv_parts), layers=mamba),
    *renames({"dt_bias": "dt_bias", "A_log": "A_log", "D": "D", "norm_weight": "norm.weight",
              "out_proj.weight": "out_proj.weight"}, layers=mamba, ours=L + "mixer.", theirs=HL + "mixer."),
    rule(L + "self_attention.query_key_value.weight", tuple(HL + f"mixer.{p}_proj.weight" for p in "qkv"),
         QKV_GROUPS, layers=attention),
    rule(L + "self_attention.dense.weight", HL + "mixer.o_proj.weight", layers=attention),
    rule(L + "mlp.dense_h_to_4h.weight", HL + "mixer.up_proj.weight", layers=mlp),
    rule(L + "mlp.dense_4h_to_h.weight", HL + "mixer.down_proj.weight", layers=mlp),
    rule(L + "mlp.router.weight", HL + "mixer.gate.weight", layers=moe),
    rule(L + "mlp.experts.{}.dense_h_to_4h.weight", HL + "mixer.experts.{}.up_proj.weight", layers=moe),
    rule(L + "mlp.experts.{}.dense_4h_to_h.weight", HL + "mixer.experts.{}.down_proj.weight", layers=moe),
    rule(L + "mlp.shared_expert.dense_h_to_4h.weight", HL + "mixer.shared_experts.up_proj.weight", layers=moe),
    rule(L + "mlp.shared_expert.dense_4h_to_h.weight", HL + "mixer.shared_experts.down_proj.weight", layers=moe),
    rule("final_layernorm.weight", "backbone.norm_f.weight"),
    rule(hf_llama.HEAD, hf_llama.HF_HEAD, VOCAB, when=hf_llama.untied),
)

KEYS = (
    Key("architectures", export=lambda m: [ARCHITECTURE]),
    Key("model_type", export=lambda m: "nemotron_h"),
    Key("vocab_size", "vocab_size"),
    Key("hidden_size", "hidden_size"),
    Key("intermediate_size", "ffn_hidden_size"),
    Key("num_hidden_layers", "num_layers"),
    Key("layers_block_type", export=lambda m: [KINDS[k] for k in _pattern(m)]),
    Key("num_attention_heads", "num_attention_heads"),
    Key("num_key_value_heads", export=lambda m: hf_llama.dims(m)[1]),
    Key("head_dim", export=lambda m: hf_llama.dims(m)[2]),
    Key("max_position_embeddings", "max_position_embeddings"),
    Key("layer_norm_epsilon", "layernorm_epsilon", default=1e-5),
    Key("mlp_hidden_act", export=lambda m: "relu2"),
    Key("attention_bias", export=lambda m: False),
    Key("mlp_bias", export=lambda m: False),
    Key("use_bias", export=lambda m: False),
    Key("mamba_num_heads", export=lambda m: _dims(m)[0]),
    Key("mamba_head_dim", "mamba_head_dim"),
    Key("n_groups", "mamba_num_groups"),
    Key("ssm_state_size", "mamba_state_dim"),
    Key("conv_kernel", export=lambda m: 4),
    Key("use_conv_bias", export=lambda m: True),
    Key("mamba_hidden_act", export=lambda m: "silu"),
    Key("time_step_min", export=lambda m: 0.0),  # no clamp of the steps, as Megatron-LM's mixer (module doc)
    Key("chunk_size", export=lambda m: 128),
    Key("n_routed_experts", export=lambda m: m.num_experts or 0),
    Key("num_experts_per_tok", export=lambda m: m.moe_router_topk if m.num_experts else 1),
    Key("moe_intermediate_size", export=lambda m: (m.moe_ffn_hidden_size or m.ffn_hidden_size) if m.num_experts
        else 1),
    Key("moe_shared_expert_intermediate_size", export=lambda m: m.moe_shared_expert_intermediate_size or 1),
    Key("n_shared_experts", export=lambda m: 1),
    Key("n_group", export=lambda m: _groups(m)[0]),
    Key("topk_group", export=lambda m: _groups(m)[1]),
    Key("routed_scaling_factor", export=lambda m: float(m.moe_router_topk_scaling_factor or 1.0)),
    Key("norm_topk_prob", export=lambda m: bool(m.num_experts) and m.moe_router_topk > 1),
    Key("moe_latent_size", export=lambda m: None),
    Key("attention_dropout", "attention_probs_dropout_prob", default=0.0),
    Key("initializer_range", "initializer_range", default=0.02),
    Key("tie_word_embeddings", "untie_embeddings_and_output_weights", to_hf=lambda v: not v,
        from_hf=lambda v: not v, default=False),
    Key("bos_token_id", export=lambda m: None),
    Key("eos_token_id", export=lambda m: None),
    Key("pad_token_id", export=lambda m: None),
    Key("use_cache", export=lambda m: True),
    Key("torch_dtype", export=lambda m: None),
)


def hf_config(model_cfg: ModelConfig, dtype: str = "float32") -> dict:
    """``config.json`` of the equivalent ``NemotronHForCausalLM``."""
    check_model(model_cfg)
    return {**config_out(KEYS, model_cfg), "torch_dtype": dtype}


def model_flags(config: dict) -> list[str]:
    """Our command-line flags for the model of a Hugging Face Nemotron-H ``config.json``."""
    if config.get("model_type", "nemotron_h") != "nemotron_h":
        raise ConversionError(f"config.json describes a {config.get('model_type')!r} model, not nemotron_h.")
    kinds = config.get("layers_block_type") or config.get("layer_types") or []
    unknown = sorted(set(kinds) - set(KIND_OF))
    if unknown or not kinds:
        raise ConversionError(f"config.json's layers_block_type holds {unknown or 'nothing'}; the kinds mapped here "
                              f"are mamba, attention, mlp and moe.")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu"), ("conv_kernel", 4),
                      ("use_conv_bias", True), ("attention_bias", False), ("mlp_bias", False), ("use_bias", False),
                      ("mamba_proj_bias", False)):
        if config.get(key, want) != want:
            raise ConversionError(f"config.json sets {key} {config.get(key)!r}; this GPT's hybrid layers have {want}.")
    read = config_in(KEYS, config)
    missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings",
                           "mamba_head_dim", "mamba_num_groups", "mamba_state_dim") if read.get(k) is None]
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)}.")
    heads, kv = int(read["num_attention_heads"]), int(config.get("num_key_value_heads") or read["num_attention_heads"])
    head_dim = config.get("head_dim") or read["hidden_size"] // heads
    values = {**{k: read[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "max_position_embeddings",
                                      "layernorm_epsilon", "mamba_head_dim", "mamba_num_groups", "mamba_state_dim",
                                      "attention_probs_dropout_prob", "initializer_range",
                                      "untie_embeddings_and_output_weights")},
              "num_layers": len(kinds), "is_hybrid_model": True,
              "hybrid_override_pattern": "".join(KIND_OF[k] for k in kinds),
              "mamba_num_heads": int(config.get("mamba_num_heads") or 0) or None,
              "normalization": "RMSNorm", "squared_relu": True, "disable_bias_linear": True,
              "position_embedding_type": "none", "group_query_attention": kv != heads,
              "num_query_groups": kv if kv != heads else None,
              "kv_channels": head_dim if head_dim * heads != read["hidden_size"] else None, "hidden_dropout_prob": 0.0}
    if "-" in values["hybrid_override_pattern"]:
        values["ffn_hidden_size"] = int(config["intermediate_size"])
    if "E" in values["hybrid_override_pattern"]:
        values.update(_moe_values(config))
    return to_flags({k: v for k, v in values.items() if v is not None})


def _moe_values(config: dict) -> dict:
    """Our MoE settings for Nemotron 3's moe layers; ConversionError for a router or expert this GPT lacks."""
    experts, k = int(config.get("n_routed_experts") or 0), int(config.get("num_experts_per_tok") or 0)
    n_group, topk_group = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    if not experts or not 1 <= k <= experts or experts % n_group or not 1 <= topk_group <= n_group:
        raise ConversionError(f"config.json's router (n_routed_experts {experts}, num_experts_per_tok {k}, n_group "
                              f"{n_group}, topk_group {topk_group}) is not one this GPT can run.")
    if config.get("moe_latent_size") is not None or int(config.get("n_shared_experts") or 1) != 1:
        raise ConversionError("config.json sets moe_latent_size or n_shared_experts other than 1; this GPT's MoE "
                              "layers have neither (a latent projection, several shared experts).")
    if bool(config.get("norm_topk_prob", True)) != (k > 1):
        raise ConversionError(f"config.json sets norm_topk_prob {config.get('norm_topk_prob')} with "
                              f"num_experts_per_tok {k}; this GPT's sigmoid router normalises the top k exactly when "
                              f"k > 1.")
    if topk_group < n_group and k // topk_group != 2:
        raise ConversionError(f"config.json's group-limited router scores a group by its top 2 experts; this GPT's "
                              f"by its top num_experts_per_tok // topk_group ({k} // {topk_group}).")
    grouped = topk_group < n_group
    return {"num_experts": experts, "moe_router_topk": k, "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
            "moe_shared_expert_intermediate_size": int(config["moe_shared_expert_intermediate_size"]),
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": n_group if grouped else None, "moe_router_group_topk": topk_group if grouped
            else None, "moe_router_topk_scaling_factor": float(config.get("routed_scaling_factor") or 1.0)}


def _bias(ctx, out: dict, name: str) -> torch.Tensor:
    """The expert bias of the checkpoint's train state (zeros without our expert bias), fp32."""
    m, saved = ctx.m, (ctx.train_state or {}).get("moe_expert_bias") or {}
    bias = saved.get(name.split(".")[2]) if m.moe_router_enable_expert_bias else None
    return torch.tensor(bias, dtype=torch.float32) if bias is not None else torch.zeros(m.num_experts,
                                                                                         dtype=torch.float32)


BIAS = "mixer.gate.e_score_correction_bias"
EXTRAS = (Extra(HL + BIAS, _bias, lambda *args: None, moe),)


def _train_state(hf: dict[str, torch.Tensor], m: ModelConfig) -> dict:
    """An import's train state: every MoE layer's ``e_score_correction_bias`` as our expert bias."""
    hf, biases = strip_hf_prefix(hf), {}
    for n, _ in moe(m):
        name = HL.format(n) + BIAS
        if name not in hf or tuple(hf[name].shape) != (m.num_experts,):
            raise ConversionError(f"the Hugging Face state dict lacks {name!r} of [{m.num_experts}] values; {_HINT}.")
        biases[str(n)] = hf[name].to(torch.float32).tolist()
    return {"consumed_samples": 0, "skipped_steps": 0, **({"moe_expert_bias": biases} if biases else {})}


def strip_hf_prefix(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory ``model.`` prefix as the Hub's ``backbone.`` (what the files hold)."""
    return {("backbone." + k[len("model."):]) if k.startswith("model.") else k: v for k, v in hf.items()}


def tied_head(head: torch.Tensor, hf: dict) -> None:
    if not torch.equal(head, hf[HF_WTE]):
        raise ConversionError("lm_head.weight differs from backbone.embeddings.weight although config.json ties them "
                              "(tie_word_embeddings); set tie_word_embeddings false to import an untied head.")


FAMILY = Family("nemotron_h", RULES, KEYS, check_model, strip_hf_prefix, HF_WTE, hf_llama.HF_HEAD, tied_head,
                extras=EXTRAS, hint=_HINT, keeps_fp32=(BIAS,), train_state=_train_state)
name_map, to_hf_state_dict, from_hf_state_dict = FAMILY.name_map, FAMILY.to_hf_state_dict, FAMILY.from_hf_state_dict
