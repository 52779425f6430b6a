"""Per-rank memory of a configuration, before launching it: model states + saved activations + the
largest temporary buffer, per pipeline stage (``estimate``); activations measured (``measure``)."""

from megatron.memory.estimate import MemoryEstimate, estimate

__all__ = ["MemoryEstimate", "estimate"]
