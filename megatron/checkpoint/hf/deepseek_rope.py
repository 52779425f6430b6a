"""The rotary settings of a Hugging Face DeepSeek-V3 ``config.json`` (``hf_deepseek``'s import of its ``rope_theta``,
``rope_scaling`` / ``rope_parameters`` keys, which its export writes from ``rotary_base``, ``rope_type`` and YaRN's
settings)."""

from __future__ import annotations

import math

from megatron.checkpoint.hf.common import ConversionError
from megatron.model.rotary import yarn_mscale


def rope_values(config: dict) -> dict:
    """Our rotary settings of a config.json's ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (DeepSeek's, transformers 4): plain rope, or YaRN with transformers' effective concentration
    (``attention_factor``, else mscale / mscale_all_dim when both are set, else mscale(factor)) as ours."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise ConversionError(f"rope_theta {theta} is not an integer, which rotary_base must be.")
    if kind == "default":
        return {"rotary_base": int(theta), "rope_type": "rope"}
    if kind != "yarn":
        raise ConversionError(f"config.json sets rope type {kind!r}; this GPT's multi-latent attention takes the plain "
                              f"rotary embedding or YaRN, so the model cannot be imported.")
    if float(params.get("partial_rotary_factor") or 1.0) != 1.0:  # transformers' YaRN rotates that share only
        raise ConversionError(f"config.json sets partial_rotary_factor {params['partial_rotary_factor']}; this GPT's "
                              f"YaRN rotates every channel of qk_rope_head_dim, so the model cannot be imported.")
    unusual = {k: params[k] for k, v in (("beta_fast", 32), ("beta_slow", 1), ("truncate", True))
               if params.get(k) is not None and params[k] != v}
    if unusual:
        raise ConversionError(f"config.json sets YaRN's {unusual}; this GPT's YaRN has beta_fast 32, beta_slow 1 and "
                              f"truncate true, so the model cannot be imported.")
    original = int(params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
                   or config["max_position_embeddings"])
    f = float(params.get("factor") or config["max_position_embeddings"] / original)
    all_dim, mscale = float(params.get("mscale_all_dim") or 0.0), params.get("mscale")
    target = params.get("attention_factor")
    if target is None:
        target = yarn_mscale(f, mscale) / yarn_mscale(f, all_dim) if mscale and all_dim else yarn_mscale(f)
    ours = float(mscale) if mscale and all_dim else 1.0
    if abs(yarn_mscale(f, ours) / yarn_mscale(f, all_dim) - target) > 1e-9 * target and f > 1:
        ours = (target * yarn_mscale(f, all_dim) - 1.0) / (0.1 * math.log(f))  # the concentration solved for mscale
    if ours < 0 or abs(yarn_mscale(f, ours) / yarn_mscale(f, all_dim) - target) > 1e-9 * target:
        raise ConversionError(f"config.json's YaRN attention factor {target} is not mscale(f, m) / mscale(f, "
                              f"mscale_all_dim) for any mscale m >= 0, as this GPT's YaRN scales cos and sin.")
    return {"rotary_base": int(theta), "rope_type": "yarn", "rotary_scaling_factor": f,
            "original_max_position_embeddings": original, "mscale": ours, "mscale_all_dim": all_dim}
