"""Validation of activation offloading (Megatron-LM's --cpu-offloading-num-layers, --fine-grained-activation-offloading,
--offload-modules, --min-offloaded-tensor-size; ``megatron.offload``): Megatron Core's rules, and the combinations
that cannot work here."""

from __future__ import annotations

from megatron.config.cli import fail as _fail
from megatron.config.schema import OFFLOAD_MODULES, Config


def check_offload(config: Config) -> None:
    """The layer count below num_layers, fine-grained offloading with its modules and without the layer count,
    attn_proj with core_attn, the experts' parts only with MoE layers, a non-negative size; fine-grained offloading
    without --compile (whole layers compile: their hooks wrap the compiled layer)."""
    layers, modules = config.cpu_offloading_num_layers, config.offload_modules
    if not 0 <= layers < config.model.num_layers:
        _fail(f"cpu_offloading_num_layers must be between 0 and num_layers - 1 ({config.model.num_layers - 1}), "
              f"got {layers}.")
    if config.min_offloaded_tensor_size < 0:
        _fail(f"min_offloaded_tensor_size must be at least 0, got {config.min_offloaded_tensor_size}.")
    if not config.fine_grained_activation_offloading:
        if modules:
            _fail(f"offload_modules ({','.join(modules)}) choose what fine-grained offloading offloads, but it is off: "
                  f"add --fine-grained-activation-offloading, or drop --offload-modules.")
    else:
        _check_modules(config, modules)
    if config.fine_grained_activation_offloading and config.compile:
        _fail("fine-grained activation offloading enters saved-tensor hooks inside the layers --compile compiles "
              "whole, which breaks each layer's graph at every offloaded part: drop --compile, or offload whole layers "
              "with --cpu-offloading-num-layers (their hooks wrap the compiled layer).")


def _check_modules(config: Config, modules: list[str] | None) -> None:
    if config.cpu_offloading_num_layers:
        _fail("fine_grained_activation_offloading and cpu_offloading_num_layers both choose what to offload (Megatron "
              "Core allows one): drop one of them.")
    if not modules:
        _fail(f"fine_grained_activation_offloading needs the parts to offload: give --offload-modules with some of "
              f"{', '.join(OFFLOAD_MODULES)}.")
    unknown = sorted(set(modules) - set(OFFLOAD_MODULES))
    if unknown:
        _fail(f"offload_modules {unknown} are not parts of a layer; choose among {', '.join(OFFLOAD_MODULES)}.")
    if "attn_proj" in modules and "core_attn" not in modules:
        _fail("offload_modules attn_proj needs core_attn too (the projection's input is the core's output, which the "
              "core's backward reads; Megatron Core's rule): add core_attn.")
    experts = sorted({"expert_fc1", "moe_act"} & set(modules))
    if experts and not config.model.num_experts:
        _fail(f"offload_modules {experts} are parts of the experts, but the model has no MoE layers: drop them or "
              f"give --num-experts.")
    config.offload_modules = list(dict.fromkeys(modules))
