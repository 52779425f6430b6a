"""Learning rate and weight decay as pure functions of the schedule's position ``n``, in samples.

Megatron-LM's OptimizerParamScheduler rule. ``n`` counts the samples of the *applied* steps before the
current one (a step skipped for inf/nan gradients does not advance it): the step at ``n = 0``, the first,
trains at ``warmup_init``. Iteration-based lengths are multiplied by the global batch (``decay_steps x
global_batch_size``); sample-based ones (with ``train_samples``) are used as they are. With ``w`` warm-up
and ``d`` decay samples (``w = warmup_rate x d`` unless given, fractional as Megatron's)::

    lr(n) = warmup_init + (max_lr - warmup_init) n / w        w > 0 and n <= w
    lr(n) = max_lr                                            constant, after warm-up
    lr(n) = min_lr                                            n > d
    lr(n) = max(min_lr, max_lr sqrt(max(w, 1) / max(n, 1)))   inverse-square-root
    lr(n) = min_lr + (max_lr - min_lr) f(r),  r = (n - w) / (d - w)

with ``f(r) = (1 + cos(pi r)) / 2`` (cosine), ``1 - r`` (linear), or, for WSD, 1 until the last ``s``
(``wsd_decay``) samples of the decay and then, with ``q = (n - (d - s)) / s``: ``2 x 0.5^q - 1``
(exponential), ``1 - q`` (linear), ``(1 + cos(pi q)) / 2`` (cosine), ``1 - sqrt(q)`` (minus_sqrt).

Weight decay over the training length ``t`` samples (``max_steps x global_batch_size``, or
``train_samples``)::

    wd(n) = end_wd                                            constant, or n > t
    wd(n) = start_wd + (end_wd - start_wd) g(n / t),  g(x) = x (linear), (1 + cos(pi (1 - x))) / 2 (cosine)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron.config.schema import Config
from megatron.config.validate_mup import mup_lr_factor, width_mult

DECAY_STYLES = ("cosine", "linear", "constant", "inverse-square-root", "WSD")
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimizerParamSchedule:
    """``lr(n)`` and ``weight_decay(n)`` as in the module doc; every length is in samples."""

    max_lr: float
    min_lr: float
    warmup: float
    decay: float
    decay_style: str = "cosine"
    warmup_init: float = 0.0
    wsd_decay: float | None = None
    wsd_decay_style: str = "exponential"
    start_wd: float = 0.0
    end_wd: float = 0.0
    wd_length: float = 1.0
    wd_style: str = "constant"

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES or self.wsd_decay_style not in WSD_STYLES or \
                self.wd_style not in WD_STYLES:
            raise ValueError(f"unknown style: decay {self.decay_style!r}, WSD {self.wsd_decay_style!r}, weight "
                             f"decay {self.wd_style!r}")
        if self.decay_style == "WSD" and not self.wsd_decay:
            raise ValueError("the WSD decay style needs the length of its final decay (wsd_decay > 0)")

    def lr(self, n: float) -> float:
        if self.warmup > 0 and n <= self.warmup:
            return self.warmup_init + (self.max_lr - self.warmup_init) * n / self.warmup
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * math.sqrt(max(self.warmup, 1.0)) / math.sqrt(max(n, 1.0)))
        ratio = (n - self.warmup) / (self.decay - self.warmup)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff(n)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _wsd_coeff(self, n: float) -> float:
        anneal_start = self.decay - self.wsd_decay
        if n <= anneal_start:
            return 1.0
        q = (n - anneal_start) / self.wsd_decay
        if self.wsd_decay_style == "linear":
            return 1.0 - q
        if self.wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * q) + 1.0)
        if self.wsd_decay_style == "exponential":
            return 2.0 * 0.5**q - 1.0
        return 1.0 - math.sqrt(q)

    def weight_decay(self, n: float) -> float:
        if self.wd_style == "constant" or n > self.wd_length:
            return self.end_wd
        x = n / self.wd_length
        coeff = x if self.wd_style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - x)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)


def build_param_schedule(config: Config) -> OptimizerParamSchedule:
    """The run's schedule in samples, from a validated ``config`` (Megatron's get_optimizer_param_scheduler):
    iteration-based lengths times ``global_batch_size`` (the final one under a batch-size schedule), or the
    sample-based ones with ``train_samples``."""
    o, lr, gbs = config.optimizer, config.optimizer.lr, config.batch_size.global_batch_size
    if config.train_samples is None:
        decay, length = lr.decay_steps * gbs, config.max_steps * gbs
        warmup = None if lr.warmup_steps is None else lr.warmup_steps * gbs
        wsd = None if lr.wsd_decay_steps is None else lr.wsd_decay_steps * gbs
    else:
        decay, length, warmup, wsd = lr.decay_samples, config.train_samples, lr.warmup_samples, lr.wsd_decay_samples
    if warmup is None:
        warmup = lr.warmup_rate * decay
    constant_wd = o.weight_decay_incr_style == "constant"
    return OptimizerParamSchedule(
        lr.max_lr, lr.min_lr, warmup, decay, lr.decay_style, lr.warmup_init, wsd, lr.wsd_decay_style,
        start_wd=o.weight_decay if constant_wd else o.start_weight_decay,
        end_wd=o.weight_decay if constant_wd else o.end_weight_decay,
        wd_length=length, wd_style=o.weight_decay_incr_style)


def decoupled_schedule(config: Config, schedule: OptimizerParamSchedule) -> OptimizerParamSchedule | None:
    """The word embedding's and output layer's schedule under Megatron-LM's --decoupled-lr: ``schedule`` with
    decoupled_lr as its peak and decoupled_min_lr (default min_lr) as its floor; None without decoupled_lr."""
    lr = config.optimizer.lr
    if lr.decoupled_lr is None:
        return None
    floor = lr.min_lr if lr.decoupled_min_lr is None else lr.decoupled_min_lr
    return dataclasses.replace(schedule, max_lr=lr.decoupled_lr, min_lr=floor)


def mup_schedule(config: Config, schedule: OptimizerParamSchedule) -> OptimizerParamSchedule | None:
    """The schedule of the parameters muP scales (``param_groups.mup_scaled``): ``schedule`` with its peak and floor
    times ``validate_mup.mup_lr_factor`` (Megatron Core's max_lr / min_lr overrides; the warm-up still starts at
    warmup_init); None without muP or at a width multiplier of 1."""
    if not config.model.use_mup or width_mult(config.model) == 1.0:
        return None
    factor = mup_lr_factor(config)
    return dataclasses.replace(schedule, max_lr=schedule.max_lr * factor, min_lr=schedule.min_lr * factor)
