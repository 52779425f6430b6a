"""Activation memory: the bytes one micro-batch's forward saves for the backward, for this model's
exact ops, and the micro-batches a pipeline schedule keeps in flight.

Notation (sizes on one rank): ``b`` micro-batch, ``s`` sequence, ``c`` context-parallel size,
``n = s b / c`` tokens (each rank holds ``L = s / c`` tokens of each sample), ``h`` hidden, ``t`` tensor-parallel
size, ``n' = n / t`` under sequence parallelism (else ``n``), ``a = nq / t`` query heads and ``g = ng / t``
key/value groups of ``hd`` channels, ``f`` the MLP width / t, ``V`` the padded vocabulary / t, ``d`` bytes
per activation element (4 fp32, 2 bf16/fp16). Dropout masks take ``m`` bytes per element: ``d`` on the CPU
(``at::dropout`` keeps a scaled mask in the input's dtype), 1 on GPUs (``native_dropout``'s bool mask).
LayerNorm's mean and rstd take ``d`` bytes each on the CPU, 4 on GPUs (``st``). The math kernel's
probability mask takes ``m'`` = 4 bytes on the CPU (fp32 inside), 1 on GPUs. Every storage is counted once
(a view saved by two ops costs its storage once). Three modules: this one (the layer, the chunk, the stage, the
schedule, the temporaries), ``megatron.memory.attention`` (the attention block: standard attention with QK-norm,
multi-latent attention, context parallelism's buffers) and ``megatron.memory.moe`` (a mixture of experts in place
of the MLP); the norms' saves are ``megatron.memory.ops``.

One decoder layer, no recompute (``layer_terms``)::

    norm1 (input x)     LayerNorm: n' h d + 2 n' st         RMSNorm: 8 n' h + 4 n'   (fp32 x, x rstd, rstd)
    attention block     standard: qkv input n' h d, [qk norms], q, k, v + the core's saves, dense input n a hd d
                        multi-latent: input n h d (whole), latents, q, k, v + the core's, dense input n a dv d
                        (``megatron.memory.attention``: the flash and math kernels, cp's communication types)
    dropout mask 1      n' h m                             (hidden dropout only)
    norm2               as norm1, on the residual sum
    fc1 input           n' h d                             (a MoE layer: ``megatron.memory.moe`` instead)
    MLP                 GELU: 2 n f d (fc1 out, gelu out); SwiGLU: 4 n f d (fc1 out 2f, silu, product); quick
                        GeGLU: 5 n f d (fc1 out 2f, the sigmoid, the activation, product); a gated unit's clamp +2
                        n f d (the clamped gate and linear halves, or the gate and linear + offset), an offset
                        alone +1 (``mlp_saves``)
    dropout mask 2      n' h m

Recompute: ``core_attn`` (selective) keeps q, k, v instead of the core's saves; ``only_attn`` keeps the layer
input x instead of norm1 .. dropout mask 1; ``full`` keeps only x (``n' h d``); a unit of several layers
(``recompute_method uniform``) keeps only its first input.

Outside the layers: the embedding (token ids ``8n``, with tp > 1 the local ids and the ``n`` bool
out-of-shard mask; learned position ids ``8n``; its dropout mask ``n' h m``), rope's cos/sin
(``2 n rot d`` per chunk; multi-latent attention's ``rot = dr``), the final norm, the head's input (``n h d``,
gathered under sp), the loss's ``softmax - onehot`` (``n V d``) and ``loss_fn``'s mask (``4n``).

Multi-token prediction (``mtp_terms``; ``D`` modules on the last stage, in training), per module::

    embedding           its dropout mask n' h m; under tp the local ids and out-of-shard mask 9 n
    enorm, hnorm        as norm1 each; enorm's input under sp without dropout a view of the whole embedding
                        output (n h d); hnorm's the previous depth's normed output: without sp the head's input,
                        kept there already
    eh_proj input       2 n' h d                           (the concatenation)
    decoder layer       ``layer_terms`` at the recompute granularity (MoE when the decoder's last layer is); under
                        sp its input a view of eh_proj's gathered output: kept whole (n h d) when the layer keeps it
    final norm, head    as norm1; the head's input n h d, the loss's n V d and the scalar loss (4)

and once the loader's ``[b, s, D]`` fields they read: the token ids ``8 n D`` (tp = 1), learned position ids
``8 n D``, the loss mask ``4 n D``.

Attention kernels: on the CPU ``F.scaled_dot_product_attention`` runs the fused flash kernel without
attention dropout, and the math kernel with it (which upcasts bf16/fp16 to fp32) or with multi-latent attention's
unequal q/k and v widths. On GPUs the estimate assumes a fused kernel (FlashAttention-2 for bf16/fp16,
memory-efficient for fp32 or unequal widths): q, k, v, out and an fp32 log-sum-exp per (head, query); dropout is
replayed from a seed, no mask is kept; grouped keys are read in place. The GPU figures are not measured here (the
tests run on the CPU); ``kernel="math"`` gives a non-fused kernel's figure. Eager mode: ``compile`` may save less.

Context parallelism (``c`` > 1, ``megatron.context_parallel``): every term counts this rank's ``n``
tokens; the attention core's saves depend on the communication type (``attention.core_terms``); the
exchanged keys and values, the ring's receive buffers and the fp32 accumulators are temporaries
(``attention.context_parallel_terms``). Packed documents (``reset_attention_mask``) run one kernel call per
document: the same bytes, but for the output kept apart from the dense input, and the math kernel's
probabilities (an upper bound: ``s^2`` per sample where the documents' squared lengths sum to less).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

from megatron.config.layer_split import rank_chunks, recompute_plan
from megatron.config.schema import Config
from megatron.config.schema_model import attention_shape
from megatron.config.validate_moe import moe_layer_flags
from megatron.memory.attention import (
    MLADims,
    attention_kernel,
    attention_terms,
    context_parallel_terms,
    mla_dims,
)
from megatron.memory.moe import MoEDims, dispatch_temporary_bytes, moe_dims, moe_terms
from megatron.memory.ops import norm_bytes, saves_input_itself
from megatron.pipeline_parallel import schedule_tables as tables

CE_CHUNK_ELEMENTS = {"cpu": 1 << 20, "gpu": 1 << 25}  # ops/cross_entropy.py's fp32 row chunk


@dataclass(frozen=True)
class Dims:
    """What the formula reads from a configuration: the sizes on one rank."""

    b: int
    s: int
    h: int
    f: int  # MLP width on this rank
    a: int  # query heads on this rank
    g: int  # key/value groups on this rank
    hd: int
    vocab: int  # padded vocabulary on this rank
    tp: int
    sp: bool
    d: int  # bytes per activation element
    hidden_dropout: bool
    attn_dropout: bool
    device: str  # "cpu" or "gpu"
    kernel: str  # "flash" or "math"
    rmsnorm: bool
    swiglu: bool
    mlp_saves: int  # the MLP's saves, in n f d (``mlp_saves``)
    rot: int  # rotated channels per head (0: no rope)
    learned_positions: bool
    cp: int = 1  # context-parallel size: this rank holds s / cp tokens of each sample
    cp_comm: str = "p2p"  # p2p, all_gather or a2a (with cp > 1)
    documents: bool = False  # packed documents (reset_attention_mask): attention per document
    moe: MoEDims | None = None  # a mixture of experts' sizes (``megatron.memory.moe``)
    moe_layers: tuple[bool, ...] = ()  # per global layer (the MTP modules' after the decoder's): a MoE layer
    qk_norm: bool = False  # standard attention's QK-norm (--qk-layernorm)
    mla: MLADims | None = None  # multi-latent attention's widths (``megatron.memory.attention``)
    mtp: int = 0  # multi-token prediction modules on the last stage
    zero_sinks: bool = False  # off-by-one attention sinks: the zero logits the attention keeps (a d)

    @property
    def n(self) -> int:
        """Tokens on this rank: ``b s / cp``."""
        return self.b * self.s // self.cp

    @property
    def length(self) -> int:
        """Tokens of one sample on this rank (``L = s / cp``)."""
        return self.s // self.cp

    @property
    def n_sp(self) -> int:
        """Tokens of the norm / dropout region: a sequence shard under sequence parallelism."""
        return self.n // self.tp if self.sp else self.n

    @property
    def mask(self) -> int:
        return 1 if self.device == "gpu" else self.d

    @property
    def stat(self) -> int:
        return 4 if self.device == "gpu" else self.d


def dims(config: Config, kernel: str | None = None) -> Dims:
    """The sizes of a validated configuration; ``kernel`` overrides ``attention_kernel``."""
    m, d = config.model, config.distributed
    tp = d.mp_degree
    nq, ng, hd = attention_shape(m)
    mla, mtp = mla_dims(config), m.mtp_num_layers or 0
    kernel = kernel or attention_kernel(config)
    if kernel not in ("flash", "math"):
        raise ValueError(f"unknown attention kernel {kernel!r}: use 'flash' or 'math'")
    return Dims(b=config.batch_size.micro_batch_size, s=config.dataset.max_seq_len, h=m.hidden_size,
                f=m.ffn_hidden_size // tp, a=nq // tp, g=ng // tp, hd=hd, vocab=config.padded_vocab_size // tp,
                tp=tp, sp=d.sequence_parallel and tp > 1, d=4 if config.params_dtype_name == "float32" else 2,
                hidden_dropout=m.hidden_dropout_prob > 0, attn_dropout=m.attention_probs_dropout_prob > 0,
                device="gpu" if config.device == "gpu" else "cpu", kernel=kernel,
                rmsnorm=m.normalization == "RMSNorm", swiglu=m.swiglu, mlp_saves=mlp_saves(m),
                zero_sinks=m.softmax_type == "off-by-one",
                rot=mla.dr if mla else int(hd * m.rotary_percent) if m.position_embedding_type in ("rope", "yarn")
                else 0,
                learned_positions=m.position_embedding_type == "learned_absolute", cp=d.context_parallel_size,
                cp_comm=d.cp_comm_type, documents=config.dataset.reset_attention_mask, moe=moe_dims(config),
                moe_layers=moe_layer_flags(m, mtp),
                qk_norm=m.qk_layernorm and mla is None, mla=mla, mtp=mtp)


def mlp_saves(m) -> int:
    """What the MLP's activation saves per token, in units of its width times the element size (the module
    docstring's MLP line): fc1's output (2 for a gated unit), the activation's own saves and fc2's input."""
    gated = m.swiglu or m.quick_geglu
    if not gated:
        return 2
    extra = 2 if m.activation_func_clamp_value is not None else 1 if m.glu_linear_offset else 0
    return (5 if m.quick_geglu else 4) + extra


def is_moe(D: Dims, layer: int) -> bool:
    return bool(D.moe_layers) and D.moe_layers[layer]


# ---------------------------------------------------------------------------- one decoder layer


def layer_terms(D: Dims, recompute: str | None = None, moe: bool = False) -> dict[str, int]:
    """Bytes one decoder layer's forward saves, by term (``recompute``: its granularity or None; ``moe``: a
    mixture of experts in place of the MLP, ``megatron.memory.moe``). A new dict each call; the terms are
    computed once per (dims, recompute, moe): a chunk repeats its layers, and the layout planner its chunks."""
    return dict(_layer_terms(D, recompute, moe))


@functools.lru_cache(maxsize=4096)
def _layer_terms(D: Dims, recompute: str | None, moe: bool) -> tuple[tuple[str, int], ...]:
    return tuple(_uncached_layer_terms(D, recompute, moe).items())


def _uncached_layer_terms(D: Dims, recompute: str | None, moe: bool) -> dict[str, int]:
    x = D.n_sp * D.h * D.d  # the layer's input
    if recompute == "full":
        return {"layer input": x}
    mask = D.n_sp * D.h * D.mask if D.hidden_dropout else 0
    if moe:
        ffn = moe_terms(D.moe, D)
    else:
        ffn = {"fc1 input": D.n_sp * D.h * D.d, "mlp": D.mlp_saves * D.n * D.f * D.d}
    terms = {"norm2": norm_bytes(D, D.n_sp), **ffn, "dropout mask 2": mask}
    if recompute in ("only_attn", "full_attn"):
        return {"layer input": x, **terms}
    return {"norm1": norm_bytes(D, D.n_sp), **attention_terms(D, recompute), "dropout mask 1": mask, **terms}


def layer_bytes(D: Dims, recompute: str | None = None, moe: bool = False) -> int:
    return sum(layer_terms(D, recompute, moe).values())


# ---------------------------------------------------------------------------- chunks and stages


def chunk_specs(config: Config, stage: int) -> list[tuple[range, bool, bool]]:
    """(global layers, pre_process, post_process) of each model chunk of pipeline ``stage``, as
    ``megatron.parallelize_gpt.build_model`` builds them."""
    d, layers, pp = config.distributed, config.model.num_layers, config.distributed.pp_degree
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is out of range for pp_degree {pp}")
    return rank_chunks(layers, pp, d.virtual_pp_degree, d.pipeline_partition, stage)


def _granularity(config: Config) -> str | None:
    """The recompute granularity (a multi-token prediction module's layer has it whatever the method)."""
    return config.recompute_granularity if config.use_recompute else None


def _recompute_units(config: Config, layers: range) -> tuple[dict[int, str | None], list[list[int]]]:
    granularity = _granularity(config)
    method = config.recompute_method if granularity else None
    return recompute_plan(layers, granularity, config.no_recompute_layers, method, config.recompute_num_layers)


def chunk_terms(config: Config, stage: int = 0, chunk: int = 0, kernel: str | None = None) -> dict[str, int]:
    """Bytes one micro-batch's forward through ``chunk`` of ``stage`` saves, by term, summed over its layers.

    Two terms are alive but not saved tensors, so ``saved_tensors_hooks`` do not see them: ``rope
    tables (in checkpoints)``, cos/sin referenced only by recomputed regions (held by the checkpoint),
    and ``received input``, a later stage's input when its first norm saves an fp32 copy instead (bf16
    RMSNorm): the pipeline executor holds it for the backward."""
    D = dims(config, kernel)
    layers, pre, post = chunk_specs(config, stage)[chunk]
    per_layer, units = _recompute_units(config, layers)
    terms: Counter[str] = Counter()
    if pre:
        terms.update(embedding_terms(D))
    # units of one kind save the same terms: counted, then added once per kind (in the order they first come,
    # so the terms keep their order); a chunk of a deep model repeats a few kinds many times
    kinds: Counter[tuple] = Counter(("unit",) if len(unit) > 1 else (per_layer[unit[0]], is_moe(D, unit[0]))
                                    for unit in units)
    for kind, count in kinds.items():
        if kind == ("unit",):  # checkpointed as one: only the unit's input is kept
            terms["layer input"] += count * D.n_sp * D.h * D.d
            continue
        for name, value in _layer_terms(D, *kind):
            terms[name] += count * value
    first = per_layer[units[0][0]] if units and len(units[0]) == 1 else "full"
    keeps_input = first in ("full", "only_attn", "full_attn") or saves_input_itself(D)
    if pre and keeps_input and D.sp and not D.hidden_dropout and layers:
        # scatter_to_sequence_region's shard is a view of the whole embedding output: kept whole
        terms["embedding output (whole)"] += (D.n - D.n_sp) * D.h * D.d
    if not pre and not keeps_input and layers:
        terms["received input"] += D.n_sp * D.h * D.d  # held by the pipeline executor for the backward
    mtp = D.mtp if post else 0  # the multi-token prediction modules: after the head, their layers seeing the rope
    if D.rot:
        visible = any(len(u) == 1 and per_layer[u[0]] in (None, "core_attn") for u in units)
        visible = visible or (mtp > 0 and _granularity(config) in (None, "core_attn"))
        terms["rope tables" if visible else "rope tables (in checkpoints)"] += 2 * D.n * D.rot * D.d
    if post:
        terms.update(head_terms(D))
    if mtp:
        terms.update(mtp_terms(D, _granularity(config)))
    return {k: v for k, v in terms.items() if v}


def embedding_terms(D: Dims) -> dict[str, int]:
    """The embedding's saves: the token ids (with tp > 1 the local ids and the bool out-of-shard
    mask), the position ids (learned positions), the dropout mask (on the shard under sp)."""
    ids = 8 * D.n + (D.n if D.tp > 1 else 0)
    return {"embedding ids": ids + (8 * D.n if D.learned_positions else 0),
            "embedding dropout mask": D.n_sp * D.h * D.mask if D.hidden_dropout else 0}


def head_terms(D: Dims) -> dict[str, int]:
    """The final norm, the head's input (the whole sequence), the loss's saved ``softmax - onehot``
    in the logits' dtype, and ``loss_fn``'s fp32 loss mask."""
    return {"final norm": norm_bytes(D, D.n_sp), "head input": D.n * D.h * D.d, "loss grad": D.n * D.vocab * D.d,
            "loss mask": 4 * D.n}


def mtp_terms(D: Dims, recompute: str | None = None) -> dict[str, int]:
    """What the ``D.mtp`` multi-token prediction modules save (``megatron.model.mtp``: the last stage, in
    training), by term; ``recompute``: their layers' granularity. See the module docstring."""
    n, n_sp, h, d, depth = D.n, D.n_sp, D.h, D.d, D.mtp
    first_layer = len(D.moe_layers) - depth  # the modules' global layer indices follow the decoder's
    # the loader's [b, s, D] fields, one storage each, read by every module (under tp the local ids per module)
    ids = 8 * n * depth if D.tp == 1 else 9 * n * depth
    terms: Counter[str] = Counter({"mtp ids": ids + (8 * n * depth if D.learned_positions else 0),
                                   "mtp loss mask": 4 * n * depth})
    embedded = n * h * d if D.sp and not D.hidden_dropout else None  # the embedding's shard: a view of it whole
    keeps_input = recompute in ("full", "only_attn", "full_attn") or saves_input_itself(D)
    for k in range(depth):
        terms["mtp embedding dropout mask"] += n_sp * h * D.mask if D.hidden_dropout else 0
        hnorm = norm_bytes(D, n_sp, input_bytes=None if D.sp else 0)  # its input without sp: the head's, kept there
        terms["mtp norms"] += norm_bytes(D, n_sp, input_bytes=embedded) + hnorm  # and enorm's
        terms["mtp eh_proj input"] += 2 * n_sp * h * d  # the concatenation (the sequence shard under sp)
        terms.update(layer_terms(D, recompute, is_moe(D, first_layer + k)))
        if D.sp and keeps_input:  # the layer's input: scatter_to_sequence_region's view of eh_proj's gathered output
            terms["mtp layer input (whole)"] += (n - n_sp) * h * d
        terms["mtp final norm"] += norm_bytes(D, n_sp)
        terms["mtp head input"] += n * h * d
        terms["mtp loss grad"] += n * D.vocab * d
        terms["mtp loss"] += 4  # the scalar _AttachLoss keeps
    return dict(terms)


def activation_terms(config: Config, stage: int = 0, chunk: int | None = None,
                     kernel: str | None = None) -> dict[str, int]:
    """``chunk_terms`` summed over the stage's chunks (or of one chunk)."""
    chunks = range(len(chunk_specs(config, stage))) if chunk is None else [chunk]
    total: Counter[str] = Counter()
    for c in chunks:
        total.update(chunk_terms(config, stage, c, kernel))
    return dict(total)


def activation_bytes_per_microbatch(config: Config, stage: int = 0, chunk: int | None = None,
                                    kernel: str | None = None) -> int:
    """Bytes saved for the backward by one micro-batch's forward on pipeline ``stage`` (all its chunks
    when ``chunk`` is None): what ``megatron.memory.measure`` measures."""
    return sum(activation_terms(config, stage, chunk, kernel).values())


# ---------------------------------------------------------------------------- the pipeline schedule


def schedule_table(config: Config, stage: int) -> list[tables.Action]:
    """The table the run executes on ``stage`` (``schedules.forward_backward_pipelining``'s choice);
    without pipelining one forward and one backward at a time."""
    d, m = config.distributed, config.num_micro_batches
    if d.pp_degree == 1:
        return [tables.Action("F", 0), tables.Action("B", 0)]
    if d.virtual_pp_degree > 1:
        return tables.interleaved_one_f_one_b(d.pp_degree, stage, m, d.virtual_pp_degree)
    make = tables.gpipe if d.pipeline_schedule == "gpipe" else tables.one_f_one_b
    return make(d.pp_degree, stage, m)


def in_flight_at_peak(config: Config, stage: int = 0, weights: list[int] | None = None) -> tuple[int, ...]:
    """Per chunk, the micro-batches whose activations are alive on ``stage`` when their bytes peak
    (``weights``: bytes per micro-batch of each chunk; default 1 each, i.e. the most activations held,
    the simulator's ``peak_in_flight``). A stage executes its table in order, so walking it is exact."""
    chunks = len(chunk_specs(config, stage))
    weights = weights or [1] * chunks
    held, best, best_value = [0] * chunks, [0] * chunks, -1
    for action in schedule_table(config, stage):
        if action.kind in ("F", "B"):
            held[action.chunk] += 1 if action.kind == "F" else -1
            value = sum(h * w for h, w in zip(held, weights))
            if value > best_value:
                best, best_value = list(held), value
    return tuple(best)


def peak_activation_bytes(config: Config, stage: int = 0, kernel: str | None = None) -> int:
    """Saved activations alive on ``stage`` at the schedule's peak: per-chunk micro-batch bytes times
    the micro-batches of each chunk in flight then."""
    chunks = range(len(chunk_specs(config, stage)))
    per_chunk = [activation_bytes_per_microbatch(config, stage, c, kernel) for c in chunks]
    return sum(k * w for k, w in zip(in_flight_at_peak(config, stage, per_chunk), per_chunk))


# ---------------------------------------------------------------------------- temporaries


def temporary_terms(config: Config, stage: int = 0, kernel: str | None = None) -> dict[str, int]:
    """Transient buffers beyond the saved activations, the largest of each kind on ``stage``:

    - ``loss``: the logits ``[n, V]`` (freed once the loss has its gradient) and two fp32 row chunks
      of the fused cross entropy;
    - ``attention scores`` (math kernel): two fp32 ``[b, a, s, s]`` (the scores before the softmax in
      the forward; the gradients of the probabilities and of the scores in the backward);
    - ``recompute``: what the backward's recompute of the largest checkpointed unit saves beyond what
      its forward kept (a multi-token prediction module's layer among them);
    - ``sequence-parallel gather``: the all-gathered ``[s, b, h]`` input of a column-parallel layer;
    - ``context-parallel attention`` (cp > 1): the buffers of the exchange and the accumulators of one
      layer's attention (``context_parallel_terms``).

    Not counted: gradient buffers of activations (about one layer's saves), the allocator's slack."""
    D = dims(config, kernel)
    terms: Counter[str] = Counter()
    moe = False
    for layers, _, post in chunk_specs(config, stage):
        if post:
            rows = min(D.n, max(1, CE_CHUNK_ELEMENTS[D.device] // D.vocab))
            terms["loss"] = D.n * D.vocab * D.d + 2 * rows * D.vocab * 4
        per_layer, units = _recompute_units(config, layers)
        if post and D.mtp:  # the modules' layers, each recomputed on its own at the granularity
            mtp_layers = range(len(D.moe_layers) - D.mtp, len(D.moe_layers))
            per_layer = {**per_layer, **{i: _granularity(config) for i in mtp_layers}}
            units = [*units, *([i] for i in mtp_layers)]
        moe = moe or any(is_moe(D, i) for unit in units for i in unit)
        # what a unit's recompute saves depends on its granularity and its layers' kinds only: once per kind
        kinds = {(per_layer[unit[0]], is_moe(D, unit[0])) if len(unit) == 1
                 else ("unit", tuple(is_moe(D, i) for i in unit)) for unit in units}
        for granularity, moe_flags in kinds:
            if granularity is None:
                continue
            if granularity == "unit":
                full, kept = sum(layer_bytes(D, None, flag) for flag in moe_flags), D.n_sp * D.h * D.d
            else:
                full, kept = layer_bytes(D, None, moe_flags), layer_bytes(D, granularity, moe_flags)
            terms["recompute"] = max(terms["recompute"], full - kept)
    if D.kernel == "math" and not (D.cp > 1 and D.cp_comm != "a2a"):
        terms["attention scores"] = 2 * 4 * D.n * D.a * D.s  # b a s^2 (a2a: a / cp heads)
    if D.sp:
        terms["sequence-parallel gather"] = D.n * D.h * D.d
    if D.cp > 1:
        terms["context-parallel attention"] = max(context_parallel_terms(D).values())
    if D.moe is not None and moe:
        terms["expert dispatch"] = dispatch_temporary_bytes(D.moe, D.n, D.h, D.d)
    return {k: v for k, v in terms.items() if v}


def largest_temporary_bytes(config: Config, stage: int = 0, kernel: str | None = None) -> int:
    """The largest transient buffer beyond the saved activations on ``stage`` (``temporary_terms``)."""
    return max(temporary_terms(config, stage, kernel).values(), default=0)
