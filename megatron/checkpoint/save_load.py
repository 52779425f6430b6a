"""Layout-independent checkpoints: save under one (tp, pp, vpp, dp, sharding, stage, offload), load
under any other.

**What is saved.** The truth of a run is its fp32 master weights and AdamW states (the
low-precision parameters are their cast). Every rank writes only the slices it owns: the
pieces of its optimizer shard, each cut at parameter boundaries, so every element of every
tensor is written exactly once, by the first data-parallel replica, without any gather. A piece
is named by the parameter's *global* name (model-chunk prefixes removed) and described by the
tensor-parallel slice it belongs to (``tp_rank`` of ``tp_size`` along ``partition_dim`` of the
global shape) and its flat range in that slice. Tensor-parallel replicated parameters come from
tp rank 0; the last pipeline stage's copy of the tied embedding is not written.

Files in ``step_{N}/`` (``megatron/checkpoint/format.py``): ``rank{r}.bin`` (that rank's pieces,
raw fp32), ``rank{r}.rng.pt`` (its RNG streams), ``metadata.json`` (every piece of every rank,
the global shapes, the layout), ``common.pt`` (step, consumed samples, loss scaler, the resolved
configuration), ``config.yaml`` (the same configuration: a run resumed with ``ckpt_dir`` takes it
as its base, under the YAML file and flags given now). A save is written into
``step_{N}.tmp`` and renamed when every rank has finished; ``latest`` (the step folder's name) is
replaced last, so a save killed half-way never touches the previous checkpoint.

**Loading** reads, for each of this rank's pieces, the saved pieces of the same tensor: the
saved pieces overlapping it are read (a seek and a read each); only when the tensor-parallel cut
differs is the global tensor reassembled, one parameter at a time (never the whole model), and
sliced for the current layout.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megatron.checkpoint.format import (
    FORMAT_VERSION,
    KINDS,
    CheckpointError,
    CheckpointReader,
    RankFileWriter,
    resolve_checkpoint,
    write_text,
)
from megatron.metrics import get_logger
from megatron.parallel_state import ParallelState

_CHUNK_PREFIX = re.compile(r"^\d+\.")


def global_name(name: str, model: nn.Module) -> str:
    """The parameter's name in the whole model, whatever the pipeline chunking."""
    return _CHUNK_PREFIX.sub("", name) if isinstance(_unwrap(model), nn.ModuleList) else name


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


@dataclass
class _Slice:
    """Where a local tensor sits in its global tensor."""

    global_shape: tuple
    partition_dim: int | None  # None: the local tensor is the global one
    tp_rank: int
    tp_size: int


def _slice_of(param: nn.Parameter, ps: ParallelState) -> _Slice:
    if getattr(param, "tensor_model_parallel", False):
        return _Slice(tuple(param.full_shape), param.partition_dim, ps.tp_rank, ps.tp_size)
    return _Slice(tuple(param.shape), None, 0, 1)


def owned_pieces(model: nn.Module, optimizer, ps: ParallelState):
    """(global name, parameter, local flat [lo, hi), master view, master offset) for every piece of
    this rank's optimizer shard, cut at parameter boundaries."""
    names = {id(p): global_name(n, model) for n, p in _unwrap(model).named_parameters()}
    for bucket, a, b, master in optimizer.pieces():
        for p, start, end in bucket.params:
            lo, hi = max(start, a), min(end, b)
            if lo < hi:
                yield names[id(p)], p, lo - start, hi - start, master, lo - a


# Saving -----------------------------------------------------------------------------------------


def _rng_state() -> dict:
    from megatron.tensor_parallel import get_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.tensor_parallel import get_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _layout(ps: ParallelState, config) -> dict:
    s = config.distributed.sharding
    return {"world_size": ps.world_size, "tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size,
            "sharding": ps.sharding_size, "vpp": config.distributed.virtual_pp_degree,
            "sharding_stage": s.sharding_stage, "sharding_offload": s.sharding_offload}


