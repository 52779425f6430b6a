"""Megatron-LM's learning-rate schedule and progress -> a converted checkpoint's run (``from-megatron``).

Megatron's ``OptimizerParamScheduler`` (``megatron/core/optimizer_param_scheduler.py``) counts samples, as ours
does (``megatron.optimizer.lr_schedule``: the same rule): its ``state_dict()``, saved as ``opt_param_scheduler``,
holds ``max_lr``, ``min_lr``, ``lr_warmup_steps``, ``lr_decay_steps``, ``lr_decay_style``, ``start_wd``,
``end_wd``, ``wd_incr_style``, ``wd_incr_steps`` (lengths in samples) and ``num_steps``, the samples of its applied
steps: its next step's learning rate is the schedule's value there. Without one (a checkpoint saved without its
optimizer) the schedule is rebuilt from the saved ``args`` as Megatron-LM's ``get_optimizer_param_scheduler`` builds
it (``--train-iters`` or ``--train-samples``, ``--lr-decay-iters`` / ``-samples``, ``--lr-warmup-fraction`` /
``-iters`` / ``-samples``; the iterations times ``--global-batch-size``) and placed at the consumed samples.
``--lr-warmup-init`` and WSD's final decay (``--lr-wsd-decay-*``) come from the ``args`` either way.

``schedule_flags`` says it in our flags (Megatron's names), for the converted checkpoint's base configuration: a run
resuming it without schedule flags trains on Megatron's schedule from Megatron's position, its first step at the
learning rate Megatron's next step would use. Iteration-based runs keep their iterations (``--train-iters``,
``--lr-decay-iters``, ``--global-batch-size``: a resume may then give its own ``--max-steps``); sample-based ones
their samples (``--train-samples``, ...).

Every number read (the scheduler's state, the args' schedule, consumed samples and global batch) is checked first
(``check_numbers``): a NaN, negative or non-numeric one is one line, not a traceback or a step_N of nonsense.
"""

from __future__ import annotations

import argparse
import math
from typing import NamedTuple

from megatron.checkpoint.format import CheckpointError
from megatron.config.bounds import size_problem
from megatron.optimizer.lr_schedule import DECAY_STYLES, WD_STYLES, WSD_STYLES, OptimizerParamSchedule

STATE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd",
              "wd_incr_style", "wd_incr_steps")
# What each number the schedule reads must be (``check_numbers``), the one place that says it: a finite number
# (RATE), a finite number of samples from 0 (LENGTH; lr_decay_steps above 0, as Megatron asserts), a whole count
# from 0 (COUNT), or text (TEXT); each may be None in the args, not in a saved scheduler.
RATE, LENGTH, POSITIVE, COUNT, TEXT = "a finite number", "a number of samples from 0", "a number of samples above 0", \
    "a whole number from 0", "a name"
_SAVED = {"max_lr": RATE, "min_lr": RATE, "lr_warmup_steps": LENGTH, "lr_decay_steps": POSITIVE, "start_wd": RATE,
          "end_wd": RATE, "wd_incr_steps": LENGTH, "num_steps": LENGTH, "lr_decay_style": TEXT, "wd_incr_style": TEXT}
_ARGS = {**{n: RATE for n in ("lr", "min_lr", "lr_warmup_fraction", "lr_warmup_init", "weight_decay",
                              "start_weight_decay", "end_weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
                              "clip_grad")},
         **{n: COUNT for n in ("train_iters", "train_samples", "lr_decay_iters", "lr_decay_samples", "lr_warmup_iters",
                               "lr_warmup_samples", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
                               "consumed_train_samples", "global_batch_size")},
         **{n: TEXT for n in ("lr_decay_style", "lr_wsd_decay_style", "weight_decay_incr_style")}}
_MOST_SAMPLES = 2**62  # a number of samples (or iterations) beyond any run; int64 holds it


class Schedule(NamedTuple):
    """Megatron's schedule (``state``: its ``state_dict`` form, lengths in samples), where it stands (``position``,
    samples), our flags for it, and where each came from (``source``: a sentence)."""

    state: dict
    position: int
    flags: list[str]
    source: str

    def lr(self, n: float | None = None) -> float:
        return build(self.state).lr(self.position if n is None else n)


