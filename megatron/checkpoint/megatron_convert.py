"""Megatron-LM checkpoints <-> ours, the tensors' part (``tools/convert_checkpoint.py from-megatron`` and
``to-megatron`` build the configuration).

- ``export_state(params, config, tp, pp)``: our full fp32 master weights as Megatron Core ``GPTModel``'s whole
  state dict, the vocabulary padded to Megatron's ``make_vocab_size_divisible_by x tp``, and the ``args``
  Namespace the export saves; ``write_export`` writes it, legacy (cut into tp x pp rank files,
  ``megatron_shards`` and ``megatron_legacy``) or torch_dist (whole tensors, ``megatron_dist``).
- ``import_state(path)``: a Megatron-LM checkpoint (legacy: its ranks merged; torch_dist: whole already) in our
  global parameter names (the word embedding and output layer with Megatron's padded rows), with its ``args``
  and the saved dict's other entries.

Names and the SwiGLU layout come from ``megatron_core_names``. Optimizer states are not converted either way:
Megatron-LM's are indexed by its own parameter order (and, with ``--use-distributed-optimizer``, kept in
``distrib_optim.pt`` files); a converted checkpoint continues with a fresh AdamW (Megatron's
``--no-load-optim``), the step and the consumed samples kept.
"""

from __future__ import annotations

import argparse

import torch

from megatron.checkpoint.format import CheckpointError, CheckpointReader, is_vocab_padded
from megatron.checkpoint.hf_common import pad_vocab
from megatron.checkpoint.megatron_args import to_args
from megatron.checkpoint.megatron_core_names import from_megatron_core_state, to_megatron_core_state
from megatron.checkpoint.megatron_dist import is_torch_dist, read_torch_dist, write_torch_dist
from megatron.checkpoint.megatron_legacy import iteration_folder, read_shards, write_shards
from megatron.checkpoint.megatron_shards import cut, merge
from megatron.config import Config
from megatron.config.schema import padded_vocab_size


def _rows(t: torch.Tensor, rows: int, vocab: int, name: str) -> torch.Tensor:
    """``t`` with ``rows`` rows: the padding rows (past ``vocab``) dropped, zeros added."""
    if t.shape[0] < vocab:
        raise CheckpointError(f"{name} has {t.shape[0]} rows, fewer than the vocabulary's {vocab}.")
    return pad_vocab(t[:vocab], rows)


def export_state(params: dict[str, torch.Tensor], config: Config, tp: int, pp: int, *, step: int,
                 consumed_samples: int) -> tuple[dict[str, torch.Tensor], argparse.Namespace]:
    """(the whole Megatron Core state dict, the args of an export for ``tp`` x ``pp``) of our full parameters."""
    m = config.model
    groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
    if m.num_attention_heads % tp or groups % tp:
        raise CheckpointError(f"--tp {tp} must divide num_attention_heads ({m.num_attention_heads}) and the key/value "
                              f"groups ({groups}): Megatron gives each tensor-parallel rank whole query groups.")
    rows = padded_vocab_size(m.vocab_size, tp, m.make_vocab_size_divisible_by)
    params = {name: _rows(t, rows, m.vocab_size, name) if is_vocab_padded(name) else t for name, t in params.items()}
    args = to_args(m, tp=tp, pp=pp, seq_length=config.dataset.max_seq_len, iteration=step,
                   consumed_train_samples=consumed_samples)
    return to_megatron_core_state(params, bool(m.swiglu)), args


def write_export(out: str, fmt: str, whole: dict[str, torch.Tensor], args: argparse.Namespace, step: int) -> str:
    """Write the export in the format ``fmt`` (legacy: cut into the args' tp x pp rank files); its folder."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if fmt == "torch_dist":
        return write_torch_dist(out, step, whole, args, args.num_layers)
    tied = not args.untie_embeddings_and_output_weights
    return write_shards(out, step, cut(whole, tp, pp, args.num_layers, bool(args.swiglu), tied), args, pp)


def read_params(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """Every parameter of our checkpoint, whole (the fp32 masters)."""
    from megatron.checkpoint.convert import read_tensors

    return read_tensors(reader, "param")


def import_state(path: str) -> tuple[argparse.Namespace, dict, dict[str, torch.Tensor]]:
    """(args, the saved dict's other entries, our global parameters) of the Megatron-LM checkpoint at ``path``
    (legacy or torch_dist)."""
    folder = iteration_folder(path)
    if is_torch_dist(folder):
        args, head, whole = read_torch_dist(folder)
    else:
        args, head, shards = read_shards(folder)
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{folder} holds no 'args' (Megatron-LM saves its arguments there; they give the "
                              f"model's shape).")
    swiglu = bool(getattr(args, "swiglu", False))
    if not is_torch_dist(folder):
        tied = not getattr(args, "untie_embeddings_and_output_weights", False)
        whole = merge(shards, int(getattr(args, "tensor_model_parallel_size", 1) or 1),
                      int(getattr(args, "pipeline_model_parallel_size", 1) or 1), swiglu, tied)
    return args, head, {name: t.float() for name, t in from_megatron_core_state(whole, swiglu).items()}


def fit_vocab(params: dict[str, torch.Tensor], vocab: int, rows: int) -> dict[str, torch.Tensor]:
    """``params`` with the vocabulary-padded tensors cut to ``vocab`` rows and zero-padded to ``rows``."""
    return {name: _rows(t, rows, vocab, name) if is_vocab_padded(name) else t for name, t in params.items()}
