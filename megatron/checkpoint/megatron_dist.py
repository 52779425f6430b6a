"""Megatron-LM's ``torch_dist`` checkpoint format (``--ckpt-format torch_dist``), written and read with PyTorch's
distributed checkpoint (DCP) directly, in the layout Megatron Core's ``dist_checkpointing`` saves::

    DIR/latest_checkpointed_iteration.txt
    DIR/iter_0000100/.metadata          DCP's index of every tensor (global shapes, chunks)
    DIR/iter_0000100/__0_0.distcp       the tensors' bytes (one file per writer)
    DIR/iter_0000100/common.pt          torch.save of the non-sharded entries: args, iteration, checkpoint_version
    DIR/iter_0000100/metadata.json      {"sharded_backend": "torch_dist", ...}

Keys are Megatron Core's sharded-state-dict keys: whole (global) tensors, independent of the tp x pp layout that
saved them; the decoder's layers stacked on a leading dim (``decoder.layers.self_attention.linear_qkv.weight`` of
shape ``[num_layers, ...]``), the norms under the names Transformer Engine's fused layers give them
(``input_layernorm.*`` -> ``self_attention.linear_qkv.layer_norm_*``, ``pre_mlp_layernorm.*`` ->
``mlp.linear_fc1.layer_norm_*``), a SwiGLU ``linear_fc1`` as ``[gate; up]``. The linears' ``_extra_state``
(None in the local spec) is written as Megatron writes it (bytes per layer), and skipped on reading.

Reading never unpickles arbitrary objects: DCP's own reader unpickles ``.metadata`` with ``pickle.load``; here it is
read with an unpickler that builds only DCP's metadata classes, ``torch.Size`` and torch dtypes, and ``common.pt``
with ``megatron_legacy.safe_load``. Mixture-of-experts models are not written or read in this format (its experts'
keys differ); the legacy format converts them.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.checkpoint.format import CheckpointError, write_text
from megatron.checkpoint.megatron_legacy import CHECKPOINT_VERSION, TRACKER, safe_load
from megatron.checkpoint.megatron_optim import NO_OPTIM

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}
_RENAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
            ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_STACKED = "decoder.layers."
OPTIMIZER_STATE = "optimizer.state."
_OPTIMIZER = re.compile(r"^(chained_\d+\.)?optimizer\.")
_BY_NAME = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param)\.(.+)$")


def is_torch_dist(folder: str) -> bool:
    path = os.path.join(folder, "metadata.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def _dist_name(rest: str) -> str:
    for ours, theirs in _RENAMES:
        if rest.startswith(ours):
            return theirs + rest[len(ours):]
    return rest


def _core_name(rest: str) -> str:
    for ours, theirs in _RENAMES:
        if rest.startswith(theirs):
            return ours + rest[len(theirs):]
    return rest


def _check_dense(names) -> None:
    if any(".mlp.router." in n or ".experts." in n for n in names):
        raise CheckpointError("a mixture of experts is not converted in the torch_dist format; use the legacy "
                              "format (--format legacy, or Megatron's --ckpt-format torch).")


def _stacked(whole: dict[str, torch.Tensor], num_layers: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """Megatron Core's sharded keys (``prefix`` before each) of a whole state dict: the layers stacked."""
    state: dict[str, torch.Tensor] = {}
    layers: dict[str, list] = {}
    for name, t in whole.items():
        found = _LAYER.match(name)
        if found:
            layers.setdefault(prefix + _STACKED + _dist_name(found[2]), [None] * num_layers)[int(found[1])] = t
        else:
            state[prefix + name] = t.contiguous()
    for key, per_layer in layers.items():
        state[key] = torch.stack(per_layer)
    return state


