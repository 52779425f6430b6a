"""QK-clip (MuonClip: Kimi K2's, Megatron Core's ``--qk-clip``): after the optimizer step, the query and key weights
of every attention head whose largest logit passed ``threshold`` are scaled down so that the logit would sit at the
threshold; and the largest logit of the step, for the log (``--log-max-attention-logit``).

Megatron Core's rule (``megatron/core/optimizer/qk_clip.py`` and its attention classes' ``clip_qk``), per decoder
layer (not multi-token prediction's), ``a = alpha``::

    m_h  = head h's largest logit over the step's training forwards (``megatron.attention.max_logits``),
           the maximum over the data-parallel x context-parallel ranks
    eta  = threshold / m  where m > threshold, else 1

    standard attention (fused QKV rows [groups, (the group's query heads, [their output gates], key, value),
    head_dim]), per key group g:
        m_g = max of its query heads' m_h;  its query heads' rows x eta_g^a, its key rows x eta_g^(1 - a)
    multi-latent attention, per head (q_proj / q_up_proj rows [heads, (nope dn, rope dr)], kv_up_proj rows
    [heads, (key nope dn, value dv)]):
        query nope rows x eta^a, query rope rows x eta, key nope rows x eta^(1 - a)

so every logit of a clipped head is multiplied by eta (the rope part's shared key, ``kv_down_proj``'s, is left
alone, its query side takes the whole eta); values, output gates (``attention_output_gate``: not in q.k; Megatron's
clip assumes no gate rows), biases and norms are never touched. A layer none of whose heads
passed the threshold is left bitwise alone (Megatron multiplies the others by exactly 1).

Tensor parallelism: each rank holds whole heads (groups), so its maxima and its clip are its own: nothing is reduced
over tp (nor pp: each stage its layers). The logged value is the largest over every layer of the model: the maximum
over the model-parallel ranks too (Megatron logs the last rank's layers').

Where the weights are scaled: the fp32 masters this rank steps (its ZeRO slice, on the CPU when offloaded; the
parameters themselves in fp32 without masters), which are then cast into the parameters and published, as after a
step (all-gathered over the bucket's sharding group; stage 3 drops its stale gathered copy) -- only the buckets
that hold a scaled weight, and only on a step that clipped a head. The maxima being reduced over the data-parallel
ranks, which hold the same layers, every rank of a sharding group takes the same decision.

Differences from Megatron Core, on purpose: only training forwards count (Megatron's evaluation forwards raise the
next step's maxima too); the maxima are reset after every step, also when only logged (Megatron keeps a run-long
maximum then); a head whose maximum is not finite or not above the threshold is not scaled (Megatron's clamp would
scale by a negative or NaN factor where a maximum is negative or NaN while another head of the layer clips).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron.model.gpt import GPTModel


@dataclass(frozen=True)
class QKClip:
    """The run's QK-clip: ``clip`` False only tracks and logs the largest logit (``--log-max-attention-logit``)."""

    clip: bool
    alpha: float
    threshold: float

    @classmethod
    def of(cls, config) -> QKClip | None:
        """From ``Optimizer``'s qk_clip leaves; None when neither clipping nor the log is asked for."""
        o = config.optimizer
        if not (o.qk_clip or o.log_max_attention_logit):
            return None
        return cls(o.qk_clip, o.qk_clip_alpha, o.qk_clip_threshold)

    @torch.no_grad()
    def after_step(self, model: nn.Module, optimizer, dp_group=None, model_parallel_group=None) -> float:
        """After ``optimizer.step``: the maxima reduced over ``dp_group`` (data x context parallel), the heads past
        the threshold clipped (``clip``), the maxima reset; returns the largest logit of the model (-inf if none),
        reduced over ``model_parallel_group``. Collective: call it on every rank."""
        layers = decoder_attention(model)
        device = optimizer.buffer.device
        maxima = [torch.full((a.num_heads,), float("-inf"), device=device) if a.max_logits is None else a.max_logits
                  for a in layers]
        for attention in layers:
            attention.max_logits = None
        flat = torch.cat(maxima) if maxima else torch.full((1,), float("-inf"), device=device)
        if dp_group is not None:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=dp_group)
        largest = flat.max().reshape(1)
        if model_parallel_group is not None:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=model_parallel_group)
        if self.clip and layers:
            per_layer = flat.split([a.num_heads for a in layers])
            clipped = torch.stack([(m > self.threshold).any() for m in per_layer]).tolist()
            factors = [rows for attention, m, over in zip(layers, per_layer, clipped) if over
                       for rows in clip_rows(attention, m, self.threshold, self.alpha)]
            scale_rows(optimizer, factors)
        return float(largest)


