"""Megatron-LM's optimizer states (Adam's moments, the fp32 master weights, the step) <-> Megatron Core names.

Megatron Core's optimizer (``megatron.core.optimizer``, not the distributed one) is ``torch.optim.AdamW`` (or
Apex's / Transformer Engine's FusedAdam, the same state) over the parameter groups of ``_get_param_groups``:

- one optimizer (a chain of one, which saves that one's dict): a second one, for the experts, exists only with
  expert parallelism (their ``allreduce`` is False only when ``expert_model_parallel_size > 1``, which is not
  converted), so with expert parallelism 1 the experts are in the same groups as the rest;
- the weight-decayed parameters (``ndim >= 2`` and not a bias) first, then the others (``wd_mult`` 0), each group
  in the model's ``named_parameters`` order (its state dict's order);
- torch's state dict numbers the parameters 0, 1, ... over the groups in that order: ``state[i]`` holds
  ``step``, ``exp_avg`` and ``exp_avg_sq`` of the i-th.

Legacy files (``--ckpt-format torch``) save ``optimizer.state_dict()`` per rank, for that rank's parameters:
the fp32 optimizer's ``{"state", "param_groups"}``; the fp16/bf16 one's ``{"optimizer": that, "grad_scaler",
"fp32_from_fp16_params": [[master per parameter] per group]}``. With ``--use-distributed-optimizer`` the states
are in ``distrib_optim.pt`` files, flattened by gradient bucket (``megatron_distrib_optim``;
``DistributedOptimizerStates`` when they are missing). ``torch_dist`` saves them by name, layout-free:
``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<the parameter's sharded key>``, the step as
``optimizer.state.common_step`` and the groups' settings in ``common.pt``.

Reading checks the order against the saved groups (their sizes, every state's shape) and refuses in one line
when it does not match rather than guess; each state is checked as it is read (``foreign_numbers``: a
floating-point tensor, finite, the second moment never negative).
"""

from __future__ import annotations

import re

import torch

from megatron.checkpoint.foreign_numbers import check_state, step_problem
from megatron.checkpoint.format import CheckpointError

ADAM_KINDS = ("exp_avg", "exp_avg_sq")
MASTER = "fp32_param"  # Megatron's name for the fp32 master weight (torch_dist's key)
_NOT_PARAMETERS = ("._extra_state", ".router.expert_bias", ".router.local_tokens_per_expert")
NO_OPTIM = ("or convert the weights only with --no-optim (the run continues with a fresh AdamW, as Megatron's "
            "--no-load-optim)")
DAMAGED = f"the optimizer states are damaged: convert an earlier checkpoint, {NO_OPTIM}"  # foreign_numbers' refusals


class OptimizerStates(dict):
    """{kind: {Megatron Core name: tensor}} for kind in ``exp_avg``, ``exp_avg_sq`` and, when saved, ``fp32_param``;
    ``step``: Adam's step; ``masters``: whether the fp32 masters were saved (and give the weights)."""

    def __init__(self, step: float):
        super().__init__({kind: {} for kind in (*ADAM_KINDS, MASTER)})
        self.step, self.masters = step, False


def parameters(model: dict) -> list[str]:
    """The parameters of one rank's Megatron Core state dict, in its order (no ``_extra_state``, no buffers)."""
    return [n for n, v in model.items() if isinstance(v, torch.Tensor) and not n.endswith(_NOT_PARAMETERS)]


def decays(name: str, shape) -> bool:
    """Megatron's default: weight decay on matrices, not on biases and 1-D parameters (norms)."""
    return len(shape) > 1 and not name.endswith(".bias")


def groups(names: list[str], shapes: dict) -> list[list[list[str]]]:
    """Megatron Core's optimizers (one, with expert parallelism 1) -> their groups (decayed, not) -> names."""
    return [[[n for n in names if decays(n, shapes[n])], [n for n in names if not decays(n, shapes[n])]]]


# Megatron Core's module order inside a layer (its named_parameters): its attention registers linear_proj first;
# multi-latent attention then its projections, then its norms
_IN_LAYER = ("input_layernorm.", "self_attention.core_attention.", "self_attention.linear_proj.",
             "self_attention.linear_qkv.",
             *(f"self_attention.{m}." for m in ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                                                "linear_kv_down_proj", "linear_kv_up_proj")),
             "self_attention.q_layernorm.", "self_attention.k_layernorm.", "self_attention.kv_layernorm.",
             "pre_mlp_layernorm.", "mlp.router.", "mlp.experts.", "mlp.shared_experts.", "mlp.linear_fc1.",
             "mlp.linear_fc2.")
# GPTModel's modules: embedding, decoder, mtp (multi-token prediction), output_layer
_OUTSIDE = ("embedding.word_embeddings.", "embedding.position_embeddings.", "decoder.layers.",
            "decoder.final_layernorm.", "mtp.layers.", "output_layer.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(enorm|hnorm|eh_proj|transformer_layer|final_layernorm)\.(.+)$")
