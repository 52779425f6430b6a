"""Megatron-LM checkpoints <-> ours, the tensors' part (``tools/convert_checkpoint.py from-megatron`` and
``to-megatron`` build the configuration).

- ``export_state(params, config, tp, pp)``: our full fp32 master weights as Megatron Core ``GPTModel``'s whole
  state dict, the vocabulary padded to Megatron's ``make_vocab_size_divisible_by x tp``, and the ``args``
  Namespace the export saves; ``write_export`` writes it, legacy (cut into tp x pp rank files,
  ``megatron_shards`` and ``megatron_legacy``) or torch_dist (whole tensors, ``megatron_dist``).
- ``import_state(path)``: a Megatron-LM checkpoint (legacy: its ranks merged; torch_dist: whole already) in our
  global parameter names (the word embedding and output layer with Megatron's padded rows), with its ``args``
  and the saved dict's other entries (``Imported``).
- The MoE routers' expert bias (aux-loss-free balancing): Megatron Core's buffer ``...mlp.router.expert_bias`` in
  its state dict, ours the train state's ``moe_expert_bias`` ({global layer: values}); ``export_state`` writes
  the buffers from it (zeros where it has none: Megatron's strict load wants them), ``import_state`` returns them
  in that form (``core_names.expert_bias_names``).

- ``export_optimizer`` / ``write_export(..., optimizer=...)``: our AdamW states (and masters) written as Megatron
  Core's fp32 optimizer saves them (``megatron_optim``); ``schedule_state``: its groups' settings and
  ``opt_param_scheduler`` of our schedule.
- ``import_state(path, optimizer=True)`` also returns the checkpoint's optimizer states under our names (Adam's
  moments, its step; the fp32 masters replace the weights when saved), merged over tp x pp like the weights, or
  None when it has none (or ``optimizer`` False); the distributed optimizer's (legacy ``distrib_optim.pt``, torch_dist
  ``dp_reshardable``) through ``megatron_distrib_optim``, and written by ``write_export`` for an ``args`` with
  ``use_distributed_optimizer`` (legacy ``distrib_optim.pt``; torch_dist ``fully_reshardable``).
- Every weight, master and optimizer state read is checked by ``foreign_numbers`` (a floating-point tensor, finite,
  Adam's second moment never negative) before anything uses it: a NaN master would pass the masters' comparison
  with the weights, and a model with a NaN weight converts to one that generates token 0 forever.

Names and the gated MLPs' layout come from ``core_names``; the optimizers' parameter order from
``megatron_optim``.
"""

from __future__ import annotations

import argparse
import os
from typing import NamedTuple

import torch

from megatron.checkpoint.foreign_numbers import check_states, check_weights
from megatron.checkpoint.format import CheckpointError, CheckpointReader, is_vocab_padded
from megatron.checkpoint.hf.common import pad_vocab
from megatron.checkpoint.megatron_lm import distrib_optim as distrib
from megatron.checkpoint.megatron_lm.args import to_args
from megatron.checkpoint.megatron_lm.core_names import (
    expert_bias_state,
    expert_biases_from_core,
    from_megatron_core_state,
    is_gated,
    to_megatron_core_state,
)
from megatron.checkpoint.megatron_lm.dist import is_torch_dist, read_torch_dist, write_torch_dist
from megatron.checkpoint.megatron_lm.experts import expert_shards, files_differ
from megatron.checkpoint.megatron_lm.legacy import (
    DISTRIBUTED,
    EXPERT_LAYOUT,
    EXPERT_LAYOUT_WHY,
    FILE,
    LEGACY_MODEL,
    iteration_folder,
    rank_folder,
    read_shards,
    write_shards,
)
from megatron.checkpoint.megatron_lm.optim import (
    ADAM_KINDS,
    DAMAGED,
    MASTER,
    NO_OPTIM,
    DistributedOptimizerStates,
    OptimizerStates,
    common_step,
    core_order,
    param_group,
    rank_optimizer,
    read_rank,
    structure,
)
from megatron.checkpoint.megatron_lm.shards import cut, merge
from megatron.config import Config
from megatron.config.schema import padded_vocab_size


