"""What a training step does around its MoE layers: before it, the auxiliary losses' gradient scale and the
layers' records reset; after it, the records summed over the data-parallel (and context-parallel), tensor-parallel
and pipeline ranks (every rank routed its own tokens) into the log's two values, and the expert bias moved
(aux-loss-free balancing).

- ``load_balancing_loss``: each MoE layer's balancing loss before its coefficient, averaged over the step's
  micro-batches (of every data-parallel rank), then over the MoE layers (as Megatron-LM logs it);
- ``expert_load_max``: per MoE layer, the tokens the router chose for its most loaded expert over the mean per
  expert, over the whole step; the worst layer's (1.0: perfect balance, E / k: every token to the same k).

- ``tokens_per_expert``: per MoE layer (``layer_{i}``, global index), the tokens the router chose for each expert
  over the step (metrics.jsonl keeps the lists; TensorBoard and W&B plot one curve per layer and expert).

The expert bias (DeepSeek-V3) moves after each applied step by ``rate x sign(mean load - load_e)`` from the same
step-wide counts, equal on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.moe.layer import MoELayer
from megatron.moe.router import set_aux_loss_scale


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _model_config(model: nn.Module):
    return next((m.cfg for m in model.modules() if hasattr(m, "cfg") and hasattr(m.cfg, "num_experts")), None)


def _num_layers(cfg) -> int:
    """Layers with a global index: the decoder's, then the multi-token prediction modules' (``megatron.model.mtp``)."""
    return cfg.num_layers + (cfg.mtp_num_layers or 0)


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def before_step(model: nn.Module, micro_batches: int, dp_group, loss_scale: float) -> None:
    """Reset the MoE layers' records; the auxiliary losses' gradient: ``loss_scale`` over the global batch's
    micro-batches (this rank's times the ranks the batch is cut over, dp x sharding: the context-parallel ranks of a
    micro-batch each hold their part of its auxiliary losses), so the objective holds their mean."""
    layers = moe_layers(model)
    for layer in layers:
        layer.reset_stats()
    if layers:
        set_aux_loss_scale(loss_scale / (micro_batches * layers[0].batch_ranks))


def after_step(model: nn.Module, applied: bool, dp_group=None, pp_group=None) -> dict | None:
    """The step's ``load_balancing_loss`` and ``expert_load_max`` (None for a dense model), equal on every rank;
    the expert bias moved when the step was applied."""
    cfg = _model_config(model)
    if cfg is None or not cfg.num_experts:
        return None
    layers = moe_layers(model)
    device = next(model.parameters()).device
    # tokens..., loss sum, count: built on the device, where the layers recorded them, and read here once a step
    records = torch.zeros(_num_layers(cfg), cfg.num_experts + 2, dtype=torch.float64, device=device)
    for layer in layers:
        if layer.tokens_per_expert is not None:
            records[layer.layer_number, :-2] = layer.tokens_per_expert
            records[layer.layer_number, -2] = layer.balance_sum
        records[layer.layer_number, -1] = layer.micro_batches
    tp_group = layers[0].tp_group if layers else None  # (a stage without MoE layers: its tp ranks have none either)
    for group in (dp_group, pp_group, tp_group):  # each rank routed its own tokens
        if group is not None:
            dist.all_reduce(records, group=group)
    records = records.cpu()
    present = records[:, -1] > 0
    if not present.any():
        return None
    tokens, rows = records[present, :-2], records[present]
    loads = tokens.max(dim=1).values / tokens.mean(dim=1).clamp(min=1e-12)
    if applied:
        for layer in layers:
            bias = layer.router.expert_bias
            if bias is not None:
                counts = records[layer.layer_number, :-2]
                bias += cfg.moe_router_bias_update_rate * torch.sign(counts.mean() - counts).to(bias)
    return {"load_balancing_loss": float((rows[:, -2] / rows[:, -1]).mean()), "expert_load_max": float(loads.max()),
            "tokens_per_expert": {f"layer_{i}": records[i, :-2].tolist() for i in present.nonzero().flatten().tolist()}}


def expert_biases(model: nn.Module, pp_group=None) -> dict[str, list[float]] | None:
    """Every MoE layer's expert bias, {global layer index: values}, gathered over the pipeline stages (a
    collective over ``pp_group``: call it on every rank); None when the model has none. A checkpoint keeps it in
    its train state: it is no parameter."""
    cfg = _model_config(model)
    if cfg is None or not cfg.num_experts or not cfg.moe_router_enable_expert_bias:
        return None
    values = torch.zeros(_num_layers(cfg), cfg.num_experts + 1, dtype=torch.float64)  # the bias, whether present
    for layer in moe_layers(model):
        values[layer.layer_number, :-1] = layer.router.expert_bias.double().cpu()
        values[layer.layer_number, -1] = 1.0
    if pp_group is not None:
        values = values.to(next(model.parameters()).device)
        dist.all_reduce(values, group=pp_group)
        values = values.cpu()
    return {str(i): values[i, :-1].tolist() for i in range(_num_layers(cfg)) if values[i, -1] > 0}


@torch.no_grad()
def set_expert_biases(model: nn.Module, saved: dict[str, list[float]]) -> None:
    """The expert biases ``expert_biases`` returned, into this rank's MoE layers."""
    for layer in moe_layers(model):
        if layer.router.expert_bias is not None and str(layer.layer_number) in saved:
            layer.router.expert_bias.copy_(torch.tensor(saved[str(layer.layer_number)]))
