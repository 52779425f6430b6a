"""The Muon optimizer's settings (``Optimizer.optimizer`` muon or dist_muon, ``Optimizer.muon``), checked before any
process group exists; ``dist_muon`` resolved into Megatron-LM's distributed optimizer (the states sharded over the
data-parallel group), which ``validate._resolve_distributed_optimizer`` then lays out."""

from __future__ import annotations

import math

from megatron.config.cli import fail as _fail
from megatron.config.schema import Config

NS_COEFFICIENT_CYCLE = 5  # the quintic coefficient sets (megatron.optimizer.muon.QUINTIC)


def check_muon(config: Config) -> None:
    """Muon's momentum, iteration count and scale in range (whichever optimizer: a value is wrong or not);
    ``dist_muon`` turns use_distributed_optimizer on."""
    o, m = config.optimizer, config.optimizer.muon
    if not 0 <= m.muon_momentum < 1:
        _fail(f"muon_momentum must be in [0, 1), got {m.muon_momentum}.")
    if m.muon_num_ns_steps < 1 or m.muon_num_ns_steps % NS_COEFFICIENT_CYCLE:
        _fail(f"muon_num_ns_steps must be a positive multiple of {NS_COEFFICIENT_CYCLE} (the quintic Newton-Schulz "
              f"coefficients come in a cycle of {NS_COEFFICIENT_CYCLE}, as Megatron-LM's emerging_optimizers "
              f"requires), got {m.muon_num_ns_steps}; use 5 or 10.")
    if not (math.isfinite(m.muon_extra_scale_factor) and m.muon_extra_scale_factor > 0):
        _fail(f"muon_extra_scale_factor must be a positive number, got {m.muon_extra_scale_factor}.")
    if o.optimizer == "dist_muon":
        config.distributed.use_distributed_optimizer = True


def check_qk_clip(config: Config) -> None:
    """QK-clip's (MuonClip's) settings, as Megatron-LM checks them with --qk-clip; here whether or not it is on (no
    numeric key takes a value without a meaning)."""
    o = config.optimizer
    if not 0.0 < o.qk_clip_alpha < 1.0:
        _fail(f"qk_clip_alpha must be between 0 and 1 (exclusive), got {o.qk_clip_alpha}; 0.5 splits the scaling "
              f"evenly between the queries and the keys.")
    if not (math.isfinite(o.qk_clip_threshold) and o.qk_clip_threshold > 0):
        _fail(f"qk_clip_threshold must be a positive number, got {o.qk_clip_threshold}; Megatron-LM's default is "
              f"100.")
