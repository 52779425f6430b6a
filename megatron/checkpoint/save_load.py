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
raw fp32), ``rank{r}.rng.json`` (its RNG streams), ``metadata.json`` (every piece of every rank,
the global shapes, the layout), ``common.json`` (step, consumed samples, loss scaler, the resolved
configuration), ``config.yaml`` (the same configuration: a run resumed with ``ckpt_dir`` takes it
as its base, under the YAML file and flags given now). Every piece and file carries a CRC-32,
checked on load. A save is written into ``step_{N}.tmp`` and renamed when every rank has finished;
``latest`` (the step folder's name) is replaced last, so a save killed half-way never touches the
previous checkpoint; pruning (``keep_last``) follows only a save that succeeded.

**Failures** of a save or a load, on any rank, go through ``run_dir.on_every_rank``: every rank
raises the same one-line CheckpointError, so none is left waiting in a collective.

**Loading** reads, for each of this rank's pieces, the saved pieces of the same tensor: the
saved pieces overlapping it are read (a seek and a read each); only when the tensor-parallel cut
differs is the global tensor reassembled, one parameter at a time (never the whole model), and
sliced for the current layout.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megatron import device as dev
from megatron.checkpoint import small_files
from megatron.checkpoint.format import (
    CRC_CHUNK_BYTES,
    FORMAT_VERSION,
    KINDS,
    CheckpointError,
    CheckpointReader,
    RankFileWriter,
    find_checkpoint,
    fsync_dir,
    is_vocab_padded,
    same_folder,
    write_bytes,
    write_text,
)
from megatron.checkpoint.run_dir import on_every_rank, ranks_with, remove_leftover, step_not_in_the_way
from megatron.config import Config, to_yaml
from megatron.config.schema import DistributedConfig
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


def slice_of(param: nn.Parameter, ps: ParallelState) -> _Slice:
    """A tensor-parallel shard's place (an expert's: its expert-tensor-parallel rank and size, which the parameter
    records; ``ps`` is kept for the callers' symmetry)."""
    if getattr(param, "tensor_model_parallel", False):
        return _Slice(tuple(param.full_shape), param.partition_dim, param.partition_rank, param.partition_size)
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


def written_pieces(model: nn.Module, optimizer, ps: ParallelState):
    """The ``owned_pieces`` this rank writes to a checkpoint: those it holds the copy of that counts once
    (``counts_once``: the first replica of the shard, the first tensor-parallel rank of a replicated parameter,
    never the tied embedding's second copy), so every element is written exactly once."""
    from megatron.distributed.parallelize import counts_once

    bucket_of = {id(p): bucket for bucket in optimizer.buffer.buckets for p, _, _ in bucket.params}
    for piece in owned_pieces(model, optimizer, ps):
        if counts_once(piece[1], bucket_of[id(piece[1])]):
            yield piece


# Saving -----------------------------------------------------------------------------------------


def rng_state() -> dict:
    from megatron.tensor_parallel import get_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_rng_tracker().get_states()}
    cuda = dev.cuda_rng_state()
    if cuda is not None:
        state["cuda"] = cuda
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.tensor_parallel import get_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        dev.set_cuda_rng_state(state["cuda"])


def _layout(ps: ParallelState, distributed: DistributedConfig) -> dict:
    """The parallel layout a checkpoint records (and a load compares): the rank grid and the Distributed section's
    virtual stages and sharding."""
    s = distributed.sharding
    layout = {"world_size": ps.world_size, "tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size,
              "sharding": ps.sharding_size, "vpp": distributed.virtual_pp_degree,
              "sharding_stage": s.sharding_stage, "sharding_offload": s.sharding_offload}
    if ps.cp_size > 1:  # recorded only when used: a checkpoint saved before the cp axis reads as the same layout
        layout["cp"], layout["shard_over_cp"] = ps.cp_size, ps.shard_over_cp
    if ps.ep_size > 1 or ps.etp_size != ps.tp_size:  # the experts' layout, likewise
        layout["ep"], layout["etp"] = ps.ep_size, ps.etp_size
    return layout


