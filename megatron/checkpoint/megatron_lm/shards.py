"""Megatron Core ``GPTModel`` state dicts: one per (tensor-parallel rank, pipeline stage) <-> one whole state dict.

How Megatron Core cuts its parameters over ``tp`` ranks (names after ``core_names``):

- column-parallel, rows cut (dim 0): ``embedding.word_embeddings.weight`` (``VocabParallelEmbedding``),
  ``output_layer.weight``, every ``linear_qkv`` and ``linear_fc1`` (weight and bias). A ``linear_qkv``'s rows are
  ``[ng, (nq/ng queries, key, value), hd]``, so rank ``r`` holds whole query groups. A gated (SwiGLU or quick
  GeGLU) ``linear_fc1`` (the MLP's, each expert's, the shared expert's) is ``[gate; up]`` on every rank: rank
  ``r``'s rows are ``[gate_r; up_r]``, the ``r``-th slice of each half, not the ``r``-th slice of the whole. The
  attention sinks (``self_attention.core_attention.softmax_offset``, one per head) are cut with the heads: rank
  ``r`` holds the ``r``-th slice, its heads' sinks. Multi-latent
  attention's projections, all ``ColumnParallelLinear`` in the local spec: ``linear_q_proj``, ``linear_q_up_proj``
  and ``linear_kv_up_proj`` (whole heads per rank), and the down-projections ``linear_q_down_proj`` and
  ``linear_kv_down_proj`` too (their outputs gathered over tp before use: rank ``r`` holds the ``r``-th contiguous
  slice of the latent rows, ``[kv_lora_rank; dr]`` cut as one); a multi-token prediction module's ``eh_proj``;
- row-parallel, columns cut (dim 1): every ``linear_proj.weight`` and ``linear_fc2.weight``;
- replicated (whole on every rank): the norms (multi-latent attention's ``q_layernorm`` / ``kv_layernorm``, the
  prediction modules' ``enorm`` / ``hnorm`` / ``final_layernorm``), the position embedding, the routers (and their
  ``expert_bias`` buffers), the row-parallel biases.

Over ``pp`` stages the decoder's layers are split evenly (``num_layers / pp`` each) and numbered from 0 within a
stage; the first stage holds the embeddings, the last the final norm, the multi-token prediction modules
(``mtp.layers.{k}``, numbered alike on every layout) and the output layer. With a tied head and ``pp > 1`` the last
stage also holds ``output_layer.weight``, Megatron's copy of the word embedding; with multi-token prediction and
``pp > 1`` it holds the embedding itself too (``embedding.*``, which its modules read: Megatron Core's MTP stage).
Those copies are dropped on merging and written on cutting. ``_extra_state`` entries (None in the local layer spec)
are dropped.
"""

from __future__ import annotations

import re

import torch

from megatron.checkpoint.format import CheckpointError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")
_SINKS = ".self_attention.core_attention.softmax_offset"
_COLUMN_PARALLEL = (".linear_qkv.weight", ".linear_qkv.bias", ".linear_fc1.weight", ".linear_fc1.bias",
                    *(f".{m}.weight" for m in ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                                               "linear_kv_down_proj", "linear_kv_up_proj", "eh_proj")))
_ROW_PARALLEL = (".linear_proj.weight", ".linear_fc2.weight")
TIED_COPY = "output_layer.weight"
_EMBEDDING, _MTP = "embedding.", "mtp."


def partition_dim(name: str) -> int | None:
    """The dim Megatron Core cuts ``name`` along over tensor-parallel ranks (None: replicated)."""
    if name in _ROWS or name.endswith((*_COLUMN_PARALLEL, _SINKS)):
        return 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    return None


def _glu(name: str, gated: bool) -> bool:
    return gated and name.endswith((".linear_fc1.weight", ".linear_fc1.bias"))


def cut_tp(name: str, t: torch.Tensor, tp: int, gated: bool) -> list[torch.Tensor]:
    """The ``tp`` slices of the whole tensor ``name``, one per tensor-parallel rank (``gated``: the MLP is SwiGLU or
    quick GeGLU, its ``linear_fc1`` ``[gate; up]``)."""
    dim = partition_dim(name)
    if dim is None:
        return [t] * tp
    if t.shape[dim] % (2 * tp if _glu(name, gated) else tp):
        raise CheckpointError(f"{name} (dim {dim} of {list(t.shape)}) cannot be cut into {tp} tensor-parallel "
                              f"slices; choose a --tp that divides it.")
    if _glu(name, gated):
        gate, up = t.chunk(2)
        return [torch.cat(pair).clone() for pair in zip(gate.chunk(tp), up.chunk(tp))]
    return [s.clone() for s in t.chunk(tp, dim=dim)]