def check_numbers(values: dict, rules: dict[str, str], source: str, optional: bool) -> None:
    """CheckpointError (one line, naming ``source`` and the field) for the first of ``values``' fields that breaks its
    rule in ``rules`` (``_SAVED``, ``_ARGS``); None passes when ``optional``."""
    for name, rule in rules.items():
        value = values.get(name)
        if value is None and optional:
            continue
        if rule == TEXT:
            ok = isinstance(value, str)
        elif rule == COUNT:
            ok = size_problem(name, value) is None and value <= _MOST_SAMPLES
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
                rule == RATE or (0 <= value <= _MOST_SAMPLES and (rule == LENGTH or value > 0)))
        if not ok:
            raise CheckpointError(f"the checkpoint's {source}: {name} is {value!r}, not {rule}; the checkpoint is "
                                  f"damaged (--finetune converts its weights alone, as a new run).")


def build(state: dict) -> OptimizerParamSchedule:
    """Our schedule object of a Megatron scheduler ``state`` (with ``init_lr``, ``wsd_decay_steps`` and
    ``lr_wsd_decay_style`` where known)."""
    return OptimizerParamSchedule(
        float(state["max_lr"]), float(state["min_lr"]), float(state["lr_warmup_steps"]), float(state["lr_decay_steps"]),
        state["lr_decay_style"], float(state.get("init_lr") or 0.0), state.get("wsd_decay_steps"),
        state.get("lr_wsd_decay_style") or "exponential", start_wd=float(state["start_wd"]),
        end_wd=float(state["end_wd"]), wd_length=float(state["wd_incr_steps"]), wd_style=state["wd_incr_style"])


def _batch(args: argparse.Namespace, iteration: int, consumed: int | None) -> int | None:
    """Megatron's global batch: the args', else the consumed samples over the iterations when they divide."""
    if getattr(args, "rampup_batch_size", None):
        return None
    gbs = getattr(args, "global_batch_size", None)
    if gbs:
        return int(gbs)
    if consumed and iteration and consumed % iteration == 0:
        return consumed // iteration
    return None


def from_args(args: argparse.Namespace, gbs: int | None) -> dict | None:
    """Megatron-LM's ``get_optimizer_param_scheduler`` of the saved ``args`` (None when they lack the learning rate
    or the training length)."""
    a = vars(args)
    if a.get("lr") is None:
        return None
    if a.get("train_iters") and gbs:
        decay = (a.get("lr_decay_iters") or a["train_iters"]) * gbs
        wd_steps = a["train_iters"] * gbs
        warmup = a["lr_warmup_fraction"] * decay if a.get("lr_warmup_fraction") is not None else \
            (a.get("lr_warmup_iters") or 0) * gbs
        wsd = a["lr_wsd_decay_iters"] * gbs if a.get("lr_wsd_decay_iters") is not None else None
    elif a.get("train_samples"):
        decay = a.get("lr_decay_samples") or a["train_samples"]
        wd_steps = a["train_samples"]
        warmup = a["lr_warmup_fraction"] * decay if a.get("lr_warmup_fraction") is not None else \
            (a.get("lr_warmup_samples") or 0)
        wsd = a.get("lr_wsd_decay_samples")
    else:
        return None
    wd = a.get("weight_decay", 0.01)  # Megatron-LM's default; its start / end default to it
    start, end = a.get("start_weight_decay"), a.get("end_weight_decay")
    return {"max_lr": float(a["lr"]), "min_lr": float(a.get("min_lr") or 0.0), "lr_warmup_steps": warmup,
            "lr_decay_steps": decay, "lr_decay_style": a.get("lr_decay_style") or "linear",
            "start_wd": wd if start is None else start, "end_wd": wd if end is None else end,
            "wd_incr_style": a.get("weight_decay_incr_style") or "constant", "wd_incr_steps": wd_steps,
            "wsd_decay_steps": wsd}


def _whole(x) -> int | None:
    return int(x) if float(x) == int(x) else None


