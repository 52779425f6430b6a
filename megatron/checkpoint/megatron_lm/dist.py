"""Megatron-LM's ``torch_dist`` checkpoint format (``--ckpt-format torch_dist``), written and read with PyTorch's
distributed checkpoint (DCP) directly, in the layout Megatron Core's ``dist_checkpointing`` saves::

    DIR/latest_checkpointed_iteration.txt
    DIR/iter_0000100/.metadata          DCP's index of every tensor (global shapes, chunks)
    DIR/iter_0000100/__0_0.distcp       the tensors' bytes (one file per writer)
    DIR/iter_0000100/common.pt          torch.save of the non-sharded entries: args, iteration, checkpoint_version
    DIR/iter_0000100/metadata.json      {"sharded_backend": "torch_dist", ...}

Keys are Megatron Core's sharded-state-dict keys: whole (global) tensors, independent of the tp x pp layout that
saved them; the decoder's layers stacked on a leading dim (``decoder.layers.self_attention.linear_qkv.weight`` of
shape ``[num_layers, ...]``), or, for Megatron Core's non-homogeneous layers (a mixture of experts whose
``moe_layer_freq`` is a list, as the exports here say), one key per layer (``decoder.layers.{i}.X``); a MoE layer's
experts stacked on a leading dim (``decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight`` of shape
``[num_experts, ...]``: SequentialMLP's keys, which its grouped-GEMM experts, TEGroupedMLP and GroupedMLP, save
too), its router (with its ``expert_bias`` buffer) and shared expert as in the dense MLP; the
norms under the names Transformer Engine's fused layers give them (``input_layernorm.*`` ->
``self_attention.linear_qkv.layer_norm_*``, ``pre_mlp_layernorm.*`` -> ``mlp.linear_fc1.layer_norm_*``: the local
spec's ``sharded_state_dict_keys_map``), a SwiGLU ``linear_fc1`` as ``[gate; up]``. Multi-latent attention's local
spec has no such map: its layers keep their own names (``input_layernorm``, ``pre_mlp_layernorm``,
``self_attention.q_layernorm``, ``kv_layernorm``); reading also takes Transformer Engine's MLA names (the latent
norms fused into ``linear_q_up_proj`` / ``linear_kv_up_proj`` as ``layer_norm_weight``). Multi-token prediction's
modules are keyed one by one (``mtp.layers.{k}.``, never stacked), their ``transformer_layer`` named as a decoder
layer is. The linears' ``_extra_state`` (None in the local spec) is written as Megatron writes it (bytes per layer,
per expert, per module), and skipped on reading. The optimizer states are
``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<key>`` (``megatron_optim``), in the same layout; a distributed
optimizer's bucket layout (dp_reshardable) is read by ``megatron_distrib_optim``.

Reading never unpickles arbitrary objects nor opens a file outside the folder: ``.metadata`` and the data files
through ``dcp_reader.SafeReader`` (an explicit allow-list of (module, name) pairs; every path, byte range, size and
chunk the index names checked first, each chunk's data checked to be what the index says), ``common.pt`` with
``megatron_legacy.safe_load`` (``dist_head``: inside the folder, its args' sizes and iteration checked by
``megatron_args.check_saved``), ``metadata.json`` inside the folder; the stacked layers and experts must be as many
as the args say before they are unstacked.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.checkpoint.format import CheckpointError, file_inside, write_text
from megatron.checkpoint.megatron_lm.args import check_saved
from megatron.checkpoint.megatron_lm.dcp_reader import CheckpointException, SafeReader, load_error
from megatron.checkpoint.megatron_lm.legacy import CHECKPOINT_VERSION, publish_iteration, safe_load
from megatron.checkpoint.megatron_lm.optim import NO_OPTIM

# what Megatron-LM's save records of its sharded state dict's layout (get_sharded_sd_metadata, no distributed
# optimizer), so that its load builds the same keys: the layers stacked (or per layer: non-homogeneous), no prefix
# on a chain of optimizers
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}
_RENAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
            ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
# read only: Transformer Engine's multi-latent attention fuses its latent norms into the up-projections
_TE_MLA = (("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_"),
           ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_"))
_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
            "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "eh_proj")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(.+)$")
_EXPERTS = re.compile(r"^(.*\.mlp\.experts\.)experts\.(.+)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer\.)(.+)$")
_MLA = ".self_attention.linear_kv_down_proj.weight"
_STACKED = "decoder.layers."
OPTIMIZER_STATE = "optimizer.state."
_OPTIMIZER = re.compile(r"^(chained_\d+\.)?optimizer\.")
# the master: fp32_param (fp32 optimizer; distributed, fully_sharded_model_space), param (fully_reshardable)
_BY_NAME = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)\.(.+)$")
_METADATA_JSON_BYTES = 1 << 20  # Megatron's metadata.json is a few names: more is not read


def is_torch_dist(folder: str) -> bool:
    """Whether ``folder`` is a torch_dist iteration folder: its ``metadata.json`` says ``"sharded_backend":
    "torch_dist"``. A ``metadata.json`` linked from outside the folder is refused (``format.file_inside``)."""
    path = os.path.join(folder, "metadata.json")
    if os.path.islink(path):
        file_inside(folder, "metadata.json", folder)
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(_METADATA_JSON_BYTES)).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def dist_head(folder: str) -> tuple[dict, object, int]:
    """(``common.pt``'s dict, its checked ``args``, the iteration) of the torch_dist iteration folder ``folder``:
    ``common.pt`` a file inside it (``format.file_inside``), read without code (``megatron_legacy.safe_load``), what it
    says checked (``megatron_args.check_saved``) before anything proportional to it is built."""
    common = safe_load(file_inside(folder, "common.pt", folder))
    args, iteration = check_saved(common, os.path.join(folder, "common.pt"))
    return common, args, iteration


def _dist_name(rest: str, mla: bool = False) -> str:
    """A layer's sharded key (after its layer prefix) of its state-dict name; multi-latent attention keeps it."""
    for ours, theirs in () if mla else _RENAMES:
        if rest.startswith(ours):
            return theirs + rest[len(ours):]
    return rest


def _core_name(rest: str) -> str:
    for ours, theirs in (*_RENAMES, *_TE_MLA):
        if rest.startswith(theirs):
            return ours + rest[len(theirs):]
    return rest


def _mtp_name(name: str, to_core: bool, mla: bool = False) -> str:
    """A multi-token prediction module's key: its ``transformer_layer`` renamed as a decoder layer is."""
    found = _MTP_LAYER.match(name)
    if not found:
        return name
    return found[1] + (_core_name(found[2]) if to_core else _dist_name(found[2], mla))


def _fold_experts(whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``...mlp.experts.local_experts.{e}.X`` -> ``...mlp.experts.experts.X`` stacked over the experts."""
    out: dict[str, object] = {}
    for name, t in whole.items():
        found = _LOCAL_EXPERT.match(name)
        if found:
            out.setdefault(f"{found[1]}experts.{found[3]}", {})[int(found[2])] = t
        else:
            out[name] = t
    return {name: torch.stack([v[e] for e in range(len(v))]) if isinstance(v, dict) else v
            for name, v in out.items()}


def _unfold_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        found = _EXPERTS.match(name)
        if found:
            out.update({f"{found[1]}local_experts.{e}.{found[2]}": t[e].clone() for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def _stacked(whole: dict[str, torch.Tensor], num_layers: int, prefix: str = "",
             per_layer: bool = False) -> dict[str, torch.Tensor]:
    """Megatron Core's sharded keys (``prefix`` before each) of a whole state dict: the experts stacked on a leading
    dim, the layers too (``decoder.layers.X`` of ``[num_layers, ...]``), or, ``per_layer`` (Megatron Core's
    non-homogeneous layers: a mixture of experts with a ``moe_layer_freq`` list), ``decoder.layers.{i}.X``."""
    state: dict[str, torch.Tensor] = {}
    layers: dict[str, list] = {}
    mla = any(name.endswith(_MLA) for name in whole)
    for name, t in _fold_experts(whole).items():
        found = _LAYER.match(name)
        if found and per_layer:
            state[f"{prefix}{_STACKED}{found[1]}.{_dist_name(found[2], mla)}"] = t.contiguous()
        elif found:
            layers.setdefault(prefix + _STACKED + _dist_name(found[2], mla), [None] * num_layers)[int(found[1])] = t
        else:
            state[prefix + _mtp_name(name, False, mla)] = t.contiguous()
    for key, per_layer_tensors in layers.items():
        state[key] = torch.stack(per_layer_tensors)
    return state


def _unstacked(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole state dict (per-layer, per-expert names) of Megatron Core's sharded keys, the layers stacked or
    not."""
    whole: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        found = _LAYER.match(key)
        if found:
            whole[f"{_STACKED}{found[1]}.{_core_name(found[2])}"] = t
        elif key.startswith(_STACKED):
            rest = _core_name(key[len(_STACKED):])
            for i in range(t.shape[0]):
                whole[f"{_STACKED}{i}.{rest}"] = t[i].clone()
        else:
            whole[_mtp_name(key, True)] = t
    return _unfold_experts(whole)


def _check_stacks(state: dict[str, torch.Tensor], args, folder: str) -> None:
    """Each stacked tensor's leading dim is what the args say (before ``_unstacked`` makes one entry per index): the
    decoder's layers (``decoder.layers.X``: ``num_layers``), a layer's experts (``...mlp.experts.experts.X``:
    ``num_experts``, after the layers' dim when both are stacked)."""
    layers, experts = getattr(args, "num_layers", None), getattr(args, "num_experts", None)
    for key, t in state.items():
        name = _BY_NAME.match(key)[2] if _BY_NAME.match(key) else key
        stacked = name.startswith(_STACKED) and not _LAYER.match(name)
        want = [("num_layers", layers)] if stacked else []
        want += [("num_experts", experts)] if _EXPERTS.match(name) else []
        if t.dim() < len(want) or any(t.shape[i] != value for i, (_, value) in enumerate(want)):
            said = " and ".join(f"{what} {value}" for what, value in want)
            raise CheckpointError(f"{folder}/.metadata gives {key} the shape {list(t.shape)}, but the args say "
                                  f"{said} (its leading dim{'s' if len(want) > 1 else ''}): the index does not "
                                  f"match the checkpoint's args.")


def _extra_states(state: dict[str, torch.Tensor], num_layers: int, per_layer: bool) -> dict[str, list]:
    """The linears' ``_extra_state`` entries Megatron Core's loader asks for (None in the local spec: written as
    DCP writes Megatron's sharded object, the list of its shards' data), one per layer / per expert."""
    out = {}
    for key, t in state.items():
        module = key[:-len(".weight")] if key.endswith(".weight") else None
        if module is None or not module.endswith(_LINEARS):
            continue
        if not per_layer and key.startswith(_STACKED):  # the decoder's layers, stacked
            out.update({f"{module}._extra_state/shard_{i}_{num_layers}": [None] for i in range(num_layers)})
        elif _EXPERTS.match(key):
            out.update({f"{module}._extra_state/shard_{e}_{t.shape[0]}": [None] for e in range(t.shape[0])})
        else:
            out[f"{module}._extra_state/shard_0_1"] = [None]
    return out


def write_torch_dist(out: str, iteration: int, whole: dict[str, torch.Tensor], args, num_layers: int,
                     optimizer: dict[str, dict[str, torch.Tensor]] | None = None, common: dict | None = None) -> str:
    """Write ``out/iter_{iteration:07d}`` (into a ``.tmp`` folder renamed when complete) and the tracker;
    ``optimizer``: {kind: whole state dict} of the optimizer states (``optimizer.state.<kind>.<key>``);
    ``common``: more entries of ``common.pt`` (the optimizer's groups and step, the scheduler). A mixture of experts
    is written with per-layer keys (Megatron Core's non-homogeneous layers, as the export's ``moe_layer_freq``
    list builds them). A failed write removes the ``.tmp`` folder; ``tools/convert_checkpoint.py to-megatron`` gives
    ``out`` as a private staging folder (``megatron_commands``), so that no two writers share it."""
    def write(tmp: str) -> None:
        per_layer = any(_LOCAL_EXPERT.match(name) for name in whole)
        model = _stacked(whole, num_layers, per_layer=per_layer)
        state: dict[str, object] = {**model, **_extra_states(model, num_layers, per_layer)}
        for kind, states in (optimizer or {}).items():
            state.update(_stacked(states, num_layers, f"{OPTIMIZER_STATE}{kind}.", per_layer))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ...: assuming ... a single process"
            # flat keys, no flattening map in .metadata (Megatron Core's loader reads its BytesIO entries only then)
            dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=DefaultSavePlanner(flatten_state_dict=False),
                     no_dist=True)
        torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                    "content_metadata": CONTENT_METADATA, **(common or {})}, os.path.join(tmp, "common.pt"))
        write_text(os.path.join(tmp, "metadata.json"), json.dumps(METADATA_JSON))

    return publish_iteration(out, iteration, write)


