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
- ``global_aux_loss`` (global-batch balancing, arXiv 2501.11873): the Switch loss of the micro-batches of every
  data-parallel rank together (their T tokens), N_e those ranks' counts averaged over the step's micro-batches so
  far (Megatron Core's ``global_tokens_per_expert / ga_steps``); each rank's term is its tokens' share, the terms
  summing over the pipeline stage's ranks to the loss (its gradient is not divided by the data-parallel size:
  ``TopKRouter.global_term``);
- several of the three at once (Megatron Core's lists), each with its own coefficient;
- z-loss (ST-MoE): ``mean(logsumexp(logits)^2)``.

Sinkhorn routing (``sinkhorn``, S-BASE; no loss): in training each token's top k of Sinkhorn's balanced
assignment of the logits (``sinkhorn``: rows and columns of ``exp(logits)`` scaled until every expert's column
holds 1/E; over the micro-batch's tokens on every layout: the column sums are summed over ``token_group``); in
evaluation the top k of the scores; the probabilities the scores of the chosen experts, the softmax over all E (for
k = 1 the sigmoid), unrenormalised.

``moe_input_jitter_eps`` multiplies the router's input (in training) by noise uniform in ``[1 - eps, 1 + eps]``;
``moe_router_force_load_balancing`` replaces the logits by N(0, 1) draws whose gradient goes to the logits unchanged
(Megatron Core's ``RandomSTE``, for benchmarks). Both draw from the default generator, or from the tensor-parallel
stream where the router sees a share of the micro-batch's tokens (each share its own noise).

Capacity (``moe_expert_capacity_factor`` f): each expert takes at most ``ceil(T k / E x f)`` tokens of the
micro-batch (Megatron-LM's ``get_capacity``); ``probs`` keeps those with the highest probabilities, ``position``
the first in the micro-batch's order. A dropped (token, expert) pair contributes nothing to the token's output
(its other experts keep their probabilities, unrenormalised), as in Megatron-LM.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.config.validate_moe import balancing_coefficients
from megatron.tensor_parallel.random import get_rng_tracker

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


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4, group=None) -> torch.Tensor:
    """Sinkhorn's balanced assignment of ``cost`` [T, E] (Megatron-LM's ``sinkhorn``): ``K = exp(cost)`` scaled by
    rows ``d0`` [T] and columns ``d1`` [E], ``d0 = 1 / (T (K d1))``, ``d1 = 1 / (E (K^T d0))``, repeated until
    ``d1`` moves by less than ``tol`` (mean absolute change); returns ``d1 K d0``. ``group``: the ranks holding the
    rest of the micro-batch's tokens: ``K^T d0`` is summed over them and T counts them all, so each rank returns
    its rows of the one-process result (every rank runs the same number of rounds: ``d1`` is the same on all)."""
    cost = torch.exp(cost)
    num_tokens = cost.shape[0] * _group_size(group)
    d0 = torch.ones(cost.shape[0], device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.shape[1], device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / num_tokens) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.shape[0]) * 1 / (_sum_over(torch.sum(d0.unsqueeze(1) * cost, 0), group) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool,
                     group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities [T, E], 0 off the chosen experts; routing map [T, E]) of Sinkhorn routing (Megatron Core's
    ``sinkhorn_load_balancing``): the choice the top k of ``sinkhorn(logits)`` in training (no gradient), of the
    scores in evaluation; the probabilities the scores, ``softmax(logits)`` over all E (``sigmoid(logits)`` for
    k = 1), at the chosen experts."""
    scores = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    if training:
        with torch.no_grad():
            top = torch.topk(sinkhorn(logits.float(), group=group), topk, dim=1).indices
    else:
        top = torch.topk(scores, topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return scores * routing_map, routing_map


class RandomLogits(torch.autograd.Function):
    """Megatron Core's ``RandomSTE`` (``moe_router_force_load_balancing``): N(0, 1) values in place of the logits;
    their gradient is the logits' (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return logits.detach().clone().normal_()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output


class ScoresTimes(torch.autograd.Function):
    """``sum_{t,e} scores[t, e] weights[e]``, the weights kept on the node itself, not saved: a checkpointed
    layer's recompute runs the forward again (``weights`` then a running mean that moved on) and its backward reads
    the weights of the forward that built the node (the global aux loss's counts: ``TopKRouter.global_term``)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx.weights, ctx.shape = weights, scores.shape
        return (scores.sum(dim=0) * weights).sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return (grad_output * ctx.weights).expand(ctx.shape), None


def _in_backward() -> bool:
    """Whether this runs inside a backward pass (a checkpointed layer's recompute)."""
    return torch._C._current_graph_task_id() != -1


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
    coefficient (several: their sum; the Switch loss of the choice when none joins the objective, for the log)).

    ``global_groups`` (the tensor-parallel group whose ranks split the tokens, and the data-parallel one: together
    the pipeline stage's ranks) and ``batch_ranks`` (dp x sharding): where ``global_aux_loss`` sums its counts, set
    by ``moe.parallelize``; ``global_counts`` / ``global_steps``: the counts so far this step (``reset_global``)."""

    global_groups: tuple = ()
    batch_ranks = 1

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.score_function, self.pre_softmax = cfg.moe_router_score_function, cfg.moe_router_pre_softmax
        self.num_groups, self.group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
        self.scaling_factor = cfg.moe_router_topk_scaling_factor
        self.dtype = ROUTER_DTYPES[cfg.moe_router_dtype]
        self.balancing, self.coefficients = cfg.moe_router_load_balancing_type, balancing_coefficients(cfg)
        self.z_coeff = cfg.moe_z_loss_coeff
        self.jitter_eps, self.force_balance = cfg.moe_input_jitter_eps, cfg.moe_router_force_load_balancing
        self.reset_global()
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

    def reset_global(self) -> None:
        """Forget the step's counts of ``global_aux_loss`` (before each step, as Megatron Core's
        ``reset_global_aux_loss_tracker`` in ``finalize_model_grads``)."""
        self.global_counts: torch.Tensor | None = None
        self.global_steps = 0

    def _draws(self, token_group):
        """Where the jitter and random logits draw: the tensor-parallel stream when this rank routes a share of the
        micro-batch's tokens (each share its own draws), the default generator otherwise."""
        return get_rng_tracker().fork() if token_group is not None else contextlib.nullcontext()

    def logits(self, x: torch.Tensor, token_group=None) -> torch.Tensor:
        """[T, E] in the router dtype: ``x W^T + b`` of the (jittered) input, or random ones (forced balancing)."""
        if self.jitter_eps is not None and self.training:  # Megatron Core's Uniform(1 - eps, 1 + eps).rsample
            low, high = (torch.tensor(1.0 + s * self.jitter_eps, dtype=x.dtype, device=x.device) for s in (-1, 1))
            with self._draws(token_group):
                x = x * (low + torch.rand(x.shape, dtype=x.dtype, device=x.device) * (high - low))
        bias = None if self.bias is None else self.bias.to(self.dtype)
        logits = F.linear(x.to(self.dtype), self.weight.to(self.dtype), bias)
        if self.force_balance:
            with self._draws(token_group):
                logits = RandomLogits.apply(logits)
        return logits

    def forward(self, x: torch.Tensor, batch_size: int, token_group=None, with_losses: bool = True):
        """``token_group``: the ranks holding the rest of this micro-batch's tokens (their counts are summed
        for the balancing losses, each rank returning its term); ``with_losses`` False (evaluation): no
        auxiliary loss, the balancing value 0."""
        logits = self.logits(x, token_group)  # [T, E]
        if self.balancing == "sinkhorn":
            probs, chosen = sinkhorn_routing(logits, self.topk, self.training, token_group)
        else:
            probs, chosen = topk_routing(logits, self.topk, self.score_function, self.pre_softmax, self.expert_bias,
                                         self.num_groups, self.group_topk, self.scaling_factor)
        kept = chosen
        if self.capacity_factor is not None:
            capacity = get_capacity(logits.shape[0] * self.topk, self.num_experts, self.capacity_factor)
            probs, kept = apply_capacity(probs, chosen, capacity, self.drop_policy)
        if not with_losses:
            return probs, kept, chosen, None, torch.zeros(())
        num_tokens = logits.shape[0] * _group_size(token_group)
        in_objective = bool(self.coefficients)
        with torch.set_grad_enabled(torch.is_grad_enabled() and in_objective):
            scores = scores_for_aux_loss(logits, self.topk, self.score_function)
            # what the loss counts: the choice without the expert bias, as Megatron Core (only logged: the choice)
            counted = routing_map_for_aux_loss(scores, self.topk) if in_objective else chosen
            losses = {kind: self.balancing_loss(kind, scores, counted, batch_size, token_group, num_tokens)
                      for kind in self.coefficients or ("aux_loss",)}
        balance = sum(losses.values())
        aux = sum(self.coefficients[kind] * loss for kind, loss in losses.items()) if in_objective else None
        if self.z_coeff:
            z = self.z_coeff * z_loss(logits, num_tokens)
            aux = z if aux is None else aux + z
        return probs, kept, chosen, aux, balance.detach()

    def balancing_loss(self, kind: str, scores: torch.Tensor, counted: torch.Tensor, batch_size: int, token_group,
                       num_tokens: int) -> torch.Tensor:
        """This rank's term of the balancing loss ``kind`` (before its coefficient) of the micro-batch's
        ``num_tokens`` tokens, of which it holds ``scores`` / ``counted`` [T, E]."""
        if kind == "seq_aux_loss":
            return sequence_load_balancing_loss(scores, counted, batch_size, self.topk, token_group)
        if kind == "global_aux_loss":
            return self.global_term(scores, counted.sum(dim=0, dtype=scores.dtype), num_tokens)
        counts = _sum_over(counted.sum(dim=0, dtype=scores.dtype), token_group)
        return switch_load_balancing_loss(scores, counts, self.topk, num_tokens)

    def global_term(self, scores: torch.Tensor, counts: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """This rank's term of ``global_aux_loss``: ``batch_ranks x E / (k T^2) sum_e P_e N_e``, P_e its tokens'
        scores summed, N_e its ``counts`` summed over the stage's ranks (``global_groups``) and averaged with the
        step's earlier micro-batches' (kept when the gradient is on: a forward, not a recompute, not an evaluation),
        T = ``num_tokens`` x ``batch_ranks``. The terms of a micro-batch's ranks over the stage sum to ``batch_ranks``
        times the loss, and the auxiliary gradient's scale divides by ``batch_ranks``: the objective holds the
        loss itself, as a run in one process over the same micro-batches (Megatron Core 0.16.1 divides its gradient
        by the data-parallel size; its issue 3672)."""
        if _in_backward():  # a recompute: its value is not read (ScoresTimes keeps the forward's weights)
            total, steps = (counts if self.global_counts is None else self.global_counts), max(self.global_steps, 1)
        else:
            for group in self.global_groups:  # tp (the token split), then dp x sharding x cp: the stage's ranks
                counts = _sum_over(counts, group)
            total = counts if self.global_counts is None else self.global_counts + counts
            steps = self.global_steps + 1
            if torch.is_grad_enabled():
                self.global_counts, self.global_steps = total, steps
        tokens = num_tokens * self.batch_ranks
        return ScoresTimes.apply(scores, total / steps) * (self.batch_ranks * self.num_experts /
                                                            (self.topk * tokens * tokens))
