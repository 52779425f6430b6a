"""The Mamba-2 mixer of hybrid models (Megatron Core's ``MambaMixer``, Nemotron-H's ``NemotronHMamba2Mixer``), a
layer's sequence mixer in place of attention.

``x [s, b, h]`` ->

1. ``in_proj``: per group ``g`` (of ``G``, each shared by ``H / G`` heads of width ``P``): its heads' output gates
   ``z`` and inputs ``x`` (``[H/G x P]`` each), the group's ``B`` and ``C`` (``[N]`` each) and its heads' steps
   ``dt`` (``[H/G]``). The rows are ordered by group (``[G, (z, x, B, C, dt)]``), so a contiguous block of rows
   holds whole groups: what a tensor-parallel rank would own;
2. a causal depthwise convolution (kernel ``d_conv`` 4, with a bias) of the ``x``, ``B`` and ``C`` channels (ordered
   by group too), then SiLU; within packed documents it does not reach across a document start;
3. the state-space scan (``megatron.hybrid.ssd.chunked``) with ``dt = softplus(dt + dt_bias)``, ``A = -exp(A_log)``
   and the skip ``D``, the state dropped at each document start;
4. ``y * silu(z)`` RMS-normalised over each group's channels (the gated norm, ``norm_before_gate`` off, its weight
   ``[H x P]``), then ``out_proj`` back to ``h``.

Parameters: ``in_proj.weight``, ``conv1d_weight`` and ``conv1d_bias``, ``dt_bias``, ``A_log`` (log U(1, 16)) and
``D`` (ones) per head, ``norm_weight`` (ones), ``out_proj.weight``; no linear biases. Hugging Face's
``NemotronHMamba2Mixer`` holds the same numbers in another order (``in_proj``: all gates, all inputs, all B, all C,
all steps; the convolution's channels: all inputs, all B, all C).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.hybrid import ssd
from megatron.hybrid.gated_deltanet import _pieces, causal_conv

CHUNK = 128  # the chunked scan's chunk (the reference kernels')
D_CONV = 4  # Megatron Core's and Nemotron-H's convolution kernel


def mamba_shape(cfg) -> tuple[int, int, int, int]:
    """(heads H, head width P, groups G, state size N): H = ``mamba_num_heads``, or 2 x hidden / P (Megatron's
    ``expand`` 2)."""
    heads = cfg.mamba_num_heads or 2 * cfg.hidden_size // cfg.mamba_head_dim
    return heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim


class Mamba2Mixer(nn.Module):
    """See the module doc. ``forward(x, kv_cache, rotary, plan)`` as the attention's; ``rotary`` is unused, ``plan``
    gives the documents of packed samples."""

    def __init__(self, cfg, layer_number: int = 0, eps: float | None = None):
        super().__init__()
        self.layer_number = layer_number
        heads, width, groups, state = mamba_shape(cfg)
        if heads % groups:
            raise ValueError(f"mamba_num_heads ({heads}) must be a multiple of mamba_num_groups ({groups})")
        self.num_heads, self.head_dim, self.num_groups, self.state_dim = heads, width, groups, state
        per = heads // groups
        self.in_proj = nn.Linear(cfg.hidden_size, groups * (2 * per * width + 2 * state + per), bias=False)
        channels = groups * (per * width + 2 * state)
        self.conv1d_weight = nn.Parameter(torch.empty(channels, D_CONV))
        self.conv1d_bias = nn.Parameter(torch.empty(channels))
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm_weight = nn.Parameter(torch.empty(heads * width))
        self.eps = cfg.layernorm_epsilon if eps is None else eps
        self.out_proj = nn.Linear(heads * width, cfg.hidden_size, bias=False)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, groups={self.num_groups}, "
                f"state={self.state_dim}, kernel={D_CONV}")

    def forward(self, x: torch.Tensor, kv_cache=None, rotary=None, plan=None) -> torch.Tensor:
        if kv_cache is not None:
            raise NotImplementedError("generation with Mamba-2 layers is not built yet")
        heads, width, groups, state = self.num_heads, self.head_dim, self.num_groups, self.state_dim
        per = heads // groups
        proj = self.in_proj(x)
        s, b, _ = proj.shape
        proj = proj.transpose(0, 1).reshape(b, s, groups, 2 * per * width + 2 * state + per)
        z, xbc, dt = proj.split([per * width, per * width + 2 * state, per], dim=-1)
        pieces = _pieces(xbc.reshape(b, s, -1), plan, D_CONV - 1)
        xbc = torch.cat([F.silu(causal_conv(torch.cat([halo, rows], 1), self.conv1d_weight, doc)[:, halo.shape[1]:]
                                + self.conv1d_bias) for rows, halo, doc, _ in pieces], dim=1).view(b, s, groups, -1)
        inputs, B, C = xbc.split([per * width, state, state], dim=-1)
        dt = F.softplus(dt.reshape(b, s, heads).float() + self.dt_bias.float())
        y, _ = ssd.chunked(inputs.reshape(b, s, heads, width), dt, -self.A_log.float().exp(), B, C, self.D, None,
                           pieces[0][3] if len(pieces) == 1 else None, CHUNK)
        return self.out_proj(self._gated_norm(y.reshape(b, s, -1), z.reshape(b, s, -1)).transpose(0, 1))

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``y * silu(z)`` RMS-normalised over each group's channels (fp32), times the weight."""
        b, s, _ = y.shape
        gated = (y.float() * F.silu(z.float())).view(b, s, self.num_groups, -1)
        normed = gated * torch.rsqrt(gated.square().mean(-1, keepdim=True) + self.eps)
        return (self.norm_weight * normed.view(b, s, -1).to(y.dtype)).to(y.dtype)