def save_checkpoint(output_dir: str, step: int, model: nn.Module, optimizer, ps: ParallelState, config: Config,
                    train_state: dict, keep_last: int | None = None) -> str:
    """Write ``output_dir/step_{step}`` on every rank (collective); returns its path.

    A failure on any rank (a folder in the way, a full disk) raises the same one-line CheckpointError
    on every rank; the previous checkpoint and ``latest`` are left as they were, and nothing is
    pruned. Older checkpoints are pruned (``keep_last``) only once the new one and ``latest`` are
    durably in place. ``megatron/checkpoint/async_save.py`` runs the same phases with the rank files
    written by a background thread."""
    save = begin_save(output_dir, step, optimizer, ps, config, train_state)
    mine = save.agreed(lambda: _write_rank_files(save.tmp, model, optimizer, ps))
    return save.seal(mine, keep_last)



def after_a_failed_save(output_dir: str) -> str:
    """What a failed save's line tells the user to do: resume from the previous checkpoint, or, where the run has
    none yet, start again."""
    if os.path.lexists(os.path.join(output_dir, "latest")):
        return "the previous checkpoint and 'latest' are unchanged: fix this and resume from them"
    return f"no checkpoint was saved in {output_dir} before this one: fix this and start the run again"

class Save:
    """One save under way, from ``step_N.tmp`` made empty to its seal. What rank 0 writes into ``common.json``
    (the step, AdamW's step count, the loss scaler, the train state) is captured when the save begins: an
    asynchronous save seals it steps later, after the optimizer has moved on."""

    def __init__(self, output_dir: str, step: int, optimizer, ps: ParallelState, config: Config, train_state: dict):
        self.output_dir, self.step, self.ps, self.config = output_dir, step, ps, config
        self.final = os.path.join(output_dir, f"step_{step}")
        self.tmp, self.device = self.final + ".tmp", optimizer.buffer.device
        self.common = _common(step, optimizer, config, train_state) if ps.rank == 0 else None

    def agreed(self, fn):
        """``fn()`` on this rank; a failure on any rank is the same one-line CheckpointError on every rank, and
        rank 0 removes ``step_N.tmp``. Collective."""
        try:
            return on_every_rank(fn, device=self.device, what=f"cannot save {self.final}",
                                 todo=after_a_failed_save(self.output_dir))
        except CheckpointError:
            self.abort()
            raise

    def abort(self) -> None:
        if self.ps.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def seal(self, mine: tuple[list, dict], keep_last: int | None = None) -> str:
        """Every rank has written its files (``mine``: this rank's pieces and file checksums): gather the pieces
        on rank 0, which writes ``common.json``, ``config.yaml`` and ``metadata.json``, renames the folder into
        place, points ``latest`` at it and prunes. Collective; returns the step folder."""
        ps, rank = self.ps, self.ps.rank
        gathered = [None] * ps.world_size if rank == 0 else None  # every rank's pieces, on rank 0 only
        if dist.is_initialized():
            dist.gather_object(mine, gathered, dst=0)
        elif rank == 0:
            gathered = [mine]
        self.agreed(lambda: _write_common(self.tmp, self.step, self.common, ps, self.config, gathered)
                    if rank == 0 else None)
        self.agreed(lambda: _commit(self.output_dir, self.final, self.tmp) if rank == 0 else None)
        if rank == 0 and keep_last:
            prune_checkpoints(self.output_dir, self.step, keep_last)
        _barrier()
        return self.final


def begin_save(output_dir: str, step: int, optimizer, ps: ParallelState, config: Config,
               train_state: dict) -> Save:
    """Start a save: rank 0 makes ``step_N.tmp`` empty (a leftover of a save killed half-way is removed), then
    every rank may write its files there. Collective."""
    save = Save(output_dir, step, optimizer, ps, config, train_state)
    save.agreed(lambda: _make_empty(save.tmp) if ps.rank == 0 else None)
    return save