def _all_ranks_ok(error: str | None, device: torch.device) -> None:
    """Raise on every rank if any rank failed (so none waits in a collective the others skip)."""
    failed = torch.tensor([0.0 if error is None else 1.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise CheckpointError(error)
    if failed.item():
        raise CheckpointError("another rank could not load the checkpoint (its message is above)")


def save_checkpoint(output_dir: str, step: int, model: nn.Module, optimizer, ps: ParallelState, config,
                    train_state: dict, keep_last: int | None = None) -> str:
    """Write ``output_dir/step_{step}`` on every rank (collective); returns its path."""
    from megatron.config import to_yaml

    final = os.path.join(output_dir, f"step_{step}")
    tmp = final + ".tmp"
    rank = ps.rank
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed half-way earlier
        os.makedirs(tmp, exist_ok=True)
    _barrier()
    writer, pieces = RankFileWriter(tmp, rank), []
    if ps.dp_rank == 0:  # replicas hold the same shard
        for name, p, lo, hi, master, offset in owned_pieces(model, optimizer, ps):
            if getattr(p, "tied_copy", False) or not (getattr(p, "tensor_model_parallel", False) or ps.tp_rank == 0):
                continue
            where = _slice_of(p, ps)
            state = optimizer.inner.state.get(master, {})
            for kind in KINDS:
                source = master if kind == "param" else state.get(kind)
                if source is None:
                    continue
                pieces.append({**writer.add(source[offset:offset + hi - lo]), "kind": kind, "name": name, "lo": lo,
                               "hi": hi, "global_shape": list(where.global_shape),
                               "partition_dim": where.partition_dim, "tp_rank": where.tp_rank,
                               "tp_size": where.tp_size, "local_shape": list(p.shape)})
    writer.close()
    torch.save(_rng_state(), os.path.join(tmp, f"rank{rank}.rng.pt"))
    gathered = [None] * ps.world_size if rank == 0 else None  # every rank's piece list, on rank 0 only
    if dist.is_initialized():
        dist.gather_object(pieces, gathered, dst=0)
    elif rank == 0:
        gathered = [pieces]
    if rank == 0:
        adam_steps = [float(s["step"]) for s in optimizer.inner.state.values() if "step" in s]
        common = {"format_version": FORMAT_VERSION, "step": step, "adam_step": adam_steps[0] if adam_steps else 0.0,
                  "grad_scaler": optimizer.grad_scaler.state_dict() if optimizer.grad_scaler else None,
                  "train_state": train_state, "config": to_yaml(config)}
        torch.save(common, os.path.join(tmp, "common.pt"))
        write_text(os.path.join(tmp, "config.yaml"), common["config"])  # the base of a resumed run's config
        metadata = {"format_version": FORMAT_VERSION, "step": step, "layout": _layout(ps, config),
                    "pieces": [piece for rank_pieces in gathered for piece in rank_pieces]}
        write_text(os.path.join(tmp, "metadata.json"), json.dumps(metadata))
    _barrier()  # every rank has written its file
    if rank == 0:
        old = final + ".old"
        if os.path.exists(final):  # saving a step again (a resumed run): the old one stays until replaced
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        write_text(os.path.join(output_dir, "latest"), os.path.basename(final))
        shutil.rmtree(old, ignore_errors=True)
        if keep_last:
            _remove_old(output_dir, step, keep_last)
    _barrier()
    return final


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _remove_old(output_dir: str, step: int, keep_last: int) -> None:
    """Keep the ``keep_last`` most recent saves of this run: the one just written and the steps below
    it. Higher-numbered folders (another attempt's, before a resume from an earlier step) are not
    this run's to delete."""
    steps = sorted(int(m.group(1)) for d in os.listdir(output_dir) if (m := re.fullmatch(r"step_(\d+)", d)))
    for old in [s for s in steps if s < step][:-(keep_last - 1) or None]:
        shutil.rmtree(os.path.join(output_dir, f"step_{old}"), ignore_errors=True)


# Loading ----------------------------------------------------------------------------------------


def check_compatible(reader: CheckpointReader, model: nn.Module, ps: ParallelState, vocab_size: int,
                     model_names: set[str] | None = None) -> str | None:
    """A sentence naming the first tensor whose shape differs, that is missing, or that the model
    lacks (``model_names``: the global names of the whole model, all ranks together), or None. The
    word embedding may differ in its padding rows (the padding depends on tp)."""
    for name, p in _unwrap(model).named_parameters():
        name = global_name(name, model)
        if not reader.has("param", name):
            return (f"the checkpoint has no tensor {name!r}, which the model has; it is from another model "
                    f"(checkpoint tensors: {len(reader.names)}).")
        want, got = tuple(_slice_of(p, ps).global_shape), reader.global_shape(name)
        repadded = (name.endswith("word_embeddings.weight") and want[1:] == got[1:] and got[0] >= vocab_size)
        if want != got and not repadded:
            return (f"tensor {name!r} has shape {list(got)} in the checkpoint but {list(want)} in the model; "
                    f"the checkpoint is from another model (check hidden_size, num_layers, vocab_size).")
    extra = sorted(set(reader.names) - model_names) if model_names is not None else []
    if extra:
        return (f"the checkpoint has {len(extra)} tensor(s) the model lacks, e.g. {extra[0]!r}; it is from another "
                f"model (check num_layers).")
    return None


def _model_names(model: nn.Module) -> set[str]:
    """The global parameter names of the whole model (every pipeline stage's)."""
    names = {global_name(n, model) for n, _ in _unwrap(model).named_parameters()}
    if not dist.is_initialized():
        return names
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    return set().union(*gathered)


def load_checkpoint(path: str, model: nn.Module, optimizer, ps: ParallelState, config, load_optim: bool = True,
                    load_rng: bool = True) -> dict:
    """Fill the masters (and AdamW states), publish the parameters, restore the scaler and the RNG;
    returns the saved train state (step, consumed samples, ...). Collective: call on every rank."""
    device = optimizer.buffer.device
    model_names = _model_names(model)
    error, reader = None, None
    try:
        reader = CheckpointReader(resolve_checkpoint(path))
        error = check_compatible(reader, model, ps, config.model.vocab_size, model_names)
        if error is None:
            reader.verify()
            common = reader.common()
    except Exception as err:  # any failure, on any rank, stops every rank (none waits in a collective)
        error = str(err) if isinstance(err, CheckpointError) else f"cannot load {path}: {type(err).__name__}: {err}"
    _all_ranks_ok(error, device)
    adam_step = common["adam_step"]
    error = None
    try:
        _fill(reader, model, optimizer, ps, load_optim, adam_step)
    except Exception as err:
        error = str(err) if isinstance(err, CheckpointError) else f"cannot load {path}: {type(err).__name__}: {err}"
    finally:
        reader.close()
    _all_ranks_ok(error, device)
    optimizer.publish_params()
    scaler, saved_scaler = optimizer.grad_scaler, common["grad_scaler"]
    if load_optim and scaler is not None and saved_scaler is not None:
        if set(saved_scaler) == set(scaler.state_dict()):  # the same kind of scaler (dynamic or static)
            scaler.load_state_dict(saved_scaler)
        elif ps.rank == 0:
            get_logger().warning("the checkpoint's loss scaler is of another kind (dynamic vs static); the one "
                                 "configured now starts afresh.")
    same_layout = reader.metadata["layout"] == _layout(ps, config)
    rng = reader.rng_state(ps.rank) if load_rng and same_layout else None
    if rng is not None:
        _set_rng_state(rng)
    return {**common["train_state"], "step": common["step"], "path": reader.step_dir, "same_layout": same_layout,
            "bytes_read": reader.bytes_read}


@torch.no_grad()
def _fill(reader: CheckpointReader, model: nn.Module, optimizer, ps: ParallelState, load_optim: bool,
          adam_step: float) -> None:
    """Each owned piece's master weights (and AdamW moments) from the checkpoint."""
    with_states = load_optim and adam_step > 0
    for name, p, lo, hi, master, offset in owned_pieces(model, optimizer, ps):
        where = _slice_of(p, ps)
        shape = tuple(where.global_shape)
        dim = where.partition_dim
        master[offset:offset + hi - lo].copy_(
            reader.local_range("param", name, shape, dim, where.tp_rank, where.tp_size, lo, hi))
        if not with_states:
            continue
        if not all(reader.has(kind, name) for kind in KINDS[1:]):
            raise CheckpointError(f"the checkpoint lacks the AdamW states of {name!r}; load it with --no-load-optim.")
        state = optimizer.adam_state(master, int(adam_step))
        for kind in KINDS[1:]:
            state[kind][offset:offset + hi - lo].copy_(
                reader.local_range(kind, name, shape, dim, where.tp_rank, where.tp_size, lo, hi))
