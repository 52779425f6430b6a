"""Per-rank memory of a configuration, before launching it: model states + saved activations + the
largest temporary buffer, per pipeline stage (``estimate``); activations measured (``measure``); the check
before a run, against what the device has (``check``)."""

from megatron.memory.estimate import MemoryEstimate, estimate

__all__ = ["MemoryEstimate", "estimate"]
