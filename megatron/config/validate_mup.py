"""Maximal Update Parametrization (muP, Megatron-LM's ``--use-mup``; docs/mup.md): its settings checked before any
process group exists, and the numbers the model, its initialisation and the optimizer read from them, as Megatron
Core derives them (``TransformerConfig.__post_init__``, ``get_mup_config_overrides``):

- the width multiplier ``m = hidden_size / mup_base_hidden_size`` (1 without a base width);
- the logits' multiplier ``mup_output_mult``, where its default 1.0 means ``1 / m``;
- the attention's softmax scale ``sqrt(mup_base_head_dim) / d^p`` (``1 / d^p`` without a base head width; ``p``
  ``mup_attn_scale_power``, ``d`` the head width); multi-latent attention keeps its own, as Megatron Core's;
- the learning rates: with AdamW the hidden matrices' (and its epsilon) ``/ m``, with SGD the vector-like
  parameters' ``x m`` (``mup_lr_factor``; which parameters: ``optimizer.param_groups.mup_scaled``).

Without ``use_mup`` every one of these is the plain model's (m = 1, no multipliers, ``1 / sqrt(d)``).
"""

from __future__ import annotations

import math

from megatron.config.cli import fail as _fail
from megatron.config.schema import Config
from megatron.config.schema_model import ModelConfig, attention_shape

MUP_FIELDS = ("mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult", "mup_base_head_dim",
              "mup_attn_scale_power")
_DEFAULTS = {"mup_base_hidden_size": None, "mup_embedding_mult": 1.0, "mup_output_mult": 1.0,
             "mup_base_head_dim": None, "mup_attn_scale_power": 1.0}


def width_mult(cfg: ModelConfig) -> float:
    """``m = hidden_size / mup_base_hidden_size`` under muP (the base defaults to hidden_size); 1 without it."""
    if not cfg.use_mup:
        return 1.0
    return cfg.hidden_size / (cfg.mup_base_hidden_size or cfg.hidden_size)


def output_multiplier(cfg: ModelConfig) -> float:
    """What the logits are multiplied by: ``mup_output_mult``, its default 1.0 read as ``1 / m`` (Megatron Core's
    rule: a value of exactly 1.0 given with m != 1 is read so too)."""
    if not cfg.use_mup:
        return 1.0
    m = width_mult(cfg)
    return 1.0 / m if cfg.mup_output_mult == 1.0 and m != 1.0 else cfg.mup_output_mult


def embedding_multiplier(cfg: ModelConfig) -> float:
    return cfg.mup_embedding_mult if cfg.use_mup else 1.0


def attention_scale(cfg: ModelConfig) -> float | None:
    """The softmax scale of standard attention under muP, ``sqrt(mup_base_head_dim) / d^p``; None (the kernels'
    ``1 / sqrt(d)``) without muP."""
    if not cfg.use_mup:
        return None
    base = 1.0 if cfg.mup_base_head_dim is None else cfg.mup_base_head_dim ** 0.5
    return base / attention_shape(cfg)[2] ** cfg.mup_attn_scale_power


def mup_lr_factor(config: Config) -> float:
    """The factor on the peak and floor learning rates of the parameters muP scales (``param_groups.mup_scaled``):
    ``1 / m`` for the hidden matrices under AdamW or Muon, ``m`` for the vector-like ones under SGD."""
    m = width_mult(config.model)
    return m if config.optimizer.optimizer == "sgd" else 1.0 / m


def changes_the_function(cfg: ModelConfig) -> bool:
    """Whether muP makes the model compute something the plain one with the same weights does not (a multiplier
    other than 1, or an attention scale other than ``1 / sqrt(d)``); initialisation and learning rates aside."""
    if not cfg.use_mup:
        return False
    scale = attention_scale(cfg)
    plain_scale = not cfg.multi_latent_attention and not math.isclose(scale, attention_shape(cfg)[2] ** -0.5,
                                                                       rel_tol=1e-12)  # sqrt(d) / d: within an ulp
    return output_multiplier(cfg) != 1.0 or embedding_multiplier(cfg) != 1.0 or plain_scale


def check_mup(config: Config, warnings: list[str]) -> None:
    """muP's settings in range (always: no negative or non-finite value means anything); a warning for those given
    without use_mup (Megatron-LM ignores them), and for what Megatron-LM warns about with muP (Muon's spectral scale,
    decoupled_lr)."""
    m = config.model
    if m.mup_base_hidden_size is not None and m.mup_base_hidden_size < 1:
        _fail(f"mup_base_hidden_size must be positive, got {m.mup_base_hidden_size}; give the base model's "
              f"hidden_size, or leave it unset for hidden_size.")
    for name in ("mup_embedding_mult", "mup_output_mult"):
        value = getattr(m, name)
        if not (math.isfinite(value) and value > 0):
            _fail(f"{name} must be a positive number, got {value}.")
    if m.mup_base_head_dim is not None and not (math.isfinite(m.mup_base_head_dim) and m.mup_base_head_dim > 0):
        _fail(f"mup_base_head_dim must be a positive number, got {m.mup_base_head_dim}; leave it unset for a "
              f"scale of 1 / head_dim^mup_attn_scale_power.")
    if not (math.isfinite(m.mup_attn_scale_power) and m.mup_attn_scale_power >= 0):
        _fail(f"mup_attn_scale_power must be a finite number of at least 0 (1: muP's 1 / d, 0.5: 1 / sqrt(d)), got "
              f"{m.mup_attn_scale_power}.")
    given = [name for name in MUP_FIELDS if getattr(m, name) != _DEFAULTS[name]]
    if not m.use_mup:
        if given:
            warnings.append(f"{', '.join(given)} set without use_mup: muP is off and they do nothing (as in "
                            f"Megatron-LM); give --use-mup to turn it on.")
        return
    o = config.optimizer
    if o.optimizer in ("muon", "dist_muon") and o.muon.muon_scale_mode == "spectral":
        warnings.append("use_mup with Muon's spectral scale: Muon's matrices keep their learning rate and spectral "
                        "scaling (muP scales AdamW's hidden matrices only, and Muon steps them all); "
                        "--muon-scale-mode unit_rms_norm is Megatron-LM's suggestion with muP.")
    if o.lr.decoupled_lr is not None:
        warnings.append("use_mup with decoupled_lr: the word embedding and output layer train at decoupled_lr; the "
                        "hidden matrices' lr and eps are still divided by the width multiplier.")
