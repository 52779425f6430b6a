"""Megatron Core's distributed optimizer (``--use-distributed-optimizer``): its Adam states, flattened by gradient
bucket, <-> each model-parallel rank's parameters by name.

**The buffer** (``megatron/core/distributed/param_and_grad_buffer.py``, ``_ParamAndGradBuffer``). Megatron Core's
``DistributedDataParallel`` keeps each model-parallel rank's parameters in one flat buffer per (param dtype, grad
dtype), the key its files name (one buffer: every parameter has the run's dtype; with expert parallelism > 1 the
experts have their own optimizer and buffer, not converted here). Its layout:

- the parameters in reverse ``named_parameters`` order (roughly the backward's), each starting at a multiple of 64
  elements (``_pad_start_of_param_if_needed``);
- a bucket closes once it holds ``bucket_size`` elements or more: ``--ddp-bucket-size``, by default
  max(40,000,000, 1,000,000 x dp) with ``--overlap-grad-reduce`` and no limit (one bucket) without it, and no limit
  on every pipeline stage but the first; the shared word embedding (a tied head with pp > 1: the first stage's
  embedding, the last stage's ``output_layer`` copy; with multi-token prediction the last stage's embedding) is a
  bucket of its own;
- a bucket's ``numel_unpadded`` is everything up to its last parameter's end (the 64-alignment gaps included); its
  end is then padded to a multiple of lcm(dp, 128), and dp rank r owns the r-th contiguous slice of each bucket.

**What Megatron saves** (``megatron/core/optimizer/distrib_optimizer.py``):

- legacy (``--ckpt-format torch``), beside each rank's ``model_optim_rng.pt``: ``distrib_optim.pt``
  (``save_parameter_state`` = ``get_parameter_state_dp_zero``, gathered on dp rank 0): ``{"buckets_coalesced":
  True, 0: {(param_dtype, grad_dtype): {"param", "exp_avg", "exp_avg_sq": fp32 [numel_unpadded], "numel_unpadded":
  n}}}``, the buffer's buckets' unpadded parts one after another; ``param`` is the fp32 master weight. The rank file's
  ``optimizer`` entry (``DistributedOptimizer.state_dict()``) holds only the groups, with Adam's ``step``.
- torch_dist, ``dp_reshardable`` (Megatron-LM's default): one 1-D tensor per bucket and kind,
  ``optimizer.distributed.dp_group_idx_{i}.gbuf_idx_0.dtype_{(param_dtype, grad_dtype)}.bucket_idx_{b}.{param,
  exp_avg,exp_avg_sq}`` of that bucket's numel_unpadded, i the model-parallel rank (pp rank x tp + tp rank); the
  groups (``....optimizer``) and the buckets' sizes (``....per_bucket_numel_unpadded``) as sharded objects (bytes).
  ``dp_zero_gather_scatter`` (deprecated) keeps the legacy file's dict as ``....param_state``.
- torch_dist, ``fully_reshardable``: by name, ``optimizer.state.{param,exp_avg,exp_avg_sq}.<the parameter's key>``
  (read by ``megatron_dist``; written here for the export).

None of these depends on the dp size (the end padding is never saved), so they load at any dp (torch_dist
``fully_reshardable`` at any tp and pp too). Reading recomputes the layout from the saved ``args`` and checks it
against the saved sizes (the buffer's; every bucket's in torch_dist) and against the weights (each fp32 master,
rounded to the saved weight's dtype, is that weight; each state is first checked by ``foreign_numbers``: finite,
the second moment never negative); a checkpoint that does not match is refused in one line, never guessed. The
ShardedObjects' bytes and ``distrib_optim.pt`` are read with ``torch.load(weights_only=True)`` (tensors, dtypes and
plain containers only).
"""

from __future__ import annotations

import argparse
import io
import math
import os
import re
import warnings
from typing import NamedTuple

import torch

