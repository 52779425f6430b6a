"""The top-k router of a mixture-of-experts layer, its balancing losses and the expert capacity: Megatron-LM's
``TopKRouter`` and ``moe_utils`` (``topk_routing_with_score_function``, ``switch_load_balancing_loss_func``,
``sequence_load_balancing_loss_func``, ``z_loss_func``, ``get_capacity``, ``MoEAuxLossAutoScaler``).

Shapes: T tokens (the micro-batch's ``[s, b]`` positions flattened, sequence-major), E experts, k = topk.
The router's weight is ``[E, h]``, with a bias ``[E]`` when the model's linear layers have biases (Megatron Core's
rule: gpt-oss); its logits ``x W^T + b`` are computed in the router dtype (fp32 by default, whatever the model's).

Scores (``route``), the probabilities each token's chosen experts' outputs are weighted by:

- softmax (default): the top k logits, then a softmax over those k;
- softmax with ``pre_softmax``: a softmax over all E, then the top k (their probabilities not renormalised);
- sigmoid: ``sigmoid(logits)``, the top k (chosen by the scores plus the expert bias when it is enabled; the bias
  never enters the probabilities), normalised to sum to 1 over the k when k > 1; the scores always come before
  the top k, so ``pre_softmax`` changes nothing here (Megatron Core accepts the two together: DeepSeek-V3's
  configurations set both).

Group-limited routing (``moe_router_num_groups`` G, ``moe_router_group_topk`` g; DeepSeek-V2's device-limited and
DeepSeek-V3's node-limited routing): the E experts in G equal groups; each token picks its g best groups, a
group's score the sum of its top ``k // g`` selection scores (the logits, softmax or biased sigmoid scores the top k
is taken over), then its top k among those groups' experts only. ``moe_router_topk_scaling_factor`` multiplies the
chosen experts' probabilities (DeepSeek-V3's ``routed_scaling_factor``).

Balancing losses, their values before the coefficient (the coefficient multiplies them into the objective):

- ``aux_loss`` (Switch Transformer): ``E / (k T^2) sum_e P_e N_e``, P_e the sum over tokens of the full score
  distribution (softmax of the logits; sigmoid's normalised over E, whatever k), N_e the tokens whose top k of that
  distribution hold e: the tokens routed to e, except that the expert bias never counts (Megatron Core's
  ``compute_routing_scores_for_aux_loss``; the logged Switch loss of ``none`` counts the bias's choice);
- ``seq_aux_loss`` (DeepSeek-V2): the same per sequence, ``sum_e (N_e E / (k S)) mean_s(p_e)``, averaged over
  the micro-batch's sequences;
- z-loss (ST-MoE): ``mean(logsumexp(logits)^2)``.

Capacity (``moe_expert_capacity_factor`` f): each expert takes at most ``ceil(T k / E x f)`` tokens of the
micro-batch (Megatron-LM's ``get_capacity``); ``probs`` keeps those with the highest probabilities, ``position``
the first in the micro-batch's order. A dropped (token, expert) pair contributes nothing to the token's output
(its other experts keep their probabilities, unrenormalised), as in Megatron-LM.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig

ROUTER_DTYPES = {None: torch.float32, "fp32": torch.float32, "fp64": torch.float64}


class AuxLossScaler(torch.autograd.Function):
    """Megatron-LM's ``MoEAuxLossAutoScaler``: returns ``output`` unchanged; in the backward, gives ``aux_loss``
    the gradient ``scale`` (``set_aux_loss_scale``), so the auxiliary losses join the objective without joining
    the reported loss. The training step sets the scale to ``loss_scale / (micro-batches of the step over all
    data-parallel ranks)``: the objective is the language-model loss plus the coefficient times the mean of the
    auxiliary losses over the step's micro-batches (Megatron-LM's scale ``1 / num_microbatches``)."""

    scale = 1.0

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, AuxLossScaler.scale)


def set_aux_loss_scale(scale: float) -> None:
    """The gradient the auxiliary losses of the coming backwards get (see ``AuxLossScaler``)."""
    AuxLossScaler.scale = float(scale)


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron-LM's ``get_capacity``: ``ceil(num_tokens / num_experts x capacity_factor)``, ``num_tokens`` the
    (token, expert) assignments (T x k)."""
    return math.ceil(num_tokens / num_experts * capacity_factor)