def _rows(t: torch.Tensor, rows: int, vocab: int, name: str) -> torch.Tensor:
    """``t`` with ``rows`` rows: the padding rows (past ``vocab``) dropped, zeros added."""
    if t.shape[0] < vocab:
        raise CheckpointError(f"{name} has {t.shape[0]} rows, fewer than the vocabulary's {vocab}.")
    return pad_vocab(t[:vocab], rows)


def _core(params: dict[str, torch.Tensor], config: Config, tp: int) -> dict[str, torch.Tensor]:
    """Our whole tensors (parameters, or one kind of optimizer state) as Megatron Core's whole state dict, the
    vocabulary padded for ``tp``."""
    m = config.model
    rows = padded_vocab_size(m.vocab_size, tp, m.make_vocab_size_divisible_by)
    params = {name: _rows(t, rows, m.vocab_size, name) if is_vocab_padded(name) else t for name, t in params.items()}
    return to_megatron_core_state(params, is_gated(m))


def export_state(params: dict[str, torch.Tensor], config: Config, tp: int, pp: int, *, step: int,
                 consumed_samples: int, expert_bias: dict[str, list[float]] | None = None
                 ) -> tuple[dict[str, torch.Tensor], argparse.Namespace]:
    """(the whole Megatron Core state dict, the args of an export for ``tp`` x ``pp``) of our full parameters, with
    the routers' ``expert_bias`` buffers from ``expert_bias`` (the train state's ``moe_expert_bias``) when the model
    has them."""
    m = config.model
    groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
    if m.num_attention_heads % tp or groups % tp:
        raise CheckpointError(f"--tp {tp} must divide num_attention_heads ({m.num_attention_heads}) and the key/value "
                              f"groups ({groups}): Megatron gives each tensor-parallel rank whole query groups.")
    args = to_args(m, tp=tp, pp=pp, seq_length=config.dataset.max_seq_len, iteration=step,
                   consumed_train_samples=consumed_samples)
    whole = _core(params, config, tp)
    if m.num_experts and m.moe_router_enable_expert_bias:
        whole.update(expert_bias_state(params, m.num_layers, m.num_experts, expert_bias))
    return whole, args


def export_optimizer(states: dict[str, dict[str, torch.Tensor]], params: dict[str, torch.Tensor], config: Config,
                     tp: int) -> dict[str, dict[str, torch.Tensor]]:
    """{kind: Megatron Core's whole state dict} of our AdamW states ({kind: our whole tensors}), the masters as
    ``fp32_param``."""
    return {**{kind: _core(states[kind], config, tp) for kind in ADAM_KINDS}, MASTER: _core(params, config, tp)}


