"""Offline checkpoint reading and writing, without a training process (used by ``tools/``).

``write_checkpoint`` produces what ``megatron.checkpoint.save_checkpoint`` produces (the same
``metadata.json``, ``rank{r}.bin``, ``common.json`` and ``config.yaml``, read by the same
``CheckpointReader`` and ``load_checkpoint``) from full tensors held by one process: one file per
tensor-parallel rank, each tensor-parallel parameter cut along its ``partition_dim`` (its slice
``r`` in ``rank{r}.bin``), each replicated parameter whole in ``rank0.bin``, as a tp-T, pp-1, dp-1 run
saves. The rank files hold no RNG streams, and the layout records ``converted_by``, so a run loading
the checkpoint never mistakes it for one of its own saves: it seeds its RNG afresh (as it does after
loading under another layout).

``reshard`` rewrites a checkpoint for another tensor-parallel size, every kind (masters and AdamW
states) included, one tensor at a time; the word embedding is re-padded to the new size's
``padded_vocab_size`` (a multiple of 128 x tp), the padding rows being zeros.

The converters' output folders (``tools/convert_checkpoint.py``) have one writer at a time: ``output_folder``
holds their ``run.lock``, the lock a training run holds on its ``--save`` folder, so a second converter, or a run,
writing there is refused in one line naming the first one. What a converter writes goes through private
temporary names (``megatron/file_lock.py``) renamed at the end; a write that fails (a full disk) is one line
(``writes_into``) and leaves nothing: no temporary, no half-written output, ``latest`` as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator

import torch
import yaml

from megatron import file_lock
from megatron.checkpoint import small_files
from megatron.checkpoint.foreign_numbers import check_state
from megatron.checkpoint.format import (
    CRC_CHUNK_BYTES,
    FORMAT_VERSION,
    KINDS,
    CheckpointError,
    CheckpointReader,
    RankFileWriter,
    fsync_dir,
    is_vocab_padded,
    resolve_checkpoint,
    write_bytes,
    write_text,
)
from megatron.checkpoint.ownership import LOCK_FILE, held_run
from megatron.checkpoint.tokenizer_files import find_tokenizer_files
from megatron.config import Config, ConfigError, flatten_yaml, set_value, to_yaml
from megatron.config.bounds import config_size_problem
from megatron.config.syntax import read_yaml
from megatron.progress import Progress

WORD_EMBEDDING = "embedding.word_embeddings.weight"
# What a full disk (or another failed write) raises from the writers converters call: OSError from ours, a
# RuntimeError from torch.save ("unexpected pos ..."), these by name (safetensors' and PyTorch DCP's).
_WRITE_ERRORS = ("SafetensorError", "CheckpointException")


def check_apart(out: str, source: str) -> None:
    """CheckpointError, one line, when the output folder ``out`` would mix the written files with those being read:
    it is ``source``, lies inside one of ``source``'s step or iteration folders (``step_N``, ``iter_N``), or, where
    ``source`` is such a folder, is the run or save folder holding it. A folder beside them (``run/hf``) is apart."""
    out_path, source_path = os.path.realpath(out), os.path.realpath(source)
    below = os.path.relpath(out_path, source_path).split(os.sep)
    step = re.compile(r"(step|iter)_\d+")
    if (out_path == source_path or (below[0] != ".." and step.fullmatch(below[0]))
            or (step.fullmatch(os.path.basename(source_path)) and os.path.dirname(source_path) == out_path)):
        raise CheckpointError(f"the output folder {out} is where {source} is read from: the written files would mix "
                              f"with those being converted; give another output folder.")


@contextlib.contextmanager
def output_folder(folder: str, command: str) -> Iterator[str | None]:
    """Hold ``folder/run.lock`` while a converter writes into ``folder`` (created if needed; removed again, with the
    parents it needed, when a failure leaves it empty); the context is a warning where the file system has no
    locks, else None. CheckpointError, one line, when another process holds the lock (its pid and command named)
    or the folder cannot be made. ``command``: what this process's holder line names."""
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise CheckpointError(f"the output folder {folder} is a file; give another folder, or move the file.")
    lock = file_lock.OutputFolder(folder, LOCK_FILE, command)
    try:
        warning = lock.acquire()
    except file_lock.Busy as busy:
        raise CheckpointError(f"another process is writing to {folder} ({busy.holder}, holding {lock.path}): two "
                              f"writers of one folder would mix their files; wait for it to end, or give another "
                              f"output folder.") from None
    except OSError as err:
        odd = ("a symbolic link" if os.path.islink(lock.path) else "a folder" if os.path.isdir(lock.path) else None)
        if odd is not None:  # never followed nor written through
            raise CheckpointError(f"{lock.path} is {odd}, not the lock file this tool keeps there; remove it, or give "
                                  f"another output folder.") from err
        raise CheckpointError(f"cannot write to the output folder {folder} ({err.strerror or err}); fix it or give "
                              f"another one.") from err
    failed = True
    try:
        yield warning
        failed = False
    finally:
        lock.release(failed)


