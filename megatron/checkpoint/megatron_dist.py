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

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}
_RENAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
            ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_STACKED = "decoder.layers."


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


def write_torch_dist(out: str, iteration: int, whole: dict[str, torch.Tensor], args, num_layers: int) -> str:
    """Write ``out/iter_{iteration:07d}`` (into a ``.tmp`` folder renamed when complete) and the tracker."""
    _check_dense(whole)
    final = os.path.join(out, f"iter_{iteration:07d}")
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose another output folder.")
    state: dict[str, object] = {}
    layers: dict[str, list] = {}
    for name, t in whole.items():
        found = _LAYER.match(name)
        if found:
            layers.setdefault(_STACKED + _dist_name(found[2]), [None] * num_layers)[int(found[1])] = t
        else:
            state[name] = t.contiguous()
    for key, per_layer in layers.items():
        state[key] = torch.stack(per_layer)
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
    torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration},
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


def read_torch_dist(folder: str) -> tuple[object, dict, dict[str, torch.Tensor]]:
    """(args, common.pt's other entries, the whole Megatron Core state dict, per-layer names) of ``folder``."""
    common = safe_load(os.path.join(folder, "common.pt"))
    args = common.get("args")
    reader = _SafeReader(folder)
    metadata = reader.read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    _check_dense(state)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except Exception as err:  # noqa: BLE001 - DCP raises its own wrapper types
        raise CheckpointError(f"cannot read the tensors of {folder} ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}).") from err
    whole: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if key.startswith(_STACKED):
            rest = _core_name(key[len(_STACKED):])
            for i in range(t.shape[0]):
                whole[f"{_STACKED}{i}.{rest}"] = t[i].clone()
        else:
            whole[key] = t
    return args, {k: v for k, v in common.items() if k != "args"}, whole
