"""Megatron-LM's legacy rank files as MoE runs write them: grouped-GEMM experts, Transformer Engine's names, expert
parallelism. Read into (and written from) Megatron Core's local-spec names with SequentialMLP experts, the names
``core_names`` maps.

One rank's experts (``E`` local experts; after a layer's prefix ``decoder.layers.{i}.`` or
``mtp.layers.{k}.transformer_layer.``; ``h`` the hidden size, ``F`` the rank's rows of an expert's ``linear_fc1``:
``moe_ffn_hidden_size / tp``, twice that for a gated MLP, whose rows are ``[gate_r; up_r]``; ``F'`` its columns of
``linear_fc2``, ``moe_ffn_hidden_size / tp``), as the three modules of Megatron Core 0.16.1 name them:

- ``SequentialMLP`` (the local spec, or Transformer Engine's without grouped GEMM):
  ``mlp.experts.local_experts.{e}.linear_fc1.weight`` ``[F, h]`` and ``.bias`` ``[F]``,
  ``mlp.experts.local_experts.{e}.linear_fc2.weight`` ``[h, F']`` and ``.bias`` ``[h]``;
- ``TEGroupedMLP`` (Transformer Engine's spec with ``--moe-grouped-gemm``, as Megatron-LM's MoE examples train):
  ``mlp.experts.linear_fc1.weight{e}`` / ``.bias{e}`` and ``mlp.experts.linear_fc2.weight{e}`` / ``.bias{e}``, the
  same tensors (Transformer Engine's ``GroupedLinear`` keeps one weight per GEMM), and one ``_extra_state`` per
  module;
- ``GroupedMLP`` (the legacy grouped GEMM: the local spec with ``--moe-grouped-gemm``, or
  ``--moe-use-legacy-grouped-gemm``; no biases): ``mlp.experts.weight1`` ``[h, E * F]`` and ``mlp.experts.weight2``
  ``[E * F', h]``, which its forward reads as ``weight1.view(E, h, F)`` and ``weight2.view(E, F', h)``: expert
  ``e``'s ``linear_fc1.weight`` is ``weight1.view(E, h, F)[e].T`` and its ``linear_fc2.weight``
  ``weight2.view(E, F', h)[e].T`` (its ``sharded_state_dict`` maps them so).

In torch_dist all three save SequentialMLP's sharded keys (``...mlp.experts.experts.linear_fc1.weight`` stacked over
the global experts; ``TEGroupedMLP.sharded_state_dict`` is "interchangeable with SequentialMLP's"): nothing here is
needed for that format but the ``args``.

Transformer Engine's spec fuses norms into the linear after them: a standard attention's ``input_layernorm`` is
``self_attention.linear_qkv.layer_norm_weight`` / ``_bias``, a dense layer's ``pre_mlp_layernorm`` is
``mlp.linear_fc1.layer_norm_*`` (a MoE layer keeps its ``pre_mlp_layernorm``), multi-latent attention's latent
norms are ``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight`` (its
``input_layernorm`` kept), and each Transformer Engine module has an ``_extra_state`` (FP8 metadata; None is
what it reads as "none").

Expert parallelism ``ep`` > 1: Megatron-LM's ``get_checkpoint_name`` adds the expert rank to each rank folder,
``mp_rank_{tp:02d}_{ep:03d}`` (pipeline size 1) or ``mp_rank_{tp:02d}_{pp:03d}_{ep:03d}``; each file holds its
(tp, pp) rank's whole non-expert part and its ``E / ep`` experts numbered from 0: global expert
``ep_rank * E / ep + local``. The experts are cut over the expert tensor-parallel size, which must be the
tensor-parallel size here (Megatron-LM's default).

Two expert-parallel rank files with the same experts and RNG state are a copy of one under another's name, refused
(``check_copies``; ``megatron_legacy.rank_files`` refuses two names of one file).

The optimizer states of such files are not converted (their parameter order is Transformer Engine's, or the
chain of a dense and an expert optimizer): refused in one line, the weights converted with ``--no-optim``.
"""

from __future__ import annotations

import argparse
import re

import numpy as np
import torch

from megatron.checkpoint.format import CheckpointError