from megatron.checkpoint.foreign_numbers import check_state
from megatron.checkpoint.format import CheckpointError, file_inside
from megatron.checkpoint.megatron_lm.optim import (
    ADAM_KINDS,
    DAMAGED,
    MASTER,
    NO_OPTIM,
    core_order,
    param_group,
    parameters,
)

KINDS = ("param", *ADAM_KINDS)  # Megatron's names: "param" is the fp32 master
FILE = "distrib_optim.pt"
_PARAM_ALIGN = 64
_BUCKET_KEY = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                         r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
OBJECT_KEY = "optimizer.distributed.dp_group_idx_{}.{}/shard_0_1"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Layout(NamedTuple):
    """One buffer: {name: (offset in the buckets' unpadded parts laid end to end, numel)}, each bucket's
    numel_unpadded."""

    slots: dict[str, tuple[int, int]]
    buckets: list[int]

    @property
    def numel(self) -> int:
        return sum(self.buckets)


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def buffer_layout(params: list[tuple[str, int]], bucket_size: int | None, shared: frozenset = frozenset(),
                  dp: int = 1) -> Layout:
    """``_ParamAndGradBuffer``'s layout of ``params`` ((name, numel) in ``named_parameters`` order) with the
    distributed optimizer (see the module's docstring); ``dp`` only pads the buckets' ends, never saved."""
    divisor, index, unpadded = math.lcm(dp, 128), {}, []
    start = bucket_start = end = count = 0

    def close(at: int) -> int:
        nonlocal bucket_start, count
        unpadded.append(at - bucket_start)
        bucket_start, count = _pad(at, divisor), 0
        return bucket_start

    for name, numel in reversed(params):
        start = _pad(start, _PARAM_ALIGN)
        alone = name in shared
        if alone and count:
            start = close(start)
        end = start + numel
        index[name] = (start, len(unpadded))
        count += 1
        start = close(end) if alone or (bucket_size is not None and end - bucket_start >= bucket_size) else end
    if count:
        close(end)
    starts, offset = [], 0
    for size in unpadded:  # each bucket's start in the buffer, and in the buckets' unpadded parts end to end
        starts.append(offset)
        offset += size
    padded = [0]
    for size in unpadded[:-1]:
        padded.append(_pad(padded[-1] + size, divisor))
    numels = dict(params)
    return Layout({name: (starts[b] + at - padded[b], numels[name]) for name, (at, b) in index.items()}, unpadded)


def bucket_size(args: argparse.Namespace, pp_rank: int) -> int | None:
    """The bucket size Megatron Core's DDP used on pipeline stage ``pp_rank`` of the run whose ``args`` these are."""
    if pp_rank > 0 or not getattr(args, "overlap_grad_reduce", False):
        return None
    size = getattr(args, "ddp_bucket_size", None)
    return int(size) if size else max(40_000_000, 1_000_000 * int(getattr(args, "data_parallel_size", 1) or 1))


def shared_embedding(names, args: argparse.Namespace, pp_rank: int) -> frozenset:
    """The parameter of stage ``pp_rank`` marked ``shared_embedding`` (LanguageModule's
    ``setup_embeddings_and_output_layer``): a bucket of its own."""
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    mtp = bool(getattr(args, "mtp_num_layers", None))
    if pp == 1 or not (tied or mtp):
        return frozenset()
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        return frozenset({"embedding.word_embeddings.weight"}) & set(names)
    if last and (tied or mtp):
        name = "embedding.word_embeddings.weight" if mtp else "output_layer.weight"
        return frozenset({name}) & set(names)
    return frozenset()


def rank_layout(model: dict, args: argparse.Namespace, pp_rank: int) -> Layout:
    """The buffer layout of one model-parallel rank whose state dict is ``model`` (its parameters in Megatron
    Core's order)."""
    names = core_order(parameters(model))
    return buffer_layout([(n, model[n].numel()) for n in names], bucket_size(args, pp_rank),
                         shared_embedding(names, args, pp_rank), int(getattr(args, "data_parallel_size", 1) or 1))


