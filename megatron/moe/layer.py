"""The mixture-of-experts layer, in place of the MLP in the layers ``moe_layer_freq`` chooses (Megatron-LM's
``MoELayer`` on one expert-parallel rank).

``x [s, b, h]`` -> the router chooses each token's experts and their probabilities -> the (token, expert) pairs
sorted by expert (the permutation) -> each expert's MLP on its tokens -> each output weighted by its probability
and summed back into its token's row (the unpermutation, in fp32) -> plus the shared expert's output on every
token when there is one. The auxiliary losses join the objective through ``AuxLossScaler`` on the output.

Under tensor parallelism every expert (and the shared expert) is column/row-parallel like the MLP and the router
is replicated: every rank routes the same tokens. Under sequence parallelism the layer gathers the sequence first
(its gradient split back, each rank already holding the whole one) and keeps its rank's share of the output.

The layer runs eager under ``--compile`` (its token counts are data-dependent): the compiled decoder layer breaks
its graph around it.

Per step, a training layer records the tokens the router chose per expert and its balancing loss (before the
coefficient) of each micro-batch, outside the recompute of a checkpointed layer; ``megatron.moe.stats`` reads
them after the step (the log's ``load_balancing_loss`` and ``expert_load_max``, the expert bias's update).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from megatron import tensor_parallel as tp
from megatron.config.schema import ModelConfig
from megatron.moe.experts import Experts
from megatron.moe.router import AuxLossScaler, TopKRouter, get_capacity


def _in_backward() -> bool:
    """Whether this runs inside a backward pass (a checkpointed layer's recompute)."""
    return torch._C._current_graph_task_id() != -1


class MoELayer(nn.Module):
    """``make_mlp(cfg)`` builds an MLP of ``cfg.ffn_hidden_size`` (the model's ``MLP``): each expert, of
    ``moe_ffn_hidden_size``, and the shared expert, of ``moe_shared_expert_intermediate_size``."""

    def __init__(self, cfg: ModelConfig, make_mlp: Callable[[ModelConfig], nn.Module], layer_number: int = 0,
                 sequence_parallel: bool = False):
        super().__init__()
        self.layer_number, self.sequence_parallel = layer_number, sequence_parallel
        self.router = TopKRouter(cfg)
        expert_cfg = dataclasses.replace(cfg, ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size)
        self.experts = Experts(cfg.num_experts, lambda: make_mlp(expert_cfg))
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_expert = make_mlp(dataclasses.replace(cfg, ffn_hidden_size=shared)) if shared else None
        self.pad_to_capacity = cfg.moe_pad_expert_input_to_capacity and cfg.moe_expert_capacity_factor is not None
        self.reset_stats()

    def reset_stats(self) -> None:
        """Forget the recorded micro-batches (the training step calls it before its first forward)."""
        self.tokens_per_expert = torch.zeros(self.router.num_experts, dtype=torch.float64, device="cpu")
        self.balance_sum, self.micro_batches = 0.0, 0

    def _record(self, chosen: torch.Tensor, balance: torch.Tensor) -> None:
        if self.training and not _in_backward():
            self.tokens_per_expert += chosen.sum(dim=0).to("cpu", torch.float64)
            self.balance_sum += float(balance)
            self.micro_batches += 1

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # every rank routes the whole sequence, as without sequence parallelism
            full = tp.gather_from_sequence_region(x, tensor_parallel_output_grad=False)
            return tp.scatter_to_sequence_region(self._forward(full))
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        probs, kept, chosen, aux, balance = self.router(tokens, b)
        self._record(chosen, balance)
        expert_index, token_index = kept.t().nonzero(as_tuple=True)  # sorted by expert, then token
        counts = kept.sum(dim=0).tolist()
        capacity = None
        if self.pad_to_capacity:
            capacity = get_capacity(s * b * self.router.topk, self.router.num_experts, self.router.capacity_factor)
        routed = self.experts(tokens[token_index], counts, capacity)
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 at least
        weighted = routed.to(acc) * probs[token_index, expert_index].unsqueeze(-1).to(acc)
        out = torch.zeros(s * b, h, dtype=acc, device=x.device).index_add(0, token_index, weighted)
        out = out.to(x.dtype)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        if aux is not None and torch.is_grad_enabled():
            out = AuxLossScaler.apply(out, aux)
        return out.view(s, b, h)
