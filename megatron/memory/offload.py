"""Activation offloading's share of the saved activations (``megatron.offload``): the bytes one micro-batch's forward
through a chunk sends to host memory, by term, from the same layer terms as ``megatron.memory.activations``.

Per decoder layer that is not recomputed whole (a ``full`` layer, a unit of several: nothing to offload):

- ``cpu_offloading_num_layers`` N: the first N layers of each chunk, every term of the layer (``only_attn``: but the
  layer input, which the checkpoint keeps by reference);
- ``offload_modules``: ``attn_norm`` / ``mlp_norm`` the terms norm1 / norm2 (the input, its statistics or fp32
  copies, storage by storage), ``qkv_linear`` the qkv input (multi-latent attention: with the latents),
  ``core_attn`` the core's terms (q, k, v as given, its output, log-sum-exp, the math kernel's saves),
  ``attn_proj`` the dense input, ``expert_fc1`` the expert inputs, ``moe_act`` the experts' activation saves
  (all but fc2's input); parts a selective recompute covers send nothing.

Each storage counts when it holds at least ``min_offloaded_tensor_size`` elements (the norms' statistics and the
log-sum-exp apart, each term one storage of its bytes over the element size: exact for the dense layers' terms, an
upper bound for the experts' per-expert storages, whose sizes follow the routing). Terms named ``kept: ...`` are sent
to host but stay on the device too, another op or the pipeline holding them: the output of a flash core when it is
the dense input and attn_proj is not offloaded, and a later stage's received input that the first offloaded layer's
norm keeps. ``freed_bytes`` leaves them out: what the memory estimate subtracts from the device's activations.
"""

from __future__ import annotations

from collections import Counter

from megatron.config.schema import Config
from megatron.memory import activations as act

_NOT_CORE = {"qkv input", "qk norms", "dense input", "q latent", "kv latent"}


def offload_terms(config: Config, stage: int = 0, chunk: int = 0, kernel: str | None = None) -> dict[str, int]:
    """Bytes one micro-batch's forward through ``chunk`` of ``stage`` sends to host memory, by term."""
    modules = set(config.offload_modules or []) if config.fine_grained_activation_offloading else set()
    first = config.cpu_offloading_num_layers
    if not first and not modules:
        return {}
    D = act.dims(config, kernel)
    layers, pre, _ = act.chunk_specs(config, stage)[chunk]
    per_layer, units = act._recompute_units(config, layers)
    in_units = {i for unit in units if len(unit) > 1 for i in unit}
    terms: Counter[str] = Counter()
    for position, i in enumerate(layers):
        granularity = per_layer[i]
        if i in in_units or granularity == "full":
            continue
        layer = act.layer_terms(D, granularity, act.is_moe(D, i))
        if first:
            if position < first:
                whole = {k: v for k, v in layer.items() if k != "layer input"}
                if position == 0 and not pre and "norm1" in whole:  # the received input: the pipeline keeps it
                    terms["kept: received input"] += D.n_sp * D.h * D.d
                    whole["norm1"] -= D.n_sp * D.h * D.d
                terms.update(_filtered(D, config.min_offloaded_tensor_size, whole))
            continue
        parts = modules - _recomputed(config, granularity)
        terms.update(_filtered(D, config.min_offloaded_tensor_size, _part_terms(D, layer, parts)))
    return {k: v for k, v in terms.items() if v}


def _part_terms(D, layer: dict[str, int], parts: set[str]) -> dict[str, int]:
    """The layer terms the offloaded ``parts`` save (see the module docstring)."""
    out: dict[str, int] = {}
    if "attn_norm" in parts and "norm1" in layer:
        out["norm1"] = layer["norm1"]
    if "mlp_norm" in parts:
        out["norm2"] = layer["norm2"]
    if "qkv_linear" in parts:
        out.update({k: layer[k] for k in ("qkv input", "q latent", "kv latent") if k in layer})
    if "core_attn" in parts:
        out.update({k: v for k, v in layer.items() if k.startswith("attention")})
        if layer.get("attention out", None) == 0 and "attn_proj" not in parts:  # its output is the dense input
            out["kept: core output (the dense input)"] = layer["dense input"]
    if "attn_proj" in parts:
        out["dense input"] = layer["dense input"]
    if "expert_fc1" in parts and "expert inputs" in layer:
        out["expert inputs"] = layer["expert inputs"]
    if "moe_act" in parts and "experts" in layer:
        out["expert activation"] = layer["experts"] * (D.mlp_saves - 1) // D.mlp_saves
    return out


def _recomputed(config: Config, granularity: str | None) -> set[str]:
    """The parts a layer's recompute covers (``megatron.offload._recomputed``, from the configuration)."""
    if granularity in ("only_attn", "full_attn"):
        return {"attn_norm", "qkv_linear", "core_attn", "attn_proj"}
    if granularity != "core_attn":
        return set()
    recomputed = set(config.recompute_modules or ["core_attn"])
    covered = recomputed & {"core_attn", "moe_act"}
    if "layernorm" in recomputed:
        covered |= {"attn_norm", "mlp_norm"}
    if "moe" in recomputed:
        covered |= {"expert_fc1", "moe_act"}
    return covered


def _filtered(D, min_elements: int, terms: dict[str, int]) -> dict[str, int]:
    """``terms`` less their storages under ``min_elements`` elements (see the module docstring)."""
    out = {}
    for name, value in terms.items():
        if name in ("norm1", "norm2"):
            value = sum(b for e, b in _norm_storages(D) if e >= min_elements)
        elif name == "attention lse":
            value = value if D.n * D.a >= min_elements else 0
        elif value // D.d < min_elements:
            value = 0
        out[name] = value
    return out


def _norm_storages(D) -> list[tuple[int, int]]:
    """(elements, bytes) of each storage a layer norm saves (``megatron.memory.ops.norm_bytes``)."""
    rows, h = D.n_sp, D.h
    if D.rmsnorm:
        return [(rows * h, rows * h * 4), (rows * h, rows * h * 4), (rows, rows * 4)]
    return [(rows * h, rows * h * D.d), (rows, rows * D.stat), (rows, rows * D.stat)]


def offloaded_bytes(config: Config, stage: int = 0, chunk: int = 0, kernel: str | None = None) -> int:
    """Bytes one micro-batch's forward through ``chunk`` sends to host (what ``ActivationOffload.packed_bytes``
    counts)."""
    return sum(offload_terms(config, stage, chunk, kernel).values())


def freed_bytes(config: Config, stage: int = 0, chunk: int = 0, kernel: str | None = None) -> int:
    """The device bytes that offloading frees per micro-batch of ``chunk``: the terms sent to host and not kept."""
    return sum(v for k, v in offload_terms(config, stage, chunk, kernel).items() if not k.startswith("kept: "))
