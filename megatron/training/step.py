"""One optimizer step and one evaluation pass, under any layout (the model made ready to run them:
``megatron.parallelize_gpt``).

``train_step`` and ``evaluate`` are what the Trainer repeats; benchmarks and tools call them directly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megatron import parallel_state, watchdog
from megatron.config import Config
from megatron.data.loader import build_loader, split_micro_batches
from megatron.data.token_check import check_batch
from megatron.distributed.data_parallel import DataParallel
from megatron.distributed.finalize_grads import finalize_model_grads
from megatron.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.model import step_hooks
from megatron.optimizer import MixedPrecisionOptimizer, StepResult
from megatron.optimizer.qk_clip import QKClip
from megatron.pipeline_parallel.schedules import ForwardStep, forward_backward_no_pipelining
from megatron.training.rerun import RerunExit, RerunMachine, checked_grads, checked_loss, rerun_exit_message
from megatron.training.stopping import SIGNALS

ModelProvider = Callable[..., torch.nn.Module]  # (config, device, meta_init=...) -> this rank's model
DatasetsProvider = Callable[[Config], tuple]  # -> (train, valid, test); each has __len__, __getitem__, eod_id


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (applied or skipped)
    consumed_samples: int = 0  # by every step, skipped ones too: the data position and the batch-size schedule's
    skipped_steps: int = 0
    schedule_samples: int = 0  # the samples of the applied steps: the learning-rate / weight-decay position
    losses: list = field(default_factory=list)  # every step's global-batch loss


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def all_reduce_sum(value: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(value, group=group)
    return value


def data_loader(config: Config, ps: parallel_state.ParallelState, dataset, consumed: int = 0, num_workers: int = 0,
                batches=None):
    """This data-parallel rank's batches of ``dataset`` from sample ``consumed``, of ``batches`` samples per global
    batch (a number, or consumed -> global batch; default: global_batch_size); under context parallelism its
    share of each sample. Its workers ignore the signals the run stops on (``stopping.SIGNALS``): a
    preemption signals the whole process group."""
    d = config.dataset
    return build_loader(dataset, consumed, batches or config.batch_size.global_batch_size, dataset.eod_id,
                        d.eod_mask_loss, ps.data_parallel_rank, ps.data_parallel_size,
                        num_workers=num_workers, stop_signals=SIGNALS, reset_position_ids=d.reset_position_ids,
                        reset_attention_mask=d.reset_attention_mask, cp_rank=ps.cp_rank, cp_size=ps.cp_size,
                        mtp_depth=config.model.mtp_num_layers or 0)


def train_step(forward_step: ForwardStep, batch: dict, model: torch.nn.Module, buffer: ParamAndGradBuffer,
               optimizer: MixedPrecisionOptimizer, lr: float, micro_batch_size: int, dp_group=None,
               forward_backward: Callable = None, pp_group=None,
               weight_decay: float | None = None, rerun: RerunMachine | None = None,
               step: int = 0, qk_clip: QKClip | None = None) -> tuple[float, StepResult]:
    """One optimizer step over this rank's share of the global batch (any size: it is cut into as many
    micro-batches as it holds); returns (token-mean loss of the global batch, step result). The loss is the
    language model's; a MoE model's auxiliary losses and multi-token prediction's losses join only the gradient
    (``megatron.moe``, ``megatron.model.mtp``), and the result carries their log values. ``model``,
    ``buffer``: as ``parallelize`` returns them; ``dp_group``: the data-parallel group (None: one replica);
    ``forward_backward``: the schedule (default: no pipelining); ``pp_group``: the pipeline group, over
    which the last stage's loss is shared; ``weight_decay``: this step's (None: the configured one); ``rerun``: the
    rerun state machine (``megatron.training.rerun``), which may run the forward and backward again on the same batch
    and raise RerunExit before the update; ``step``: this step's number, for its log lines; ``qk_clip``: QK-clip
    after the update (``megatron.optimizer.qk_clip``: the heads past its threshold clipped, the largest attention
    logit in the result), None: off."""
    forward_backward = forward_backward or forward_backward_no_pipelining
    num_tokens = float(all_reduce_sum(batch["loss_mask"].sum().float(), dp_group).clamp(min=1.0))
    rerun = rerun or RerunMachine()  # disabled: the loop runs once
    checks = rerun.mode != "disabled"
    ps = parallel_state.get()
    last_stage = ps.pp_rank == ps.pp_size - 1
    while rerun.should_run_forward_backward(step):
        optimizer.zero_grad()
        model.train()
        micro_batches = split_micro_batches(batch, micro_batch_size)
        step_hooks.before_step(model, batch, len(micro_batches), dp_group, optimizer.loss_scale, all_reduce_sum)
        loss_sum = forward_backward(forward_step, micro_batches, model, num_tokens, optimizer.loss_scale)
        if checks and last_stage:
            checked_loss(rerun, float(loss_sum))  # this rank's, before any reduction (pretrain_gpt.py's loss_func)
        loss_sum = all_reduce_sum(loss_sum, pp_group)  # only the last stage holds it
        if isinstance(model, DataParallel):
            model.finish_grad_sync()
        finalize_model_grads(model, ps, buffer)
        if checks:
            checked_grads(rerun, optimizer.main_grads())
    checkpoint, leave, code = rerun.should_checkpoint_and_exit()
    if leave:
        raise RerunExit(code, checkpoint, rerun_exit_message(step, code))
    result = optimizer.step(lr, weight_decay)
    if qk_clip is not None:  # part of the MuonClip step, as Megatron's: after the update, applied or not
        mp_group = ps.group("model_parallel") if ps.tp_size * ps.pp_size > 1 else None
        result.max_attention_logit = qk_clip.after_step(model, optimizer, dp_group, mp_group)
    result.moe, result.mtp = step_hooks.after_step(model, result.applied, dp_group, pp_group, all_reduce_sum)
    return float(all_reduce_sum(loss_sum, dp_group)) / num_tokens, result


@torch.no_grad()
def evaluate(forward_step: ForwardStep, loader, model: torch.nn.Module, micro_batch_size: int,
             max_batches: int, device: torch.device, dp_group=None, forward_backward: Callable = None,
             pp_group=None, vocab_size: int | None = None) -> float | None:
    """Token-mean loss over the first ``max_batches`` global batches (None if there are none); with
    ``vocab_size``, each batch's token ids checked first (``token_check.check_batch``)."""
    forward_backward = forward_backward or forward_backward_no_pipelining
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, tokens)
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        watchdog.beat(f"evaluation batch {i + 1}")
        if vocab_size:
            check_batch(batch, vocab_size)
        batch = to_device(batch, device)
        loss = forward_backward(forward_step, split_micro_batches(batch, micro_batch_size), model, 1.0,
                                forward_only=True)
        sums += torch.stack([all_reduce_sum(loss, pp_group).double(), batch["loss_mask"].sum().double()])
    model.train()
    total, tokens = all_reduce_sum(sums, dp_group).tolist()
    return total / tokens if tokens else None
