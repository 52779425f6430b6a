"""AdamW (or SGD, or Muon and AdamW) with fp32 master weights, loss scaling, clipping, and the learning-rate and
weight-decay schedule."""

from __future__ import annotations

from megatron import parallel_state
from megatron.config.schema import Config
from megatron.config.validate_mup import width_mult
from megatron.distributed.parallelize import ShardingPlan
from megatron.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.optimizer.lr_schedule import (
    OptimizerParamSchedule,
    build_param_schedule,
    decoupled_schedule,
    mup_schedule,
)
from megatron.optimizer.muon import MuonSettings, muon_matrices
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


def build_optimizer(buffer: ParamAndGradBuffer, plan: ShardingPlan, config: Config) -> MixedPrecisionOptimizer:
    """The optimizer over ``buffer`` (from ``parallelize``), sharded and offloaded as ``plan`` says: AdamW, SGD
    (``Optimizer.optimizer`` sgd), or (muon / dist_muon) Muon for the matrices ``muon.is_muon_param`` picks and AdamW
    for the rest."""
    muon = None
    if config.optimizer.optimizer in ("muon", "dist_muon"):
        ps = parallel_state.get()
        muon = (MuonSettings.from_config(config), muon_matrices(buffer, ps.group("tp"), ps.group("etp")))
    return MixedPrecisionOptimizer(buffer, plan, config.optimizer, build_grad_scaler(config), muon,
                                   mup_width=width_mult(config.model))


__all__ = ["ConstantGradScaler", "DynamicGradScaler", "MixedPrecisionOptimizer", "OptimizerParamSchedule",
           "StepResult", "build_grad_scaler", "build_optimizer", "build_param_schedule",
           "decoupled_schedule", "mup_schedule"]
