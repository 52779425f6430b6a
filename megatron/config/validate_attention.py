"""DeepSeek-V3's model settings: multi-latent attention and YaRN (``megatron.model.mla``,
``megatron.model.rotary.Yarn``), multi-token prediction (``megatron.model.mtp``)."""

from __future__ import annotations

import math

from megatron.config.cli import fail as _fail
from megatron.config.schema import Config

YARN_DEFAULTS = {"rope_type": None, "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                 "original_max_position_embeddings": 4096}


def check_attention(config: Config, warnings: list[str] | None = None) -> None:
    m, d = config.model, config.distributed
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                 "original_max_position_embeddings"):  # checked for every model: a typo is never meant
        if getattr(m, name) < 1:
            _fail(f"{name} must be at least 1, got {getattr(m, name)}.")
    if m.q_lora_rank is not None and m.q_lora_rank < 1:
        _fail(f"q_lora_rank must be at least 1 (or unset: one query projection), got {m.q_lora_rank}.")
    for name in ("rotary_scaling_factor", "mscale", "mscale_all_dim"):
        value = getattr(m, name)
        if not math.isfinite(value) or value < 0 or (name == "rotary_scaling_factor" and value <= 0):
            _fail(f"{name} must be a finite {'positive' if name == 'rotary_scaling_factor' else 'non-negative'} "
                  f"number, got {value}.")
    if not m.multi_latent_attention:
        changed = [name for name, default in YARN_DEFAULTS.items() if getattr(m, name) != default]
        if changed:
            _fail(f"{', '.join(changed)} given without --multi-latent-attention: rotary_scaling_factor, mscale, "
                  f"mscale_all_dim and rope_type set YaRN for multi-latent attention here and would change "
                  f"nothing; drop them (Llama 3's --use-rope-scaling is not built).")
        return
    if m.position_embedding_type != "rope":
        _fail(f"multi-latent attention takes --position-embedding-type rope (its rotary channels), got "
              f"{m.position_embedding_type}.")
    if m.qk_pos_emb_head_dim % 2:
        _fail(f"qk_pos_emb_head_dim ({m.qk_pos_emb_head_dim}) must be even: rotary embeddings turn channel pairs.")
    if m.group_query_attention:
        _fail("group_query_attention shapes SelfAttention's heads; multi-latent attention's are qk_head_dim, "
              "qk_pos_emb_head_dim and v_head_dim: drop it.")
    if m.kv_channels is not None and warnings is not None:  # Megatron-LM's DeepSeek scripts give it; unused there too
        warnings.append(f"kv_channels ({m.kv_channels}) shapes nothing under multi-latent attention, as in "
                        f"Megatron-LM: its heads are qk_head_dim + qk_pos_emb_head_dim and v_head_dim wide.")
    if m.num_attention_heads % d.mp_degree:
        _fail(f"num_attention_heads ({m.num_attention_heads}) must be divisible by the tensor-parallel size "
              f"mp_degree ({d.mp_degree}): each rank holds whole heads.")


def check_mtp(config: Config) -> None:
    m = config.model
    if not math.isfinite(m.mtp_loss_scaling_factor) or m.mtp_loss_scaling_factor < 0:
        _fail(f"mtp_loss_scaling_factor must be a finite non-negative number, got {m.mtp_loss_scaling_factor}.")
    if m.mtp_num_layers is None:
        return
    seq = config.dataset.max_seq_len
    if not 1 <= m.mtp_num_layers < seq:
        _fail(f"mtp_num_layers must be at least 1 and below the sequence length ({seq}), got {m.mtp_num_layers} "
              f"(unset it to turn multi-token prediction off).")
