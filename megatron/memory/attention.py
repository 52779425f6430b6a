"""Activation memory of a decoder layer's attention block: what it saves for the backward from its input (the first
norm's output) to the dense layer's input, for standard attention (``transformer.SelfAttention``, with QK-norm)
and multi-latent attention (``mla.MultiLatentAttention``), and the transient buffers of context-parallel
attention. Sizes on one rank as ``megatron.memory.activations`` names them (``n = b s / c`` tokens, ``n'`` the
sequence shard under sequence parallelism, ``a`` query heads, ``g`` key/value groups of ``hd`` channels, ``d``
bytes per element, ``st`` LayerNorm's statistic bytes; the norms as ``megatron.memory.ops``).

Standard attention (``standard_terms``)::

    qkv input       n' h d                       the norm's output (only the shard under sp)
    qk norms        (--qk-layernorm) per head of q and k: LayerNorm 2 st, RMSNorm 4 + 4 hd (+ 4 hd: the fp32
                    copy in bf16); the norms keep q and k as given (LayerNorm, RMSNorm in fp32): views of the QKV
                    output, so nothing more, but the grouped queries' copy (n a hd d) and, when the core keeps no
                    view of it (math kernel in bf16 or grouped, a2a), the QKV output itself
    core            flash: given + out + lse; math: see ``core_terms``
    dense input     n a hd d

``given`` (the q, k and v the core receives) is the QKV output ``n (a + 2g) hd d`` (v, a view of it, keeps it
whole) plus ``n a hd d`` when q is a tensor of its own (rotated, normalised, or the reshaped copy of grouped
queries: g > 1 groups of several) and ``n g hd d`` when k is (rotated or normalised). q is laid out
``[s, b, a, hd]`` (a view of the QKV output, or an elementwise op of one: rope) unless partial rope (``torch.cat``)
or the QK norms (their output is contiguous ``[b, a, s, hd]``) made it ``[b, a, s, hd]``: an output allocated in
q's layout is then not the dense input's order, which copies it (``out``: ``n a hd d`` more, unless a = b = 1).

Multi-latent attention (``mla_terms``; ``dn``, ``dr``, ``dv`` the q/k channels without and with rope and the
value's, ``dk = dn + dr``, ``r_q``, ``r_kv`` the LoRA ranks, ``a`` heads on this rank)::

    qkv input       n h d                        the norm's output, whole: the down-projections are replicated
                                                 and under sp gather the sequence first (kept by them and q_proj)
    q latent        (q LoRA) q_down's output n r_q d; with --qk-layernorm its norm over n rows of r_q and the
                    normalised latent q_up keeps, n r_q d
    kv latent       kv_down's output n (r_kv + dr) d (the latent a view of it); with --qk-layernorm its norm (the
                    input, a view, keeps that storage) and the normalised latent kv_up keeps, n r_kv d
    core            given = q and k (torch.cat's, [b, a, s, dk]) 2 n a dk d + v: its contiguous copy n a dv d,
                    or through the attention plan (cp > 1, packed documents) a view of kv_up's output,
                    n a (dn + dv) d; out (n a dv d, unless a = b = 1: q is [b, a, s, dk]) and lse
    dense input     n a dv d

The decoupled rotary key (kv_down's last ``dr`` channels, expanded to every head) and the query's rotary part are
rotated and concatenated (rope keeps only cos and sin, counted per chunk with ``rot = dr``; ``torch.cat`` keeps
nothing). The q_proj / q_up and kv_up outputs are not kept otherwise. On the CPU the fused kernel wants one width
for q, k and v, so with ``dk != dv`` ``F.scaled_dot_product_attention`` runs the math kernel, dropout or not
(``attention_kernel``); on GPUs the memory-efficient kernel (FlashAttention-2 wants one width too) keeps what the
flash kernel does.

The core (``core_terms``; ``dk``, ``dv`` the query/key and value widths, ``hd`` both for standard attention):

- flash: ``given``, the output ``n a dv d`` when it is not the dense input (see above; always with packed
  documents: one call per document, their concatenation copied) and the fp32 log-sum-exp ``4 n a``;
- math (fp32 inside; grouped keys and values repeated to ``a`` heads): the scaled q and k ``2 x 4 n a dk``, the
  softmax ``4 b a s^2``, with dropout its mask and the dropped probabilities (``(m' + 4) b a s^2``, ``m'`` = 4 on
  the CPU, 1 on GPUs) and v: in fp32 where it need not be copied its storage (standard attention without
  grouping: the QKV output; multi-latent attention: v as given), else an fp32 copy ``4 n a dv``;
- context parallelism, p2p and all_gather (``RingAttention``, ``GatheredAttention``: custom autograd functions
  whatever the kernel): ``given``, their output (in q's layout, as the flash kernel's) and the fp32 log-sum-exp,
  with attention dropout too (its masks are drawn again in the backward, ``attention.dropout``);
- a2a: whole sequences of ``a / c`` heads; q, k and v the all-to-all's own ``n (a dk + g (dk + dv)) d``, then
  the kernel's saves on them (the probabilities ``b (a / c) s^2``), the output its own;
- a2a+p2p: the ring's saves on the inner all-to-all's q, k and v (``I`` times the tokens of ``a / I`` heads: the
  same bytes as a2a's), its output in their layout and the log-sum-exp;
- ``core_attn`` recompute: ``given`` only (the checkpoint's inputs).

Packed documents run one kernel call per document on slices of q, k and v: the same bytes but for the output
(the math kernel's probabilities then bounded by ``s^2`` per sample).

Sliding windows and attention sinks (gpt-oss) attend through the plan's blocks (``LocalAttention``, a custom
autograd function like the ring's): ``given``, the output and the log-sum-exp, the bytes the flash kernel keeps;
off-by-one sinks add the zero logits (``a d``). With attention dropout a window is the masked math softmax, counted
as the math kernel; sinks with dropout (the softmax with a sink column) are counted as without the column (a few
percent off).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.attention.tiling import tile_rows
from megatron.config.schema import Config
from megatron.memory.ops import norm_bytes, saves_input_itself


@dataclass(frozen=True)
class MLADims:
    """Multi-latent attention's widths (``megatron.model.mla``); the heads on this rank are ``Dims.a``."""

    dn: int  # q/k channels without rope
    dr: int  # rotary channels (the shared rotary key's)
    dv: int  # value channels
    kv_lora: int
    q_lora: int | None  # None: one query projection
    norms: bool  # the latent norms (--qk-layernorm)

    @property
    def dk(self) -> int:
        return self.dn + self.dr


