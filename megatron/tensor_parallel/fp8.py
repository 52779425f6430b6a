"""FP8 matmuls of the tensor-parallel linear layers (``--fp8-format``, ``--fp8-recipe tensorwise``).

Each FP8 matmul scales its operands to the FP8 range, casts them, multiplies with ``torch._scaled_mm`` (fp32
accumulation, the result in the layer's dtype) and keeps the master weights, the saved activations and every
gradient that leaves the layer in their usual precision. Torch's own kernel, no Transformer Engine or torchao:
the layers are this project's, and the scales must follow its layouts (below).

- **Formats**: ``e4m3`` casts the input, the weight and the output gradient to E4M3 (max 448); ``hybrid``
  (Megatron-LM's and Transformer Engine's default) casts the output gradient to E5M2 (max 57344, more range,
  less precision) instead.
- **Scaling** (``tensorwise``, torchao's and Megatron Core's "current scaling"): each operand's scale is
  ``fmax / amax`` of the tensor as it is now (``amax`` its largest magnitude), one per tensor.
- **The same scales whatever the layout**: an operand split over ranks is scaled by the amax of the whole tensor,
  the maximum over the ranks that hold its parts (``amax_groups``): a column-parallel weight and output gradient
  over tp; a row-parallel weight and input over tp; every activation and activation gradient over cp (each cp rank
  holds part of the sequence). Every element is then cast exactly as in one process, and the products differ from
  one process's only by the order of the sums (as the bf16 layers' do).
- **Backward**: ``dX = dY W`` and ``dW = dY^T X``, both from FP8 operands (``X`` and ``W`` cast again with their
  forward scales from what the layer saved: the saved activations are the bf16 ones, as without FP8).

What stays in bf16: the embedding, the output layer (the vocabulary-parallel matmul), the attention core, the
norms, and the experts of MoE layers. ``torch._scaled_mm`` on a GPU needs FP8 tensor cores (compute capability
8.9 or newer) and sizes that are multiples of 16 (``megatron.config.validate`` checks the model's); on a CPU it is
emulated, which the tests use and a training run refuses (slower than bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

FORMATS = ("e4m3", "hybrid")
_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@dataclass(frozen=True)
class FP8Recipe:
    """How a layer's matmuls run in FP8: ``format`` (``FORMATS``): the output gradient in E5M2 (hybrid) or E4M3."""

    format: str = "hybrid"

    @property
    def grad_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn


@dataclass(frozen=True)
class AmaxGroups:
    """The process groups each operand of one layer's matmul is split over (its amax the maximum over each; empty:
    this rank holds the whole tensor)."""

    input: tuple = ()
    weight: tuple = ()
    grad: tuple = ()


def amax(t: torch.Tensor, groups: tuple) -> torch.Tensor:
    """The largest magnitude of ``t`` over the ranks of every group in ``groups`` (fp32, 0-dim)."""
    value = t.detach().abs().amax().float()
    for group in groups:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value


def scale_for(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fmax / amax`` (1 for an all-zero tensor): multiplying by it fills the FP8 range. An amax under 1e-12 (torchao's
    floor) counts as 1e-12, so that the scale stays finite: ``0 x scale`` must not be NaN."""
    return torch.where(value > 0, _MAX[dtype] / value.clamp(min=1e-12), 1.0)


def cast(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t x scale`` saturated to the format's range, in FP8."""
    limit = _MAX[dtype]
    return (t.float() * scale).clamp_(-limit, limit).to(dtype)


def scaled_mm(a8: torch.Tensor, a_scale: torch.Tensor, b8: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``(a8 / a_scale) @ (b8 / b_scale)`` accumulated in fp32: ``a8`` [m, k] (made row-major) and ``b8`` [k, n] (made
    column-major) here, as the GPU's kernel wants (the CPU's emulation takes any layout)."""
    if a8.stride(1) != 1:
        a8 = a8.contiguous()
    if b8.stride(0) != 1:
        b8 = b8.t().contiguous().t()
    return torch._scaled_mm(a8, b8, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(), out_dtype=out_dtype)


def forward_mm(x2: torch.Tensor, weight: torch.Tensor, groups: AmaxGroups) -> tuple:
    """(``x2 weight^T`` in ``x2``'s dtype, the input's scale, the weight's): ``x2`` [tokens, in], ``weight``
    [out, in]."""
    x_scale = scale_for(amax(x2, groups.input), torch.float8_e4m3fn)
    w_scale = scale_for(amax(weight, groups.weight), torch.float8_e4m3fn)
    out = scaled_mm(cast(x2, x_scale, torch.float8_e4m3fn), x_scale, cast(weight, w_scale, torch.float8_e4m3fn).t(),
                    w_scale, x2.dtype)
    return out, x_scale, w_scale


def cast_grad(grad2: torch.Tensor, recipe: FP8Recipe, groups: AmaxGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output gradient [tokens, out] in the recipe's gradient format, its scale): cast once for both matmuls."""
    scale = scale_for(amax(grad2, groups.grad), recipe.grad_dtype)
    return cast(grad2, scale, recipe.grad_dtype), scale


def input_grad(g: tuple, weight: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dX [tokens, in] = dY W from the cast gradient ``g`` (``cast_grad``) and the weight cast again."""
    return scaled_mm(g[0], g[1], cast(weight, w_scale, torch.float8_e4m3fn), w_scale, dtype)


def weight_grad(g: tuple, x2: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dW [out, in] = dY^T X from the cast gradient ``g`` and the input [tokens, in] cast again."""
    return scaled_mm(g[0].t().contiguous(), g[1], cast(x2, x_scale, torch.float8_e4m3fn), x_scale, dtype)


class _FP8Linear(torch.autograd.Function):
    """``X W^T`` in FP8 (no bias), ``X`` [..., in], ``W`` [out, in]; saves ``X``, ``W`` and the two scales."""

    @staticmethod
    def forward(ctx, x, weight, recipe: FP8Recipe, groups: AmaxGroups):
        out, x_scale, w_scale = forward_mm(x.reshape(-1, x.shape[-1]), weight, groups)
        ctx.save_for_backward(x, weight, x_scale, w_scale)
        ctx.recipe, ctx.groups = recipe, groups
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, x_scale, w_scale = ctx.saved_tensors
        need_input, need_weight = ctx.needs_input_grad[:2]
        g = cast_grad(grad_out.reshape(-1, grad_out.shape[-1]), ctx.recipe, ctx.groups)
        grad_input = input_grad(g, weight, w_scale, x.dtype).view(x.shape) if need_input else None
        grad_weight = weight_grad(g, x.reshape(-1, x.shape[-1]), x_scale, weight.dtype) if need_weight else None
        return grad_input, grad_weight, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: FP8Recipe, groups: AmaxGroups = AmaxGroups(),
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the matmul (forward and backward) in FP8; the bias added after it."""
    out = _FP8Linear.apply(x, weight, recipe, groups)
    return out if bias is None else out + bias