def dtype_key(args: argparse.Namespace) -> tuple[torch.dtype, torch.dtype]:
    """(param dtype, grad dtype) of the run's buffer: what its files key the states by."""
    param = next((dtype for flag, dtype in _DTYPES.items() if getattr(args, flag, False)), torch.float32)
    fp32_grads = param == torch.float32 or getattr(args, "accumulate_allreduce_grads_in_fp32", False)
    return param, torch.float32 if fp32_grads else param


def _load_plain(source, where: str):
    """``torch.load`` of tensors, dtypes and plain containers only (``weights_only``, no other class)."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - an unpickling refusal, a damaged file: one line either way
        detail = str(err).split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        raise CheckpointError(f"cannot read {where} ({type(err).__name__}: {detail[0][:200] if detail else ''}); "
                              f"{NO_OPTIM}.") from err


def _split(world: dict[str, torch.Tensor], layout: Layout, model: dict, where: str) -> dict[str, dict]:
    """{kind: {name: tensor shaped as the parameter}} of one buffer's ``world`` tensors (buckets end to end)."""
    out = {}
    for kind in KINDS:
        flat = world.get(kind)
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() != layout.numel:
            size = ("missing" if not isinstance(flat, torch.Tensor) else f"{flat.numel()} elements" if flat.dim() == 1
                    else f"shaped {list(flat.shape)}")
            raise CheckpointError(f"{where}: the distributed optimizer's {kind} is {size}, but Megatron Core's "
                                  f"bucket layout of this rank's parameters (from the args) holds {layout.numel} "
                                  f"elements in one dimension; {NO_OPTIM}.")
        out[kind] = {name: check_state(kind, name, flat[at:at + numel], where, DAMAGED).view(model[name].shape)
                     .float().clone() for name, (at, numel) in layout.slots.items()}
    check_masters(out["param"], model, where)  # after check_state: a NaN master would pass it
    return {MASTER if kind == "param" else kind: by_name for kind, by_name in out.items()}


def check_masters(masters: dict[str, torch.Tensor], model: dict, where: str,
                  why: str = " under Megatron Core's bucket layout (bucket size, order from the args)") -> None:
    """Each fp32 master, rounded to its weight's dtype, is the saved weight: the states line up with the weights."""
    for name, master in masters.items():
        weight = model.get(name)
        if not isinstance(weight, torch.Tensor) or not weight.numel():
            continue
        eps = torch.finfo(weight.dtype).eps if weight.dtype.is_floating_point else 0.0
        if float((master.float() - weight.float()).abs().max()) > eps * float(weight.float().abs().max()):
            raise CheckpointError(f"{where}: the optimizer's fp32 master of {name} is not its saved weight{why}: the "
                                  f"states cannot be matched to the weights; {NO_OPTIM}.")


def check_by_name(masters: dict[str, torch.Tensor], whole: dict, folder: str, common: dict) -> None:
    """``check_masters`` for torch_dist's states by name. Megatron Core 0.16's ``fully_reshardable`` save misplaces
    the states of a buffer with several buckets (``--overlap-grad-reduce``): it slices the buckets' unpadded parts,
    laid end to end, at the padded buffer's offsets (its "param range exceeds unpadded buffer" warning)."""
    fully = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type") == "fully_reshardable"
    check_masters(masters, whole, folder, " (Megatron Core's fully_reshardable save misplaces the states of a buffer "
                                          "with several gradient buckets, --overlap-grad-reduce: its 'param range "
                                          "exceeds unpadded buffer' warning; re-save it with dp_reshardable, Megatron-"
                                          "LM's default)" if fully else "")


