"""``tools/convert_checkpoint.py``'s Megatron-LM commands: ``from_megatron`` (a Megatron-LM save folder into a run
folder of ours: weights, optimizer states, schedule and progress) and ``to_megatron`` (a checkpoint of ours into the
folder a Megatron-LM run loads). The tensors and layouts are ``megatron_convert``'s and the modules it uses; this is the
command around them: the configuration, the printed lines, and where the export is written: into a private staging
folder inside ``out`` whose ``iter_N`` and tracker are renamed into ``out`` when complete, so a failed write leaves
nothing behind and two writers never share a temporary folder."""

from __future__ import annotations

import os

from megatron import file_lock
from megatron.checkpoint.convert import open_checkpoint, read_tensors, write_checkpoint, writes_into
from megatron.checkpoint.converted_config import ToolError, model_base, shaped_config
from megatron.checkpoint.megatron_lm import distrib_optim as distrib
from megatron.checkpoint.megatron_lm import schedule as schedules
from megatron.checkpoint.megatron_lm.args import model_flags as megatron_model_flags
from megatron.checkpoint.megatron_lm.args import saved_iteration
from megatron.checkpoint.megatron_lm.args import vocab_size as megatron_vocab_size
from megatron.checkpoint.megatron_lm.convert import (
    export_optimizer,
    export_state,
    fit_vocab,
    import_state,
    read_params,
    schedule_state,
    write_export,
)
from megatron.checkpoint.megatron_lm.experts import export_layout, megatron_flags
from megatron.checkpoint.megatron_lm.legacy import TRACKER


def from_megatron(path: str, out_dir: str, flags: list[str], force: bool = False, finetune: bool = False,
                  optim: bool = True) -> None:
    """Write ``out_dir/step_N`` (N: the saved iteration; 0 with ``finetune``) of a Megatron-LM checkpoint, with its
    optimizer states when it has them (not with ``finetune`` or without ``optim``)."""
    args, head, params, states, expert_bias = import_state(path, optimizer=optim and not finetune)
    iteration = 0 if finetune else saved_iteration(head, args, path)
    consumed, schedule, notes = (0, None, []) if finetune else schedules.megatron_schedule(args, head, iteration)
    config = shaped_config([*megatron_model_flags(args), *(schedule.flags if schedule else [])], flags,
                           "the checkpoint's args")
    vocab, rows = megatron_vocab_size(args), config.padded_vocab_size
    params = fit_vocab(params, vocab, rows)
    if consumed is None:  # neither the args' samples nor their batch
        consumed, note = schedules.assumed_consumed(iteration, config.batch_size.global_batch_size)
        notes.append(note)
    position = schedule.position if schedule else consumed
    train_state = {"consumed_samples": consumed, "skipped_steps": 0, "schedule_samples": position}
    if expert_bias and config.model.moe_router_enable_expert_bias:  # no parameter: the train state keeps it
        train_state["moe_expert_bias"] = expert_bias
    entries = [("param", name) for name in params]
    tensors = {"param": params}
    if states is not None:
        tensors.update({kind: fit_vocab(states[kind], vocab, rows) for kind in ("exp_avg", "exp_avg_sq")})
        entries += [(kind, name) for kind in ("exp_avg", "exp_avg_sq") for name in params]
    step_dir = write_checkpoint(out_dir, config, entries, lambda kind, name: tensors[kind][name],
                                tp=config.distributed.mp_degree, step=iteration,
                                adam_step=states.step if states is not None else 0.0, train_state=train_state,
                                converted_by="from-megatron", force=force,
                                resume_config=model_base(config, schedule is not None))
    print(f"wrote {step_dir} (step {iteration}, {consumed:,} consumed samples, "
          f"{sum(t.numel() for t in params.values()):,} parameters) from {path}; continue pretraining with: "
          f"pretrain_gpt.py ... --load {out_dir}")
    for line in [*notes, *([schedules.schedule_line(schedule, config)] if schedule else [])]:
        print(line)
    if states is not None:
        print(f"the optimizer states are converted: Adam's moments at step {states.step:g}"
              f"{', the fp32 master weights' if states.masters else ''}, the learning-rate schedule at "
              f"{position:,} samples.")
    elif "optimizer" in head:
        why = "--finetune" if finetune else "--no-optim" if not optim else "the saved optimizer never stepped"
        print(f"the optimizer states are not converted ({why}): the run continues with a fresh AdamW, as Megatron's "
              f"--no-load-optim.")