def mla_dims(config: Config) -> MLADims | None:
    m = config.model
    if not m.multi_latent_attention:
        return None
    return MLADims(dn=m.qk_head_dim, dr=m.qk_pos_emb_head_dim, dv=m.v_head_dim, kv_lora=m.kv_lora_rank,
                   q_lora=m.q_lora_rank, norms=m.qk_layernorm)


def attention_kernel(config: Config) -> str:
    """The kernel ``F.scaled_dot_product_attention`` runs in training: on GPUs a fused one ("flash"); on the CPU
    the math kernel with attention dropout or unequal q/k and v widths (multi-latent attention), else flash."""
    if config.device == "gpu":
        return "flash"
    m = config.model
    widths = m.multi_latent_attention and m.qk_head_dim + m.qk_pos_emb_head_dim != m.v_head_dim
    return "math" if m.attention_probs_dropout_prob > 0 or widths else "flash"


@dataclass(frozen=True)
class CoreInputs:
    """What the attention core is given, as ``core_terms`` reads it."""

    given: int  # bytes of the storages q, k and v belong to (what a core keeping them as given holds)
    dk: int  # query / key width
    dv: int  # value width
    g: int  # key / value heads on this rank
    q_batch_major: bool  # q laid out [b, a, s, dk]: an output in its layout is not the dense input
    v_math: int  # bytes of v the math kernel keeps (a view of its storage, or an fp32 copy)