def _one_buffer(saved, where: str) -> dict:
    """The one buffer's world tensors of ``get_parameter_state_dp_zero``'s dict (a chain of one unwrapped)."""
    if isinstance(saved, list) and len(saved) == 1:
        saved = saved[0]
    if isinstance(saved, list):
        raise CheckpointError(f"{where} holds the states of {len(saved)} distributed optimizers (the experts' own, "
                              f"expert parallelism > 1), which this tool does not convert; {NO_OPTIM}.")
    if not isinstance(saved, dict) or not saved.get("buckets_coalesced"):
        raise CheckpointError(f"{where} is not Megatron Core's distributed-optimizer state (no buckets_coalesced: "
                              f"saved before 2024?); re-save it with a current Megatron-LM, {NO_OPTIM}.")
    buffers = [k for k in saved if k != "buckets_coalesced"]
    by_dtype = saved.get(0) if buffers == [0] else None
    if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
        raise CheckpointError(f"{where} holds {len(buffers)} gradient buffer(s) keyed {buffers[:3]}, not one buffer "
                              f"of one dtype (fp8 parameters?), which this tool does not convert; {NO_OPTIM}.")
    return next(iter(by_dtype.values()))


def legacy_states(folder: str, shards: dict, head: dict, args, rank_folder) -> tuple[dict, float]:
    """({(tp, pp): {kind: {name: tensor}}}, Adam's step) of a legacy folder whose ranks saved ``distrib_optim.pt``;
    ``head``: the first rank file's entries (its ``optimizer``: the groups and the step)."""
    _no_experts(args, folder)
    per_rank = {}
    for (t, p), model in shards.items():
        where = os.path.join(folder, rank_folder(t, p), FILE)
        if not os.path.isfile(where):
            raise CheckpointError(f"{where} is missing: the other ranks saved the distributed optimizer's states; "
                                  f"{NO_OPTIM}.")
        per_rank[(t, p)] = _split(_one_buffer(_load_plain(where, where), where), rank_layout(model, args, p), model,
                                  where)
    return per_rank, _step(head.get("optimizer"), os.path.join(folder, rank_folder(0, 0)))


def _no_experts(args, where: str) -> None:
    if int(getattr(args, "expert_model_parallel_size", 1) or 1) > 1:
        raise CheckpointError(f"{where} was saved with --use-distributed-optimizer and expert parallelism "
                              f"{args.expert_model_parallel_size}: the experts' optimizer states are not converted; "
                              f"{NO_OPTIM}.")


def _step(entry, where: str) -> float:
    from megatron.checkpoint.megatron_lm.optim import common_step

    return common_step(entry, f"{where} (the distributed optimizer's groups)")


# ---- torch_dist: dp_reshardable (and the deprecated dp_zero_gather_scatter) ----

def bucketed(metadata) -> str | None:
    """The torch_dist sharding type of a distributed optimizer's states held by bucket ('dp_reshardable',
    'dp_zero_gather_scatter'), None when they are by name (or absent), of a DCP index."""
    keys = metadata.state_dict_metadata
    if any(_BUCKET_KEY.match(k) for k in keys):
        return "dp_reshardable"
    if any(re.match(r"^(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\.param_state", k) for k in keys):
        return "dp_zero_gather_scatter"
    return None


def read_object(folder: str, metadata, key: str):
    """A Megatron ShardedObject (``key`` with its ``/shard_...`` suffix) of a torch_dist folder: the bytes DCP
    stores, a ``torch.save`` of the list of its shards' data, read as plain data; None when absent."""
    info = next((v for k, v in metadata.storage_data.items() if getattr(k, "fqn", None) == key), None)
    if info is None:
        return None
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{folder}: {key} is stored transformed ({info.transform_descriptors}), which this tool "
                              f"does not read; {NO_OPTIM}.")
    with open(file_inside(folder, info.relative_path, os.path.join(folder, ".metadata")), "rb") as f:
        f.seek(info.offset)
        data = _load_plain(io.BytesIO(f.read(info.length)), f"{folder}: {key}")
    return data[0] if isinstance(data, list) and len(data) == 1 else data


