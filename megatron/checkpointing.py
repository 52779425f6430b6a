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

Files in ``step_{N}/``: ``rank{r}.pt`` (that rank's pieces, its RNG streams), ``metadata.json``
(every piece of every rank, the global shapes, the layout), ``common.pt`` (step, consumed
samples, loss scaler, the resolved configuration), ``config.yaml`` (the same configuration: a
run started with ``ckpt_dir`` takes it as its base, under the YAML file and flags given now). A save is written into
``step_{N}.tmp`` and renamed when every rank has finished; ``latest`` (the step folder's name) is
replaced last, so a save killed half-way never touches the previous checkpoint.

**Loading** reads, for each of this rank's pieces, the saved pieces of the same tensor: the
saved tensor-parallel slices are reassembled into the global tensor, one parameter at a time
(never the whole model), sliced for the current layout, and the flat range copied in. Files are
memory-mapped, so a rank reads only the pages it needs.
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

from megatron.parallel_state import ParallelState

FORMAT_VERSION = 1
KINDS = ("param", "exp_avg", "exp_avg_sq")  # param: the fp32 master weight
_CHUNK_PREFIX = re.compile(r"^\d+\.")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, truncated, or from another model."""


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


def _owned(model: nn.Module, optimizer, ps: ParallelState):
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
    tensors, pieces = {}, []
    if ps.dp_rank == 0:  # replicas hold the same shard
        for name, p, lo, hi, master, offset in _owned(model, optimizer, ps):
            if getattr(p, "tied_copy", False) or not (getattr(p, "tensor_model_parallel", False) or ps.tp_rank == 0):
                continue
            where = _slice_of(p, ps)
            state = optimizer.inner.state.get(master, {})
            for kind in KINDS:
                source = master if kind == "param" else state.get(kind)
                if source is None:
                    continue
                key = f"{kind}/{name}/{where.tp_rank}/{lo}"
                tensors[key] = source[offset:offset + hi - lo].detach().to("cpu", copy=True)
                pieces.append({"key": key, "rank": rank, "kind": kind, "name": name, "lo": lo, "hi": hi,
                               "global_shape": list(where.global_shape), "partition_dim": where.partition_dim,
                               "tp_rank": where.tp_rank, "tp_size": where.tp_size, "local_shape": list(p.shape)})
    torch.save({"tensors": tensors, "rng": _rng_state(), "rank": rank}, os.path.join(tmp, f"rank{rank}.pt"))
    del tensors
    gathered = [None] * ps.world_size if dist.is_initialized() else [pieces]
    if dist.is_initialized():
        dist.all_gather_object(gathered, pieces)
    if rank == 0:
        adam_steps = [float(s["step"]) for s in optimizer.inner.state.values() if "step" in s]
        common = {"format_version": FORMAT_VERSION, "step": step, "adam_step": adam_steps[0] if adam_steps else 0.0,
                  "grad_scaler": optimizer.grad_scaler.state_dict() if optimizer.grad_scaler else None,
                  "train_state": train_state, "config": to_yaml(config)}
        torch.save(common, os.path.join(tmp, "common.pt"))
        _write_text(os.path.join(tmp, "config.yaml"), common["config"])  # the base of a resumed run's config
        metadata = {"format_version": FORMAT_VERSION, "step": step, "layout": _layout(ps, config),
                    "pieces": [piece for rank_pieces in gathered for piece in rank_pieces]}
        _write_text(os.path.join(tmp, "metadata.json"), json.dumps(metadata))
    _barrier()  # every rank has written its file
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_text(os.path.join(output_dir, "latest"), os.path.basename(final))
        if keep_last:
            _remove_old(output_dir, keep_last)
    _barrier()
    return final


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_text(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _remove_old(output_dir: str, keep_last: int) -> None:
    steps = sorted(int(m.group(1)) for d in os.listdir(output_dir) if (m := re.fullmatch(r"step_(\d+)", d)))
    for old in steps[:-keep_last]:
        shutil.rmtree(os.path.join(output_dir, f"step_{old}"), ignore_errors=True)


# Loading ----------------------------------------------------------------------------------------


def resolve_checkpoint(path: str) -> str:
    """A step folder from ``path``: a run's output folder (its ``latest``) or a step folder."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            step_dir = os.path.join(path, f.read().strip())
        if os.path.isfile(os.path.join(step_dir, "metadata.json")):
            return step_dir
        raise CheckpointError(f"{latest} names {step_dir}, which holds no checkpoint (metadata.json is missing).")
    raise CheckpointError(f"no checkpoint at {path}: expected a step folder with metadata.json or a run folder "
                          f"with a 'latest' file.")


class CheckpointReader:
    """Global tensors (or any tensor-parallel slice of them) out of a saved step folder."""

    def __init__(self, step_dir: str):
        self.step_dir = step_dir
        try:
            with open(os.path.join(step_dir, "metadata.json")) as f:
                self.metadata = json.load(f)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read {step_dir}/metadata.json: {err}") from err
        self.index: dict[tuple[str, str], list[dict]] = {}
        for piece in self.metadata["pieces"]:
            self.index.setdefault((piece["kind"], piece["name"]), []).append(piece)
        self._files: dict[int, dict] = {}

    @property
    def names(self) -> list[str]:
        return sorted({name for kind, name in self.index if kind == "param"})

    def global_shape(self, name: str) -> tuple:
        return tuple(self.index[("param", name)][0]["global_shape"])

    def _file(self, rank: int) -> dict:
        if rank not in self._files:
            path = os.path.join(self.step_dir, f"rank{rank}.pt")
            try:
                self._files[rank] = torch.load(path, map_location="cpu", mmap=True, weights_only=False)["tensors"]
            except Exception as err:  # truncated or missing: say which file
                raise CheckpointError(f"cannot read {path} ({type(err).__name__}: {err}); the checkpoint is "
                                      f"incomplete or damaged.") from err
        return self._files[rank]

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.index

    def full(self, kind: str, name: str) -> torch.Tensor:
        """The whole global tensor (fp32)."""
        pieces = self.index[(kind, name)]
        first = pieces[0]
        tp_size, dim = first["tp_size"], first["partition_dim"]
        local_numel = int(np.prod(first["local_shape"]))
        locals_ = [torch.zeros(local_numel) for _ in range(tp_size)]
        filled = [0] * tp_size
        for piece in pieces:
            data = self._file(piece["rank"])[piece["key"]]
            locals_[piece["tp_rank"]][piece["lo"]:piece["hi"]] = data
            filled[piece["tp_rank"]] += piece["hi"] - piece["lo"]
        if any(n != local_numel for n in filled):
            raise CheckpointError(f"the checkpoint holds only part of {kind} {name!r}; it is incomplete.")
        shaped = [t.view(first["local_shape"]) for t in locals_]
        return torch.cat(shaped, dim=dim) if dim is not None and tp_size > 1 else shaped[0]

    def local(self, kind: str, name: str, where: _Slice) -> torch.Tensor:
        """This layout's tensor-parallel slice of the global tensor."""
        full = self.full(kind, name)
        if where.partition_dim is None:
            return full
        return full.chunk(where.tp_size, dim=where.partition_dim)[where.tp_rank]

    def common(self) -> dict:
        path = os.path.join(self.step_dir, "common.pt")
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:
            raise CheckpointError(f"cannot read {path} ({type(err).__name__}: {err}).") from err

    def rng_state(self, rank: int) -> dict:
        path = os.path.join(self.step_dir, f"rank{rank}.pt")
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)["rng"]


def check_compatible(reader: CheckpointReader, model: nn.Module, ps: ParallelState) -> str | None:
    """A sentence naming the first tensor whose shape differs (or that is missing), or None."""
    for name, p in _unwrap(model).named_parameters():
        name = global_name(name, model)
        if not reader.has("param", name):
            return (f"the checkpoint has no tensor {name!r}, which the model has; it is from another model "
                    f"(checkpoint tensors: {len(reader.names)}).")
        want, got = _slice_of(p, ps).global_shape, reader.global_shape(name)
        if tuple(want) != tuple(got):
            return (f"tensor {name!r} has shape {list(got)} in the checkpoint but {list(want)} in the model; "
                    f"the checkpoint is from another model (check hidden_size, num_layers, vocab_size).")
    return None


def load_checkpoint(path: str, model: nn.Module, optimizer, ps: ParallelState, config, load_optim: bool = True,
                    load_rng: bool = True) -> dict:
    """Fill the masters (and AdamW states), publish the parameters, restore the scaler and the RNG;
    returns the saved train state (step, consumed samples, ...). Collective: call on every rank."""
    device = optimizer.buffer.device
    error, reader = None, None
    try:
        reader = CheckpointReader(resolve_checkpoint(path))
        error = check_compatible(reader, model, ps)
        common = reader.common()
    except CheckpointError as err:
        error = str(err)
    _all_ranks_ok(error, device)
    adam_step = common["adam_step"]
    error = None
    try:
        _fill(reader, model, optimizer, ps, load_optim, adam_step)
    except CheckpointError as err:
        error = str(err)
    _all_ranks_ok(error, device)
    optimizer.publish_params()
    if load_optim and optimizer.grad_scaler is not None and common["grad_scaler"] is not None:
        optimizer.grad_scaler.load_state_dict(common["grad_scaler"])
    if load_rng and reader.metadata["layout"] == _layout(ps, config):
        _set_rng_state(reader.rng_state(ps.rank))
    return {**common["train_state"], "step": common["step"], "path": reader.step_dir,
            "same_layout": reader.metadata["layout"] == _layout(ps, config)}


@torch.no_grad()
def _fill(reader: CheckpointReader, model: nn.Module, optimizer, ps: ParallelState, load_optim: bool,
          adam_step: float) -> None:
    by_param: dict[int, list] = {}
    for name, p, lo, hi, master, offset in _owned(model, optimizer, ps):
        by_param.setdefault(id(p), []).append((name, p, lo, hi, master, offset))
    for pieces in by_param.values():  # one parameter's global tensors at a time
        name, p = pieces[0][0], pieces[0][1]
        where = _slice_of(p, ps)
        kinds = KINDS if load_optim and adam_step > 0 else ("param",)
        values = {kind: reader.local(kind, name, where).reshape(-1) for kind in kinds if reader.has(kind, name)}
        for _, _, lo, hi, master, offset in pieces:
            master[offset:offset + hi - lo].copy_(values["param"][lo:hi])
            if len(values) > 1:
                state = optimizer.adam_state(master, int(adam_step))
                for kind in KINDS[1:]:
                    state[kind][offset:offset + hi - lo].copy_(values[kind][lo:hi])
