"""The mixture-of-experts layer, in place of the MLP in the layers ``moe_layer_freq`` chooses (Megatron-LM's
``MoELayer``).

``x [s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> this rank's tokens -> the router chooses each
token's experts and their probabilities -> the dispatcher (``megatron.moe.dispatch``) takes the (token, expert)
pairs to the ranks holding the experts (expert parallelism, ``ep``), runs them (each cut over ``etp`` ranks) and
brings the outputs back weighted by their probabilities, summed per token in fp32 -> plus the shared expert's
output on every token when there is one. The auxiliary losses join the objective through ``AuxLossScaler``.

**Whose tokens.** Every rank routes tokens no other rank of its tensor-parallel group routes: under sequence
parallelism its sequence shard; without it the layer cuts the (replicated) sequence over the tensor-parallel
ranks itself and gathers the output back (Megatron-LM requires sequence parallelism instead). So the router sees a
different share on each tensor-parallel rank: its weight's gradient is summed over the group
(``sequence_parallel``), and the balancing losses count the tokens of the whole micro-batch (the tensor- and
context-parallel ranks holding parts of the same samples, group ``tp_cp``: ``megatron.moe.router``). A sequence
the tensor-parallel size does not divide (generation's short steps; training checks it) is padded with zero
tokens for the split, their outputs dropped.

The shared expert is the model's MLP (tensor-parallel, sequence-parallel as the dense layers) on the layer's
input, its output scaled by ``sigmoid(x g^T)`` with ``moe_shared_expert_gate`` (Qwen2-MoE's gate, ``g`` [1, h]).
The layer runs eager under ``--compile`` (its token counts are data-dependent): the compiled decoder layer
breaks its graph around it.

Per step, a training layer records the tokens the router chose per expert and its balancing loss (before the
coefficient) of each micro-batch, outside the recompute of a checkpointed layer; ``megatron.moe.stats`` sums them
over the ranks after the step (the log's ``load_balancing_loss`` and ``expert_load_max``, the expert bias's update).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron import tensor_parallel as tp
from megatron.config.schema import ModelConfig
from megatron.moe.dispatch import DISPATCHERS, Groups
from megatron.moe.experts import Experts
from megatron.moe.overlap import Overlap
from megatron.moe.router import AuxLossScaler, TopKRouter, get_capacity
from megatron.ops.seams import LOCAL, maybe_checkpoint


def _in_backward() -> bool:
    """Whether this runs inside a backward pass (a checkpointed layer's recompute)."""
    return torch._C._current_graph_task_id() != -1


class MoELayer(nn.Module):
    """``make_mlp(cfg)`` builds the model's MLP of ``cfg.ffn_hidden_size``: the shared expert, of
    ``moe_shared_expert_intermediate_size``. The routed experts are this rank's share (``Experts``)."""

    sequence_parallel = False  # this rank's tokens are its sequence shard (set by ``tensor_parallel.parallelize``)
    # one rank's layout; ``moe.parallelize.apply_expert_parallel`` sets this rank's (``ExpertLayout``)
    tp_size, tp_group, token_group, token_share, batch_ranks = 1, None, None, True, 1
    recompute_shared = False  # megatron.recompute (recompute_modules shared_experts)

    def __init__(self, cfg: ModelConfig, make_mlp: Callable[..., nn.Module], layer_number: int = 0):
        super().__init__()
        self.layer_number = layer_number
        self.groups = Groups()
        self.router = TopKRouter(cfg)
        self.experts = Experts(cfg)  # all of them, until the layout keeps this rank's
        self.dispatch = DISPATCHERS[cfg.moe_token_dispatcher_type]
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_expert = make_mlp(dataclasses.replace(cfg, ffn_hidden_size=shared)) if shared else None
        # its gate (Qwen2-MoE's; Megatron Core's shared_experts.gate_weight): [1, h], replicated over tp
        gated = shared and cfg.moe_shared_expert_gate
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if gated else None
        self.pad_to_capacity = cfg.moe_pad_expert_input_to_capacity and cfg.moe_expert_capacity_factor is not None
        # the token exchange overlapped (megatron.moe.overlap): with the shared expert's forward, the weight gradients
        self.shared_overlap = bool(shared) and cfg.moe_shared_expert_overlap
        self.delay_wgrad = cfg.delay_wgrad_compute
        self.reset_stats()

    def reset_stats(self) -> None:
        """Forget the recorded micro-batches (the training step calls it before its first forward)."""
        self.tokens_per_expert: torch.Tensor | None = None  # float64 [E] on the model's device
        self.balance_sum: torch.Tensor | None = None  # float64, 0-dim
        self.micro_batches = 0
        self.router.reset_global()

    def _record(self, chosen: torch.Tensor, balance: torch.Tensor) -> None:
        """This rank's tokens' choices and its part of the micro-batch's balancing loss (summed over the ranks
        by ``megatron.moe.stats``; the micro-batch counted once, on the first rank of its tokens). Kept on the
        device: read once per step, by ``stats.after_step``, not after every layer (no host synchronisation)."""
        if self.training and not _in_backward():
            counts = chosen.sum(dim=0).to(torch.float64)
            loss = torch.as_tensor(balance, device=counts.device).detach().to(torch.float64)
            first = self.tokens_per_expert is None
            self.tokens_per_expert = counts if first else self.tokens_per_expert + counts
            self.balance_sum = loss if first else self.balance_sum + loss
            self.micro_batches += int(self.token_share)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        split = self.tp_size > 1 and not self.sequence_parallel
        if split:  # this rank's share of the sequence (padded to a multiple of tp: generation's short steps)
            pad = -x.shape[0] % self.tp_size
            out = tp.scatter_to_sequence_region(F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x, self.tp_group)
        shared: dict[str, torch.Tensor] = {}

        def shared_expert() -> None:  # recomputed in the backward under recompute_modules shared_experts
            shared["out"] = maybe_checkpoint(self.recompute_shared, LOCAL, self._shared, x)

        overlap = None
        if self.shared_overlap or self.delay_wgrad:  # used by the alltoall dispatcher at ep > 1 while training
            overlap = Overlap(self.delay_wgrad, shared_expert if self.shared_overlap else None)
        out = self._routed(out, overlap)
        if split:
            out = tp.gather_from_sequence_region(out, self.tp_group, tensor_parallel_output_grad=False)[: x.shape[0]]
        if self.shared_expert is not None:
            if "out" not in shared:  # not run during the token exchange
                shared_expert()
            out = out + shared["out"]
        return out

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output on ``x`` (this rank's rows of it under sequence parallelism), times
        ``sigmoid(x g^T)`` [s, b, 1] with the gate."""
        y = self.shared_expert(x)
        return y if self.shared_expert_gate is None else y * torch.sigmoid(self.shared_expert_gate(x))

    def _routed(self, x: torch.Tensor, overlap: Overlap | None = None) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        probs, kept, chosen, aux, balance = self.router(tokens, b, self.token_group, with_losses=self.training)
        self._record(chosen, balance)
        pad_to = None
        if self.pad_to_capacity:
            sources = self.groups.ep_size * self.groups.etp_size
            pad_to = sources * get_capacity(s * b * self.router.topk, self.router.num_experts,
                                            self.router.capacity_factor)
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 at least
        pairs = s * b * self.router.topk if self.router.capacity_factor is None else None  # dropless: each token's k
        out = self.dispatch(tokens, probs, kept, self.experts, self.groups, acc, pad_to, pairs, overlap).to(x.dtype)
        if aux is not None and torch.is_grad_enabled():
            out = AuxLossScaler.apply(out, aux)
        return out.view(s, b, h)