def select_topk(scores: torch.Tensor, topk: int, num_groups: int | None = None,
                group_topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [T, k] of each token's top k ``scores`` [T, E]; with ``group_topk`` (group-limited
    routing, DeepSeek-V2/V3), only among the experts of the token's ``group_topk`` best groups of the ``num_groups``
    equal groups, a group's score the sum of its top ``topk // group_topk`` scores (Megatron Core's
    ``group_limited_topk``)."""
    if not group_topk:
        return torch.topk(scores, topk, dim=-1)
    tokens, experts = scores.shape
    group_scores = scores.view(tokens, num_groups, -1).topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen_groups = torch.topk(group_scores, group_topk, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, -1)
    return torch.topk(scores.masked_fill(~expert_mask, float("-inf")), topk, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
                 expert_bias: torch.Tensor | None = None, num_groups: int | None = None,
                 group_topk: int | None = None, scaling_factor: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities [T, E], 0 off the chosen experts; routing map [T, E] bool) of ``logits`` [T, E]; the choice
    group-limited with ``group_topk`` (``select_topk``), the probabilities multiplied by ``scaling_factor``."""
    if score_function == "softmax":
        if pre_softmax:
            probs, top = select_topk(torch.softmax(logits, dim=-1), topk, num_groups, group_topk)
        else:
            top_logits, top = select_topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(top_logits, dim=-1)
    elif score_function == "sigmoid":  # the scores always precede the top k (pre_softmax changes nothing)
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            _, top = select_topk(scores + expert_bias.to(scores.dtype), topk, num_groups, group_topk)
            probs = scores.gather(1, top)
        else:
            probs, top = select_topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown router score function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return torch.zeros_like(logits).scatter(1, top, probs), routing_map


def scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str) -> torch.Tensor:
    """The full score distribution [T, E] the balancing losses read: softmax of the logits, or the sigmoid scores
    normalised over the experts (whatever k), as Megatron Core's ``compute_routing_scores_for_aux_loss``."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def routing_map_for_aux_loss(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, E] bool: each token's top k of the balancing losses' scores (``scores_for_aux_loss``), the routing the
    auxiliary losses count: the router's choice without the expert bias (Megatron Core's
    ``compute_routing_scores_for_aux_loss``)."""
    return torch.zeros_like(scores, dtype=torch.bool).scatter(1, torch.topk(scores, topk, dim=-1).indices, True)


