"""Checkpoints: layout-independent save and load (``save_load``), the on-disk format (``format``),
offline writing and resharding (``convert``) and the Hugging Face GPT-2 mapping (``hf_gpt2``)."""

from megatron.checkpoint.format import KINDS, CheckpointError, CheckpointReader, resolve_checkpoint
from megatron.checkpoint.save_load import (
    check_compatible,
    global_name,
    load_checkpoint,
    owned_pieces,
    save_checkpoint,
)

__all__ = ["KINDS", "CheckpointError", "CheckpointReader", "check_compatible", "global_name", "load_checkpoint",
           "owned_pieces", "resolve_checkpoint", "save_checkpoint"]