def core_terms(D, c: CoreInputs) -> dict[str, int]:
    """What the attention core saves (``megatron.context_parallel.attend`` and the kernels under it): see the
    module docstring."""
    n, a = D.n, D.a
    lse = 4 * n * a
    if D.cp > 1 and D.cp_comm in ("p2p", "all_gather"):  # their output in q's layout, as the flash kernel's
        own_out = c.q_batch_major and (a > 1 or D.b > 1)
        return {"attention q, k, v": c.given, "attention out": own_out * n * a * c.dv * D.d, "attention lse": lse}
    if D.cp > 1 and D.cp_comm == "a2a+p2p":  # the ring on the all-to-all's copies
        return {"attention q, k, v": n * (a * c.dk + c.g * (c.dk + c.dv)) * D.d, "attention out": n * a * c.dv * D.d,
                "attention lse": lse}
    ulysses = D.cp > 1  # a2a
    if D.kernel == "flash":
        own_out = ulysses or D.documents or (c.q_batch_major and (a > 1 or D.b > 1))
        exchanged = n * (a * c.dk + c.g * (c.dk + c.dv)) * D.d  # q, k, v after the all-to-all
        return {"attention q, k, v": exchanged if ulysses else c.given, "attention out": own_out * n * a * c.dv * D.d,
                "attention lse": lse}
    scores = n * a * D.s  # b a s^2; under a2a b (a / cp) s^2
    terms = {"attention q, k scaled": 2 * 4 * n * a * c.dk, "attention probs": 4 * scores,
             "attention v": 4 * n * a * c.dv if ulysses else c.v_math}
    if D.attn_dropout:
        terms["attention dropout"] = (D.mask if D.device == "gpu" else 4) * scores + 4 * scores
    return terms


def keeps_given(D, recompute: str | None) -> bool:
    """Whether the core keeps q, k and v as given (rather than copies of its own)."""
    if recompute == "core_attn" or (D.cp > 1 and D.cp_comm in ("p2p", "all_gather")):
        return True
    return D.cp == 1 and D.kernel == "flash"


def standard_terms(D, recompute: str | None = None) -> dict[str, int]:
    """``SelfAttention``'s saves (``recompute``: None or ``core_attn``): see the module docstring."""
    n, a, g, hd, d = D.n, D.a, D.g, D.hd, D.d
    qkv_out = n * (a + 2 * g) * hd * d
    q_copy = g > 1 and a != g  # grouped queries: the reshape copies (one group: a view)
    rope = D.rot > 0
    given = qkv_out + (rope or D.qk_norm or q_copy) * n * a * hd * d + (rope or D.qk_norm) * n * g * hd * d
    v_view = d == 4 and a == g  # the math kernel keeps v as a view of the QKV output (fp32, ungrouped)
    v_math = qkv_out if v_view else 4 * n * a * hd
    terms = {"qkv input": D.n_sp * D.h * d}
    if D.qk_norm:  # q's input its copy (grouped), else a view of the QKV output, as k's
        terms["qk norms"] = norm_bytes(D, n * a, hd, q_copy * n * a * hd * d) + norm_bytes(D, n * g, hd, 0)
        core_keeps_qkv = keeps_given(D, recompute) or (v_view and D.cp == 1 and D.kernel == "math")
        if saves_input_itself(D) and not core_keeps_qkv:  # the norms keep views of it
            terms["qk norms"] += qkv_out
    layout = CoreInputs(given, hd, hd, g, 0 < D.rot < hd or D.qk_norm, v_math)
    core = {"attention q, k, v": given} if recompute == "core_attn" else core_terms(D, layout)
    if D.zero_sinks and recompute != "core_attn":  # off-by-one: the zero logit of each head, kept by the core
        core["attention sinks"] = a * d
    return {**terms, **core, "dense input": n * a * hd * d}


def mla_terms(D, recompute: str | None = None) -> dict[str, int]:
    """``MultiLatentAttention``'s saves (``recompute``: None or ``core_attn``): see the module docstring."""
    M, n, a, d = D.mla, D.n, D.a, D.d
    terms = {"qkv input": n * D.h * d}
    if M.q_lora is not None:
        latent = n * M.q_lora * d
        terms["q latent"] = norm_bytes(D, n, M.q_lora) + latent if M.norms else latent
    kv_down = n * (M.kv_lora + M.dr) * d
    terms["kv latent"] = norm_bytes(D, n, M.kv_lora, kv_down) + n * M.kv_lora * d if M.norms else kv_down
    planned = D.cp > 1 or D.documents  # attend through the plan: v is given as a view of kv_up's output
    v = n * a * (M.dn + M.dv) * d if planned else n * a * M.dv * d
    given = 2 * n * a * M.dk * d + v
    layout = CoreInputs(given, M.dk, M.dv, a, True, v if d == 4 else 4 * n * a * M.dv)
    core = {"attention q, k, v": given} if recompute == "core_attn" else core_terms(D, layout)
    return {**terms, **core, "dense input": n * a * M.dv * d}


