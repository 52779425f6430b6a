"""Tensor and sequence parallelism applied to a built GPT, the recipe's step (picotron's way, with Megatron-LM's
layers): one table says which of the plain model's linear layers split by output columns, by input rows or by
vocabulary rows; ``apply_tensor_parallel`` swaps in ``ColumnParallelLinear`` / ``RowParallelLinear`` /
``VocabParallelEmbedding`` under the same names (this rank's slice of each parameter, the tensor-parallel
attributes checkpoints and the initialiser read), cuts what else follows the heads, marks the replicated parameters
whose gradients are partial over the group, and hands every module the model's ``Seams``: the group's collectives
where the hidden states change hands, the tracker's per-rank dropout streams, and the recompute that replays them.

Applied at every size, one rank included (the parallel layers there are the plain ones, and the recompute replays
the tracker): the arithmetic is the same at every tp. The model is expected on the meta device (the recipe builds
it there); a materialised one keeps its values, each new parameter its slice.
"""

from __future__ import annotations

from fnmatch import fnmatch
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from megatron.ops.seams import Seams
from megatron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    rank_rows,
    shard_full_tensor,
)
from megatron.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    scatter_to_sequence_region,
)
from megatron.tensor_parallel.random import checkpoint, get_rng_tracker

COLUMN = "column"  # output columns split; the input is the layer's (sequence-sharded under sequence parallelism)
COLUMN_WHOLE_INPUT = "column, whole input"  # output columns split; the input is whole on every rank
ROW = "row"  # input rows split; the partial outputs summed (reduce-scattered to the sequence shard under sp)
VOCAB = "vocab"  # embedding rows (the vocabulary) split

# module name pattern (fnmatch) -> how the plain model's linear layer (or embedding) is split over the group
PLAN: dict[str, str] = {
    "embedding.word_embeddings": VOCAB,
    "*self_attention.query_key_value": COLUMN,
    "*self_attention.dense": ROW,
    "*self_attention.linear_q_proj": COLUMN_WHOLE_INPUT,  # multi-latent attention gathers its input itself
    "*self_attention.linear_q_up_proj": COLUMN_WHOLE_INPUT,
    "*self_attention.linear_kv_up_proj": COLUMN_WHOLE_INPUT,
    "*self_attention.in_proj": COLUMN,  # Gated DeltaNet's (megatron.hybrid): rows ordered by key head
    "*self_attention.out_proj": ROW,
    "*mixer.in_proj": COLUMN,  # a Mamba-2 mixer's (megatron.hybrid): rows ordered by group
    "*mixer.out_proj": ROW,
    "*mlp.dense_h_to_4h": COLUMN,
    "*mlp.dense_4h_to_h": ROW,
    "*shared_expert.dense_h_to_4h": COLUMN,  # a MoE layer's shared expert: the model's MLP
    "*shared_expert.dense_4h_to_h": ROW,
    "*eh_proj": COLUMN,  # multi-token prediction's projection (its output gathered: Seams.gather_heads)
    "output_layer": COLUMN_WHOLE_INPUT,  # only its weight is read (GPTModel.parallel_logits)
}
# the replicated norms that see a sequence shard under sequence parallelism: gradients summed over the group
SEQUENCE_SHARDED = ("*input_layernorm", "*post_attention_layernorm", "*final_layernorm", "*enorm", "*hnorm",
                    "*shared_expert_gate")  # (and a MoE layer's shared-expert gate, which reads the shard)


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup | None, sequence_parallel: bool) -> nn.Module:
    """Split ``model`` over ``group`` (None: one rank) in place, as ``PLAN`` says; returns it."""
    size, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    sp = sequence_parallel and size > 1
    for name, module in list(model.named_modules()):
        style = next((s for pattern, s in PLAN.items() if fnmatch(name, pattern)), None)
        if style is not None and isinstance(module, nn.Linear | nn.Embedding):
            _swap(model, name, _parallel_layer(module, style, group, sp))
        elif sp and any(fnmatch(name, pattern) for pattern in SEQUENCE_SHARDED):
            mark_sequence_parallel(module)
        _cut_heads(module, size, rank)
    seams = tensor_parallel_seams(group if size > 1 else None, sp)
    for module in model.modules():
        if isinstance(getattr(type(module), "seams", None), Seams):
            module.seams = seams
        if "sequence_parallel" in vars(type(module)):  # a MoE layer: whose tokens it routes
            module.sequence_parallel = sp
    return model


