"""The rerun state machine's settings (``Config.rerun``; megatron/training/rerun.py), checked before any process group
exists."""

from __future__ import annotations

from megatron.config.cli import fail as _fail
from megatron.config.schema import Config


def check_rerun(config: Config, warnings: list[str]) -> None:
    """Injection only where the machine validates; under fp16's dynamic loss scale the NaN check is off (an overflow
    is the scaler's business), as Megatron-LM turns it off."""
    r = config.rerun
    if r.error_injection_rate < 0:
        _fail(f"error_injection_rate must be >= 0 (0 injects nothing), got {r.error_injection_rate}.")
    if r.error_injection_rate and r.rerun_mode != "validate_results":
        _fail(f"error_injection_rate {r.error_injection_rate} injects into result validation, which rerun_mode "
              f"{r.rerun_mode} does not run; add --rerun-mode validate_results or drop --error-injection-rate.")
    mp = config.mix_precision
    if r.rerun_mode != "disabled" and r.check_for_nan_in_loss_and_grad and mp.use_pure_fp16 and mp.dynamic_loss_scale:
        r.check_for_nan_in_loss_and_grad = False
        warnings.append("check_for_nan_in_loss_and_grad is off: fp16's dynamic loss scale skips the steps that "
                        "overflow (as Megatron-LM turns the check off with dynamic loss scaling).")