def write_export(out: str, fmt: str, whole: dict[str, torch.Tensor], args: argparse.Namespace, step: int,
                 optimizer: dict[str, dict[str, torch.Tensor]] | None = None, adam_step: float = 0.0,
                 settings: dict | None = None, scheduler: dict | None = None) -> str:
    """Write the export in the format ``fmt`` (legacy: cut into the args' tp x pp rank files); its folder.
    ``optimizer`` ({kind: whole state dict}, ``export_optimizer``): the AdamW states at ``adam_step``, written as
    Megatron Core's fp32 optimizer saves them, with its groups' ``settings`` (``megatron_optim.param_group``) and
    the learning-rate ``scheduler``'s state (``opt_param_scheduler``)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    extra = {} if optimizer is None else {"opt_param_scheduler": scheduler}
    distributed = optimizer is not None and getattr(args, "use_distributed_optimizer", False)
    if fmt == "torch_dist" and distributed:
        return _write_fully_reshardable(out, step, whole, args, optimizer, adam_step, settings, extra)
    if fmt == "torch_dist":
        if optimizer is not None:  # common.pt's part of the optimizer: its step and groups
            (present,) = structure([whole])
            extra["optimizer"] = {"state": {"common_step": torch.tensor(float(adam_step))},
                                  "param_groups": [param_group(decayed, settings)
                                                   for decayed, exists in zip((True, False), present) if exists]}
        return write_torch_dist(out, step, whole, args, args.num_layers, optimizer, extra)
    tied, gated = not args.untie_embeddings_and_output_weights, is_gated(args)
    shards = cut(whole, tp, pp, args.num_layers, gated, tied)
    shards = {key: {name: model[name] for name in core_order(model)} for key, model in shards.items()}  # Megatron's
    if files_differ(args):  # expert parallelism, grouped GEMM, Transformer Engine's names: the weights only
        return write_shards(out, step, expert_shards(shards, args), args, pp, extra)
    if distributed:  # distrib_optim.pt beside each rank file
        return distrib.write_legacy(out, step, shards, args, extra, optimizer, adam_step, settings)
    optimizers = None
    if optimizer is not None:
        cut_states = {kind: cut(optimizer[kind], tp, pp, args.num_layers, gated, tied) for kind in ADAM_KINDS}
        present = structure(list(shards.values()))
        optimizers = {key: rank_optimizer(model, {kind: cut_states[kind][key] for kind in ADAM_KINDS}, adam_step,
                                          settings, present)
                      for key, model in shards.items()}
    return write_shards(out, step, shards, args, pp, extra, optimizers)


def _write_fully_reshardable(out: str, step: int, whole: dict, args: argparse.Namespace, optimizer: dict,
                             adam_step: float, settings: dict, extra: dict) -> str:
    """torch_dist for a run with --use-distributed-optimizer: its ``fully_reshardable`` layout, the states by name
    (the master as ``param``), which it loads at any dp, tp and pp."""
    (present,) = structure([whole])
    extra.update(distrib.fully_reshardable_common(present, settings, adam_step))
    states = {("param" if kind == MASTER else kind): by_name for kind, by_name in optimizer.items()}
    return write_torch_dist(out, step, whole, args, args.num_layers, states, extra)


def schedule_state(config: Config, schedule_samples: int) -> tuple[dict, dict]:
    """(the optimizer groups' settings at the schedule's position, Megatron's ``opt_param_scheduler`` state) of our
    run's configuration: both schedules count samples (``num_steps``: the samples of the applied steps)."""
    from megatron.config.validate_mup import width_mult
    from megatron.optimizer.lr_schedule import build_param_schedule

    if width_mult(config.model) != 1.0:  # Megatron Core's get_mup_config_overrides: groups of their own
        raise CheckpointError(f"the run trains with muP at width multiplier {width_mult(config.model):g}, whose "
                              f"parameter groups (the hidden matrices' own learning rate and eps) this export does "
                              f"not write; export it with --no-optim (Megatron-LM then starts a fresh optimizer).")
    try:
        o, s = config.optimizer, build_param_schedule(config)
    except (TypeError, ValueError) as err:  # a saved config without a resolved schedule
        raise CheckpointError(f"the checkpoint's learning-rate schedule cannot be read ({err}); export it with "
                              f"--no-optim.") from err
    settings = {"lr": s.lr(schedule_samples), "weight_decay": s.weight_decay(schedule_samples), "max_lr": s.max_lr,
                "min_lr": s.min_lr, "betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_epsilon}
    scheduler = {"max_lr": s.max_lr, "lr_warmup_steps": s.warmup, "num_steps": schedule_samples,
                 "lr_decay_style": s.decay_style, "lr_decay_steps": s.decay, "min_lr": s.min_lr, "start_wd": s.start_wd,
                 "end_wd": s.end_wd, "wd_incr_style": s.wd_style, "wd_incr_steps": s.wd_length}
    return settings, scheduler


def read_params(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """Every parameter of our checkpoint, whole (the fp32 masters)."""
    from megatron.checkpoint.convert import read_tensors

    return read_tensors(reader, "param")


class Imported(NamedTuple):
    """A Megatron-LM checkpoint in our terms: its ``args``, the saved dict's other entries (``head``), our global
    parameters, the optimizer states under our names (None: not saved or not asked for) and the routers' expert
    biases as our train state keeps them ({str(global layer): values}; empty without)."""

    args: argparse.Namespace
    head: dict
    params: dict[str, torch.Tensor]
    states: OptimizerStates | None
    expert_bias: dict[str, list[float]]


def import_state(path: str, optimizer: bool = True) -> Imported:
    """The Megatron-LM checkpoint at ``path`` (legacy or torch_dist) in our terms. ``optimizer`` False: the
    weights only. The parameters are the fp32 masters where the optimizer saved them."""
    folder = iteration_folder(path)
    states = None
    if is_torch_dist(folder):
        by_bucket = optimizer and _by_bucket(folder)
        args, head, whole, by_kind = read_torch_dist(folder, optimizer and not by_bucket)
        _check_weights(whole, folder)
        if by_bucket:
            states = _distributed_dist_states(folder, args, whole)
        elif by_kind:
            missing = [kind for kind in ADAM_KINDS if kind not in by_kind]
            if missing:
                raise CheckpointError(f"{folder} holds optimizer states without {missing[0]}: not Adam's; {NO_OPTIM}.")
            states = OptimizerStates(common_step(head.get("optimizer"), f"{folder}/common.pt"))
            states.update(by_kind)
            check_states(states, folder, DAMAGED, {n: tuple(t.shape) for n, t in whole.items()
                                                   if isinstance(t, torch.Tensor)})
            distrib.check_by_name(states[MASTER], whole, folder, head)  # after check_states: NaN would pass it
    else:
        args, head, shards, optimizers = read_shards(folder)
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{folder} holds no 'args' (Megatron-LM saves its arguments there; they give the "
                              f"model's shape).")
    gated = is_gated(args)
    if not is_torch_dist(folder):
        tied = not getattr(args, "untie_embeddings_and_output_weights", False)
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        whole = merge(shards, tp, pp, gated, tied)
        _check_weights(whole, folder)
        if optimizer and any(entry is DISTRIBUTED for entry in optimizers.values()):
            states = _distributed_legacy_states(folder, shards, head, args, tp, pp, gated, tied)
        elif optimizer and optimizers:
            states = _legacy_states(folder, shards, optimizers, tp, pp, gated, tied)
    params = _ours(whole, gated)
    biases = expert_biases_from_core(whole, params, int(getattr(args, "num_layers", 0) or 0),
                                     int(getattr(args, "num_experts", 0) or 0))
    if states is None:
        return Imported(args, head, params, None, biases)
    ours = OptimizerStates(states.step)
    for kind, by_name in states.items():
        if by_name:
            ours[kind] = _ours(by_name, gated)
            if ours[kind].keys() != params.keys():
                missing = sorted(params.keys() - ours[kind].keys()) or sorted(ours[kind].keys() - params.keys())
                raise CheckpointError(f"{folder}: the optimizer's {kind} does not cover the model's parameters "
                                      f"({missing[0]}); {NO_OPTIM}.")
    ours.masters = bool(ours[MASTER])
    if ours.masters:
        params = ours[MASTER]
    del ours[MASTER]
    return Imported(args, head, params, ours, biases)


def _check_weights(whole: dict, folder: str) -> None:
    """``foreign_numbers``' rule on the weights (and the routers' buffers) of Megatron Core's whole state dict, before
    any optimizer state is compared with them; its ``_extra_state`` entries are not numbers."""
    check_weights(whole, folder, "a model with such a weight cannot be trained or run: convert an earlier checkpoint",
                  skip=("._extra_state",))


def _ours(whole: dict[str, torch.Tensor], gated: bool) -> dict[str, torch.Tensor]:
    return {name: t.float() for name, t in from_megatron_core_state(whole, gated).items()}


def _legacy_states(folder: str, shards: dict, optimizers: dict, tp: int, pp: int, gated: bool,
                   tied: bool) -> OptimizerStates | None:
    """The legacy ranks' optimizer states, merged like the weights (Megatron Core's names, whole)."""
    for key, entry in optimizers.items():
        where = os.path.join(folder, rank_folder(*key, pp))
        if entry is DISTRIBUTED:
            raise DistributedOptimizerStates(where)
        if entry is EXPERT_LAYOUT:
            raise CheckpointError(f"{folder}: {EXPERT_LAYOUT_WHY}; {NO_OPTIM}.")
        if entry is LEGACY_MODEL:
            raise CheckpointError(f"{where}: the optimizer states of Megatron-LM's legacy (non-Core) GPT model are not "
                                  f"converted (its parameter order is its own); {NO_OPTIM}.")
    if set(optimizers) != set(shards):
        raise CheckpointError(f"{folder}: only some ranks saved an optimizer; {NO_OPTIM}.")
    per_rank = {key: read_rank(optimizers[key], shards[key], os.path.join(folder, rank_folder(*key, pp), FILE))
                for key in shards}
    if all(r is None for r in per_rank.values()):
        return None  # saved before the first step
    steps = {r.step if r is not None else None for r in per_rank.values()}
    if len(steps) != 1:
        raise CheckpointError(f"{folder}: the ranks' optimizers are at different steps ({sorted(map(str, steps))}); "
                              f"{NO_OPTIM}.")
    out = OptimizerStates(steps.pop())
    for kind in out:
        if all(r[kind] for r in per_rank.values()):
            out[kind] = merge({key: r[kind] for key, r in per_rank.items()}, tp, pp, gated, tied)
    return out


def _merged(per_rank: dict, step: float, tp: int, pp: int, gated: bool, tied: bool) -> OptimizerStates:
    out = OptimizerStates(step)
    for kind in out:
        out[kind] = merge({key: by_kind[kind] for key, by_kind in per_rank.items()}, tp, pp, gated, tied)
    return out


def _distributed_legacy_states(folder: str, shards: dict, head: dict, args, tp: int, pp: int, gated: bool,
                               tied: bool) -> OptimizerStates:
    """The distributed optimizer's states of a legacy folder (``distrib_optim.pt`` per rank), merged."""
    per_rank, step = distrib.legacy_states(folder, shards, head, args, lambda t, p: rank_folder(t, p, pp))
    return _merged(per_rank, step, tp, pp, gated, tied)


def _by_bucket(folder: str) -> str | None:
    from megatron.checkpoint.megatron_lm.dcp_reader import SafeReader

    return distrib.bucketed(SafeReader(folder).read_metadata())


def _distributed_dist_states(folder: str, args, whole: dict) -> OptimizerStates:
    """The distributed optimizer's states of a torch_dist folder by bucket (``dp_reshardable``), merged: the whole
    model cut as the args' tp x pp saved it, each rank's buckets read in its layout."""
    from megatron.checkpoint.megatron_lm.dcp_reader import SafeReader

    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    gated, tied = is_gated(args), not getattr(args, "untie_embeddings_and_output_weights", False)
    shards = cut(whole, tp, pp, int(args.num_layers), gated, tied)
    reader = SafeReader(folder)
    per_rank, step = distrib.dist_states(folder, reader, reader.read_metadata(), args, shards)
    return _merged(per_rank, step, tp, pp, gated, tied)


def fit_vocab(params: dict[str, torch.Tensor], vocab: int, rows: int) -> dict[str, torch.Tensor]:
    """``params`` with the vocabulary-padded tensors cut to ``vocab`` rows and zero-padded to ``rows``."""
    return {name: _rows(t, rows, vocab, name) if is_vocab_padded(name) else t for name, t in params.items()}
