"""What a training step does around the model's parts that scale losses of their own and keep records: the MoE
layers (their auxiliary losses' gradient scale, the load statistics, the expert bias: ``megatron.moe.stats``) and
multi-token prediction (its losses' gradient scales and log values: ``megatron.model.mtp``). The training step
calls these two, whatever the model holds; a new part with step hooks joins here."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from megatron.model import mtp
from megatron.moe import stats


def before_step(model: nn.Module, batch: dict, micro_batches: int, dp_group, loss_scale: float,
                sum_over: Callable) -> None:
    """Before a step over this rank's ``batch`` (``micro_batches`` of them): the parts' gradient scales and records
    reset. ``sum_over(tensor, group)``: the caller's all-reduce (multi-token prediction's token counts over
    ``dp_group``): call it on every rank."""
    stats.before_step(model, micro_batches, dp_group, loss_scale)
    mtp.before_step(model, batch, dp_group, loss_scale, sum_over)


def after_step(model: nn.Module, applied: bool, dp_group, pp_group,
               sum_over: Callable) -> tuple[dict | None, dict | None]:
    """After the optimizer step: (the MoE log values, multi-token prediction's), each None when the model has no
    such part; the expert bias moved when the step was ``applied``. Collective over the data-parallel and
    pipeline groups (``sum_over``: the caller's all-reduce): call it on every rank."""
    return (stats.after_step(model, applied, dp_group, pp_group),
            mtp.after_step(model, dp_group, pp_group, sum_over))
