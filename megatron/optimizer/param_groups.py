"""Which AdamW group each slice of the buffer the optimizer steps joins: Megatron-LM's parameter-group rules
(``megatron/core/optimizer/__init__.py``, ``get_standard_config_overrides``).

- weight decay: on every matrix (``distributed.buffer_layout.is_decay``, which orders each bucket's decaying
  parameters first); biases and norms none, except the query and key norms' weights and biases with
  ``apply_wd_to_qk_layernorm`` (Megatron's rule: a name holding ``q_layernorm.`` or ``k_layernorm.``);
- the learning rate: the word embedding and the output layer (Megatron's ``is_embedding_or_output_parameter``) at
  ``decoupled_lr``'s schedule when it is set (``lr_schedule.decoupled_schedule``), every other parameter at the
  run's;
- muP (``use_mup`` with a width multiplier m != 1; Megatron Core's ``get_mup_config_overrides``): the parameters
  ``mup_scaled`` picks train at the run's schedule with its peak and floor times ``validate_mup.mup_lr_factor``
  (``lr_schedule.mup_schedule``): with AdamW (and Muon's AdamW part) the hidden matrices (``is_mup_hidden``: every
  parameter of two or more dimensions but the word and position embeddings and the output layer) at 1 / m, and with
  ``adam`` an epsilon / m too; with SGD the others (vectors, embeddings, output layer; not those decoupled_lr sets) at
  m. Muon's own matrices keep Muon's rate (Megatron leaves them out too).

``regroup`` cuts the optimizer's pieces (bucket, start, end, decay region, Muon's) at every parameter boundary where
those change; the padding at a bucket's end goes with the run before it.
"""

from __future__ import annotations

import re

from megatron.config.schema import OptimizerConfig
from megatron.distributed.buffer_layout import is_decay

EMBEDDING_OR_OUTPUT = re.compile(r"(^|\.)(embedding\.word_embeddings|output_layer)\.weight$")
# muP's "embedding-class" parameters (Megatron Core's is_embedding_parameter): all of the embedding, the output layer
MUP_EMBEDDING = re.compile(r"(^|\.)(embedding\.(word|position)_embeddings|output_layer)\.weight$")


def is_embedding_or_output(name: str) -> bool:
    return bool(EMBEDDING_OR_OUTPUT.search(name))


def is_qk_norm(name: str) -> bool:
    return "q_layernorm." in name or "k_layernorm." in name


def is_mup_hidden(name: str, shape) -> bool:
    """Whether muP scales the learning rate and epsilon of the parameter ``name``: a matrix (or a stack of them),
    not the embedding's nor the output layer's (Megatron Core's ``should_scale_eps_with_mup`` for Adam)."""
    return len(shape) >= 2 and not MUP_EMBEDDING.search(name)


def mup_scaled(name: str, shape, cfg: OptimizerConfig) -> bool:
    """Whether muP changes the learning rate of the parameter ``name`` (see the module doc)."""
    if cfg.optimizer == "sgd":
        return not is_mup_hidden(name, shape) and not (cfg.lr.decoupled_lr is not None and is_embedding_or_output(name))
    return is_mup_hidden(name, shape)


def group_of(name: str, shape, cfg: OptimizerConfig) -> tuple[bool, bool]:
    """(decays, decoupled learning rate) of the parameter ``name``."""
    decays = is_decay(shape) or (cfg.apply_wd_to_qk_layernorm and is_qk_norm(name))
    return decays, cfg.lr.decoupled_lr is not None and is_embedding_or_output(name)


def regroup(pieces: list[tuple], buffer, cfg: OptimizerConfig, mup: bool = False) -> list[tuple]:
    """``pieces`` (bucket, lo, hi, decay, muon) -> (bucket, lo, hi, decay, muon, decoupled, muP-scaled), cut where a
    parameter's group changes; ``mup``: muP's scaled parameters apart (``mup_scaled``; a width multiplier != 1)."""
    names = {id(bucket): [(start, end, span.name, param.shape) for span, (param, start, end) in
                          zip(layout.params, bucket.params)]
             for layout, bucket in zip(buffer.layout.buckets, buffer.buckets)}
    out = []
    for bucket, lo, hi, decay, muon in pieces:
        runs: list[list] = []
        for start, end, name, shape in names[id(bucket)]:
            a, b = max(start, lo), min(end, hi)
            if a >= b:
                continue
            key = (*group_of(name, shape, cfg), mup and mup_scaled(name, shape, cfg))
            if runs and runs[-1][2] == key:
                runs[-1][1] = b
            else:
                runs.append([a, b, key])
        if not runs:
            out.append((bucket, lo, hi, decay, muon, False, False))
            continue
        runs[0][0], runs[-1][1] = lo, hi
        for (a, _, (decays, decoupled, scaled)), nxt in zip(runs, runs[1:] + [None]):
            out.append((bucket, a, nxt[0] if nxt else hi, decays, muon, decoupled, scaled))
    return out