def _make_empty(tmp: str) -> None:
    final = tmp[:-len(".tmp")]
    for path in (final, final + ".old"):  # _commit moves an earlier step_N aside: never a file or link of someone's
        step_not_in_the_way(path)
    remove_leftover(tmp)  # a save killed half-way earlier
    os.makedirs(tmp)


def rank_pieces(model: nn.Module, optimizer, ps: ParallelState):
    """(piece description, tensor) for every piece this rank writes, in file order: the master slice and its
    AdamW states of each ``written_pieces`` entry. The tensors are views of the live masters and states."""
    for name, p, lo, hi, master, offset in written_pieces(model, optimizer, ps):
        where = slice_of(p, ps)
        state = optimizer.inner.state.get(master, {})
        for kind in KINDS:
            source = master if kind == "param" else state.get(kind)
            if source is not None:
                yield ({"kind": kind, "name": name, "lo": lo, "hi": hi, "global_shape": list(where.global_shape),
                        "partition_dim": where.partition_dim, "tp_rank": where.tp_rank, "tp_size": where.tp_size,
                        "local_shape": list(p.shape)}, source[offset:offset + hi - lo])


def write_rank_files(tmp: str, rank: int, pieces, rng: dict) -> tuple[list, dict]:
    """``pieces`` ((description, tensor) pairs) into ``rank{r}.bin`` and the RNG streams ``rng`` into its
    file; returns (pieces with their locations and checksums, {file: CRC-32})."""
    writer, written = RankFileWriter(tmp, rank), []
    try:
        for description, tensor in pieces:
            written.append({**writer.add(tensor), **description})
    finally:
        writer.close()
    name = small_files.rng_file(rank)
    return written, {name: write_bytes(os.path.join(tmp, name), small_files.to_json_bytes(
        small_files.encode_rng(rng)))}


def _write_rank_files(tmp: str, model: nn.Module, optimizer, ps: ParallelState) -> tuple[list, dict]:
    """This rank's pieces into ``rank{r}.bin`` and its RNG streams; returns (pieces, {file: CRC-32})."""
    return write_rank_files(tmp, ps.rank, rank_pieces(model, optimizer, ps), rng_state())


def _common(step: int, optimizer, config: Config, train_state: dict) -> dict:
    """What ``common.json`` holds, as of now."""
    adam_steps = [float(s["step"]) for s in optimizer.inner.state.values() if "step" in s]
    scaler = optimizer.grad_scaler.state_dict() if optimizer.grad_scaler else None
    return {"format_version": FORMAT_VERSION, "step": step, "adam_step": adam_steps[0] if adam_steps else 0.0,
            "grad_scaler": copy.deepcopy(scaler), "train_state": copy.deepcopy(train_state),
            "config": to_yaml(config)}


def _write_common(tmp: str, step: int, common: dict, ps: ParallelState, config: Config, gathered: list) -> None:
    """Rank 0: ``common.json``, ``config.yaml`` and, last, ``metadata.json`` with every checksum."""
    name = small_files.COMMON_FILE
    files = {name: write_bytes(os.path.join(tmp, name), small_files.to_json_bytes(common)),
             "config.yaml": write_text(os.path.join(tmp, "config.yaml"), common["config"])}  # a resumed run's base
    for _, rank_files in gathered:
        files.update(rank_files)
    metadata = {"format_version": FORMAT_VERSION, "step": step, "layout": _layout(ps, config.distributed),
                "checksum": {"algorithm": "crc32", "chunk_bytes": CRC_CHUNK_BYTES}, "files": files,
                "pieces": [piece for rank_pieces, _ in gathered for piece in rank_pieces]}
    write_text(os.path.join(tmp, "metadata.json"), json.dumps(metadata))