_PREFIX = r"(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\."
_IN_LAYER = re.compile(rf"^({_PREFIX})(.+)$")
_SEQUENTIAL = re.compile(rf"^({_PREFIX}mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_LOCAL_EXPERT = re.compile(rf"^({_PREFIX}mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_TE_GROUPED = re.compile(rf"^({_PREFIX}mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
_GROUPED = re.compile(rf"^({_PREFIX}mlp\.experts\.)weight([12])$")
_EXTRA = "._extra_state"
# (Megatron Core's local name, Transformer Engine's fused one) after a layer's prefix
_TE_NORMS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
             ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
             ("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_"),
             ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_"))
# Transformer Engine's modules with an _extra_state: its linears (by their weight) and the attention's core
_TE_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
               "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "eh_proj")
LOCAL, TRANSFORMER_ENGINE = "local", "transformer_engine"
NO_OPTIM_EXPORT = "export the weights with --no-optim and load them in Megatron-LM with --no-load-optim"


def expert_ranks(args: argparse.Namespace, where: str) -> tuple[int, int]:
    """(ep, each expert-parallel rank's number of experts) of a legacy checkpoint's ``args``; CheckpointError for an
    expert layout these files cannot be read in (expert tensor parallelism other than tp, experts not divided)."""
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    experts = int(getattr(args, "num_experts", 0) or 0)
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if experts and etp is not None and int(etp) != tp:
        raise CheckpointError(f"{where} was saved with expert tensor parallelism {etp} under tensor parallelism "
                              f"{tp}, whose rank files this tool does not read (it reads experts cut as the rest, "
                              f"--expert-tensor-parallel-size equal to --tensor-model-parallel-size); save it in "
                              f"the torch_dist format (--ckpt-format torch_dist), which does not depend on the "
                              f"layout.")
    if ep > 1 and (not experts or experts % ep):
        raise CheckpointError(f"{where}: the args say expert parallelism {ep} but {experts or 'no'} experts; the "
                              f"checkpoint's args do not match its files.")
    return ep, experts // ep if experts else 0


def _ffn(args) -> int:
    """An expert's ``linear_fc1`` rows (0: the args do not say)."""
    f = int(getattr(args, "moe_ffn_hidden_size", None) or getattr(args, "ffn_hidden_size", None) or 0)
    return 2 * f if (getattr(args, "swiglu", False) or getattr(args, "quick_geglu", False)) else f


def local_names(model: dict, args: argparse.Namespace, local_experts: int, where: str) -> tuple[dict, bool]:
    """One legacy rank's state dict under Megatron Core's local-spec names (SequentialMLP's experts numbered
    ``0 .. local_experts - 1``, the norms unfused, no ``_extra_state``), and whether any name was Transformer
    Engine's or a grouped GEMM's."""
    out, grouped, renamed = {}, {}, False
    for name, t in model.items():
        if name.endswith(_EXTRA):
            continue
        found = _TE_GROUPED.match(name)
        if found:
            out[f"{found[1]}local_experts.{found[4]}.{found[2]}.{found[3]}"], renamed = t, True
            continue
        found = _GROUPED.match(name)
        if found:
            grouped.setdefault(found[1], {})[found[2]] = t
            continue
        layer = _IN_LAYER.match(name)
        rest = layer[2] if layer else ""
        for ours, te in _TE_NORMS:
            if rest.startswith(te):
                name, renamed = layer[1] + ours + rest[len(te):], True
                break
        out[name] = t
    for prefix, weights in grouped.items():
        out.update(_ungroup(prefix, weights, args, local_experts, where))
        renamed = True
    _check_expert_rows(out, args, where)
    return out, renamed


def _ungroup(prefix: str, weights: dict, args, local_experts: int, where: str) -> dict:
    """SequentialMLP's tensors of a GroupedMLP's ``weight1`` / ``weight2`` (see the module's docstring)."""
    h = int(args.hidden_size)
    if set(weights) != {"1", "2"}:
        raise CheckpointError(f"{where} holds {prefix}weight{min(weights)} without weight{3 - int(min(weights))} "
                              f"(a grouped GEMM's experts have both).")
    w1, w2 = weights["1"], weights["2"]
    if (w1.dim() != 2 or w2.dim() != 2 or w1.shape[0] != h or w2.shape[1] != h or not local_experts
            or w1.shape[1] % local_experts or w2.shape[0] % local_experts):
        raise CheckpointError(f"{where}: {prefix}weight1 {list(w1.shape)} and weight2 {list(w2.shape)} are not "
                              f"{local_experts or 'the args'}' experts of hidden size {h} (GroupedMLP's [h, E*F] "
                              f"and [E*F', h]); the checkpoint does not match its args.")
    fc1 = w1.contiguous().view(local_experts, h, -1)  # GroupedMLP.forward's views
    fc2 = w2.contiguous().view(local_experts, -1, h)
    out = {}
    for e in range(local_experts):
        out[f"{prefix}local_experts.{e}.linear_fc1.weight"] = fc1[e].t().contiguous()
        out[f"{prefix}local_experts.{e}.linear_fc2.weight"] = fc2[e].t().contiguous()
    return out


def _check_expert_rows(model: dict, args, where: str) -> None:
    """Each expert's ``linear_fc1`` holds ``moe_ffn_hidden_size`` (x2 gated) / tp rows: the experts were cut over
    the tensor-parallel size the args say."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    want = _ffn(args)
    for name, t in model.items():
        found = _SEQUENTIAL.match(name)
        if found and found[3] == "linear_fc1" and found[4] == "weight" and want and t.shape[0] * tp != want:
            raise CheckpointError(f"{where}: {name} has {t.shape[0]} rows, not the {want // tp} of {want} cut over "
                                  f"tensor parallelism {tp}: its experts were cut over another expert tensor-parallel "
                                  f"size than the args say; the checkpoint does not match its args.")


def merge_ep(models: list[dict], local_experts: int, where: list[str]) -> dict:
    """One (tp, pp) rank's state dict with global expert numbers, of its ``ep`` files' (local names, in expert-rank
    order): the experts of file ``r`` renumbered ``r * local_experts + e``, the rest taken once (every file holds
    it, the same)."""
    whole, first = {}, models[0]
    for r, model in enumerate(models):
        held: dict[str, set[int]] = {}
        for found in filter(None, map(_LOCAL_EXPERT.match, model)):
            held.setdefault(found[1], set()).add(int(found[2]))
        for layer, experts in held.items():
            if experts != set(range(local_experts)):
                raise CheckpointError(f"{where[r]} holds experts {sorted(experts)} of {layer[:-len('local_experts.')]}"
                                      f", but the args give each expert-parallel rank {local_experts}; the checkpoint "
                                      f"does not match its args.")
        rest = {n for n in model if not _LOCAL_EXPERT.match(n)}
        if rest != {n for n in first if not _LOCAL_EXPERT.match(n)}:
            other = sorted(rest ^ {n for n in first if not _LOCAL_EXPERT.match(n)})[0]
            raise CheckpointError(f"{where[r]} and {where[0]} do not hold the same non-expert tensors ({other}): not "
                                  f"the expert-parallel ranks of one checkpoint.")
        for name, t in model.items():
            found = _LOCAL_EXPERT.match(name)
            if found:
                whole[f"{found[1]}{r * local_experts + int(found[2])}{found[3]}"] = t
            elif r == 0:
                whole[name] = t
            elif (not name.endswith(".local_tokens_per_expert") and isinstance(t, torch.Tensor)
                  and not (isinstance(first[name], torch.Tensor) and torch.equal(t, first[name]))):
                raise CheckpointError(f"{where[r]} and {where[0]} hold different {name}: not the expert-parallel ranks "
                                      f"of one checkpoint.")
    return whole


def check_copies(models: list[dict], rngs: list, where: list[str]) -> None:
    """CheckpointError when two expert-parallel rank files of one (tp, pp) rank (``models``: their state dicts under
    local names, in expert-rank order; ``rngs``: their saved ``rng_state``; ``where``: their paths) hold the same
    experts and the same RNG state (or none): one rank's file copied under another's name, whose experts would be
    converted as other experts' (Megatron-LM initialises each expert-parallel rank's experts from its own RNG stream,
    which each file saves). Each file's experts are fingerprinted by a sample of its first expert tensor; only files
    whose samples agree are compared whole, so distinct ranks cost one sample each."""
    by_sample: dict[tuple, list[int]] = {}
    for r, model in enumerate(models):
        experts = sorted(name for name, t in model.items() if _LOCAL_EXPERT.match(name) and isinstance(t, torch.Tensor))
        if not experts:
            continue
        first = model[experts[0]]
        flat = first.reshape(-1)
        key = (experts[0], first.dtype, tuple(first.shape), _raw(flat[::max(1, flat.numel() // 256)][:256]))
        for other in by_sample.get(key, []):
            if _same_experts(models[other], model) and _same(rngs[other], rngs[r]):
                raise CheckpointError(f"{where[r]} holds the same experts (and RNG state) as {where[other]}: a copy of "
                                      f"one expert-parallel rank's file under another's name, whose experts would be "
                                      f"converted as other experts' copies; the rank files are damaged (copy the "
                                      f"checkpoint as Megatron-LM saved it).")
        by_sample.setdefault(key, []).append(r)


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes (NaN equals NaN here, as it does not in ``torch.equal``)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same_experts(a: dict, b: dict) -> bool:
    names = {n for n, t in a.items() if _LOCAL_EXPERT.match(n) and isinstance(t, torch.Tensor)}
    if names != {n for n, t in b.items() if _LOCAL_EXPERT.match(n) and isinstance(t, torch.Tensor)}:
        return False
    return all(a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and _raw(a[n]) == _raw(b[n]) for n in names)


def _same(a, b) -> bool:
    """Whether two saved values (an RNG state: dicts, lists, tuples, tensors, numpy arrays, numbers) are equal, by
    their bytes; iterative, so a deeply nested crafted value cannot overflow the stack."""
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or _raw(x) != _raw(y):
                return False
        elif isinstance(x, np.ndarray):
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return False
        elif isinstance(x, dict):
            if list(x) != list(y):
                return False
            pending.extend((x[k], y[k]) for k in x)
        elif isinstance(x, (list, tuple)):
            if len(x) != len(y):
                return False
            pending.extend(zip(x, y))
        elif not (x is y or x == y):
            return False
    return True


# ---- writing ----------------------------------------------------------------------------------------------------


def export_layout(args: argparse.Namespace, *, ep: int, grouped: bool, impl: str | None, legacy_grouped: bool,
                  fmt: str, optimizer: bool) -> None:
    """Set an export's ``args`` for ``ep`` expert-parallel ranks, grouped-GEMM experts (``grouped``; the legacy
    GroupedMLP with ``legacy_grouped`` or the local ``impl``) and Transformer Engine's or the local spec (``impl``;
    None: Transformer Engine's with ``grouped``, else local); CheckpointError for what Megatron cannot build that
    way or what is not written with the optimizer states."""
    experts = int(getattr(args, "num_experts", 0) or 0)
    grouped = grouped or legacy_grouped
    impl = impl or (TRANSFORMER_ENGINE if grouped else LOCAL)
    if ep < 1:
        raise CheckpointError(f"--expert-model-parallel-size must be at least 1, got {ep}.")
    if (ep > 1 or grouped or legacy_grouped) and not experts:
        raise CheckpointError("--expert-model-parallel-size, --moe-grouped-gemm and --moe-use-legacy-grouped-gemm "
                              "need a mixture of experts; the checkpoint's model has none.")
    if experts % ep:
        raise CheckpointError(f"--expert-model-parallel-size {ep} does not divide the {experts} experts; choose one "
                              f"that does.")
    legacy_grouped = grouped and (legacy_grouped or impl == LOCAL)
    if legacy_grouped and args.add_bias_linear:
        raise CheckpointError("Megatron Core's legacy GroupedMLP (--moe-grouped-gemm with the local spec, or "
                              "--moe-use-legacy-grouped-gemm) has no biases, and this model's experts have them; "
                              "export with --transformer-impl transformer_engine (TEGroupedMLP).")
    files_differ = fmt == "legacy" and (ep > 1 or grouped or impl == TRANSFORMER_ENGINE)
    if optimizer and (ep > 1 or files_differ):
        raise CheckpointError(f"the AdamW states are written only for expert parallelism 1 and, in the legacy format, "
                              f"Megatron Core's local names without grouped GEMM; {NO_OPTIM_EXPORT}.")
    args.expert_model_parallel_size = ep
    args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    args.moe_grouped_gemm, args.moe_use_legacy_grouped_gemm = grouped, legacy_grouped
    args.transformer_impl = impl


def files_differ(args: argparse.Namespace) -> bool:
    """Whether a legacy export with these ``args`` has rank files other than Megatron Core's local names with
    expert parallelism 1 (``expert_shards`` writes them)."""
    return (int(getattr(args, "expert_model_parallel_size", 1) or 1) > 1 or bool(getattr(args, "moe_grouped_gemm",
            False)) or getattr(args, "transformer_impl", LOCAL) == TRANSFORMER_ENGINE)


def megatron_flags(args: argparse.Namespace) -> str:
    """The Megatron-LM flags a run loading the export needs besides ``--use-checkpoint-args`` (which reads neither
    the spec nor, without ``--use-mp-args-from-checkpoint-args``, the expert parallelism)."""
    flags = []
    if getattr(args, "transformer_impl", LOCAL) == TRANSFORMER_ENGINE:
        flags.append("--transformer-impl transformer_engine")
    else:
        flags.append("--transformer-impl local")
    if getattr(args, "moe_grouped_gemm", False):
        flags.append("--moe-grouped-gemm")
        if getattr(args, "moe_use_legacy_grouped_gemm", False) and args.transformer_impl == TRANSFORMER_ENGINE:
            flags.append("--moe-use-legacy-grouped-gemm")
    if int(getattr(args, "expert_model_parallel_size", 1) or 1) > 1:
        flags.append(f"--expert-model-parallel-size {args.expert_model_parallel_size}")
    return " ".join(flags)


def expert_shards(shards: dict[tuple[int, int], dict], args: argparse.Namespace) -> dict[tuple[int, int, int], dict]:
    """The legacy rank files' state dicts, {(tp rank, pp stage, ep rank): state dict}, of each (tp, pp) rank's local
    names with global expert numbers: the experts cut over the args' expert parallelism and renumbered, named as
    the args' spec and experts (see the module's docstring)."""
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    per = int(args.num_experts) // ep if getattr(args, "num_experts", None) else 0
    te = getattr(args, "transformer_impl", LOCAL) == TRANSFORMER_ENGINE
    style = ("legacy" if args.moe_use_legacy_grouped_gemm else "te") if getattr(args, "moe_grouped_gemm", False) \
        else None
    out = {}
    for (t, p), model in shards.items():
        for r in range(ep):
            mine = {}
            for name, tensor in model.items():
                found = _LOCAL_EXPERT.match(name)
                if found and int(found[2]) // per != r:
                    continue
                mine[f"{found[1]}{int(found[2]) % per}{found[3]}" if found else name] = tensor
            if style:
                mine = _group(mine, style, te)
            out[(t, p, r)] = _te_names(mine) if te else mine
    return out


def _group(model: dict, style: str, te: bool) -> dict:
    """SequentialMLP's expert names -> TEGroupedMLP's (``te``) or GroupedMLP's ``weight1`` / ``weight2``
    (``legacy``), each layer's experts where its first one was."""
    experts: dict[str, dict] = {}
    for name, t in model.items():
        found = _SEQUENTIAL.match(name)
        if found:
            experts.setdefault(found[1], {})[(int(found[2]), found[3], found[4])] = t
    out = {}
    for name, t in model.items():
        found = _SEQUENTIAL.match(name)
        if not found:
            out[name] = t
        elif found[1] in experts:  # the layer's first expert tensor: all of them, grouped
            out.update(_grouped(found[1], experts.pop(found[1]), style, te))
    return out


