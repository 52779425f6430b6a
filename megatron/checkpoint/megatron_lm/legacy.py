"""Megatron-LM's legacy checkpoint layout (``--ckpt-format torch``), read and written without unpickling code.

A save folder ``DIR`` holds ``latest_checkpointed_iteration.txt`` (the iteration, or ``release``) and one folder
per saved iteration, ``iter_{N:07d}`` (or ``release``), with one file per model-parallel rank::

    DIR/iter_0000100/mp_rank_{tp:02d}/model_optim_rng.pt           pipeline size 1
    DIR/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt  pipeline size > 1
    DIR/iter_0000100/mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}/...       expert parallelism > 1 (megatron_experts)

Each file is a ``torch.save`` of a dict: ``model`` (that rank's Megatron Core ``GPTModel`` state dict, or the
legacy GPT model's, renamed on reading: its tensor-parallel slices, its pipeline stage's layers numbered from 0),
``args`` (the run's ``argparse.Namespace``), ``iteration``, ``checkpoint_version`` (3.0), and, when saved,
``optimizer``, ``opt_param_scheduler``, ``rng_state`` and ``num_floating_point_operations_so_far``.

Reading never unpickles arbitrary objects: ``safe_load`` is ``torch.load(weights_only=True)`` with an allow-list,
the types Megatron-LM itself allows in its files (``megatron.core.safe_globals``): ``argparse.Namespace``,
``types.SimpleNamespace``, ``pathlib.PosixPath``, numpy's arrays and dtypes (an RNG state), ``io.BytesIO``
(Transformer Engine's extra state), ``signal.Signals``, Megatron's enums (read as their names) and its
``OptimizerConfig`` (read as a plain record); a file holding anything else is refused in one line, naming what it
holds. Virtual pipeline chunks (``model0``, ``model1``, ...) are refused too (convert from a checkpoint saved
without them). Nor is anything read outside the folder, or believed before it is checked: the tracker, the
iteration folder it names, every rank file (and ``distrib_optim.pt``) must lie inside (``format.file_inside``), no
two ranks' names may be one file; what the first file says of itself (its args' sizes, the iteration) is checked
before anything proportional to it is built (``megatron_args.check_saved``). ``first_file`` and ``rank_files``
are these checks, which ``checkpoint_info.py`` makes too. Expert-parallel ranks' files, grouped-GEMM experts and
Transformer Engine's names are read into Megatron Core's local names (``megatron_experts``); their optimizer states
are not (``EXPERT_LAYOUT``).
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pickle
import shutil
import signal
import types
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from megatron.checkpoint.format import CheckpointError, file_inside, write_text
from megatron.checkpoint.megatron_lm.args import check_saved, iteration_problem
from megatron.checkpoint.megatron_lm.core_names import is_legacy_model_state, legacy_to_core_state
from megatron.checkpoint.megatron_lm.experts import check_copies, expert_ranks, local_names, merge_ep

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
DISTRIBUTED_FILE = "distrib_optim.pt"  # --use-distributed-optimizer: the Adam states, flattened by bucket
DISTRIBUTED, LEGACY_MODEL = "distributed optimizer", "legacy model"  # optimizer entries not converted
EXPERT_LAYOUT = "expert layout"  # the optimizer of expert-parallel, grouped-GEMM or Transformer Engine rank files
EXPERT_LAYOUT_WHY = ("the optimizer states of rank files with expert parallelism > 1, grouped-GEMM experts or "
                     "Transformer Engine's names are not converted (their parameter order is not Megatron Core's "
                     "local one, which this tool derives)")
CHECKPOINT_VERSION = 3.0
_TRACKER_BYTES = 4096  # latest_checkpointed_iteration.txt holds a number: more is not read
_EXTRA = "._extra_state"  # Transformer Engine's (FP8) metadata, None in the local spec: not a tensor
# What Megatron-LM itself allows in its files (megatron.core.safe_globals): its enums are read as their
# "Class.value" text and its OptimizerConfig as a plain record, never imported or constructed.
_MEGATRON_ENUMS = ("megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphScope",
                   "megatron.core.transformer.enums.AttnMaskType", "megatron.core.enums.ModelType",
                   "megatron.core.rerun_state_machine.RerunDiagnostic", "megatron.core.rerun_state_machine.RerunMode",
                   "megatron.core.rerun_state_machine.RerunState")
_MEGATRON_RECORDS = ("megatron.core.optimizer.optimizer_config.OptimizerConfig",
                     "megatron.core.optimizer.OptimizerConfig")


def _enum_stub(qualified: str):
    def read(value):
        return f"{qualified.rsplit('.', 1)[1]}.{value}"
    return read


class _Record:
    """A Megatron dataclass's fields, as attributes (what the unpickler's BUILD sets); no code of its own."""


def _allowed() -> list:
    multiarray = getattr(np, "_core", None) or np.core
    allowed = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, io.BytesIO, signal.Signals, np.ndarray,
               np.dtype, multiarray.multiarray._reconstruct]
    allowed += [getattr(np.dtypes, n) for n in ("UInt32DType", "Int64DType", "Float64DType", "Float32DType")
                if hasattr(getattr(np, "dtypes", None), n)]
    return (allowed + [(_enum_stub(name), name) for name in _MEGATRON_ENUMS]
            + [(_Record, name) for name in _MEGATRON_RECORDS])


def safe_load(path: str) -> dict:
    """``torch.load`` of a Megatron checkpoint file with ``weights_only=True`` and the allow-list; CheckpointError
    (one line) for a file that is missing, damaged, or holds any other object."""
    try:
        with torch.serialization.safe_globals(_allowed()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        try:
            known = {f"{g.__module__}.{g.__qualname__}" for g in _allowed() if not isinstance(g, tuple)}
            allowed = known.union(_MEGATRON_ENUMS, _MEGATRON_RECORDS)
            unsafe = ", ".join(name for name in torch.serialization.get_unsafe_globals_in_checkpoint(path)
                               if name not in allowed) or "an unknown object"
        except Exception:  # noqa: BLE001 - only for the message
            unsafe = "an object outside the allow-list"
        raise CheckpointError(f"{path} holds {unsafe}, which this tool does not unpickle (only tensors, "
                              f"argparse.Namespace, numpy RNG states and Megatron's enums are read); re-save it "
                              f"without them (docs/checkpoints.md, Megatron-LM).") from err
    except (OSError, RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(f"cannot read {path} ({type(err).__name__}: {err}).") from err
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not Megatron-LM's checkpoint dict.")
    return state


def rank_folder(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """``mp_rank_{tp:02d}`` (pipeline size 1) or ``mp_rank_{tp:02d}_{pp:03d}``, with ``_{ep:03d}`` added for
    expert parallelism ``ep`` > 1 (Megatron-LM's ``get_checkpoint_name``)."""
    folder = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return folder if ep == 1 else f"{folder}_{ep_rank:03d}"


def iteration_folder(path: str) -> str:
    """The folder of one saved iteration: ``path`` itself (``iter_N``/``release``, or any folder holding
    ``mp_rank_*``), else the one ``path/latest_checkpointed_iteration.txt`` names (a whole number from 0 to 2^40, or
    ``release``). The tracker and the folder it names must lie inside ``path`` (``format.file_inside``)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a folder; give a Megatron-LM save folder or its iter_N folder.")
    if any(name.startswith("mp_rank_") or name == "metadata.json" for name in os.listdir(path)):
        return path  # a legacy iteration folder, or a torch_dist one
    tracker = os.path.join(path, TRACKER)
    if not os.path.lexists(tracker):
        raise CheckpointError(f"{path} has no {TRACKER}, no mp_rank_* folders and no metadata.json: it is not a "
                              f"Megatron-LM checkpoint (give its save folder or an iter_N folder).")
    with open(file_inside(path, TRACKER, path), "rb") as f:
        text = f.read(_TRACKER_BYTES).decode("utf-8", "replace").strip()
    number = int(text) if text.isascii() and text.isdigit() else None
    if text != "release" and (number is None or iteration_problem(number)):
        raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number (a whole number from 0 to "
                              f"2^40) or 'release'.")
    folder = "release" if number is None else f"iter_{number:07d}"
    found = os.path.join(path, folder)
    if not os.path.lexists(found):
        raise CheckpointError(f"{tracker} names iteration {text}, but {found} does not exist.")
    file_inside(path, folder, tracker, is_folder=True)
    return found


class RankFiles(NamedTuple):
    """What a legacy iteration folder's first rank file says and which files its ranks are: ``first`` (that file's
    real path), ``head`` (its dict), its ``args`` and ``iteration`` (checked: ``megatron_args.check_saved``), the
    layout (``tp``, ``pp``, ``ep``, each expert-parallel rank's ``local_experts``) and ``files``: {(tp rank, pp
    stage): [the real path of each expert-parallel rank's file]}."""

    first: str
    head: dict
    args: argparse.Namespace
    iteration: int
    tp: int
    pp: int
    ep: int
    local_experts: int
    files: dict[tuple[int, int], list[str]]


def first_file(folder: str) -> tuple[str, dict, argparse.Namespace, int]:
    """(its real path, its dict, the checked args, the iteration) of the legacy iteration folder's first rank file
    (``mp_rank_00``, ``mp_rank_00_000`` or ``mp_rank_00_000_000``): the file every reader starts with."""
    for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        if os.path.lexists(os.path.join(folder, name, FILE)):
            real = file_inside(folder, f"{name}/{FILE}", folder)
            head = safe_load(real)
            return (real, head, *check_saved(head, os.path.join(folder, name, FILE)))
    if os.path.lexists(os.path.join(folder, ".metadata")):  # a torch_dist folder whose metadata.json did not say so
        raise CheckpointError(f"{folder} holds a torch_dist index (.metadata), but its metadata.json is missing, "
                              f"damaged or not Megatron's (it must say \"sharded_backend\": \"torch_dist\"); the "
                              f"checkpoint is damaged: convert another one.")
    raise CheckpointError(f"{folder} has no mp_rank_00/{FILE}, mp_rank_00_000/{FILE} or mp_rank_00_000_000/{FILE}.")


def rank_files(folder: str, first: tuple | None = None) -> RankFiles:
    """The checks ``from-megatron`` makes of a legacy iteration folder before it reads a tensor, which
    ``checkpoint_info.py`` makes too: the first file (``first``: ``first_file``'s result, when read already), its
    ``model`` entry (virtual pipeline chunks are not converted), the expert layout (``expert_ranks``), and every rank
    file the args' tp x pp x ep name: there, a file inside the folder (``format.file_inside``, its
    ``distrib_optim.pt`` too), and not one file under two ranks' names (a link, or a second name of one file)."""
    real, head, args, iteration = first or first_file(folder)
    if "model" not in head:
        keys = ", ".join(sorted(k for k in head if k.startswith("model"))) or "none"
        raise CheckpointError(f"{real} has no 'model' entry (model entries: {keys}); virtual pipeline chunks "
                              f"are not converted: save the run without --num-layers-per-virtual-pipeline-stage.")
    ep, local_experts = expert_ranks(args, folder)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    files: dict[tuple[int, int], list[str]] = {}
    seen: dict[tuple[int, int], str] = {}
    for p in range(pp):
        for t in range(tp):
            for e in range(ep):
                relative = f"{rank_folder(t, p, pp, e, ep)}/{FILE}"
                if not os.path.lexists(os.path.join(folder, relative)):
                    raise CheckpointError(f"{os.path.join(folder, relative)} is missing: the checkpoint's args say "
                                          f"tensor-parallel size {tp}, pipeline size {pp} and expert parallelism {ep}; "
                                          f"every rank's file is needed.")
                path = file_inside(folder, relative, folder)
                stat = os.stat(path)
                other = seen.setdefault((stat.st_dev, stat.st_ino), relative)
                if other != relative:
                    raise CheckpointError(f"{folder}: {relative} and {other} are one file (a link, or a second name "
                                          f"of it), but each rank saves its own: the rank files are damaged (copy the "
                                          f"checkpoint as Megatron-LM saved it).")
                distributed = f"{rank_folder(t, p, pp, e, ep)}/{DISTRIBUTED_FILE}"
                if os.path.lexists(os.path.join(folder, distributed)):
                    file_inside(folder, distributed, folder)
                files.setdefault((t, p), []).append(path)
    return RankFiles(real, head, args, iteration, tp, pp, ep, local_experts, files)


def read_shards(folder: str) -> tuple[argparse.Namespace, dict, dict[tuple[int, int], dict],
                                     dict[tuple[int, int], object]]:
    """(args, the first file's dict without its model, {(tp_rank, pp_rank): model state dict}, {(tp_rank, pp_rank):
    its ``optimizer`` entry}, only for ranks that saved one) of the legacy iteration folder ``folder``; every rank
    file must be there (``rank_files``). A rank folder with ``distrib_optim.pt`` (the distributed optimizer's states)
    has its ``optimizer`` entry replaced by ``DISTRIBUTED``. Expert-parallel ranks' files that are copies of one
    another are refused (``megatron_experts.check_copies``)."""
    ranks = rank_files(folder)
    shards, optimizers = {}, {}
    for (t, p), paths in ranks.files.items():
        models, files, rngs, entries, renamed, distributed = [], [], [], [], ranks.ep > 1, False
        for path in paths:
            saved = ranks.head if path == ranks.first else safe_load(path)
            model = saved.get("model")
            if not isinstance(model, dict):
                raise CheckpointError(f"{path} holds no 'model' state dict (a {type(model).__name__}): not a rank "
                                      f"file of this checkpoint.")
            if is_legacy_model_state(model):
                model = legacy_to_core_state(model)
                if "optimizer" in saved:  # its parameter order is its own model's, not Megatron Core's
                    saved = {**saved, "optimizer": LEGACY_MODEL}
            odd = next((n for n, v in model.items() if not (isinstance(v, torch.Tensor) or n.endswith(_EXTRA))), None)
            if odd is not None:
                raise CheckpointError(f"{path} holds {odd!r} as a {type(model[odd]).__name__}, not a tensor: not a "
                                      f"rank file of this checkpoint.")
            model, changed = local_names(model, ranks.args, ranks.local_experts, path)
            models.append(model)
            files.append(path)
            rngs.append(saved.get("rng_state"))
            renamed = renamed or changed
            distributed = distributed or os.path.isfile(os.path.join(os.path.dirname(path), DISTRIBUTED_FILE))
            if "optimizer" in saved:
                entries.append(saved["optimizer"])
        if ranks.ep > 1:
            check_copies(models, rngs, files)
        shards[(t, p)] = merge_ep(models, ranks.local_experts, files) if ranks.ep > 1 else models[0]
        if renamed and (distributed or entries):
            optimizers[(t, p)] = EXPERT_LAYOUT
        elif distributed:
            optimizers[(t, p)] = DISTRIBUTED
        elif entries:
            optimizers[(t, p)] = entries[0]
    return ranks.args, {k: v for k, v in ranks.head.items() if k != "model"}, shards, optimizers


def write_shards(out: str, iteration: int, shards: dict[tuple, dict], args: argparse.Namespace,
                 pp: int, extra: dict | None = None, optimizers: dict[tuple[int, int], object] | None = None) -> str:
    """Write ``out/iter_{iteration:07d}/mp_rank_*/model_optim_rng.pt`` (into a ``.tmp`` folder renamed when
    complete) and ``out/latest_checkpointed_iteration.txt``; returns the iteration folder. ``shards``: keyed by
    (tp rank, pp stage), or (tp rank, pp stage, ep rank) for the args' expert parallelism; ``extra``: more entries
    of every file; ``optimizers``: each rank's ``optimizer`` entry. A failed write removes the ``.tmp`` folder;
    ``tools/convert_checkpoint.py to-megatron`` gives ``out`` as a private staging folder (``megatron_commands``), so
    that no two writers share it."""
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)

    def write(tmp: str) -> None:
        for key, model in shards.items():
            folder = os.path.join(tmp, rank_folder(key[0], key[1], pp, key[2] if len(key) > 2 else 0, ep))
            os.makedirs(folder, exist_ok=True)
            optimizer = {"optimizer": optimizers[key]} if optimizers else {}
            torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                        "model": model, **(extra or {}), **optimizer}, os.path.join(folder, FILE))

    return publish_iteration(out, iteration, write)


def publish_iteration(out: str, iteration: int, write: Callable[[str], None]) -> str:
    """``out/iter_{iteration:07d}`` written by ``write(tmp)`` into a ``.tmp`` folder renamed when complete, then the
    tracker; returns the folder. A failed write removes the ``.tmp`` folder; an existing iteration folder is a
    CheckpointError before anything is written."""
    final = os.path.join(out, f"iter_{iteration:07d}")
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose another output folder.")
    tmp = final + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, final)
    write_text(os.path.join(out, TRACKER), str(iteration))
    return final
