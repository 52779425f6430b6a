"""AdamW with fp32 master weights, loss scaling, clipping and the LR schedule."""

from __future__ import annotations

from torch import nn

from megatron.config.schema import Config
from megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.optimizer.lr_schedule import CosineWithWarmup
from megatron.optimizer.optimizer import MixedPrecisionOptimizer, StepResult


def build_grad_scaler(config: Config) -> ConstantGradScaler | None:
    """A loss scaler for fp16 (dynamic unless disabled); None for fp32 and bf16."""
    mp = config.mix_precision
    if not mp.use_pure_fp16:
        return None
    if not mp.dynamic_loss_scale:
        return ConstantGradScaler(mp.scale_loss)
    return DynamicGradScaler(mp.scale_loss, min_scale=mp.min_loss_scale,
                             growth_interval=mp.loss_scale_window, hysteresis=mp.hysteresis)


def build_optimizer(model: nn.Module, config: Config, model_parallel_group=None,
                    sharding_group=None) -> MixedPrecisionOptimizer:
    d = config.distributed
    return MixedPrecisionOptimizer(model, config.optimizer, build_grad_scaler(config), model_parallel_group,
                                   sharding_group, d.sharding.sharding_stage, d.sharding.sharding_offload,
                                   bucket_size=int(d.bucket_size_mb * 2**20 / 4))


def build_lr_schedule(config: Config) -> CosineWithWarmup:
    lr = config.optimizer.lr
    return CosineWithWarmup(lr.max_lr, lr.min_lr, lr.warmup_steps, lr.decay_steps, lr.decay_style)


__all__ = ["ConstantGradScaler", "CosineWithWarmup", "DynamicGradScaler", "MixedPrecisionOptimizer",
           "StepResult", "build_grad_scaler", "build_lr_schedule", "build_optimizer"]