def _grouped(prefix: str, tensors: dict, style: str, te: bool) -> dict:
    count = 1 + max(e for e, _, _ in tensors)
    if style == "legacy":  # GroupedMLP.forward: weight1.view(E, h, F)[e] is fc1[e].T, weight2.view(E, F', h)[e] fc2's
        fc1 = torch.stack([tensors[(e, "linear_fc1", "weight")].t() for e in range(count)])
        return {f"{prefix}weight1": fc1.reshape(fc1.shape[1], -1),
                f"{prefix}weight2": torch.cat([tensors[(e, "linear_fc2", "weight")].t() for e in range(count)])}
    out = {}
    for module in ("linear_fc1", "linear_fc2"):
        for param in ("weight", "bias"):
            out.update({f"{prefix}{module}.{param}{e}": tensors[(e, module, param)].clone() for e in range(count)
                        if (e, module, param) in tensors})
        if te:
            out[f"{prefix}{module}{_EXTRA}"] = None
    return out


def _te_names(model: dict) -> dict:
    """Megatron Core's local names -> Transformer Engine's spec's: the fused norms (per layer: standard attention's
    input norm, a dense layer's MLP norm, multi-latent attention's latent norms), an ``_extra_state`` (None) for
    each of its linears and attention cores."""
    moe = {m[1] for m in map(_IN_LAYER.match, model) if m and m[2] == "mlp.router.weight"}
    mla = {m[1] for m in map(_IN_LAYER.match, model) if m and m[2] == "self_attention.linear_kv_down_proj.weight"}
    out = {}
    for name, t in model.items():
        layer = _IN_LAYER.match(name)
        if layer:
            prefix, rest = layer[1], layer[2]
            fused = {"input_layernorm.": prefix not in mla, "pre_mlp_layernorm.": prefix not in moe,
                     "self_attention.q_layernorm.": prefix in mla, "self_attention.kv_layernorm.": prefix in mla}
            for ours, te in _TE_NORMS:
                if rest.startswith(ours) and fused[ours]:
                    name = prefix + te + rest[len(ours):]
                    break
            if rest == "self_attention.linear_proj.weight":
                out[f"{prefix}self_attention.core_attention{_EXTRA}"] = None
        out[name] = t
        module = name[:-len(".weight")] if name.endswith(".weight") else ""
        if module.endswith(_TE_LINEARS) and not module.startswith("output_layer"):
            out[module + _EXTRA] = None
    return out