def _commit(output_dir: str, final: str, tmp: str) -> None:
    """Rank 0, once every rank has written its files: rename ``tmp`` to ``final``, then point ``latest``
    at it, each durably (the folder fsync'ed after each rename)."""
    fsync_dir(tmp)
    old = final + ".old"
    if os.path.lexists(final):  # saving a step again (a resumed run): the old one stays until replaced
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(output_dir)
    write_text(os.path.join(output_dir, "latest"), os.path.basename(final))
    fsync_dir(output_dir)
    shutil.rmtree(old, ignore_errors=True)


def point_latest(output_dir: str, step_dir: str) -> None:
    """Rank 0: make ``latest`` name ``step_dir`` (a folder of ``output_dir``), durably."""
    write_text(os.path.join(output_dir, "latest"), os.path.basename(os.path.normpath(step_dir)))
    fsync_dir(output_dir)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def prune_checkpoints(output_dir: str, step: int, keep_last: int, protect: str | None = None) -> None:
    """Rank 0: keep the ``keep_last`` most recent saves of this run: ``step_{step}`` and the steps below
    it. Higher-numbered folders (another attempt's, before a resume from an earlier step) are not
    this run's to delete, and neither is the one ``latest`` names, nor ``protect`` (the newest
    checkpoint known good). A folder that cannot be removed is reported, not fatal."""
    try:
        protected = [p for p in (find_checkpoint(output_dir), protect) if p is not None]
    except CheckpointError as err:
        get_logger().warning(f"not pruning old checkpoints: {err}")
        return
    steps = sorted(int(m.group(1)) for d in os.listdir(output_dir) if (m := re.fullmatch(r"step_(\d+)", d)))
    for old in [s for s in steps if s < step][:-(keep_last - 1) or None]:
        path = os.path.join(output_dir, f"step_{old}")
        if any(same_folder(path, p) for p in protected):
            continue
        try:
            shutil.rmtree(path)
        except OSError as err:
            get_logger().warning(f"cannot remove the old checkpoint {path} ({err.strerror or err}); remove it by "
                                 f"hand.")


# Loading ----------------------------------------------------------------------------------------


def check_compatible(reader: CheckpointReader, model: nn.Module, ps: ParallelState, vocab_size: int,
                     model_names: set[str] | None = None) -> str | None:
    """A sentence naming the first tensor whose shape differs, that is missing, or that the model
    lacks (``model_names``: the global names of the whole model, all ranks together), or None. The
    word embedding and an untied output layer may differ in their padding rows (the padding depends on tp)."""
    for name, p in _unwrap(model).named_parameters():
        name = global_name(name, model)
        if not reader.has("param", name):
            return (f"the checkpoint has no tensor {name!r}, which the model has; it is from another model "
                    f"(checkpoint tensors: {len(reader.names)}).")
        want, got = tuple(slice_of(p, ps).global_shape), reader.global_shape(name)
        repadded = is_vocab_padded(name) and want[1:] == got[1:] and got[0] >= vocab_size
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