_MTP_ORDER = ("enorm", "hnorm", "eh_proj", "transformer_layer", "final_layernorm")  # MultiTokenPredictionLayer's
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.")


def _in_layer(rest: str) -> tuple:
    """The order key of a name inside a decoder layer (after ``decoder.layers.{i}.``)."""
    where = next(i for i, p in enumerate(_IN_LAYER) if rest.startswith(p))
    expert = _EXPERT.match(rest)
    inner = (int(expert[1]), expert[2] == "linear_fc2") if expert else (0, "linear_fc2" in rest)
    return (where, *inner, rest.endswith(".bias"))


def core_order(names) -> list[str]:
    """``names`` (one rank's Megatron Core parameters) in Megatron Core's ``named_parameters`` order."""
    def key(name: str):
        found, mtp = _LAYER.match(name), _MTP.match(name)
        if found:
            return (2, int(found[1]), 0, _in_layer(found[2]))
        if mtp:
            inner = _in_layer(mtp[3]) if mtp[2] == "transformer_layer" else (0, 0, 0, name.endswith(".bias"))
            return (4, int(mtp[1]), _MTP_ORDER.index(mtp[2]), inner)
        return (next(i for i, p in enumerate(_OUTSIDE) if name.startswith(p)), 0, 0, (0, 0, 0, name.endswith(".bias")))
    return sorted(names, key=key)


def _unwrap(saved, where: str) -> tuple[dict, list | None]:
    """(torch's optimizer state dict, the fp32 masters per group or None) of one saved optimizer dict."""
    if isinstance(saved, dict) and isinstance(saved.get("optimizer"), dict) and "fp32_from_fp16_params" in saved:
        return saved["optimizer"], saved["fp32_from_fp16_params"]  # Float16OptimizerWithFloat16Params
    if isinstance(saved, dict) and isinstance(saved.get("state"), dict) and isinstance(saved.get("param_groups"), list):
        return saved, None  # FP32Optimizer
    if isinstance(saved, dict) and isinstance(saved.get("optimizer"), dict):
        raise DistributedOptimizerStates(where)  # the distributed optimizer: param_groups here, states elsewhere
    raise CheckpointError(f"{where}: the 'optimizer' entry is not a Megatron Core optimizer's state dict "
                          f"(no 'state' and 'param_groups'); {NO_OPTIM}.")


class DistributedOptimizerStates(CheckpointError):
    def __init__(self, where: str):
        super().__init__(f"{where} was saved with --use-distributed-optimizer, but its Adam states "
                         f"(distrib_optim.pt beside the rank file, megatron_distrib_optim) are missing; copy them "
                         f"there, {NO_OPTIM}.")


def read_rank(entry, model: dict, where: str) -> OptimizerStates | None:
    """One legacy rank file's optimizer states under its model's (local) names; None when it never stepped."""
    names = parameters(model)
    shapes = {n: tuple(model[n].shape) for n in names}
    expected = groups(names, shapes)
    saved = entry if isinstance(entry, list) else [entry]
    if len(saved) != len(expected):
        raise CheckpointError(f"{where} holds a chain of {len(saved)} optimizers (expert parallelism?), but Megatron "
                              f"Core builds {len(expected)} for this model; {NO_OPTIM}.")
    unwrapped = [_unwrap(s, where) for s in saved]
    if not any(torch_sd["state"] for torch_sd, _ in unwrapped):
        return None
    steps, out = set(), OptimizerStates(0.0)
    for (torch_sd, masters), want in zip(unwrapped, expected):
        got = [(g, list(group.get("params", []))) for g, group in enumerate(torch_sd["param_groups"])]
        sizes = [len(ids) for _, ids in got if ids]
        if sizes != [len(names) for names in want if names]:
            raise CheckpointError(f"{where}: the optimizer's parameter groups hold {sizes} parameters, but Megatron "
                                  f"Core's order for this model gives {[len(n) for n in want if n]} (decayed, then "
                                  f"not, per optimizer); the states cannot be matched to the weights: {NO_OPTIM}.")
        lengths = [len(m) if isinstance(m, list) else -1 for m in masters] if isinstance(masters, list) else None
        if masters is not None and lengths != [len(ids) for _, ids in got]:
            raise CheckpointError(f"{where}: the fp32 masters (fp32_from_fp16_params) do not match the optimizer's "
                                  f"parameter groups; {NO_OPTIM}.")
        for (g, ids), names_ in zip([x for x in got if x[1]], [n for n in want if n]):
            for j, (i, name) in enumerate(zip(ids, names_)):
                state = torch_sd["state"].get(i, torch_sd["state"].get(str(i)))
                if not isinstance(state, dict) or any(not isinstance(state.get(k), torch.Tensor) for k in ADAM_KINDS):
                    raise CheckpointError(f"{where}: the optimizer has no Adam state for parameter {i} ({name}); "
                                          f"{NO_OPTIM}.")
                for kind in ADAM_KINDS:
                    if tuple(state[kind].shape) != shapes[name]:
                        raise CheckpointError(f"{where}: the optimizer's {kind} of parameter {i} has shape "
                                              f"{list(state[kind].shape)}, but Megatron Core's order puts {name} "
                                              f"{list(shapes[name])} there; {NO_OPTIM}.")
                    out[kind][name] = check_state(kind, name, state[kind], where, DAMAGED).float()
                if "step" in state:
                    steps.add(_adam_step(state["step"], where))
                if masters is not None:
                    master = check_state(MASTER, name, masters[g][j], where, DAMAGED)
                    if tuple(master.shape) != shapes[name]:
                        raise CheckpointError(f"{where}: the fp32 master of parameter {i} has shape "
                                              f"{list(master.shape)}, not {name}'s {list(shapes[name])}; {NO_OPTIM}.")
                    out[MASTER][name] = master.float()
        common = torch_sd["state"].get("common_step")
        if common is not None:
            steps.add(_adam_step(common, where))
        steps.update(_adam_step(g["step"], where) for g in torch_sd["param_groups"]
                     if g.get("params") and "step" in g)  # Apex/TE
    out.step = _one_step(steps, where)
    return out


