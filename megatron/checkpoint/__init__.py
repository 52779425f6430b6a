"""Checkpoints: layout-independent save and load (``save_load``), the on-disk format (``format``),
the output folder and agreement between ranks on a failure (``run_dir``), what a resumed run inherits
(``resume``: the saved configuration as the base of the one given now), offline writing and resharding
(``convert``). Other frameworks' checkpoints live in subpackages: ``hf`` (Hugging Face: one module per family,
each a table of names that the engine in ``hf.mapping`` reads both ways) and ``megatron_lm`` (NVIDIA Megatron-LM's
legacy and torch_dist formats)."""

from megatron.checkpoint.format import (
    KINDS,
    CheckpointError,
    CheckpointReader,
    find_checkpoint,
    resolve_checkpoint,
    same_folder,
)
from megatron.checkpoint.resume import resume_base, resumed_config, schedule_kept_warning
from megatron.checkpoint.run_dir import check_output_dir, claim_output_dir, on_every_rank
from megatron.checkpoint.save_load import (
    check_compatible,
    global_name,
    load_checkpoint,
    owned_pieces,
    point_latest,
    prune_checkpoints,
    save_checkpoint,
)

__all__ = ["KINDS", "CheckpointError", "CheckpointReader", "check_compatible", "check_output_dir",
           "claim_output_dir", "find_checkpoint", "global_name", "load_checkpoint", "on_every_rank", "owned_pieces",
           "point_latest", "prune_checkpoints", "resolve_checkpoint", "resume_base", "resumed_config", "same_folder",
           "save_checkpoint", "schedule_kept_warning"]
