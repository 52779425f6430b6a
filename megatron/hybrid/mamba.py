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
from megatron.hybrid.gated_deltanet import convolved, sequence_pieces

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

    def cut_heads(self, size: int, rank: int) -> None:
        """This tensor-parallel rank's groups (with their heads): ``tensor_parallel.parallelize`` splits ``in_proj``
        by output rows and ``out_proj`` by input columns (both ordered by group); here the convolution's channels and
        bias, ``dt_bias``, ``A_log``, ``D`` and the gated norm's weight keep this rank's groups."""
        from megatron.tensor_parallel.layers import rank_rows

        if self.num_groups % size or self.num_heads % size:
            raise ValueError(f"mamba_num_groups ({self.num_groups}) and the heads ({self.num_heads}) must be "
                             f"divisible by the tensor-parallel size ({size})")
        for name in ("conv1d_weight", "conv1d_bias", "dt_bias", "A_log", "D", "norm_weight"):
            setattr(self, name, rank_rows(getattr(self, name), rank, size))
        self.num_heads, self.num_groups = self.num_heads // size, self.num_groups // size

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, groups={self.num_groups}, "
                f"state={self.state_dim}, kernel={D_CONV}")

    @property
    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """What generation keeps per row (``inference.KVCache``): the convolution's last ``D_CONV - 1`` rows and
        the scan's state of this rank's heads."""
        return {"conv": (D_CONV - 1, self.conv1d_weight.shape[0]),
                "recurrent": (self.num_heads, self.state_dim, self.head_dim)}

    def forward(self, x: torch.Tensor, kv_cache=None, rotary=None, plan=None) -> torch.Tensor:
        heads, width, groups, state = self.num_heads, self.head_dim, self.num_groups, self.state_dim
        per = heads // groups
        proj = self.in_proj(x)
        s, b, _ = proj.shape
        proj = proj.transpose(0, 1).reshape(b, s, groups, 2 * per * width + 2 * state + per)
        z, xbc, dt = proj.split([per * width, per * width + 2 * state, per], dim=-1)
        # generation: after the cached rows, which then hold this forward's (the scan's state below)
        pieces = sequence_pieces(xbc.reshape(b, s, -1), plan, D_CONV - 1, kv_cache, self.layer_number)
        xbc = convolved(pieces, self.conv1d_weight, self.conv1d_bias).view(b, s, groups, -1)
        cached = kv_cache.states[self.layer_number] if kv_cache is not None else None
        inputs, B, C = xbc.split([per * width, state, state], dim=-1)
        dt = F.softplus(dt.reshape(b, s, heads).float() + self.dt_bias.float())
        args = (inputs.reshape(b, s, heads, width), dt, -self.A_log.float().exp(), B, C, self.D)
        if kv_cache is None and len(pieces) == 1:
            y, _ = ssd.chunked(*args, None, pieces[0][3], CHUNK)
        elif kv_cache is None:  # context parallelism: each chunk from the state the earlier chunks hand it
            y = self._scan_chunks(args, [resets for *_, resets in pieces], plan)
        elif s == 1:
            y, cached["recurrent"] = ssd.recurrent(*args, cached["recurrent"], pieces[0][3])
        else:
            y, cached["recurrent"] = ssd.chunked(*args, cached["recurrent"], pieces[0][3], CHUNK)
        return self.out_proj(self._gated_norm(y.reshape(b, s, -1), z.reshape(b, s, -1)).transpose(0, 1))

    @staticmethod
    def _scan_chunks(args: tuple, resets: list, plan) -> torch.Tensor:
        """The scan over this rank's two chunks, each from its entering state (``context_parallel``)."""
        from megatron.hybrid.context_parallel import scan_entering_states

        x, dt, A, B, C, D = args
        length = x.shape[1] // 2
        x, dt, B, C = ([t[:, i * length:(i + 1) * length] for i in range(2)] for t in (x, dt, B, C))
        starts = scan_entering_states(x, dt, A, B, C, resets, plan, CHUNK)
        return torch.cat([ssd.chunked(x[i], dt[i], A, B[i], C[i], D, starts[i], resets[i], CHUNK)[0]
                          for i in range(2)], dim=1)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``y * silu(z)`` RMS-normalised over each group's channels (fp32), times the weight."""
        b, s, _ = y.shape
        gated = (y.float() * F.silu(z.float())).view(b, s, self.num_groups, -1)
        normed = gated * torch.rsqrt(gated.square().mean(-1, keepdim=True) + self.eps)
        return (self.norm_weight * normed.view(b, s, -1).to(y.dtype)).to(y.dtype)
