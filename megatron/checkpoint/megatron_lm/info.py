"""``tools/checkpoint_info.py`` on a Megatron-LM folder: what it holds and what ``from-megatron`` converts.

``is_megatron(path)``: a Megatron-LM save folder (``latest_checkpointed_iteration.txt``) or one of its iteration
folders (legacy ``mp_rank_*`` folders, or torch_dist's ``metadata.json``). ``describe(path, convert)``: lines saying
the format and iteration, the layout the rank files were saved under (tp x pp x ep from the files, dp from the args),
the model's shape (from the args), the optimizer's states and their layout, the learning-rate scheduler's state, and
whether ``from-megatron`` converts it, in the converter's own words when it does not. "Converts" is decided by the
converter's own checks, called here (``_converts``): the folder's files and what they say of themselves
(``megatron_legacy.first_file`` / ``rank_files``, ``megatron_dist.dist_head``), the schedule
(``megatron_schedule``), the configuration the args give (``megatron_args.model_flags``,
``converted_config.shaped_config``), reading one rank file; with ``convert`` (``--verify``), every tensor too, read
as the conversion reads it.
"""

from __future__ import annotations

import os
import re

from megatron.checkpoint.format import CheckpointError
from megatron.checkpoint.hf.common import ConversionError

_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_BY_NAME = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)\.")


def is_megatron(path: str) -> bool:
    from megatron.checkpoint.megatron_lm.dist import is_torch_dist
    from megatron.checkpoint.megatron_lm.legacy import TRACKER

    if not os.path.isdir(path):
        return False
    return (os.path.isfile(os.path.join(path, TRACKER)) or is_torch_dist(path)
            or any(_RANK.match(name) for name in os.listdir(path)))


def _arg(args, name, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def _model(args) -> str:
    heads = f"{_arg(args, 'num_attention_heads', '?')} heads"
    if _arg(args, "group_query_attention", False):
        heads += f" ({_arg(args, 'num_query_groups', '?')} query groups)"
    if _arg(args, "multi_latent_attention", False):
        heads += " (multi-latent attention)"
    shape = [f"{_arg(args, 'num_layers', '?')} layers", f"hidden {_arg(args, 'hidden_size', '?')}", heads,
             f"ffn {_arg(args, 'ffn_hidden_size', '?')}",
             (f"vocab {args.vocab_size} (padded {_arg(args, 'padded_vocab_size', '?')})" if _arg(args, "vocab_size")
              else f"vocab padded to {_arg(args, 'padded_vocab_size', '?')}"),
             f"positions {_arg(args, 'max_position_embeddings', '?')} ({_arg(args, 'position_embedding_type', '?')})",
             str(_arg(args, "normalization", "LayerNorm")),
             "swiglu" if _arg(args, "swiglu", False) else "quick GeGLU" if _arg(args, "quick_geglu", False) else "gelu",
             "untied head" if _arg(args, "untie_embeddings_and_output_weights", False) else "tied head"]
    if _arg(args, "num_experts", None):
        shape.append(f"{args.num_experts} experts top-{_arg(args, 'moe_router_topk', 2)}"
                     + (" (grouped GEMM)" if _arg(args, "moe_grouped_gemm", False) else ""))
    if _arg(args, "mtp_num_layers", None):
        shape.append(f"{args.mtp_num_layers} multi-token prediction module(s)")
    precision = "bf16" if _arg(args, "bf16", False) else "fp16" if _arg(args, "fp16", False) else "fp32"
    return "model (args): " + ", ".join(shape) + f"; trained in {precision}"


def _ranks(folder: str, args) -> str:
    """The layout the legacy rank folders' names say (mp_rank_TT[_PPP][_EEE]; with pipeline size 1 the second number
    is the expert rank), against the args'."""
    tp, pp, ep = (int(_arg(args, n, 1)) for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                   "expert_model_parallel_size"))
    found = [m for m in map(_RANK.match, sorted(os.listdir(folder))) if m]
    counts = [len({m[i] for m in found if m[i] is not None}) or 1 for i in (1, 2, 3)]
    files = (counts[0], counts[1], counts[2]) if pp > 1 else (counts[0], 1, counts[1])
    said = f"tensor-parallel {tp} x pipeline {pp} x expert-parallel {ep}"
    seen = f"tensor-parallel {files[0]} x pipeline {files[1]} x expert-parallel {files[2]}"
    agree = "as its args say" if seen == said else f"but its args say {said}"
    return (f"saved under: {seen} ({len(found)} rank folders mp_rank_*, {agree}), data-parallel "
            f"{_arg(args, 'data_parallel_size', '?')} (args)")