@contextlib.contextmanager
def writes_into(folder: str) -> Iterator[None]:
    """A write into ``folder`` that fails (a full disk, a quota, an I/O error), re-raised as one CheckpointError
    line naming the folder, the reason and the space left there. Around writes whose outputs are staged
    (``file_lock.Staged``): leaving the block by an error leaves nothing of them."""
    try:
        yield
    except CheckpointError:
        raise
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if not isinstance(err, (OSError, RuntimeError)) and type(err).__name__ not in _WRITE_ERRORS:
            raise  # never a KeyboardInterrupt
        raise CheckpointError(write_failure(folder, err)) from err


def write_failure(folder: str, err: BaseException) -> str:
    """The one line of a failed write into ``folder``: its reason (the last line of a multi-line message, as
    DCP's CheckpointException carries the failing rank's traceback) and the space left there."""
    if isinstance(err, OSError) and err.strerror:
        reason = err.strerror
    else:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        reason = lines[-1] if len(lines) > 1 else f"{type(err).__name__}: {lines[0] if lines else ''}"
    reason = reason if len(reason) <= 300 else reason[:297] + "..."
    try:
        space = f"; {shutil.disk_usage(folder).free / 2**30:.2f} GiB free there"
    except OSError:
        space = ""
    return (f"cannot write to {folder} ({reason}{space}); nothing of this conversion is left there: free some "
            f"space, or give another output folder.")


def config_from_yaml(text: str) -> Config:
    """The ``Config`` of a YAML text (a checkpoint's ``common.json "config"``: the resolved config)."""
    config = Config()
    for leaf, value in flatten_yaml(read_yaml(text) or {}, "the checkpoint's config"):
        set_value(config, leaf, value)
    problem = config_size_problem(config)  # before anything builds the model it describes
    if problem is not None:
        raise ConfigError(f"the checkpoint's config: {problem}")
    return config