def to_megatron(ckpt: str, out: str, fmt: str = "legacy", tp: int = 1, pp: int = 1, optim: bool = True, ep: int = 1,
                grouped: bool = False, impl: str | None = None, legacy_grouped: bool = False,
                distributed: tuple | None = None) -> None:
    """Write Megatron-LM's checkpoint of ``ckpt`` for ``tp`` x ``pp`` (x ``ep`` expert-parallel) ranks in the format
    ``fmt``, with the AdamW states when the checkpoint has them (not without ``optim``); ``grouped``, ``impl`` and
    ``legacy_grouped``: the experts' module and the spec of the Megatron run (``megatron_experts.export_layout``);
    ``distributed``: (dp, overlap_grad_reduce, ddp_bucket_size, bf16) for a run with --use-distributed-optimizer."""
    if tp < 1 or pp < 1:
        raise ToolError(f"--tp and --pp must be at least 1, got {tp} and {pp}.")
    reader, common, config = open_checkpoint(ckpt)
    train_state = common.get("train_state") or {}
    consumed = int(train_state.get("consumed_samples", 0))
    step, adam_step = int(common["step"]), float(common.get("adam_step") or 0.0)
    final = os.path.join(out, f"iter_{step:07d}")
    if os.path.lexists(final):
        raise ToolError(f"{final} already exists; choose another output folder.")
    params = read_params(reader)
    whole, args = export_state(params, config, tp, pp, step=step, consumed_samples=consumed,
                               expert_bias=train_state.get("moe_expert_bias"))
    has_states = adam_step > 0 and all(reader.has(kind, name) for kind in ("exp_avg", "exp_avg_sq") for name in params)
    export_layout(args, ep=ep, grouped=grouped, impl=impl, legacy_grouped=legacy_grouped, fmt=fmt,
                  optimizer=optim and has_states)
    args.__dict__.update(schedules.schedule_args(config))  # the schedule, length and batch, as Megatron saves them
    if distributed is not None:
        distrib.export_args(args, *distributed)
    optimizer = settings = scheduler = None
    if optim and has_states:
        states = {kind: read_tensors(reader, kind) for kind in ("exp_avg", "exp_avg_sq")}
        optimizer = export_optimizer(states, params, config, tp)
        settings, scheduler = schedule_state(config, int(train_state.get("schedule_samples", consumed)))
    folder = _export_staged(out, final, lambda stage: write_export(stage, fmt, whole, args, step, optimizer, adam_step,
                                                                settings, scheduler))
    carried = "the weights, iteration and consumed samples"
    layout = f"tensor-parallel {tp} x pipeline {pp}" + (f" x expert-parallel {ep}" if ep > 1 else "")
    if optimizer is not None:
        print(f"wrote {folder} ({fmt}, {layout}, iteration {step}, padded vocabulary "
              f"{args.padded_vocab_size}, the AdamW states at step {adam_step:g}) from {reader.step_dir}; load it in "
              f"Megatron-LM with --load {out} --use-mcore-models --no-load-rng {megatron_flags(args)} ({carried}, "
              f"the optimizer and its learning-rate schedule: {distrib.how_to_load(args, fmt)})")
    else:
        why = "--no-optim" if has_states else "the checkpoint has no AdamW states"
        print(f"wrote {folder} ({fmt}, {layout}, iteration {step}, padded vocabulary "
              f"{args.padded_vocab_size}) from {reader.step_dir}; load it in Megatron-LM with --load {out} "
              f"--use-mcore-models --no-load-optim --no-load-rng {megatron_flags(args)} ({carried}; no optimizer "
              f"states: {why})")


def _export_staged(out: str, final: str, write) -> str:
    """``write(stage)`` (it writes ``stage/iter_N`` and ``stage/TRACKER``) into a private folder inside ``out``, then
    ``iter_N`` renamed to ``final`` and the tracker into ``out``; returns ``final``. A failed write is one line and
    leaves nothing (``writes_into``)."""
    os.makedirs(out, exist_ok=True)
    stage = file_lock.private_folder(final)
    try:
        with writes_into(out):
            written = write(stage)
        if os.path.lexists(final):  # another writer's, meanwhile (a file system without locks)
            raise ToolError(f"{final} appeared while this export was written; choose another output folder.")
        os.replace(written, final)
        os.replace(os.path.join(stage, TRACKER), os.path.join(out, TRACKER))
    finally:
        file_lock.remove_quietly(stage)
    return final
