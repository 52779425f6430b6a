"""The experts of a mixture-of-experts layer held by this rank: ``E / ep`` MLPs shaped like the model's (GELU, SwiGLU
or quick GeGLU, with the MLP's interleaved gate/up rows, biases or not: gpt-oss's experts have them) of width
``moe_ffn_hidden_size``, each cut over the expert-tensor-parallel ranks (etp) like a column- then row-parallel MLP,
without communication of its own:
the dispatcher (``megatron.moe.dispatch``) gives every etp rank of an expert the same tokens and sums their
partial outputs.

Names are global whatever the layout: expert ``i`` of the model is ``experts.{i}.dense_h_to_4h.weight`` and
``experts.{i}.dense_4h_to_h.weight`` (``.bias`` with biases) on the ep rank that holds it, so initialisation (by
name) and checkpoints do not depend on ep or etp. Parameter attributes: ``expert_parallel`` (reduced over the
expert-data-parallel ranks, not the data-parallel ones); the sharded weights carry the tensor-parallel attributes
with the etp rank and size; ``dense_4h_to_h.bias``, replicated over etp, is added on etp rank 0 only and carries
``expert_tp_replicated`` (its gradient is summed over the etp group after the backward).

Every local expert runs every micro-batch, on no tokens when none reached it, so each expert parameter gets a
gradient every step (zero when idle), as the gradient buckets expect. ``--moe-grouped-gemm`` on a CUDA device in
bf16 runs the experts' matmuls as one grouped matmul (``torch._grouped_mm``) where torch has it; elsewhere (the
CPU) a loop.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from megatron import device as dev
from megatron.config.schema import ModelConfig
from megatron.ops.activations import activate, is_gated, mlp_activation
from megatron.ops.offload import NO_OFFLOAD
from megatron.ops.seams import LOCAL, maybe_checkpoint
from megatron.tensor_parallel.layers import set_replicated_attributes, set_tensor_parallel_attributes


class _ShardedLinear(nn.Module):
    """``weight`` (and ``bias``) of one expert's linear layer: this etp rank's slice along ``partition_dim``."""

    def __init__(self, out_features: int, in_features: int, bias: bool, partition_dim: int | None, rank: int,
                 size: int):
        super().__init__()
        full = (out_features, in_features)
        local = list(full)
        if partition_dim is not None:
            local[partition_dim] //= size
        self.weight = nn.Parameter(torch.empty(local))
        self.bias = nn.Parameter(torch.empty(local[0])) if bias else None
        for p in self.parameters():
            p.expert_parallel = True
        if partition_dim is None:
            set_replicated_attributes(self.weight)
        else:
            set_tensor_parallel_attributes(self.weight, partition_dim, full, rank, size)
        if self.bias is not None:
            if partition_dim == 0:
                set_tensor_parallel_attributes(self.bias, 0, (out_features,), rank, size)
            else:
                set_replicated_attributes(self.bias)
                self.bias.expert_tp_replicated = size > 1


class ExpertMLP(nn.Module):
    """One expert: ``fc2(act(fc1 x))`` on this etp rank's share of the hidden units; the output is this rank's
    partial sum (the bias of ``fc2`` added on etp rank 0 only)."""

    recompute_activation = False  # megatron.recompute (recompute_modules moe_act)
    offload = NO_OFFLOAD  # expert_fc1 (its input), moe_act (the activation's saves): to host (megatron.offload)

    def __init__(self, cfg: ModelConfig, etp_rank: int = 0, etp_size: int = 1):
        super().__init__()
        self.activation, self.add_bias = mlp_activation(cfg), etp_rank == 0
        gated = is_gated(self.activation)
        ffn, h, bias = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size, cfg.hidden_size, not cfg.disable_bias_linear
        if ffn % etp_size:
            raise ValueError(f"moe_ffn_hidden_size ({ffn}) is not divisible by the expert tensor-parallel size "
                             f"({etp_size})")
        sharded = 0 if etp_size > 1 else None
        self.dense_h_to_4h = _ShardedLinear(2 * ffn if gated else ffn, h, bias, sharded, etp_rank, etp_size)
        self.dense_4h_to_h = _ShardedLinear(h, ffn, bias, 1 if etp_size > 1 else None, etp_rank, etp_size)

    def forward(self, x: torch.Tensor, record: list | None = None) -> torch.Tensor:
        """``record`` (``megatron.moe.overlap``): appended ``([self], None, x, h1, y, o)``, the matmuls' inputs and
        outputs (``y`` None when the activation is recomputed), for weight gradients computed later."""
        fc1, fc2 = self.dense_h_to_4h, self.dense_4h_to_h
        h1 = maybe_checkpoint(False, LOCAL, F.linear, x, fc1.weight, fc1.bias, offload=self.offload.get("expert_fc1"))
        y = maybe_checkpoint(self.recompute_activation, LOCAL, activate, h1, self.activation,
                             offload=self.offload.get("moe_act"))
        o = F.linear(y, fc2.weight, fc2.bias if self.add_bias else None)
        if record is not None:
            record.append(([self], None, x, h1, None if self.recompute_activation else y, o))
        return o


def _grouped_mm_available(x: torch.Tensor, grouped: bool | None, widths: tuple[int, ...]) -> bool:
    """``grouped`` True: wherever torch has the grouped matmul (CUDA, bf16); None (the default): there, and only on
    a GPU where it has its own kernel, for widths it takes (multiples of 8); False: never."""
    if grouped is False or not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    return grouped is True or (dev.grouped_mm_fast(x.device) and all(w % 8 == 0 for w in widths))


class Experts(nn.ModuleDict):
    """This ep rank's experts, keyed by their global index (``local_range``).

    ``forward(tokens [N, h] sorted by local expert, counts [E/ep] summing to N, pad_to)`` -> [N, h]: expert
    j's (partial) output on its ``counts[j]`` rows. ``counts``: a tensor (on the tokens' device: the grouped
    matmul reads it there, without waiting for the device) or a list. ``pad_to``
    (``moe_pad_expert_input_to_capacity``): each expert computes on at least that many rows, padded with zero
    rows whose outputs are dropped (static shapes; the result is the same)."""

    def __init__(self, cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1, etp_rank: int = 0, etp_size: int = 1):
        if cfg.num_experts % ep_size:
            raise ValueError(f"num_experts ({cfg.num_experts}) is not divisible by the expert-parallel size "
                             f"({ep_size})")
        per_rank = cfg.num_experts // ep_size
        self.cfg = cfg
        self.local_range = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        super().__init__({str(i): ExpertMLP(cfg, etp_rank, etp_size) for i in self.local_range})
        self.grouped = cfg.moe_grouped_gemm  # None: where torch._grouped_mm is fast (``_grouped_mm_available``)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor | list[int],
                pad_to: int | None = None, record: list | None = None) -> torch.Tensor:
        experts = list(self.values())
        widths = (tokens.shape[-1], experts[0].dense_h_to_4h.weight.shape[0], experts[0].dense_4h_to_h.weight.shape[1])
        if pad_to is None and _grouped_mm_available(tokens, self.grouped, widths):
            return _grouped_forward(experts, tokens, torch.as_tensor(counts, device=tokens.device), record)
        counts = counts.tolist() if torch.is_tensor(counts) else counts
        outputs = []
        for expert, rows in zip(experts, tokens.split(counts)):
            if pad_to is not None and rows.shape[0] < pad_to:
                padded = torch.cat([rows, rows.new_zeros(pad_to - rows.shape[0], rows.shape[1])])
                outputs.append(expert(padded, record)[: rows.shape[0]])
            else:
                outputs.append(expert(rows, record))
        return torch.cat(outputs)


def _grouped_forward(experts: list[ExpertMLP], tokens: torch.Tensor, counts: torch.Tensor,
                     record: list | None = None) -> torch.Tensor:
    """The loop of ``Experts.forward`` as two grouped matmuls over the experts' stacked weights (``counts`` on the
    device); ``record`` as ``ExpertMLP.forward``'s, one entry for all the experts (cut by ``counts``)."""
    offsets = counts.cumsum(0).to(torch.int32)
    w1 = torch.stack([e.dense_h_to_4h.weight for e in experts]).transpose(1, 2)  # [E, h, rows]
    first = experts[0]
    y = maybe_checkpoint(False, LOCAL, partial(torch._grouped_mm, offs=offsets), tokens, w1,
                         offload=first.offload.get("expert_fc1"))
    if first.dense_h_to_4h.bias is not None:
        y = y + torch.repeat_interleave(torch.stack([e.dense_h_to_4h.bias for e in experts]),
                                        counts, dim=0, output_size=tokens.shape[0])
    h1 = y
    y = maybe_checkpoint(first.recompute_activation, LOCAL, activate, h1, first.activation,
                         offload=first.offload.get("moe_act"))
    w2 = torch.stack([e.dense_4h_to_h.weight for e in experts]).transpose(1, 2)  # [E, ffn, h]
    out = torch._grouped_mm(y.contiguous(), w2, offs=offsets)
    if first.dense_4h_to_h.bias is not None and first.add_bias:
        out = out + torch.repeat_interleave(torch.stack([e.dense_4h_to_h.bias for e in experts]), counts, dim=0,
                                            output_size=tokens.shape[0])
    if record is not None:
        record.append((experts, counts.tolist(), tokens, h1, None if first.recompute_activation else y, out))
    return out