def _unstacked(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole state dict (per-layer names) of Megatron Core's sharded keys."""
    whole: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if key.startswith(_STACKED):
            rest = _core_name(key[len(_STACKED):])
            for i in range(t.shape[0]):
                whole[f"{_STACKED}{i}.{rest}"] = t[i].clone()
        else:
            whole[key] = t
    return whole


def write_torch_dist(out: str, iteration: int, whole: dict[str, torch.Tensor], args, num_layers: int,
                     optimizer: dict[str, dict[str, torch.Tensor]] | None = None, common: dict | None = None) -> str:
    """Write ``out/iter_{iteration:07d}`` (into a ``.tmp`` folder renamed when complete) and the tracker;
    ``optimizer``: {kind: whole state dict} of the optimizer states (``optimizer.state.<kind>.<key>``);
    ``common``: more entries of ``common.pt`` (the optimizer's groups and step, the scheduler)."""
    _check_dense(whole)
    final = os.path.join(out, f"iter_{iteration:07d}")
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose another output folder.")
    state: dict[str, object] = dict(_stacked(whole, num_layers))
    for kind, states in (optimizer or {}).items():
        state.update(_stacked(states, num_layers, f"{OPTIMIZER_STATE}{kind}."))
    for module in _EXTRA_STATE:
        for i in range(num_layers):
            # DCP torch.saves a non-tensor value: Megatron Core's sharded object is the list of its shards' data
            state[f"{_STACKED}{module}._extra_state/shard_{i}_{num_layers}"] = [None]
    tmp = final + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ...: assuming ... a single process"
        # flat keys, no flattening map in .metadata (Megatron Core's loader reads its BytesIO entries only then)
        dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=DefaultSavePlanner(flatten_state_dict=False),
                 no_dist=True)
    torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, **(common or {})},
               os.path.join(tmp, "common.pt"))
    write_text(os.path.join(tmp, "metadata.json"), json.dumps(METADATA_JSON))
    os.replace(tmp, final)
    write_text(os.path.join(out, TRACKER), str(iteration))
    return final


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch.Size, dtypes, layouts and memory formats; refuses anything else."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")

    def find_class(self, module: str, name: str):
        if module in self._MODULES and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if (module, name) in (("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                              ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "PurePosixPath")):  # a layout by its name; the saved folder
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


class _SafeReader(FileSystemReader):
    def read_metadata(self):
        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"{path} holds {err}, which this tool does not unpickle (only PyTorch's "
                                  f"distributed-checkpoint metadata is read).") from err
        except (OSError, EOFError, ValueError, AttributeError) as err:
            raise CheckpointError(f"cannot read {path} ({type(err).__name__}: {err}).") from err
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def read_torch_dist(folder: str, optimizer: bool = True) -> tuple[object, dict, dict[str, torch.Tensor], dict]:
    """(args, common.pt's other entries, the whole Megatron Core state dict, {kind: the whole optimizer states}
    (empty when none are saved, or not ``optimizer``)) of ``folder``."""
    common = safe_load(os.path.join(folder, "common.pt"))
    args = common.get("args")
    reader = _SafeReader(folder)
    metadata = reader.read_metadata()
    keys = metadata.state_dict_metadata
    unknown = [k for k in keys if _OPTIMIZER.match(k) and not _BY_NAME.match(k)]
    if optimizer and unknown:
        raise CheckpointError(f"{folder} holds optimizer states by gradient bucket ({unknown[0]}: the distributed "
                              f"optimizer's dp_reshardable layout), which this tool does not convert; re-save it with "
                              f"--dist-ckpt-optim-fully-reshardable (states by parameter name), {NO_OPTIM}.")
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in keys.items()
             if isinstance(meta, TensorStorageMetadata) and (optimizer or not _OPTIMIZER.match(key))
             and (not _OPTIMIZER.match(key) or _BY_NAME.match(key))}
    _check_dense(state)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except Exception as err:  # noqa: BLE001 - DCP raises its own wrapper types
        raise CheckpointError(f"cannot read the tensors of {folder} ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}).") from err
    model = {k: t for k, t in state.items() if not _OPTIMIZER.match(k)}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        found = _BY_NAME.match(key)
        if found:
            states.setdefault(found[1], {})[found[2]] = t
    return (args, {k: v for k, v in common.items() if k != "args"}, _unstacked(model),
            {kind: _unstacked(by_key) for kind, by_key in states.items()})
