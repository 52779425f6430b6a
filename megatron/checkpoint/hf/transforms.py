"""The named tensor transforms the Hugging Face families share (``mapping.Transform``: each both ways): the
vocabulary padding, the fused query/key/value split by key/value group (Llama) or by head (GPT-2), GPT-2's
transposed Conv1D weights, the interleaved gate/up rows, a constant factor. A family's own (DeepSeek-V3's rotary
de-interleave and latent scale) are in its file."""

from __future__ import annotations

import torch

from megatron.checkpoint.hf.common import pad_vocab, unpad_vocab
from megatron.checkpoint.hf.mapping import Transform, per_part


def _dims(m) -> tuple[int, int]:
    """(query heads, key/value groups) of our ``ModelConfig``."""
    nq = m.num_attention_heads
    return nq, (m.num_query_groups or nq) if m.group_query_attention else nq


def _qkv_to_groups(t: torch.Tensor, ctx, ours: str) -> list[torch.Tensor]:
    """Rows ``[ng, (r q, k, v), hd]`` -> q ``[nq * hd]``, k and v ``[ng * hd]`` rows (any trailing dims)."""
    nq, ng = _dims(ctx.m)
    r, rest = nq // ng, t.shape[1:]
    groups = t.reshape(ng, r + 2, -1, *rest)
    return [groups[:, :r].reshape(-1, *rest), groups[:, r].reshape(-1, *rest), groups[:, r + 1].reshape(-1, *rest)]


def _qkv_from_groups(parts: list[torch.Tensor], ctx) -> torch.Tensor:
    nq, ng = _dims(ctx.m)
    q, k, v = parts
    r, rest = nq // ng, q.shape[1:]
    pieces = (q.reshape(ng, r, -1, *rest), k.reshape(ng, 1, -1, *rest), v.reshape(ng, 1, -1, *rest))
    return torch.cat(pieces, dim=1).reshape(-1, *rest)


def _gate_up_to_hf(t: torch.Tensor, ctx, ours: str) -> list[torch.Tensor]:
    pairs = t.reshape(-1, 2, *t.shape[1:])  # row 2j: gate_j, row 2j + 1: up_j
    return [pairs[:, 0], pairs[:, 1]]


def _qkv_heads_to_hf(t: torch.Tensor, ctx) -> torch.Tensor:
    """Rows ``[head, (q, k, v), head_dim]`` -> ``[(q, k, v), head, head_dim]`` (any trailing dims)."""
    rest = t.shape[1:]
    return t.reshape(ctx.m.num_attention_heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_heads_from_hf(t: torch.Tensor, ctx) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(3, ctx.m.num_attention_heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def _conv1d(t: torch.Tensor, ctx) -> torch.Tensor:
    return t.t() if t.dim() == 2 else t


# the word embedding / an untied head: our padded_vocab_size rows <-> Hugging Face's vocab_size (padding rows zero)
VOCAB = Transform("vocab padding", lambda t, ctx, ours: [unpad_vocab(t, ctx.m.vocab_size, ours)],
                  lambda parts, ctx: pad_vocab(parts[0], ctx.padded_vocab))
# our fused query_key_value, rows by key/value group <-> q_proj, k_proj, v_proj (Llama and every family on it)
QKV_GROUPS = Transform("qkv by group", _qkv_to_groups, _qkv_from_groups)
# our dense_h_to_4h, gate and up rows interleaved <-> gate_proj (w1) and up_proj (w3)
GATE_UP = Transform("gate/up interleave", _gate_up_to_hf,
                    lambda parts, ctx: torch.stack(parts, dim=1).reshape(-1, *parts[0].shape[1:]))
# GPT-2's fused c_attn: rows by head <-> by q, k, v
QKV_HEADS = per_part("qkv by head", _qkv_heads_to_hf, _qkv_heads_from_hf)
# GPT-2's Conv1D weights ([in, out]) <-> our Linear's ([out, in]); a bias as it is
CONV1D = per_part("conv1d transpose", _conv1d, _conv1d)
# a stacked expert's weight (gpt-oss: [in, out]) <-> ours
TRANSPOSED = per_part("transpose", lambda t, ctx: t.t(), lambda t, ctx: t.t())


def scaled(factor: float) -> Transform:
    """Hugging Face's tensor is ours times ``factor`` (exact for a power of two)."""
    return per_part(f"times {factor}", lambda t, ctx: t * factor, lambda t, ctx: t * (1.0 / factor))
