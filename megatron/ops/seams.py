"""The seams where a parallel layout changes what the single-device model computes (``Seams``), with their
one-device defaults (``LOCAL``): the model calls them, ``megatron.tensor_parallel.parallelize`` fills them in."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from megatron.ops.cross_entropy import token_cross_entropy


def _identity(x: torch.Tensor, *_: Any) -> torch.Tensor:
    return x


def _recompute(fn: Callable, *args: Any) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


@dataclass(frozen=True)
class Seams:
    """Where a parallel layout changes what the plain model computes, as functions the model calls; on one device
    (``LOCAL``, every module's default) identities, the one-device cross entropy, the default RNG stream and
    torch's recompute. ``megatron.tensor_parallel.parallelize`` gives a model its own (the tensor-parallel
    group's collectives, the tracker's streams): the model never asks which layout it runs in.

    - ``scatter_sequence`` / ``gather_sequence``: the hidden states to this rank's sequence shard and back (sequence
      parallelism; the gather's backward reduce-scatters); ``gather_sequence_input``: the same gather whose
      backward keeps this rank's slice (a layer that computes on the whole sequence: multi-latent attention);
    - ``copy_to_heads``: a replicated tensor into the tensor-parallel region (backward: all-reduce);
      ``head_input``: the LM head's input (that copy without sequence parallelism, whose gather already reduces);
      ``gather_heads``: this rank's output columns to all of them (logits, multi-token prediction's projection);
    - ``cross_entropy(logits [.., V/tp], labels, vocab_size)``: the vocabulary-parallel one under tp;
    - ``region_rng`` / ``sequence_rng``: the RNG stream dropout draws from inside a tensor-parallel region (this
      rank's heads) and on the hidden states (per rank under sequence parallelism): context managers;
    - ``checkpoint(fn, *args)``: recompute ``fn`` in the backward (replaying every stream dropout draws from)."""

    scatter_sequence: Callable = _identity
    gather_sequence: Callable = _identity
    gather_sequence_input: Callable = _identity
    copy_to_heads: Callable = _identity
    head_input: Callable = _identity
    gather_heads: Callable = _identity
    cross_entropy: Callable = token_cross_entropy
    region_rng: Callable = nullcontext
    sequence_rng: Callable = nullcontext
    checkpoint: Callable = _recompute


LOCAL = Seams()


def maybe_checkpoint(enabled: bool, seams: Seams, fn: Callable, *args: Any, offload=None) -> torch.Tensor:
    """Run ``fn`` and, when enabled, recompute it in the backward instead of storing its activations
    (``seams.checkpoint``: the RNG streams are saved and restored, so dropout masks are identical); else, given
    an ``offload`` region (``megatron.ops.offload``, set by ``megatron.offload``), what ``fn`` saves for the
    backward goes to host memory meanwhile. A recomputed ``fn`` saves nothing: the recipe gives it no region."""
    if enabled and torch.is_grad_enabled():
        return seams.checkpoint(fn, *args)
    if offload is not None and torch.is_grad_enabled():
        return offload.run(fn, *args)
    return fn(*args)