def attention_terms(D, recompute: str | None = None) -> dict[str, int]:
    """The attention block's saves, from its input (the first norm's output) to the dense layer's input."""
    return (mla_terms if D.mla is not None else standard_terms)(D, recompute)


def core_widths(D) -> tuple[int, int, int]:
    """(key / value heads, query / key width, value width) of the attention core on this rank."""
    if D.mla is not None:
        return D.a, D.mla.dk, D.mla.dv
    return D.g, D.hd, D.hd


# ---------------------------------------------------------------------------- context parallelism's temporaries


def context_parallel_terms(D) -> dict[str, int]:
    """The transient bytes of one layer's context-parallel attention, forward and backward (``dk``, ``dv`` the
    query/key and value widths, ``hd`` both for standard attention; ``kv = n g (dk + dv) d``: this rank's keys and
    values packed in one buffer; fp32 accumulators ``acc = 4 n a dv + 4 n a`` of the output and log-sum-exp;
    ``dkv = n g (dk + dv) 4``: fp32 gradients of keys and values):

    - p2p forward: the packed keys and values, the receive buffer of the next rank's, the running
      accumulators and one step's block result (2 kv + 2 acc); backward: the keys and values and their
      receive buffer, the dK/dV accumulator being sent and the one being received, the fp32 dQ and the
      contiguous output gradient (2 kv + 2 dkv + 4 n a dk + n a dv d);
    - all_gather forward: every rank's keys and values (cp kv) with the packed local ones during the gather,
      then the accumulators; backward: them gathered again, fp32 dK/dV for every rank and this rank's
      reduce-scattered share, dQ and the output gradient;
    - a2a: the all-to-all's send (stacked) and receive buffers of the queries and of the output
      (2 n a max(dk, dv) d), forward and backward alike;
    - on GPUs, p2p and all_gather compute each block in plain fp32 operations, a tile of query rows at a
      time (``attention.blocks``; the CPU's fused kernel keeps none of this): the backward of the
      diagonal block holds its keys and values expanded to ``a`` heads in fp32 with their gradients
      (``2 x 4 n a (dk + dv)``), its fp32 dQ (``4 n a dk``) and, per tile, the probabilities, their gradient, a
      difference and the score gradient (``4`` fp32 ``[b, a, rows, L]``, each at most ``MATH_TILE_BYTES``);
      its forward holds fewer;
    - with attention dropout the blocks run that plain kernel on the CPU too, and each tile draws its mask
      (``attention.dropout``; nothing of it is saved): its int64 hash words while they are mixed, the fp32
      scale ``keep / (1 - p)`` and the dropped probabilities, counted as 10 more fp32 tiles.

    Not counted: the kernel's own per-block outputs and gradients (at most one block's ``q, k, v``), and on the
    CPU the zero-padded copies that feed unequal widths (multi-latent attention) to its fused kernel."""
    n, a, d, cp = D.n, D.a, D.d, D.cp
    g, dk, dv = core_widths(D)
    if D.cp_comm == "a2a":
        return {"forward": 2 * n * a * max(dk, dv) * d, "backward": 2 * n * a * max(dk, dv) * d}
    kv, acc, dkv = n * g * (dk + dv) * d, 4 * n * a * dv + 4 * n * a, n * g * (dk + dv) * 4
    grads = 4 * n * a * dk + n * a * dv * d  # fp32 dQ, the output gradient made contiguous
    blocks = 0
    if D.device == "gpu" or D.attn_dropout:  # the plain block kernel (with dropout: positional masks, on any device)
        row = D.b * a * D.length * 4  # one query row of the diagonal block's fp32 scores, every sample and head
        tile = row * min(D.length, tile_rows(row))
        blocks = 2 * 4 * n * a * (dk + dv) + 4 * n * a * dk + (14 if D.attn_dropout else 4) * tile
    if D.cp_comm == "all_gather":
        return {"forward": cp * kv + max(kv, 2 * acc), "backward": cp * kv + (cp + 1) * dkv + grads + blocks}
    return {"forward": 2 * kv + 2 * acc, "backward": 2 * kv + 2 * dkv + grads + blocks}