def _legacy_optimizer(folder: str, head: dict) -> str:
    from megatron.checkpoint.megatron_lm.distrib_optim import FILE as DISTRIBUTED_FILE

    entry = head.get("optimizer")
    first = next((n for n in sorted(os.listdir(folder)) if _RANK.match(n)), "")
    if os.path.isfile(os.path.join(folder, first, DISTRIBUTED_FILE)):
        return (f"optimizer: the distributed optimizer's (--use-distributed-optimizer): Adam's states flattened by "
                f"gradient bucket in each rank folder's {DISTRIBUTED_FILE} (fp32 masters, exp_avg, exp_avg_sq), "
                f"{_step(entry)}")
    if entry is None:
        return "optimizer: none saved (--no-save-optim): the weights only"
    if isinstance(entry, dict) and "fp32_from_fp16_params" in entry:
        return f"optimizer: Megatron Core's mixed-precision Adam (fp32 masters, per rank file), {_step(entry)}"
    if isinstance(entry, list):
        return f"optimizer: a chain of {len(entry)} optimizers (expert parallelism), {_step(entry)}"
    return f"optimizer: Megatron Core's fp32 Adam (its states per rank file), {_step(entry)}"


def _step(entry) -> str:
    from megatron.checkpoint.megatron_lm.optim import common_step

    try:
        return f"Adam's step {common_step(entry, ''):g}"
    except CheckpointError:
        return "Adam's step not found"


def _dist_optimizer(folder: str, common: dict) -> str:
    from megatron.checkpoint.megatron_lm.dcp_reader import SafeReader
    from megatron.checkpoint.megatron_lm.distrib_optim import OBJECT_KEY, bucketed, read_object

    metadata = SafeReader(folder).read_metadata()
    keys = metadata.state_dict_metadata
    sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    by_bucket = bucketed(metadata)
    if by_bucket == "dp_reshardable":
        buckets = read_object(folder, metadata, OBJECT_KEY.format(0, "per_bucket_numel_unpadded"))
        sizes = [n for per_dtype in (buckets or [{}]) for numels in per_dtype.values() for n in numels]
        where = f": model-parallel rank 0 has {len(sizes)} bucket(s) of {min(sizes):,} to {max(sizes):,} elements" \
            if sizes else ""
        return (f"optimizer: the distributed optimizer's, by gradient bucket (dp_reshardable{where}), "
                f"{_step(read_object(folder, metadata, OBJECT_KEY.format(0, 'optimizer')))}")
    if by_bucket:
        return (f"optimizer: the distributed optimizer's, gathered by gradient bucket ({by_bucket}), "
                f"{_step(read_object(folder, metadata, OBJECT_KEY.format(0, 'optimizer')))}")
    kinds = sorted({m[1] for m in map(_BY_NAME.match, keys) if m})
    if not kinds:
        return "optimizer: none saved: the weights only"
    what = f"the distributed optimizer's {sharding}" if sharding else "Megatron Core's Adam"
    return f"optimizer: {what}, by parameter name ({', '.join(kinds)}), {_step(common.get('optimizer'))}"


def _scheduler(args, head: dict, iteration: int) -> str:
    from megatron.checkpoint.megatron_lm.schedule import megatron_schedule

    _, schedule, notes = megatron_schedule(args, head, iteration)
    if schedule is None:
        return "scheduler: " + (notes[-1] if notes else "none")
    s = schedule.state
    return (f"scheduler: from {schedule.source}: {s['lr_decay_style']} from max_lr {s['max_lr']:g} to min_lr "
            f"{s['min_lr']:g}, warm-up {s['lr_warmup_steps']:g} and decay {s['lr_decay_steps']:g} samples, at "
            f"{schedule.position:,} samples: the next step's learning rate {schedule.lr():.6g}")


