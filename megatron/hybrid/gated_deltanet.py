"""Qwen3-Next's linear-attention layer, Gated DeltaNet (Megatron Core's ``GatedDeltaNet``,
``--experimental-attention-variant gated_delta_net``), in the place of a layer's attention.

``x [s, b, h]`` ->

1. ``in_proj``: per key head ``j`` (of ``nk``), with ``r = nv / nk`` value heads each: the query and key
   ``[dk]``, the values and output gates ``z`` of its value heads ``[r dv]`` each, and their ``b`` and ``a``
   ``[r]`` each. The rows are ordered by key head (``[nk, (q, k, v, z, b, a)]``), so a contiguous block of rows
   holds whole heads, as the attention's QKV rows are ordered by group;
2. a causal depthwise convolution over the sequence (kernel ``linear_conv_kernel_dim``, no bias) of the query, key
   and value channels (ordered by key head too: ``conv1d [nk (2 dk + r dv), kernel]``), then SiLU. Within packed
   documents it does not reach across a document start;
3. q and k L2-normalised (eps 1e-6, as the reference kernels), q scaled by ``dk^-1/2``; each value head reads its
   key head's q and k;
4. the gated delta rule (``megatron.hybrid.delta_rule.chunked``) with ``beta = sigmoid(b)`` and the log-decay
   ``g = -exp(A_log) softplus(a + dt_bias)`` (fp32), the state dropped at each document start;
5. each value head's output RMS-normalised (``out_norm``, over ``dv``: zero-centred with ``--apply-layernorm-1p``)
   and multiplied by ``silu(z)``; ``out_proj`` back to ``h``.

Parameters: ``in_proj.weight``, ``conv1d_weight``, ``dt_bias`` (ones) and ``A_log`` (log of U(1, 16)) per value
head, ``out_norm.weight``, ``out_proj.weight``. No biases (Megatron Core's default). Hugging Face's
``Qwen3NextGatedDeltaNet`` holds the same numbers in another order (``in_proj_qkvz`` and ``in_proj_ba``; the
convolution's channels query-major): ``megatron.checkpoint.hf`` maps them.

Tensor parallelism splits the key heads (with their value heads) over the ranks (``cut_heads``); context
parallelism passes the convolution's halos and the recurrent states between the ranks' chunks
(``megatron.hybrid.context_parallel``). Generation keeps the convolution's last rows and the recurrent state per
row (``state_shapes``, ``inference.KVCache``): the prompt through the chunked form, each new token through the
recurrent one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.hybrid import delta_rule

CHUNK = 64  # the chunked delta rule's chunk (the reference kernels')


def linear_attention_shape(cfg: ModelConfig) -> tuple[int, int, int, int, int]:
    """(key heads nk, value heads nv, key width dk, value width dv, convolution kernel)."""
    return (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, doc: torch.Tensor | None) -> torch.Tensor:
    """``x [b, s, c]``, ``weight [c, K]``: ``y_t = sum_i w[:, i] x_{t - K + 1 + i}`` over the earlier positions of
    ``x_t``'s document (``doc [b, s]`` document ids, or None: one document)."""
    kernel, s = weight.shape[1], x.shape[1]
    y = x * weight[:, -1]
    for shift in range(1, min(kernel, s)):
        earlier = F.pad(x[:, :-shift], (0, 0, shift, 0))
        if doc is not None:
            same = F.pad(doc[:, :-shift], (shift, 0), value=-1) == doc
            earlier = earlier * same[..., None].to(x.dtype)
        y = y + earlier * weight[:, kernel - 1 - shift]
    return y