def merge_tp(name: str, slices: list[torch.Tensor], gated: bool) -> torch.Tensor:
    """The whole tensor ``name`` of its tensor-parallel slices (rank order); CheckpointError for slices that are not
    cuts of one tensor (another shape off the cut dim, no such dim, a gated MLP's odd rows)."""
    dim = partition_dim(name)
    if dim is None:
        return slices[0]
    rest = [tuple(s.shape[:dim]) + tuple(s.shape[dim + 1:]) for s in slices]
    odd = _glu(name, gated) and any(s.dim() > dim and s.shape[dim] % 2 for s in slices)
    if any(s.dim() <= dim for s in slices) or len(set(rest)) > 1 or odd:
        shapes = ", ".join(str(list(s.shape)) for s in slices)
        raise CheckpointError(f"{name} has tensor-parallel slices of shapes {shapes}, which are not cuts of one tensor "
                              f"along dim {dim}{' into [gate; up] halves' if odd else ''}: the checkpoint's ranks do "
                              f"not match.")
    if len(slices) == 1:
        return slices[0]
    if _glu(name, gated):
        halves = [s.chunk(2) for s in slices]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(slices, dim=dim)


def merge(shards: dict[tuple[int, int], dict], tp: int, pp: int, gated: bool, tied: bool) -> dict[str, torch.Tensor]:
    """The whole Megatron Core state dict (global layer numbers) of the ranks' state dicts."""
    whole: dict[str, torch.Tensor] = {}
    offset = 0
    for p in range(pp):
        stage = [shards[(t, p)] for t in range(tp)]
        names = [n for n, v in stage[0].items() if not n.endswith("._extra_state") and isinstance(v, torch.Tensor)]
        layers = {int(m[1]) for m in map(_LAYER.match, names) if m}
        for name in names:
            if (tied and pp > 1 and name == TIED_COPY) or (p > 0 and name.startswith(_EMBEDDING)):
                continue  # the last stage's copies of the word embedding (tied head, multi-token prediction)
            missing = [t for t in range(tp) if not isinstance(stage[t].get(name), torch.Tensor)]
            if missing:
                raise CheckpointError(f"{name} is on tensor-parallel rank 0 of stage {p} but not on rank "
                                      f"{missing[0]}: the checkpoint's ranks do not match.")
            found = _LAYER.match(name)
            glob = f"decoder.layers.{int(found[1]) + offset}.{found[2]}" if found else name
            if glob in whole:
                raise CheckpointError(f"{glob} is on more than one pipeline stage.")
            whole[glob] = merge_tp(name, [stage[t][name] for t in range(tp)], gated)
        offset += len(layers)
    return whole


def cut(whole: dict[str, torch.Tensor], tp: int, pp: int, num_layers: int, gated: bool,
        tied: bool) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """Each (tp rank, pp stage)'s state dict of the whole Megatron Core state dict."""
    if num_layers % pp:
        raise CheckpointError(f"--pp {pp} does not divide num_layers {num_layers} (Megatron splits the layers "
                              f"evenly); choose another --pp.")
    per = num_layers // pp
    shards = {(t, p): {} for p in range(pp) for t in range(tp)}
    for name, tensor in whole.items():
        found = _LAYER.match(name)
        if found:
            p, local = divmod(int(found[1]), per)
            local_name = f"decoder.layers.{local}.{found[2]}"
        else:
            p = 0 if name.startswith("embedding.") else pp - 1
            local_name = name
        for t, piece in enumerate(cut_tp(name, tensor, tp, gated)):
            shards[(t, p)][local_name] = piece
    if pp > 1 and any(name.startswith(_MTP) for name in whole):  # the prediction modules read the embedding
        for name in [n for n in whole if n.startswith(_EMBEDDING)]:
            for t, piece in enumerate(cut_tp(name, whole[name], tp, gated)):
                shards[(t, pp - 1)][name] = piece
    if tied and pp > 1:
        for t, piece in enumerate(cut_tp(TIED_COPY, whole["embedding.word_embeddings.weight"], tp, gated)):
            shards[(t, pp - 1)][TIED_COPY] = piece
    return shards