def dist_states(folder: str, reader, metadata, args, shards: dict) -> tuple[dict, float]:
    """({(tp, pp): {kind: {name: tensor}}}, Adam's step) of a torch_dist folder holding the distributed optimizer's
    states by bucket; ``shards``: the saving layout's ranks' state dicts (the whole model cut by the args)."""
    import torch.distributed.checkpoint as dcp

    from megatron.checkpoint.megatron_lm.dcp_reader import CheckpointException, load_error

    _no_experts(args, folder)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    kind = bucketed(metadata)
    keys = metadata.state_dict_metadata
    per_rank = {}
    if kind == "dp_zero_gather_scatter":
        for (t, p), model in shards.items():
            where = f"{folder}: {OBJECT_KEY.format(p * tp + t, 'param_state')}"
            saved = read_object(folder, metadata, OBJECT_KEY.format(p * tp + t, "param_state"))
            per_rank[(t, p)] = _split(_one_buffer(saved, where), rank_layout(model, args, p), model, where)
        return per_rank, _step(read_object(folder, metadata, OBJECT_KEY.format(0, "optimizer")), folder)
    found: dict[int, dict] = {}
    for key in keys:
        m = _BUCKET_KEY.match(key)
        if m:
            if m[1] not in (None, "0") or m[3] != "0":
                raise CheckpointError(f"{folder} holds {key}: more than one optimizer or gradient buffer (expert "
                                      f"parallelism, fp8 parameters?), which this tool does not convert; {NO_OPTIM}.")
            found.setdefault(int(m[2]), {}).setdefault(m[4], {}).setdefault(int(m[5]), {})[m[6]] = key
    state = {key: torch.empty(keys[key].size, dtype=keys[key].properties.dtype)
             for per in found.values() for dtypes in per.values() for buckets in dtypes.values()
             for key in buckets.values()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP wraps each rank's error
        raise load_error(folder, err) from err
    for (t, p), model in shards.items():
        index = p * tp + t
        where = f"{folder}: optimizer.distributed.dp_group_idx_{index}"
        dtypes = found.get(index, {})
        if len(dtypes) != 1:
            raise CheckpointError(f"{where} holds {len(dtypes)} buffer dtypes, not one; the checkpoint's args say "
                                  f"tensor-parallel {tp}, pipeline {len({q for _, q in shards})}; {NO_OPTIM}.")
        buckets = next(iter(dtypes.values()))
        layout = rank_layout(model, args, p)
        sizes = [keys[buckets[b]["param"]].size.numel() if "param" in buckets.get(b, {}) else None
                 for b in range(len(buckets))]
        if sizes != layout.buckets:
            raise CheckpointError(f"{where}: its buckets hold {sizes} elements, but Megatron Core's bucket layout of "
                                  f"this rank's parameters (from the args) gives {layout.buckets}; {NO_OPTIM}.")
        world = {}
        for k in KINDS:
            if any(k not in buckets[b] for b in range(len(buckets))):
                raise CheckpointError(f"{where} has no {k} for every bucket; {NO_OPTIM}.")
            world[k] = torch.cat([state[buckets[b][k]] for b in range(len(buckets))])
        per_rank[(t, p)] = _split(world, layout, model, where)
    return per_rank, _step(read_object(folder, metadata, OBJECT_KEY.format(0, "optimizer")), folder)


# ---- writing: what a run with --use-distributed-optimizer loads ----

def export_args(args: argparse.Namespace, dp: int, overlap_grad_reduce: bool, ddp_bucket_size: int | None,
                bf16: bool = False) -> None:
    """The distributed optimizer's settings of an export, in its ``args`` (they decide the bucket layout; ``bf16``:
    the buffer's dtype key, bf16 weights with fp32 gradients)."""
    args.use_distributed_optimizer, args.data_parallel_size = True, dp
    args.overlap_grad_reduce, args.ddp_bucket_size = overlap_grad_reduce, ddp_bucket_size
    if bf16:
        args.bf16, args.params_dtype, args.accumulate_allreduce_grads_in_fp32 = True, torch.bfloat16, True


def groups_entry(present: list[bool], settings: dict, step: float) -> dict:
    """``DistributedOptimizer.state_dict()`` of an export: the groups (no parameters), each with Adam's step."""
    groups = []
    for decayed, exists in zip((True, False), present):
        if exists:
            group = param_group(decayed, settings)
            group["step"] = float(step)
            groups.append(group)
    return {"optimizer": {"param_groups": groups}}


def rank_file(model: dict, states: dict[str, dict[str, torch.Tensor]], args, pp_rank: int) -> dict:
    """``distrib_optim.pt`` of one rank: ``states`` ({kind: {name: tensor}}, the master as ``fp32_param``) flattened
    in Megatron Core's bucket layout, the 64-alignment gaps zero."""
    layout = rank_layout(model, args, pp_rank)
    world = {}
    for kind in KINDS:
        by_name = states[MASTER if kind == "param" else kind]
        flat = torch.zeros(layout.numel, dtype=torch.float32)
        for name, (at, numel) in layout.slots.items():
            flat[at:at + numel] = by_name[name].reshape(-1).float()
        world[kind] = flat
    return {"buckets_coalesced": True, 0: {dtype_key(args): {**world, "numel_unpadded": layout.numel}}}


def write_rank_files(folder: str, files: dict[str, dict]) -> None:
    """Each ``{rank folder: rank_file(...)}`` as ``folder/<rank folder>/distrib_optim.pt``."""
    for rank, state in files.items():
        os.makedirs(os.path.join(folder, rank), exist_ok=True)
        torch.save(state, os.path.join(folder, rank, FILE))


def fully_reshardable_common(present: list[bool], settings: dict, step: float) -> dict:
    """``common.pt``'s entries of a torch_dist export in the ``fully_reshardable`` layout (its states are
    ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``): the groups with the step, the sharding type, and the
    content metadata Megatron-LM's load builds its request from."""
    from megatron.checkpoint.megatron_lm.dist import CONTENT_METADATA

    entry = groups_entry(present, settings, step)
    entry["param_state_sharding_type"] = "fully_reshardable"
    return {"optimizer": entry,
            "content_metadata": {**CONTENT_METADATA, "distrib_optim_sharding_type": "fully_reshardable",
                                 "distrib_optim_fully_reshardable_mem_efficient": False}}


def write_legacy(out: str, step: int, shards: dict, args, extra: dict, optimizer: dict, adam_step: float,
                 settings: dict) -> str:
    """A legacy export for a run with ``--use-distributed-optimizer``: each rank's ``model_optim_rng.pt`` with the
    groups as its ``optimizer`` entry and ``distrib_optim.pt`` beside it; ``optimizer``: {kind: the whole Megatron
    Core state dict} (the masters as ``fp32_param``). The iteration folder appears whole (``write_shards`` renames
    its ``.tmp`` folder, where the optimizer files are written first)."""
    from megatron.checkpoint.megatron_lm.core_names import is_gated
    from megatron.checkpoint.megatron_lm.legacy import rank_folder, write_shards
    from megatron.checkpoint.megatron_lm.optim import structure
    from megatron.checkpoint.megatron_lm.shards import cut

    pp, tied = args.pipeline_model_parallel_size, not args.untie_embeddings_and_output_weights
    final = os.path.join(out, f"iter_{step:07d}")
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose another output folder.")
    cuts = {kind: cut(optimizer[kind], args.tensor_model_parallel_size, pp, args.num_layers, is_gated(args), tied)
            for kind in (*ADAM_KINDS, MASTER)}
    write_rank_files(final + ".tmp", {rank_folder(t, p, pp): rank_file(model, {k: cuts[k][(t, p)] for k in cuts},
                                                                       args, p)
                                      for (t, p), model in shards.items()})
    entry = groups_entry(structure(list(shards.values()))[0], settings, adam_step)
    return write_shards(out, step, shards, args, pp, extra, {key: entry for key in shards})


def add_export_flags(parser: argparse.ArgumentParser) -> None:
    """``to-megatron``'s flags for a Megatron run with the distributed optimizer."""
    parser.add_argument("--use-distributed-optimizer", dest="distributed", action="store_true",
                        help="Write the AdamW states as Megatron's distributed optimizer loads them (legacy: "
                             "distrib_optim.pt per rank; torch_dist: its fully_reshardable layout), for any dp.")
    parser.add_argument("--data-parallel-size", "--dp", dest="dp", type=int, default=1,
                        help="The Megatron run's data-parallel size (with --use-distributed-optimizer; the files do "
                             "not depend on it, its default bucket size with --overlap-grad-reduce does).")
    parser.add_argument("--overlap-grad-reduce", action="store_true",
                        help="The Megatron run uses --overlap-grad-reduce (buckets of --ddp-bucket-size elements).")
    parser.add_argument("--ddp-bucket-size", type=int, default=None,
                        help="The Megatron run's --ddp-bucket-size (with --overlap-grad-reduce; default "
                             "max(40000000, 1000000 x dp)).")
    parser.add_argument("--bf16", action="store_true",
                        help="The Megatron run trains in bf16 (with --use-distributed-optimizer: its buffer holds bf16 "
                             "weights and fp32 gradients, the key of distrib_optim.pt's states).")


def export_options(options: argparse.Namespace) -> tuple | None:
    """(dp, overlap_grad_reduce, ddp_bucket_size, bf16) of ``add_export_flags``' parsed flags, None without the
    distributed optimizer; CheckpointError (one line) for settings that it does not read."""
    if not options.distributed:
        if options.overlap_grad_reduce or options.ddp_bucket_size is not None or options.dp != 1:
            raise CheckpointError("--data-parallel-size, --overlap-grad-reduce and --ddp-bucket-size describe the "
                                  "distributed optimizer's buckets; add --use-distributed-optimizer or drop them.")
        if options.bf16:
            raise CheckpointError("--bf16 without --use-distributed-optimizer: Megatron's mixed-precision optimizer "
                                  "expects its fp32_from_fp16_params, which this tool does not write; add "
                                  "--use-distributed-optimizer, or export with --no-optim.")
        return None
    if options.dp < 1 or (options.ddp_bucket_size is not None and options.ddp_bucket_size < 1):
        raise CheckpointError(f"--data-parallel-size and --ddp-bucket-size must be at least 1, got {options.dp} "
                              f"and {options.ddp_bucket_size}.")
    return options.dp, options.overlap_grad_reduce, options.ddp_bucket_size, options.bf16


def how_to_load(args: argparse.Namespace, fmt: str) -> str:
    """How a Megatron-LM run loads an export's optimizer states (to-megatron's message)."""
    if getattr(args, "use_distributed_optimizer", False):
        precision = "--bf16" if getattr(args, "bf16", False) else "fp32"
        if fmt == "torch_dist":
            return f"{precision}, with --use-distributed-optimizer at any data-parallel size"
        size = f" --ddp-bucket-size {args.ddp_bucket_size}" if args.ddp_bucket_size else ""
        buckets = f"--overlap-grad-reduce{size}" if args.overlap_grad_reduce else "without --overlap-grad-reduce"
        return (f"{precision}, with --use-distributed-optimizer, {buckets}, at data-parallel size "
                f"{args.data_parallel_size} or any other")
    return ("fp32, without --use-distributed-optimizer"
            + ("" if fmt == "legacy" else " or with --dist-ckpt-optim-fully-reshardable"))