def track(model: nn.Module) -> None:
    """Have every decoder layer's attention of ``model`` keep its heads' largest logit in training (the recipe's
    step, ``parallelize_gpt.build_model``)."""
    for attention in decoder_attention(model):
        attention.tracks_max_logits = True


def decoder_attention(model: nn.Module) -> list[nn.Module]:
    """The attention modules of the decoder layers of ``model`` (a chunk, chunks, or a wrapper of them), in order;
    multi-token prediction's layers are not among them (Megatron clips the decoder's)."""
    return [layer.self_attention for module in model.modules() if isinstance(module, GPTModel)
            for layer in module.layers.values() if layer.self_attention is not None]


def balancing_eta(maxima: torch.Tensor, threshold: float) -> torch.Tensor:
    """``threshold / m`` where ``m > threshold``, else 1 (fp32, ``maxima``'s shape)."""
    return torch.where(maxima > threshold, threshold / maxima, torch.ones_like(maxima))


def clip_rows(attention: nn.Module, maxima: torch.Tensor, threshold: float,
              alpha: float) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(weight, a factor per output row) of the projections QK-clip scales in ``attention`` given its heads'
    ``maxima`` [heads on this rank] (see the module docstring)."""
    if hasattr(attention, "query_key_value"):  # standard attention: per key group
        groups, hd = attention.num_kv_heads, attention.head_dim
        per_group = attention.num_heads // groups
        eta = balancing_eta(maxima.view(groups, per_group).amax(dim=1), threshold)[:, None]
        # the powers over Megatron's shapes (a query row each, a key group each): torch's vectorised and scalar
        # pow may differ in the last bit
        gates = per_group if getattr(attention, "output_gate", False) else 0  # each query's gate rows: untouched
        ones = torch.ones_like(eta)
        rows = torch.cat([eta.repeat(1, per_group * hd).pow(alpha), ones.expand(-1, gates * hd),
                          eta.pow(1 - alpha).expand(-1, hd), ones.expand(-1, hd)], dim=1)
        return [(attention.query_key_value.weight, rows.reshape(-1))]
    eta = balancing_eta(maxima, threshold)[:, None]  # multi-latent attention: per head
    dn, dr, dv = attention.dn, attention.dr, attention.dv
    q_weight = attention.linear_q_up_proj.weight if attention.q_lora else attention.linear_q_proj.weight
    q_rows = torch.cat([eta.pow(alpha).expand(-1, dn), eta.expand(-1, dr)], dim=1)
    kv_rows = torch.cat([eta.pow(1 - alpha).expand(-1, dn), torch.ones_like(eta).expand(-1, dv)], dim=1)
    return [(q_weight, q_rows.reshape(-1)), (attention.linear_kv_up_proj.weight, kv_rows.reshape(-1))]


def scale_rows(optimizer, factors: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """``W[r] *= f[r]`` for each ``(W, f)`` of ``factors`` in the masters this rank steps, cast into its parameter
    slices, then every bucket holding such a ``W`` published over its sharding group (collective: the same
    parameters on every rank of the group)."""
    buffer = optimizer.buffer
    location = {id(p): (b, start, end) for b in buffer.buckets for p, start, end in b.params}
    published = []
    for param, factor in factors:
        bucket, start, end = location[id(param)]
        width = param[0].numel()
        for piece_bucket, lo, hi, master in optimizer.pieces():
            a, z = max(lo, start), min(hi, end)
            if piece_bucket is bucket and a < z:
                part = master.data[a - lo:z - lo]
                _scale_span(part, a - start, factor.to(part.device), width)
                if optimizer.master_data is not None:  # low precision or offloaded: the parameters are a copy
                    buffer.shard_param(bucket, a, z).copy_(part)
        if bucket not in published:
            published.append(bucket)
    for bucket in published:
        bucket.publish(bucket.groups.sharding)


def _scale_span(flat: torch.Tensor, first: int, factor: torch.Tensor, width: int) -> None:
    """``flat``: elements ``[first, first + n)`` of a row-major matrix of rows of ``width``, each multiplied in place
    by its row's ``factor``: a partial first row, whole rows, a partial last row."""
    n = flat.numel()
    head = min(n, -first % width)
    if head:
        flat[:head].mul_(factor[first // width])
    rows = (n - head) // width
    row = (first + head) // width
    if rows:
        flat[head:head + rows * width].view(rows, width).mul_(factor[row:row + rows, None])
    if head + rows * width < n:
        flat[head + rows * width:].mul_(factor[row + rows])