def schedule_flags(state: dict, args: argparse.Namespace, gbs: int | None) -> list[str]:
    """Our flags (Megatron's names) for the schedule ``state`` of the run whose ``args`` these are: in iterations of
    ``gbs`` samples when the run counted iterations (or its args say neither) and the lengths are whole iterations,
    else in samples."""
    a = vars(args)
    decay, length, warmup = state["lr_decay_steps"], state["wd_incr_steps"], state["lr_warmup_steps"]
    wsd = state.get("wsd_decay_steps")
    flags = ["--lr", repr(float(state["max_lr"])), "--min-lr", repr(float(state["min_lr"])),
             "--lr-decay-style", state["lr_decay_style"], "--lr-warmup-init", repr(float(a.get("lr_warmup_init") or 0))]
    iters = (not a.get("train_samples") or a.get("train_iters")) and gbs and all(
        _whole(x) is not None and _whole(x) % gbs == 0 for x in (decay, length, *([wsd] if wsd else [])))
    unit = gbs if iters else 1
    flags += (["--train-iters", str(int(length) // unit), "--lr-decay-iters", str(int(decay) // unit),
               "--global-batch-size", str(gbs)] if iters else
              ["--train-samples", str(int(length)), "--lr-decay-samples", str(int(decay))])
    fraction = a.get("lr_warmup_fraction")
    if _whole(warmup) is not None and _whole(warmup) % unit == 0:
        flags += ["--lr-warmup-iters" if iters else "--lr-warmup-samples", str(_whole(warmup) // unit)]
    else:  # fractional: Megatron's fraction x decay, the same product here
        rate = fraction if fraction is not None and fraction * decay == warmup else warmup / decay
        flags += ["--lr-warmup-fraction", repr(float(rate))]
    if wsd:
        flags += ["--lr-wsd-decay-iters" if iters else "--lr-wsd-decay-samples", str(int(wsd) // unit)]
    if a.get("lr_wsd_decay_style"):
        flags += ["--lr-wsd-decay-style", a["lr_wsd_decay_style"]]
    if state["wd_incr_style"] == "constant":
        flags += ["--weight-decay", repr(float(state["end_wd"]))]
    else:
        flags += ["--weight-decay-incr-style", state["wd_incr_style"], "--start-weight-decay",
                  repr(float(state["start_wd"])), "--end-weight-decay", repr(float(state["end_wd"]))]
    for name, flag in (("adam_beta1", "--adam-beta1"), ("adam_beta2", "--adam-beta2"), ("adam_eps", "--adam-eps"),
                       ("clip_grad", "--clip-grad")):
        if a.get(name) is not None:
            flags += [flag, repr(float(a[name]))]
    return flags


def megatron_schedule(args: argparse.Namespace, head: dict,
                      iteration: int) -> tuple[int | None, Schedule | None, list[str]]:
    """(the consumed samples, None when nothing says them; Megatron's schedule or None; notices to print) of a
    checkpoint's ``args`` and saved entries ``head`` (its ``opt_param_scheduler``). Without
    ``consumed_train_samples`` in the args the samples are the iterations times the args' global batch, or the
    scheduler's position."""
    notes = []
    check_numbers(vars(args), _ARGS, "args", optional=True)
    consumed = getattr(args, "consumed_train_samples", None)
    gbs = _batch(args, iteration, consumed)
    saved = head.get("opt_param_scheduler") or head.get("lr_scheduler")
    saved = saved if isinstance(saved, dict) and all(k in saved for k in (*STATE_KEYS, "num_steps")) else None
    if saved is not None:
        check_numbers(saved, _SAVED, "opt_param_scheduler", optional=False)
    if consumed is None and (gbs or saved):
        consumed = iteration * gbs if gbs else int(saved["num_steps"])
        how = f"iteration {iteration} x global batch {gbs}" if gbs else "the scheduler's position"
        notes.append(f"the checkpoint's args have no consumed_train_samples: {consumed:,} consumed samples ({how}).")
    if saved is not None:
        state, position, source = dict(saved), int(saved["num_steps"]), "its opt_param_scheduler"
        state["wsd_decay_steps"] = (from_args(args, gbs) or {}).get("wsd_decay_steps")
    else:
        state, position, source = from_args(args, gbs), consumed, "its args: it has no opt_param_scheduler"
        if state is None or position is None:
            notes.append("the checkpoint has no learning-rate scheduler state (opt_param_scheduler) and its args give "
                         "no schedule (lr, train_iters or train_samples, global_batch_size): a run resuming it takes "
                         "the schedule of its own flags from its consumed samples.")
            return None if consumed is None else int(consumed), None, notes
    state["init_lr"] = float(getattr(args, "lr_warmup_init", 0.0) or 0.0)
    state["lr_wsd_decay_style"] = getattr(args, "lr_wsd_decay_style", None)
    styles = (("learning-rate decay style", state["lr_decay_style"], DECAY_STYLES),
              ("WSD decay style", state["lr_wsd_decay_style"] or "exponential", WSD_STYLES),
              ("weight-decay increment style", state["wd_incr_style"], WD_STYLES))
    for what, style, known in styles:
        if style not in known:
            notes.append(f"Megatron's {what} {style!r} is not one of {known}: a run resuming the checkpoint takes the "
                         f"schedule of its own flags.")
            return int(consumed), None, notes
    schedule = Schedule(state, position, schedule_flags(state, args, gbs), source)
    if saved is None:
        notes.append(f"the checkpoint has no learning-rate scheduler state (opt_param_scheduler): Megatron's schedule "
                     f"is rebuilt from its args, at {position:,} consumed samples.")
    return int(consumed), schedule, notes


def assumed_consumed(iteration: int, gbs: int) -> tuple[int, str]:
    """The consumed samples of a checkpoint that says neither them nor its global batch: the iterations times the
    converted run's global batch, and the notice that says so."""
    return iteration * gbs, (f"the checkpoint says neither its consumed samples nor its global batch: "
                             f"{iteration * gbs:,} assumed (iteration {iteration} x the global batch {gbs} of "
                             f"these flags; give Megatron's with --global-batch-size).")


def schedule_line(schedule: Schedule, config) -> str:
    """What a run resuming the converted checkpoint does at its first step: Megatron's next learning rate, or, when
    the flags given change the schedule, both."""
    from megatron.optimizer.lr_schedule import build_param_schedule

    theirs, ours = schedule.lr(), build_param_schedule(config).lr(schedule.position)
    line = (f"the learning-rate schedule is Megatron's (from {schedule.source}), at {schedule.position:,} samples: a "
            f"run resuming this checkpoint takes its first step at learning rate {ours:.6g}")
    if ours != theirs:
        return line + f", not Megatron's next {theirs:.6g} (the flags given change the schedule)."
    return line + ", Megatron's next."


def schedule_args(config) -> dict:
    """The ``args`` fields of our run's schedule, training length and batch in Megatron-LM's names (what
    ``get_optimizer_param_scheduler`` reads; ``to-megatron`` writes them, and ``from_args`` reads them back)."""
    o, lr, b = config.optimizer, config.optimizer.lr, config.batch_size
    samples = config.train_samples is not None
    warmup = lr.warmup_samples if samples else lr.warmup_steps
    values = {"lr": lr.max_lr, "min_lr": lr.min_lr, "lr_decay_style": lr.decay_style, "lr_warmup_init": lr.warmup_init,
              "train_iters": None if samples else config.max_steps, "train_samples": config.train_samples,
              "lr_decay_iters": None if samples else lr.decay_steps, "lr_decay_samples": lr.decay_samples,
              "lr_warmup_iters": 0 if samples or warmup is None else warmup,
              "lr_warmup_samples": warmup if samples and warmup is not None else 0,
              "lr_warmup_fraction": lr.warmup_rate if warmup is None else None,
              "lr_wsd_decay_iters": lr.wsd_decay_steps, "lr_wsd_decay_samples": lr.wsd_decay_samples,
              "lr_wsd_decay_style": lr.wsd_decay_style, "weight_decay_incr_style": o.weight_decay_incr_style,
              "weight_decay": o.weight_decay, "adam_beta1": o.adam_beta1, "adam_beta2": o.adam_beta2,
              "adam_eps": o.adam_epsilon, "clip_grad": o.grad_clip, "global_batch_size": b.global_batch_size,
              "micro_batch_size": b.micro_batch_size}
    constant = o.weight_decay_incr_style == "constant"
    values["start_weight_decay"] = o.weight_decay if constant else o.start_weight_decay
    values["end_weight_decay"] = o.weight_decay if constant else o.end_weight_decay
    return values
