"""Layout-invariant initialisation.

Every parameter is drawn at its full (global) shape from a generator seeded by
``(seed, global parameter name)``, so the same name always holds the same values whatever
the parallel layout; a sharded layer then keeps its slice. Rules (GPT-2 / Megatron-LM):

- Norms (LayerNorm, RMSNorm; every name ends in ``layernorm.weight``/``.bias``, or is multi-token prediction's
  ``enorm`` / ``hnorm``): weight 1 (0 with ``apply_layernorm_1p``: the norm scales by 1 + w), bias 0;
  every other bias 0.
- Embeddings and linear weights (the untied ``output_layer`` included): N(0, initializer_range); the word and
  position embeddings N(0, embedding_init_method_std) when it is set (Megatron-LM's ``--embedding-init-method-std``).
- Output projections of each residual branch (attention ``dense``, MLP ``dense_4h_to_h``, each expert's and the
  shared expert's ``dense_4h_to_h``): N(0, initializer_range / sqrt(2 x num_layers)).
- A MoE router's weight ``mlp.router.weight`` [E, h]: N(0, initializer_range), like any linear weight.
- Gated DeltaNet (``megatron.hybrid``): ``dt_bias`` 1, ``A_log`` log U(1, 16), the convolution U(-1/sqrt(K),
  1/sqrt(K)) (torch's ``Conv1d`` default), ``out_norm`` as a norm, ``out_proj`` as a residual branch's output.
- Padded vocabulary rows of the word embedding and of the output layer: 0 (they are never looked
  up, and the loss masks them out of the softmax).

- muP (``use_mup``): ``init_std``'s widths (Megatron Core's ``mup_scaled_init_method_normal``).

A SwiGLU ``dense_h_to_4h`` [2 x ffn, h] and a grouped QKV are drawn like any weight at their full
shape, so their interleaved / grouped rows need no rule of their own.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.config.schema_model import is_norm_weight
from megatron.config.validate_mup import width_mult

# the MLP, experts, shared expert; Gated DeltaNet's output projection
_SCALED_OUTPUTS = ("self_attention.dense.weight", "dense_4h_to_h.weight", "self_attention.out_proj.weight",
                   "mixer.out_proj.weight")  # (and a hybrid model's Mamba-2 mixer's)
_LINEAR_ATTENTION = ("self_attention.dt_bias", "self_attention.A_log", "self_attention.conv1d_weight")
_VOCABULARY_ROWS = ("word_embeddings.weight", "output_layer.weight")  # [V_padded, h]: padding rows 0
_EMBEDDINGS = ("word_embeddings.weight", "position_embeddings.weight")
_OUTPUT_LAYER = "output_layer.weight"


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for (seed, parameter name), equal on every rank and run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(name: str, shape: torch.Size, seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The fp32 initial value of the parameter called ``name`` at its full ``shape``."""
    if is_norm_weight(name):
        return torch.zeros(shape) if cfg.apply_layernorm_1p else torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = init_std(name, cfg)
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    if name.endswith(_LINEAR_ATTENTION):
        return _linear_attention_value(name, shape, generator)
    if ".mixer." in name and not name.endswith(("in_proj.weight", "out_proj.weight")):
        return _mamba_value(name, shape, generator)
    if name.endswith(_VOCABULARY_ROWS):
        value = torch.zeros(shape)
        value[: cfg.vocab_size].normal_(0.0, std, generator=generator)
        return value
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def _linear_attention_value(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Gated DeltaNet's own parameters (Megatron Core's ``GatedDeltaNet.reset_parameters``): ``dt_bias`` 1,
    ``A_log`` log U(1, 16), the depthwise convolution as torch's ``Conv1d`` default, U(-1/sqrt(K), 1/sqrt(K))."""
    if name.endswith("dt_bias"):
        return torch.ones(shape)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log()
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def _mamba_value(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """A Mamba-2 mixer's own parameters (Megatron Core's ``MambaMixer``): ``dt_bias`` the inverse softplus of steps
    drawn log-uniformly in [0.001, 0.1] (at least 1e-4), ``A_log`` log U(1, 16), ``D`` and the gated norm's weight 1,
    the convolution's weight and bias torch's ``Conv1d`` default, U(-1/sqrt(K), 1/sqrt(K))."""
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp().clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log()
    if name.endswith(("mixer.D", "norm_weight")):
        return torch.ones(shape)
    bound = 1.0 / math.sqrt(4)  # the kernel of 4 (megatron.hybrid.mamba.D_CONV): the fan-in of each channel
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def init_std(name: str, cfg: ModelConfig) -> float:
    """The std of the normal draw of the weight ``name`` (not a norm's, not a bias). Under muP (Megatron Core's
    ``use_mup``, m = ``validate_mup.width_mult``): the embeddings and the untied output layer at the embeddings' std,
    every other weight at std / sqrt(m), the residual branches' output projections at std / (sqrt(2 L) sqrt(m))."""
    embedding_std = cfg.initializer_range if cfg.embedding_init_method_std is None else cfg.embedding_init_method_std
    if name.endswith(_EMBEDDINGS) or (cfg.use_mup and name.endswith(_OUTPUT_LAYER)):
        return embedding_std
    if cfg.use_mup:
        m = width_mult(cfg)
        if name.endswith(_SCALED_OUTPUTS):
            return cfg.initializer_range / (math.sqrt(2.0 * cfg.num_layers) * math.sqrt(m))
        return cfg.initializer_range / math.sqrt(m)
    if name.endswith(_SCALED_OUTPUTS):
        return cfg.initializer_range / math.sqrt(2.0 * cfg.num_layers)
    return cfg.initializer_range


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, cfg: ModelConfig) -> None:
    """Give every parameter its layout-invariant value; a tensor-parallel shard (a parameter with
    ``full_shape``) gets its slice of the full tensor."""
    for name, param in model.named_parameters():
        param.copy_(_this_slice(init_value(name, getattr(param, "full_shape", param.shape), seed, cfg), param))


def _this_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` (a parameter's whole value) that ``param`` holds: all of it, or, for a tensor-parallel
    shard, chunk ``partition_rank`` along ``partition_dim`` (the attributes the parallel layers set)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    size = param.shape[dim]
    return full.narrow(dim, param.partition_rank * size, size)


@dataclass
class DeferredInit:
    """For a parameter created on the meta device (ZeRO stage 3: the full model never exists on one
    rank): ``deferred_init()`` returns its initial value, this rank's tensor-parallel slice, on
    ``device`` in ``dtype``. The parameter buffer calls it one bucket at a time and keeps its shard."""

    name: str
    param: nn.Parameter
    seed: int
    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        p = self.param
        value = _this_slice(init_value(self.name, getattr(p, "full_shape", p.shape), self.seed, self.cfg), p)
        return value.to(device=self.device, dtype=self.dtype)


def defer_initialization(model: nn.Module, seed: int, cfg: ModelConfig, device: torch.device,
                         dtype: torch.dtype) -> None:
    """Attach a ``DeferredInit`` to every (meta) parameter of ``model``, named as ``init_parameters`` names them."""
    for name, param in model.named_parameters():
        param.deferred_init = DeferredInit(name, param, seed, cfg, torch.device(device), dtype)


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """A model built on the meta device with its storage on ``device`` (values unset: ``init_parameters`` or a
    checkpoint gives them), each parameter keeping its attributes (tensor-parallel slicing, tied and shared marks),
    which ``to_empty``'s new parameters would lose."""
    attributes = {name: dict(vars(p)) for name, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        vars(p).update(attributes[name])
    return model
