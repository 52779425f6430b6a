"""Validation of the recompute settings: the granularity (Megatron-LM's selective is core_attn), the modules a
selective recompute covers (Megatron-LM's recompute_modules, moe_layer_recompute), and recompute_method /
recompute_num_layers, which choose the layers of a full recompute."""

from __future__ import annotations

from megatron.config.cli import fail as _fail
from megatron.config.schema import RECOMPUTE_MODULES, Config


def check_recompute(config: Config) -> None:
    """The granularity (default full; Megatron-LM's selective is core_attn), and Megatron-LM's
    recompute_method / recompute_num_layers, which choose the layers of a full recompute."""
    if config.moe_layer_recompute:  # Megatron-LM: selective, with moe among the modules
        if config.use_recompute and config.recompute_granularity == "full":
            _fail("moe_layer_recompute recomputes the MoE layers within a selective recompute, but the granularity is "
                  "full (every layer recomputed whole): drop one of them.")
        config.use_recompute, config.recompute_granularity = True, "core_attn"
        config.recompute_modules = [*(config.recompute_modules or ["core_attn"]), "moe"]
    if config.recompute_granularity == "selective":
        config.recompute_granularity = "core_attn"
    if config.use_recompute and config.recompute_granularity is None:
        config.recompute_granularity = "full"
    _check_recompute_modules(config)
    method, count = config.recompute_method, config.recompute_num_layers
    if method is None:
        if count is not None:
            _fail(f"recompute_num_layers ({count}) is set without recompute_method: give --recompute-method "
                  f"uniform or block, or drop --recompute-num-layers.")
        return
    if not config.use_recompute or config.recompute_granularity != "full":
        granularity = config.recompute_granularity if config.use_recompute else "off"
        _fail(f"recompute_method ({method}) chooses the layers of a full recompute, but recompute is {granularity}: "
              f"give --use-recompute --recompute-granularity full, or drop --recompute-method.")
    if config.no_recompute_layers:
        _fail("no_recompute_layers and recompute_method both choose the layers to recompute: give one of them.")
    if count is None:
        config.recompute_num_layers = 1
    elif count < 1:
        _fail(f"recompute_num_layers must be at least 1, got {count}.")


def _check_recompute_modules(config: Config) -> None:
    """Megatron-LM's recompute_modules (default core_attn), each a part of a layer the selective granularity
    recomputes, and only with it."""
    modules = config.recompute_modules
    if modules is None:
        return
    unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
    if unknown:
        _fail(f"recompute_modules {unknown} are not parts of a layer; choose among {', '.join(RECOMPUTE_MODULES)}.")
    if not config.use_recompute or config.recompute_granularity != "core_attn":
        _fail(f"recompute_modules ({','.join(modules)}) choose what a selective recompute recomputes, but recompute "
              f"is {config.recompute_granularity if config.use_recompute else 'off'}: give --recompute-granularity "
              f"selective, or drop --recompute-modules.")
    if "mla_up_proj" in modules and not config.model.multi_latent_attention:
        _fail("recompute_modules mla_up_proj recomputes multi-latent attention's up projections, which the model "
              "does not have: drop it or give --multi-latent-attention.")
    config.recompute_modules = list(dict.fromkeys(modules))