def tensor_parallel_seams(group: dist.ProcessGroup | None, sequence_parallel: bool) -> Seams:
    """The model's ``Seams`` over ``group`` (None: one rank: identities, and the recompute replaying the
    tracker's streams as at every size)."""
    if group is None:
        return Seams(checkpoint=checkpoint)
    sp, fork = sequence_parallel, (lambda: get_rng_tracker().fork())
    copy = partial(copy_to_tp_region, group=group)
    sequence = {"scatter_sequence": partial(scatter_to_sequence_region, group=group),
                "gather_sequence": partial(gather_from_sequence_region, group=group),
                "gather_sequence_input": partial(gather_from_sequence_region, group=group,
                                                 tensor_parallel_output_grad=False),
                "sequence_rng": fork} if sp else {"head_input": copy}
    return Seams(copy_to_heads=copy, gather_heads=partial(gather_from_tp_region, group=group),
                 cross_entropy=partial(vocab_parallel_cross_entropy, group=group), region_rng=fork,
                 checkpoint=checkpoint, **sequence)


def _parallel_layer(plain: nn.Linear | nn.Embedding, style: str, group, sp: bool) -> nn.Module:
    """The parallel layer of ``style`` in place of ``plain``: built where its parameters are, with their
    attributes (tied and shared marks) and, when they hold values, this rank's slice of them."""
    with torch.device(plain.weight.device):
        if style == VOCAB:
            layer = VocabParallelEmbedding(plain.num_embeddings, plain.embedding_dim, group=group)
        elif style == ROW:
            layer = RowParallelLinear(plain.in_features, plain.out_features, plain.bias is not None,
                                      sequence_parallel=sp, group=group)
        else:
            layer = ColumnParallelLinear(plain.in_features, plain.out_features, plain.bias is not None,
                                         sequence_parallel=sp and style == COLUMN, group=group)
    for key in ("weight", "bias"):
        old, new = getattr(plain, key, None), getattr(layer, key, None)
        if old is None or new is None:
            continue
        for attribute, value in vars(old).items():
            if not hasattr(new, attribute):
                setattr(new, attribute, value)
        if not old.is_meta:
            with torch.no_grad():
                new.copy_(shard_full_tensor(old, new))
        new.requires_grad_(old.requires_grad)
    return layer


def _cut_heads(module: nn.Module, size: int, rank: int) -> None:
    """An attention module's head counts to this rank's share; grouped attention's sink logits cut with its heads
    and its per-head query / key norms marked (each rank feeds them its own heads)."""
    if hasattr(module, "cut_heads"):  # a layer that cuts its own (Gated DeltaNet)
        module.cut_heads(size, rank)
        return
    heads = getattr(module, "num_heads", None)
    if heads is None or not hasattr(module, "cache_shape"):
        return
    groups = getattr(module, "num_kv_heads", heads)
    if heads % size or groups % size:
        raise ValueError(f"the attention's {groups} key/value groups and {heads} heads must be divisible by the "
                         f"tensor-parallel size ({size})")
    module.num_heads, module.first_head = heads // size, rank * (heads // size)
    if not hasattr(module, "num_kv_heads"):
        return  # multi-latent attention
    module.num_kv_heads = groups // size
    if getattr(module, "softmax_offset", None) is not None:
        module.softmax_offset = rank_rows(module.softmax_offset, rank, size)
    for norm in (module.q_layernorm, module.k_layernorm):
        if norm is not None:
            mark_sequence_parallel(norm)


def _swap(model: nn.Module, name: str, layer: nn.Module) -> None:
    owner, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attribute, layer)


__all__ = ["COLUMN", "COLUMN_WHOLE_INPUT", "PLAN", "ROW", "SEQUENCE_SHARDED", "VOCAB", "apply_tensor_parallel",
           "tensor_parallel_seams"]