def tensor_layout(config: Config, padded_vocab: int | None = None) -> dict[str, tuple[tuple, int | None]]:
    """Every parameter's global name -> (global shape, partition_dim or None when replicated), read
    off the model itself (built on the meta device: no memory, no initialisation)."""
    from megatron import parallel_state
    from megatron.parallelize_gpt import model_to_load

    if parallel_state.get().tp_size != 1:
        raise RuntimeError("tensor_layout builds the unsharded model: call it outside a tensor-parallel run.")
    model = model_to_load(config, padded_vocab)
    return {name: (tuple(getattr(p, "full_shape", p.shape)),
                   p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
            for name, p in model.named_parameters()}


def open_checkpoint(path: str) -> tuple[CheckpointReader, dict, Config]:
    """(reader, common, config) of a run folder (its latest step) or a step folder; CheckpointError
    with a one-line message when it is missing or damaged."""
    step_dir = resolve_checkpoint(path)
    reader = CheckpointReader(step_dir)  # checks metadata.json's structure
    common = reader.common()  # checks common.json's checksum and fields
    try:
        config = config_from_yaml(common["config"])
    except (KeyError, TypeError, AttributeError, yaml.YAMLError, ConfigError) as err:
        raise CheckpointError(f"{step_dir} is damaged ({type(err).__name__}: {err}).") from err
    if config.model.vocab_size is None:
        raise CheckpointError(f"{reader.step_dir}: the saved config has no vocab_size; it is not a resolved config.")
    find_tokenizer_files(config.tokenizer, step_dir)  # paths relative to where the run was launched
    return reader, common, config


def read_full(reader: CheckpointReader, kind: str, name: str) -> torch.Tensor:
    """``reader.full``, a damaged file (a piece missing from its rank file, a wrong size) reported as a
    CheckpointError."""
    try:
        return reader.full(kind, name)
    except (KeyError, RuntimeError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"cannot read {kind} {name!r} from {reader.step_dir} ({type(err).__name__}: {err}); "
                              f"the checkpoint is damaged.") from err


def read_tensors(reader: CheckpointReader, kind: str = "param") -> dict[str, torch.Tensor]:
    """Every global tensor of ``kind`` (fp32), each held to ``foreign_numbers``' rule as it is read (a weight or state
    that is not finite, an ``exp_avg_sq`` below 0: one line, so no export carries it). Progress
    (megatron/progress.py) once the reading takes a while."""
    names = [name for name in reader.names if reader.has(kind, name)]
    tensors = {}
    with Progress(f"reading {kind} tensors", total=len(names), unit="tensors", summary=False) as progress:
        for name in names:
            tensors[name] = read_checked(reader, kind, name)
            progress.update(1)
    return tensors


def read_checked(reader: CheckpointReader, kind: str, name: str) -> torch.Tensor:
    """``read_full``, the tensor held to ``foreign_numbers``' rule (finite; ``exp_avg_sq`` not below 0)."""
    return check_state(kind, name, read_full(reader, kind, name), reader.step_dir, "training never saves such "
                       "numbers: the checkpoint is damaged; load an earlier one")


def _repad(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows]
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def write_checkpoint(run_dir: str, config: Config, entries: Iterable[tuple[str, str]],
                     load: Callable[[str, str], torch.Tensor], *, tp: int = 1, step: int = 0,
                     adam_step: float = 0.0, grad_scaler: dict | None = None, train_state: dict | None = None,
                     converted_by: str = "checkpoint_io", force: bool = False, forbidden: str | None = None,
                     resume_config: str | None = None) -> str:
    """Write ``run_dir/step_{step}`` (into a private ``step_{step}.tmp.HOST-PID.RANDOM``, renamed when complete) and
    point ``run_dir/latest`` at it; returns the step folder. A failed write (``writes_into``: one line) leaves
    neither, nor any temporary, and ``latest`` as it was.

    ``entries``: the (kind, global name) pairs to write, kind in ``KINDS``; ``load(kind, name)`` returns
    the full fp32 tensor (called once per tensor-parallel rank, so the writer holds one rank's file at
    a time). Tensor-parallel parameters (those with a ``partition_dim`` in the model of ``config``)
    are cut into ``tp`` slices; the others are written whole by rank 0. ``config`` is stored as the
    checkpoint's resolved config; its ``padded_vocab_size`` must be the word embedding's rows.
    ``forbidden``: a step folder that must not be replaced (the checkpoint being read).
    ``resume_config``: the text of ``config.yaml``, the base configuration of a run that loads the
    checkpoint (under its own YAML and flags); default the whole of ``config``, as training saves.
    """
    entries = list(entries)
    for kind, name in entries:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r} for {name!r}; expected one of {KINDS}")
    layout = tensor_layout(config)
    check_names_fit(entries, layout)
    final = os.path.join(run_dir, f"step_{step}")
    if forbidden and os.path.realpath(final) == os.path.realpath(forbidden):
        raise CheckpointError(f"{final} is the checkpoint being read; write to another folder.")
    if os.path.exists(final) and not force:
        raise CheckpointError(f"{final} already exists; choose another output folder or pass --force.")
    held = held_run(run_dir)
    if held is not None and not force:  # a run's folder: its relaunch would resume this instead of its own steps
        raise CheckpointError(f"{run_dir} holds a run ({held.what}): writing a checkpoint there would repoint its "
                              f"'latest'; choose another output folder, or pass --force.")
    with file_lock.Staged() as staged:  # a private step_N.tmp.HOST-PID.RANDOM and latest's text, renamed at the end
        with writes_into(run_dir):
            os.makedirs(run_dir, exist_ok=True)
            tmp = staged.folder(final)
            config_crc = write_text(os.path.join(tmp, "config.yaml"), to_yaml(config) if resume_config is None
                                    else resume_config)
            _write_files(tmp, config, entries, load, layout, tp, step, adam_step, grad_scaler, train_state,
                         converted_by, config_crc)
            fsync_dir(tmp)
            staged.data(os.path.join(run_dir, "latest"), os.path.basename(final).encode())
        if os.path.exists(final):
            if not force:  # another writer's, meanwhile (a file system without locks)
                raise CheckpointError(f"{final} appeared while this checkpoint was written; choose another output "
                                      f"folder or pass --force.")
            shutil.rmtree(final)
        staged.commit()
    fsync_dir(run_dir)
    return final