def _adam_step(value, where: str) -> float:
    """A saved Adam step, checked (``foreign_numbers.step_problem``); CheckpointError in one line otherwise."""
    problem = step_problem(value)
    if problem is not None:
        raise CheckpointError(f"{where}: the optimizer's Adam step {problem}; {DAMAGED}.")
    return float(value)


def _one_step(steps: set, where: str) -> float:
    if len(steps) != 1:
        raise CheckpointError(f"{where}: the optimizer's Adam steps are {sorted(steps) or 'missing'}, not one "
                              f"common step; {NO_OPTIM}.")
    return steps.pop()


def common_step(optimizer_common, where: str) -> float:
    """Adam's step in ``common.pt``'s optimizer entry (torch_dist), wherever Megatron nests it: ``common_step``, or,
    without one (the distributed optimizer's, and Apex's / TE's FusedAdam's), the groups' ``step``."""
    found: dict[str, set] = {"common_step": set(), "step": set()}

    def visit(value):
        if isinstance(value, dict):
            for k, v in value.items():
                if k in found and isinstance(v, (int, float, torch.Tensor)):
                    found[k].add(_adam_step(v, where))
                else:
                    visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
    visit(optimizer_common)
    return _one_step(found["common_step"] or found["step"], where)


def param_group(decayed: bool, settings: dict) -> dict:
    """A parameter group as Megatron Core's AdamW saves it (``params`` added by the caller)."""
    return {"is_expert_parallel": False, "default_config": True, "wd_mult": 1.0 if decayed else 0.0, "lr_mult": 1.0,
            "is_decoupled_lr": False, "max_lr": settings["max_lr"], "min_lr": settings["min_lr"],
            "lr": settings["lr"], "betas": settings["betas"], "eps": settings["eps"],
            "weight_decay": settings["weight_decay"] * (1.0 if decayed else 0.0),  # the scheduler's x wd_mult
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": True}


def rank_optimizer(model: dict, states: dict[str, dict[str, torch.Tensor]], step: float, settings: dict,
                   present: list[list[bool]]) -> dict:
    """One legacy rank file's ``optimizer`` entry: the fp32 optimizer's state dict for the rank's ``model``;
    ``present``: ``structure``'s groups that exist on some rank (Megatron gathers them over every rank: one may be
    empty here)."""
    names = core_order(parameters(model))
    (want,) = groups(names, {n: tuple(model[n].shape) for n in names})
    state, param_groups, index = {}, [], 0
    for decayed, group_names, exists in zip((True, False), want, present[0]):
        if not exists:
            continue
        ids = []
        for name in group_names:
            state[index] = {"step": torch.tensor(float(step)), "exp_avg": states["exp_avg"][name].clone(),
                            "exp_avg_sq": states["exp_avg_sq"][name].clone()}
            ids.append(index)
            index += 1
        param_groups.append({**param_group(decayed, settings), "params": ids})
    return {"state": state, "param_groups": param_groups}


def structure(models: list[dict]) -> list[list[bool]]:
    """Per optimizer, whether its decayed / other group holds a parameter on any rank."""
    found = [False, False]
    for model in models:
        names = parameters(model)
        for g, group in enumerate(groups(names, {n: tuple(model[n].shape) for n in names})[0]):
            found[g] = found[g] or bool(group)
    return [found]