def _converts(folder: str, read: tuple, convert: bool) -> str:
    """Whether ``from-megatron`` converts the folder (``read``: the first rank file's real path, None for torch_dist,
    the saved dict, its args and the iteration, as ``describe`` read them), by the checks the converter makes
    itself, in its order, and in its words when it refuses: the rank files (legacy: ``megatron_legacy.rank_files``),
    the schedule (``megatron_schedule``) and the configuration of the model and schedule the args give
    (``megatron_args.model_flags``, then ``converted_config.shaped_config``, with no flags: ``from-megatron FOLDER
    OUT``); with ``convert`` (``--verify``), every tensor read as the conversion reads it
    (``megatron_convert.import_state``) and fitted to that configuration (``_check_fit``)."""
    from megatron.checkpoint.converted_config import ToolError, shaped_config
    from megatron.checkpoint.megatron_lm.args import model_flags
    from megatron.checkpoint.megatron_lm.dist import is_torch_dist
    from megatron.checkpoint.megatron_lm.legacy import rank_files
    from megatron.checkpoint.megatron_lm.schedule import megatron_schedule
    from megatron.config import ConfigError
    from megatron.tokenizer import TokenizerError

    _, head, args, iteration = read
    try:
        if not is_torch_dist(folder):
            rank_files(folder, read)
        _, schedule, _ = megatron_schedule(args, head, iteration)
        config = shaped_config([*model_flags(args), *(schedule.flags if schedule else [])], [],
                               "the checkpoint's args")
    except (CheckpointError, ConversionError, ConfigError, ToolError, TokenizerError) as err:
        return f"converts: no, from-megatron refuses it: {err}"
    if not convert:
        return ("converts: the model, by its args and rank files (tools/checkpoint_info.py --verify reads every "
                "tensor as from-megatron does, and says whether its optimizer states convert)")
    from megatron.checkpoint.megatron_lm.convert import import_state

    optimizer_err = None
    try:
        imported = import_state(folder, optimizer=True)
    except (CheckpointError, ConversionError) as err:
        optimizer_err = err
        try:
            imported = import_state(folder, optimizer=False)
        except (CheckpointError, ConversionError) as weights_err:
            return f"converts: no, from-megatron refuses it: {weights_err}"
    try:
        _check_fit(imported.params, args, config)
    except CheckpointError as err:
        return f"converts: no, from-megatron refuses it: {err}"
    if optimizer_err is not None:
        return f"converts: the weights only (from-megatron --no-optim), not the optimizer states: {optimizer_err}"
    states = "" if imported.states is None else f", Adam's moments at step {imported.states.step:g}"
    return f"converts: yes (from-megatron): {len(imported.params)} tensors{states}"


def _check_fit(params: dict, args, config) -> None:
    """What ``from-megatron`` checks of the tensors read before it writes them: the vocabulary's rows
    (``megatron_convert.fit_vocab``), then every parameter of the configured model there (``convert.tensor_layout``),
    no other, each of its shape; CheckpointError in the writer's words otherwise."""
    from megatron.checkpoint.convert import check_names_fit, check_shape_fits, tensor_layout
    from megatron.checkpoint.megatron_lm.args import vocab_size
    from megatron.checkpoint.megatron_lm.convert import fit_vocab

    params = fit_vocab(params, vocab_size(args), config.padded_vocab_size)
    layout = tensor_layout(config)
    check_names_fit([("param", name) for name in params], layout)
    for name, t in params.items():
        check_shape_fits("param", name, t, layout)


def describe(path: str, convert: bool = False) -> list[str]:
    """The lines ``tools/checkpoint_info.py`` prints for the Megatron-LM folder ``path``. What the folder says of
    itself is read by the converter's own readers (``megatron_legacy.first_file``, ``megatron_dist.dist_head``: the
    files inside the folder, the args' sizes bounded, the iteration checked), so a crafted folder is refused here as
    there, in one line."""
    from megatron.checkpoint.megatron_lm.dist import dist_head, is_torch_dist
    from megatron.checkpoint.megatron_lm.legacy import first_file, iteration_folder

    folder = iteration_folder(path)
    if is_torch_dist(folder):
        first, (head, args, iteration) = None, dist_head(folder)
        fmt = "torch_dist (--ckpt-format torch_dist: whole tensors by name, any layout loads it)"
    else:
        first, head, args, iteration = first_file(folder)
        fmt = "legacy (--ckpt-format torch: one file per model-parallel rank)"
    lines = [f"Megatron-LM checkpoint: {folder}", f"format: {fmt}, checkpoint_version {head.get('checkpoint_version')}",
             f"iteration: {iteration} (consumed samples {_arg(args, 'consumed_train_samples', '?')})"]
    if is_torch_dist(folder):
        tp, pp, ep = (_arg(args, n, 1) for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                  "expert_model_parallel_size"))
        lines.append(f"saved under (args): tensor-parallel {tp} x pipeline {pp} x expert-parallel {ep}, "
                     f"data-parallel {_arg(args, 'data_parallel_size', '?')}")
    else:
        lines.append(_ranks(folder, args))
    lines.append(_model(args))
    lines.append(_dist_optimizer(folder, head) if is_torch_dist(folder) else _legacy_optimizer(folder, head))
    lines.append(_scheduler(args, head, iteration))
    lines.append(_converts(folder, (first, head, args, iteration), convert))
    return lines