def _write_files(tmp: str, config: Config, entries: list, load: Callable, layout: dict, tp: int, step: int,
                 adam_step: float, grad_scaler: dict | None, train_state: dict | None, converted_by: str,
                 config_crc: int) -> None:
    pieces = []
    total = sum(tp if layout[name][1] is not None else 1 for _, name in entries)
    with Progress("writing tensors", total=total, unit="tensors", summary=False) as progress:
        for rank in range(tp):
            _write_rank(tmp, rank, entries, load, layout, tp, pieces, progress)
    s = config.distributed.sharding
    common = {"format_version": FORMAT_VERSION, "step": step, "adam_step": float(adam_step),
              "grad_scaler": grad_scaler,
              "train_state": train_state if train_state is not None else {"consumed_samples": 0, "skipped_steps": 0},
              "config": to_yaml(config)}
    common_crc = write_bytes(os.path.join(tmp, small_files.COMMON_FILE), small_files.to_json_bytes(common))
    layout_info = {"world_size": tp, "tp": tp, "pp": 1, "dp": 1, "sharding": 1, "vpp": 1,
                   "sharding_stage": s.sharding_stage, "sharding_offload": s.sharding_offload,
                   "converted_by": converted_by}
    files = {small_files.COMMON_FILE: common_crc, "config.yaml": config_crc}
    metadata = {"format_version": FORMAT_VERSION, "step": step, "layout": layout_info,
                "checksum": {"algorithm": "crc32", "chunk_bytes": CRC_CHUNK_BYTES}, "files": files, "pieces": pieces}
    write_text(os.path.join(tmp, "metadata.json"), json.dumps(metadata))


def _write_rank(tmp: str, rank: int, entries: list, load: Callable, layout: dict, tp: int, pieces: list,
                progress: Progress) -> None:
    """``rank{rank}.bin``: this tensor-parallel rank's slice of each entry (the replicated ones on rank 0)."""
    writer = RankFileWriter(tmp, rank)
    for kind, name in entries:
        shape, dim = layout[name]
        if dim is None and rank > 0:
            continue
        full = load(kind, name).to(torch.float32)
        check_shape_fits(kind, name, full, layout)
        if dim is None:
            local, tp_rank, tp_size = full, 0, 1
        else:
            if shape[dim] % tp:
                raise CheckpointError(f"{name!r} (dim {dim} of {list(shape)}) cannot be cut into {tp} slices.")
            local, tp_rank, tp_size = full.chunk(tp, dim=dim)[rank], rank, tp
        pieces.append({**writer.add(local), "kind": kind, "name": name, "lo": 0, "hi": local.numel(),
                       "global_shape": list(shape), "partition_dim": dim, "tp_rank": tp_rank,
                       "tp_size": tp_size, "local_shape": list(local.shape)})
        del full
        progress.update(1)
    writer.close()