def _sum_over(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group`` (no gradient: counts), or ``x`` for None."""
    if group is None:
        return x
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def switch_load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int,
                               num_tokens: int | None = None) -> torch.Tensor:
    """``E / (k T^2) sum_e (sum_t probs[t, e]) tokens_per_expert[e]`` (coefficient 1); ``num_tokens`` T (default
    the rows of ``probs``). With the micro-batch's tokens spread over ranks, each passes its rows of ``probs``, the
    whole micro-batch's ``tokens_per_expert`` and T: the terms sum to the loss."""
    num_experts = probs.shape[1]
    num_tokens = probs.shape[0] if num_tokens is None else num_tokens
    return (probs.sum(dim=0) * tokens_per_expert).sum() * (num_experts / (topk * num_tokens * num_tokens))


def sequence_load_balancing_loss(probs: torch.Tensor, routing_map: torch.Tensor, batch_size: int,
                                 topk: int, group=None) -> torch.Tensor:
    """Megatron-LM's ``sequence_load_balancing_loss_func`` (coefficient 1); the tokens in ``[s, b]`` order. With the
    sequences spread over the ranks of ``group`` (tensor/context parallelism: each holds some positions of every
    sequence), each rank's term, the terms summing to the loss."""
    num_experts = probs.shape[1]
    seq_length = probs.shape[0] // batch_size * _group_size(group)
    probs = probs.view(-1, batch_size, num_experts)
    routing_map = routing_map.view(-1, batch_size, num_experts)
    counts = _sum_over(routing_map.sum(dim=0, dtype=probs.dtype), group)  # [b, E], the whole sequences
    cost = counts / (seq_length * topk / num_experts)
    return (cost * probs.sum(dim=0) / seq_length).sum(dim=1).mean()


def z_loss(logits: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """``mean(logsumexp(logits)^2)`` over the tokens (coefficient 1); ``num_tokens``: the micro-batch's, when its
    tokens are spread over ranks (this rank's term of the mean)."""
    num_tokens = logits.shape[0] if num_tokens is None else num_tokens
    return torch.square(torch.logsumexp(logits, dim=-1)).sum() / num_tokens


def apply_capacity(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int,
                   policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing map) with each expert's tokens beyond ``capacity`` dropped: those of the lowest
    probabilities (``probs``) or the last in order (``position``)."""
    if capacity >= routing_map.shape[0]:
        return probs, routing_map
    if policy == "probs":
        _, keep = torch.topk(probs, capacity, dim=0, sorted=False)
        within = torch.zeros_like(routing_map).scatter(0, keep, True)
    elif policy == "position":
        within = torch.cumsum(routing_map.int(), dim=0) <= capacity
    else:
        raise ValueError(f"unknown token drop policy {policy!r}")
    kept = routing_map & within
    return probs * kept, kept


class TopKRouter(nn.Module):
    """Chooses each token's k experts and their probabilities, and computes the balancing losses.

    ``forward(x [T, h], batch_size)`` returns (probs [T, E] in the router dtype, routing map [T, E] of the kept
    (token, expert) pairs, chosen [T, E]: the router's choice before the capacity, the auxiliary loss to add to the
    objective (coefficients applied; None when there is none), the balancing loss's value before its
    coefficient (the Switch loss for ``none`` and the expert bias, for the log))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.score_function, self.pre_softmax = cfg.moe_router_score_function, cfg.moe_router_pre_softmax
        self.num_groups, self.group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
        self.scaling_factor = cfg.moe_router_topk_scaling_factor
        self.dtype = ROUTER_DTYPES[cfg.moe_router_dtype]
        self.balancing, self.aux_coeff = cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff
        self.z_coeff = cfg.moe_z_loss_coeff
        self.capacity_factor, self.drop_policy = cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # a bias on the logits with the model's linear biases (Megatron Core's rule; gpt-oss's router has one)
        self.bias = None if cfg.disable_bias_linear else nn.Parameter(torch.empty(cfg.num_experts))
        if cfg.moe_router_enable_expert_bias:  # not trained: moved after each step by the step's loads (stats.py)
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32), persistent=False)
        else:
            self.expert_bias = None

    def extra_repr(self) -> str:
        groups = f", groups={self.group_topk}/{self.num_groups}" if self.group_topk else ""
        scaled = f", scaling={self.scaling_factor}" if self.scaling_factor else ""
        return (f"experts={self.num_experts}, topk={self.topk}, score={self.score_function}"
                f"{', pre_softmax' if self.pre_softmax else ''}{groups}{scaled}, balancing={self.balancing}")

    def _apply(self, fn, recurse=True):
        """The expert bias stays fp32 whatever dtype the model is cast to (its updates are ~1e-3)."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def forward(self, x: torch.Tensor, batch_size: int, token_group=None, with_losses: bool = True):
        """``token_group``: the ranks holding the rest of this micro-batch's tokens (their counts are summed
        for the balancing losses, each rank returning its term); ``with_losses`` False (evaluation): no
        auxiliary loss, the balancing value 0."""
        bias = None if self.bias is None else self.bias.to(self.dtype)
        logits = F.linear(x.to(self.dtype), self.weight.to(self.dtype), bias)  # [T, E]
        probs, chosen = topk_routing(logits, self.topk, self.score_function, self.pre_softmax, self.expert_bias,
                                     self.num_groups, self.group_topk, self.scaling_factor)
        kept = chosen
        if self.capacity_factor is not None:
            capacity = get_capacity(logits.shape[0] * self.topk, self.num_experts, self.capacity_factor)
            probs, kept = apply_capacity(probs, chosen, capacity, self.drop_policy)
        if not with_losses:
            return probs, kept, chosen, None, torch.zeros(())
        num_tokens = logits.shape[0] * _group_size(token_group)
        in_objective = self.balancing != "none" and self.aux_coeff > 0
        with torch.set_grad_enabled(torch.is_grad_enabled() and in_objective):
            scores = scores_for_aux_loss(logits, self.topk, self.score_function)
            # what the loss counts: the choice without the expert bias, as Megatron Core (only logged: the choice)
            counted = routing_map_for_aux_loss(scores, self.topk) if in_objective else chosen
            if self.balancing == "seq_aux_loss":
                balance = sequence_load_balancing_loss(scores, counted, batch_size, self.topk, token_group)
            else:
                counts = _sum_over(counted.sum(dim=0, dtype=scores.dtype), token_group)
                balance = switch_load_balancing_loss(scores, counts, self.topk, num_tokens)
        aux = None
        if in_objective:
            aux = self.aux_coeff * balance
        if self.z_coeff:
            z = self.z_coeff * z_loss(logits, num_tokens)
            aux = z if aux is None else aux + z
        return probs, kept, chosen, aux, balance.detach()