def read_torch_dist(folder: str, optimizer: bool = True) -> tuple[object, dict, dict[str, torch.Tensor], dict]:
    """(args, common.pt's other entries, the whole Megatron Core state dict, {kind: the whole optimizer states}
    (empty when none are saved, or not ``optimizer``)) of ``folder``."""
    common, args, _ = dist_head(folder)
    reader = SafeReader(folder)
    metadata = reader.read_metadata()
    keys = metadata.state_dict_metadata
    unknown = [k for k in keys if _OPTIMIZER.match(k) and not _BY_NAME.match(k)]
    if optimizer and unknown:
        raise CheckpointError(f"{folder} holds optimizer states in a layout this tool does not read ({unknown[0]}; "
                              f"the distributed optimizer's dp_reshardable buckets and states by name are read); "
                              f"re-save it with --dist-ckpt-optim-fully-reshardable (states by parameter name), "
                              f"{NO_OPTIM}.")
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in keys.items()
             if isinstance(meta, TensorStorageMetadata) and (optimizer or not _OPTIMIZER.match(key))
             and (not _OPTIMIZER.match(key) or _BY_NAME.match(key))}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP wraps each rank's error (a BaseException)
        raise load_error(folder, err) from err
    _check_stacks(state, args, folder)
    model = {k: t for k, t in state.items() if not _OPTIMIZER.match(k)}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        found = _BY_NAME.match(key)
        if found:
            states.setdefault("fp32_param" if found[1] == "param" else found[1], {})[found[2]] = t
    return (args, {k: v for k, v in common.items() if k != "args"}, _unstacked(model),
            {kind: _unstacked(by_key) for kind, by_key in states.items()})