def load_checkpoint(path: str, model: nn.Module, optimizer, ps: ParallelState, config: Config, load_optim: bool = True,
                    load_rng: bool = True, fresh_if_empty: bool = False) -> dict | None:
    """Fill the masters (and AdamW states), publish the parameters, restore the scaler and the RNG;
    returns the saved train state (step, consumed samples, ...). Collective: call on every rank.

    Any failure on any rank (a missing, short or corrupt file, a checksum mismatch, another model)
    raises the same one-line CheckpointError on every rank. ``fresh_if_empty``: when ``path`` holds
    no checkpoint at all (see ``find_checkpoint``), return None instead of failing."""
    device = optimizer.buffer.device
    model_names = _model_names(model)
    agreed = partial(on_every_rank, device=device, what=f"cannot load {path}",
                     todo="the checkpoint is damaged: load an earlier one")
    opened = agreed(lambda: _open(path, model, ps, config, model_names, load_rng))
    empty = ranks_with(opened is None, device)
    if empty:
        if empty != ps.world_size:
            raise CheckpointError(f"only some ranks see a checkpoint at {path}; put it on a filesystem every rank "
                                  f"sees.")
        if fresh_if_empty:
            return None
        raise CheckpointError(f"no checkpoint at {path}: expected a step folder with metadata.json or a run folder "
                              f"with a 'latest' file.")
    reader, common, rng, same_layout = opened
    if ps.rank == 0 and not reader.checksummed:
        get_logger().warning(f"{reader.step_dir} is in checkpoint format {reader.metadata['format_version']}, "
                             f"which has no checksums: its data is loaded unverified.")
    try:
        agreed(lambda: _fill(reader, model, optimizer, ps, load_optim, common["adam_step"]))
    finally:
        reader.close()
    optimizer.publish_params()
    agreed(lambda: _restore(optimizer, common, rng, load_optim, ps))
    return {**common["train_state"], "step": common["step"], "path": reader.step_dir, "same_layout": same_layout,
            "bytes_read": reader.bytes_read}


def _open(path: str, model: nn.Module, ps: ParallelState, config: Config, model_names: set[str], load_rng: bool):
    """(reader, common, this rank's RNG state or None, same layout), every small file read and
    checked, the rank files' sizes checked; None when ``path`` holds no checkpoint at all."""
    step_dir = find_checkpoint(path)
    if step_dir is None:
        return None
    reader = CheckpointReader(step_dir)
    error = check_compatible(reader, model, ps, config.model.vocab_size, model_names)
    if error is not None:
        raise CheckpointError(error)
    reader.verify()
    reader.verify_file("config.yaml")
    common = reader.common()
    same_layout = reader.metadata["layout"] == _layout(ps, config.distributed)
    rng = reader.rng_state(ps.rank) if load_rng and same_layout else None
    return reader, common, rng, same_layout


def _restore(optimizer, common: dict, rng: dict | None, load_optim: bool, ps: ParallelState) -> None:
    scaler, saved_scaler = optimizer.grad_scaler, common["grad_scaler"]
    if load_optim and scaler is not None and saved_scaler is not None:
        if set(saved_scaler) == set(scaler.state_dict()):  # the same kind of scaler (dynamic or static)
            scaler.load_state_dict(saved_scaler)
        elif ps.rank == 0:
            get_logger().warning("the checkpoint's loss scaler is of another kind (dynamic vs static); the one "
                                 "configured now starts afresh.")
    if rng is not None:
        _set_rng_state(rng)


@torch.no_grad()
def _fill(reader: CheckpointReader, model: nn.Module, optimizer, ps: ParallelState, load_optim: bool,
          adam_step: float) -> None:
    """Each owned piece's master weights (and AdamW moments) from the checkpoint."""
    with_states = load_optim and adam_step > 0
    for name, p, lo, hi, master, offset in owned_pieces(model, optimizer, ps):
        where = slice_of(p, ps)
        shape = tuple(where.global_shape)
        dim = where.partition_dim
        master[offset:offset + hi - lo].copy_(
            reader.local_range("param", name, shape, dim, where.tp_rank, where.tp_size, lo, hi))
        if not with_states:
            continue
        state = optimizer.adam_state(master, int(adam_step))
        kinds = [kind for kind in KINDS[1:] if kind in state]  # AdamW's moments, or Muon's momentum
        if not all(reader.has(kind, name) for kind in kinds):
            raise CheckpointError(f"the checkpoint lacks the optimizer states ({', '.join(kinds)}) of {name!r} (saved "
                                  f"by another optimizer?); load it with --no-load-optim.")
        for kind in kinds:
            state[kind][offset:offset + hi - lo].copy_(
                reader.local_range(kind, name, shape, dim, where.tp_rank, where.tp_size, lo, hi))