class GatedDeltaNet(nn.Module):
    """See the module doc. ``make_norm(cfg, size)`` builds the model's norm (``megatron.model.blocks.make_norm``:
    this package imports nothing of the model). ``forward(x, kv_cache, rotary, plan)`` as the attention's;
    ``rotary`` is unused (no positions), ``plan`` gives the documents of packed samples."""

    def __init__(self, cfg: ModelConfig, make_norm: Callable[..., nn.Module], layer_number: int = 0):
        super().__init__()
        self.layer_number = layer_number
        nk, nv, dk, dv, kernel = linear_attention_shape(cfg)
        if nv % nk:
            raise ValueError(f"linear_num_value_heads ({nv}) must be a multiple of linear_num_key_heads ({nk})")
        self.num_key_heads, self.num_value_heads, self.key_dim, self.value_dim = nk, nv, dk, dv
        r = nv // nk
        self.in_proj = nn.Linear(cfg.hidden_size, nk * (2 * dk + 2 * r * dv + 2 * r), bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(nk * (2 * dk + r * dv), kernel))
        self.dt_bias = nn.Parameter(torch.empty(nv))
        self.A_log = nn.Parameter(torch.empty(nv))
        self.out_norm = make_norm(cfg, size=dv)
        self.out_proj = nn.Linear(nv * dv, cfg.hidden_size, bias=False)

    def cut_heads(self, size: int, rank: int) -> None:
        """This tensor-parallel rank's key heads (with their value heads): ``tensor_parallel.parallelize`` splits
        ``in_proj`` by output rows and ``out_proj`` by input columns (both ordered by key head); here the
        convolution's channels, ``dt_bias`` and ``A_log`` keep this rank's heads, and ``out_norm`` (replicated, fed
        this rank's heads) has its gradients summed over the group."""
        from megatron.tensor_parallel.layers import mark_sequence_parallel, rank_rows

        if self.num_key_heads % size:
            raise ValueError(f"linear_num_key_heads ({self.num_key_heads}) must be divisible by the tensor-parallel "
                             f"size ({size})")
        for name in ("conv1d_weight", "dt_bias", "A_log"):
            setattr(self, name, rank_rows(getattr(self, name), rank, size))
        self.num_key_heads, self.num_value_heads = self.num_key_heads // size, self.num_value_heads // size
        mark_sequence_parallel(self.out_norm)

    def extra_repr(self) -> str:
        return (f"key_heads={self.num_key_heads}, value_heads={self.num_value_heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}, kernel={self.conv1d_weight.shape[1]}")

    @property
    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """What generation keeps per row (``inference.KVCache``): the last ``kernel - 1`` rows the convolution reads
        and the recurrent state of this rank's value heads."""
        width = self.conv1d_weight.shape[1] - 1
        return {"conv": (width, self.conv1d_weight.shape[0]),
                "recurrent": (self.num_value_heads, self.key_dim, self.value_dim)}

    def forward(self, x: torch.Tensor, kv_cache=None, rotary=None, plan=None) -> torch.Tensor:
        nk, nv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_dim, self.value_dim  # this rank's
        r = nv // nk
        proj = self.in_proj(x)  # [s, b, ...]: the whole sequence under sequence parallelism
        s, b, _ = proj.shape
        proj = proj.transpose(0, 1).reshape(b, s, nk, 2 * dk + 2 * r * dv + 2 * r)
        qkv, z, beta, a = proj.split([2 * dk + r * dv, r * dv, r, r], dim=-1)
        pieces = sequence_pieces(qkv.reshape(b, s, -1), plan, self.conv1d_weight.shape[1] - 1, kv_cache,
                                 self.layer_number)
        qkv = convolved(pieces, self.conv1d_weight).view(b, s, nk, -1)
        q, k, v = qkv.split([dk, dk, r * dv], dim=-1)
        q, k = (t.float() * torch.rsqrt(t.float().square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        q = q * dk ** -0.5
        q, k = (t.repeat_interleave(r, dim=2) for t in (q, k))  # value head i reads key head i // r
        v = v.reshape(b, s, nv, dv)
        g = -self.A_log.float().exp() * F.softplus(a.reshape(b, s, nv).float() + self.dt_bias.float())
        beta = beta.reshape(b, s, nv).sigmoid()
        if kv_cache is not None:
            state = kv_cache.states[self.layer_number]
            form = delta_rule.recurrent if s == 1 else partial(delta_rule.chunked, chunk_size=CHUNK)
            out, state["recurrent"] = form(q, k, v, g, beta, state["recurrent"], pieces[0][3])
        else:
            out = _recurrence(q, k, v, g, beta, [resets for *_, resets in pieces], plan)
        out = self.out_norm(out) * F.silu(z.reshape(b, s, nv, dv).float()).to(out.dtype)
        return self.out_proj(out.reshape(b, s, nv * dv).transpose(0, 1))


def convolved(pieces: list[tuple], weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The causal convolution (plus ``bias``) and SiLU of the pieces' rows, each after its halo, concatenated."""
    out = [causal_conv(torch.cat([halo, rows], 1), weight, doc)[:, halo.shape[1]:] for rows, halo, doc, _ in pieces]
    return torch.cat([F.silu(o if bias is None else o + bias) for o in out], dim=1)


def sequence_pieces(qkv: torch.Tensor, plan, width: int, kv_cache=None, layer: int = 0) -> list[tuple]:
    """(rows, the ``width`` rows before them, the document ids of both or None, resets or None) of each piece of
    the sequence this rank holds: the whole of it, or under context parallelism its two chunks (their halos from
    the ranks holding the chunks before them). In generation (``kv_cache``): this forward's rows after the rows
    ``layer`` cached, which then become its last ``width`` rows; padding slots are another document."""
    b, s, _ = qkv.shape
    if kv_cache is not None:
        states = kv_cache.states[layer]
        docs = kv_cache.slot_documents(max(width, 1))  # this forward's slots and at least one before
        resets = (docs[:, 1:] != docs[:, :-1])[:, -s:]
        pieces = [(qkv, states["conv"], docs[:, docs.shape[1] - width - s:], resets)]
        states["conv"] = torch.cat([states["conv"], qkv], 1)[:, -width:] if width else states["conv"]
        return pieces
    docs = None if plan is None or plan.document_ids is None else plan.document_ids  # over the whole sequence
    if plan is None or plan.cp_size == 1:
        resets = None if docs is None else F.pad(docs[:, 1:] != docs[:, :-1], (1, 0))
        return [(qkv, qkv.new_zeros(b, 0, qkv.shape[-1]), docs, resets)]
    from megatron.attention.plan import chunk_ids
    from megatron.hybrid.context_parallel import halos

    length, out = s // 2, []
    for (i, chunk), halo in zip(enumerate(chunk_ids(plan.cp_rank, plan.cp_size)), halos(qkv, width, plan)):
        rows, start = qkv[:, i * length:(i + 1) * length], chunk * length
        doc = resets = None
        if docs is not None:
            before = docs[:, max(0, start - width):start]
            doc = torch.cat([F.pad(before, (width - before.shape[1], 0), value=-1), docs[:, start:start + length]], 1)
            here = docs[:, max(0, start - 1):start + length]
            resets = here[:, 1:] != here[:, :-1] if start else F.pad(here[:, 1:] != here[:, :-1], (1, 0))
        out.append((rows, halo, doc, resets))
    return out


def _recurrence(q, k, v, g, beta, resets: list, plan) -> torch.Tensor:
    """The gated delta rule over the rank's pieces: from no state (one piece), or under context parallelism each
    chunk from the state the earlier chunks hand it (``context_parallel.entering_states``)."""
    if len(resets) == 1:
        return delta_rule.chunked(q, k, v, g, beta, None, resets[0], CHUNK)[0]
    from megatron.hybrid.context_parallel import entering_states

    length = q.shape[1] // 2
    parts = [[t[:, i * length:(i + 1) * length] for i in range(2)] for t in (q, k, v, g, beta)]
    starts = entering_states(*parts, resets, plan, CHUNK)
    return torch.cat([delta_rule.chunked(*(t[i] for t in parts), starts[i], resets[i], CHUNK)[0] for i in range(2)],
                     dim=1)