def check_names_fit(entries: Iterable[tuple[str, str]], layout: dict) -> None:
    """CheckpointError, in the writer's words, unless the (kind, name) ``entries`` are parameters of the model whose
    ``tensor_layout`` is ``layout`` and hold a "param" of each: what a checkpoint of ours may hold."""
    entries = list(entries)
    unknown = sorted({name for _, name in entries} - set(layout))
    if unknown:
        raise CheckpointError(f"tensor {unknown[0]!r} is not a parameter of the configured model.")
    missing = sorted(set(layout) - {name for kind, name in entries if kind == "param"})
    if missing:
        raise CheckpointError(f"no 'param' tensor for {missing[0]!r}, which the model has.")


def check_shape_fits(kind: str, name: str, t: torch.Tensor, layout: dict) -> None:
    """CheckpointError unless ``t`` (the ``kind`` of parameter ``name``) has its shape in ``layout``."""
    if tuple(t.shape) != tuple(layout[name][0]):
        raise CheckpointError(f"{kind} {name!r} has shape {list(t.shape)}, but the configured model's is "
                              f"{list(layout[name][0])}.")


def write_params(run_dir: str, config: Config, params: dict[str, torch.Tensor], **kwargs) -> str:
    """``write_checkpoint`` of full parameters only (kind "param"; step 0, no optimizer state by default)."""
    return write_checkpoint(run_dir, config, [("param", name) for name in params],
                            lambda kind, name: params[name], **kwargs)


def reshard(path: str, out_dir: str, tp: int, force: bool = False) -> str:
    """Rewrite the checkpoint at ``path`` into ``out_dir`` with ``tp`` rank files (every kind, the step,
    AdamW step, loss scaler and train state kept); returns the new step folder."""
    if tp < 1:
        raise CheckpointError(f"--tp must be at least 1, got {tp}.")
    reader, common, config = open_checkpoint(path)
    m = config.model
    heads_ok = m.num_attention_heads % tp == 0 and (m.ffn_hidden_size or 4 * m.hidden_size) % tp == 0
    if not heads_ok:
        raise CheckpointError(f"tp {tp} must divide num_attention_heads ({m.num_attention_heads}) and "
                              f"ffn_hidden_size ({m.ffn_hidden_size}).")
    config.distributed.mp_degree = tp  # the stored config describes the new files (its padded vocabulary)
    rows = config.padded_vocab_size
    saved_rows = reader.global_shape(WORD_EMBEDDING)[0] if reader.has("param", WORD_EMBEDDING) else None
    if saved_rows is not None and saved_rows < m.vocab_size:
        raise CheckpointError(f"{WORD_EMBEDDING} has {saved_rows} rows, fewer than vocab_size {m.vocab_size}.")

    def load(kind: str, name: str) -> torch.Tensor:
        t = read_checked(reader, kind, name)
        return _repad(t, rows) if is_vocab_padded(name) else t

    entries = [(kind, name) for kind in KINDS for name in reader.names if reader.has(kind, name)]
    return write_checkpoint(out_dir, config, entries, load, tp=tp, step=common["step"],
                            adam_step=common.get("adam_step", 0.0), grad_scaler=common.get("grad_scaler"),
                            train_state=common.get("train_state"), converted_by="reshard", force=force,
                            forbidden=reader.step_dir)
