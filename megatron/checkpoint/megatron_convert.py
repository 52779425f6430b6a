"""Megatron-LM checkpoints <-> ours, the tensors' part (``tools/convert_checkpoint.py from-megatron`` and
``to-megatron`` build the configuration and write the folders).

- ``export_state(reader, config, tp, pp)``: our checkpoint's fp32 master weights as Megatron Core ``GPTModel``
  state dicts, one per (tensor-parallel rank, pipeline stage), the vocabulary padded to Megatron's
  ``make_vocab_size_divisible_by x tp``; with the ``args`` Namespace the export saves.
- ``import_state(path)``: a Megatron-LM legacy checkpoint's ranks merged into our global parameter names (the
  word embedding and output layer with Megatron's padded rows), with its ``args`` and the saved dict's other
  entries.

Names and the SwiGLU layout come from ``megatron_core_names``, the cutting and merging from ``megatron_shards``,
the files from ``megatron_legacy``. Optimizer states are not converted either way: Megatron-LM's are indexed by
its own parameter order (and, with ``--use-distributed-optimizer``, kept in ``distrib_optim.pt`` files); a
converted checkpoint continues with a fresh AdamW (Megatron's ``--no-load-optim``), the step and the consumed
samples kept.
"""

from __future__ import annotations

import argparse

import torch

from megatron.checkpoint.format import CheckpointError, CheckpointReader, is_vocab_padded
from megatron.checkpoint.hf_common import pad_vocab
from megatron.checkpoint.megatron_args import to_args
from megatron.checkpoint.megatron_core_names import from_megatron_core_state, to_megatron_core_state
from megatron.checkpoint.megatron_legacy import read_shards
from megatron.checkpoint.megatron_shards import cut, merge
from megatron.config import Config
from megatron.config.schema import padded_vocab_size


def _rows(t: torch.Tensor, rows: int, vocab: int, name: str) -> torch.Tensor:
    """``t`` with ``rows`` rows: the padding rows (past ``vocab``) dropped, zeros added."""
    if t.shape[0] < vocab:
        raise CheckpointError(f"{name} has {t.shape[0]} rows, fewer than the vocabulary's {vocab}.")
    return pad_vocab(t[:vocab], rows)


def export_state(params: dict[str, torch.Tensor], config: Config, tp: int, pp: int, *, step: int,
                 consumed_samples: int) -> tuple[dict[tuple[int, int], dict], argparse.Namespace]:
    """(each rank's Megatron Core state dict, the args) of our full parameters ``params`` (global names)."""
    m = config.model
    rows = padded_vocab_size(m.vocab_size, tp, m.make_vocab_size_divisible_by)
    params = {name: _rows(t, rows, m.vocab_size, name) if is_vocab_padded(name) else t for name, t in params.items()}
    whole = to_megatron_core_state(params, bool(m.swiglu))
    shards = cut(whole, tp, pp, m.num_layers, bool(m.swiglu), tied=not m.untie_embeddings_and_output_weights)
    args = to_args(m, tp=tp, pp=pp, seq_length=config.dataset.max_seq_len, iteration=step,
                   consumed_train_samples=consumed_samples)
    return shards, args


def read_params(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """Every parameter of our checkpoint, whole (the fp32 masters)."""
    from megatron.checkpoint.convert import read_tensors

    return read_tensors(reader, "param")


def import_state(path: str) -> tuple[argparse.Namespace, dict, dict[str, torch.Tensor]]:
    """(args, the saved dict's other entries, our global parameters) of the legacy checkpoint at ``path``."""
    args, head, shards = read_shards(path)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    swiglu = bool(getattr(args, "swiglu", False))
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    whole = merge(shards, tp, pp, swiglu, tied)
    return args, head, {name: t.float() for name, t in from_megatron_core_state(whole, swiglu).items()}


def fit_vocab(params: dict[str, torch.Tensor], vocab: int, rows: int) -> dict[str, torch.Tensor]:
    """``params`` with the vocabulary-padded tensors cut to ``vocab`` rows and zero-padded to ``rows``."""
    return {name: _rows(t, rows, vocab, name) if is_vocab_padded(name) else t for name, t in params.items()}
