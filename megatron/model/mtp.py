"""Multi-token prediction (DeepSeek-V3; Megatron Core's ``MultiTokenPredictionBlock``): ``mtp_num_layers`` = D
sequential modules after the decoder, on the last pipeline stage, sharing the model's embedding and output head.

With ``h_0`` the decoder's output after its final norm, module k = 1..D at position i::

    h_k[i] = final_norm_k(layer_k(eh_proj_k([enorm_k(emb(t[i + k])), hnorm_k(h_{k-1}[i])])))
    loss_k[i] = cross_entropy(head(h_k[i]), t[i + k + 1])      counted where the loss mask of t[i + k] is

``layer_k`` is a decoder layer (MoE when the decoder's last layer is; global index ``num_layers + k - 1``) with
the decoder's rotary positions and attention plan; ``eh_proj_k`` [h, 2h] is column-parallel (its output gathered
over the tensor-parallel group, then cut to the sequence shard under sequence parallelism), as Megatron Core's.
The embedding reads the token ``k`` places on at the position it has there (``MTPInputs``): positions past the
sample's end hold token 0, and their losses are masked. With packed documents (``document_ids``) a position whose
target lies in another document is masked too.

The objective: the language model's loss plus ``mtp_loss_scaling_factor / D`` times the sum over k of loss_k's
token mean over the global batch (each depth's own count of loss tokens, ``before_step``), the same under every
layout. The reported loss stays the language model's; each depth's mean is logged as ``mtp_k loss``
(``after_step``). The modules run in training only: evaluation, generation and the exported logits use the main
head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.model.blocks import make_norm
from megatron.ops.seams import LOCAL


@dataclass
class MTPInputs:
    """Per depth k (the last dim, k - 1), at each position i: the token, label, loss mask and position id
    of position ``i + k`` (0 past the sample's end). [b, s, D] each (this rank's positions under context
    parallelism)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The batch's fields that hold them, ``mtp_`` and the field's name (what ``megatron.data.future_tokens``
        writes)."""
        return tuple(f"mtp_{f.name}" for f in fields(cls))

    @classmethod
    def from_batch(cls, batch: dict) -> MTPInputs | None:
        keys = cls.keys()
        if keys[0] not in batch:
            return None
        return cls(*(batch[k] for k in keys))


class _AttachLoss(torch.autograd.Function):
    """Returns ``output`` unchanged; the backward gives ``loss`` the gradient ``scale``: a loss joins the objective
    without joining the reported one (the MoE auxiliary losses' ``AuxLossScaler``, with the scale fixed at the
    forward)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


class MultiTokenPredictionLayer(nn.Module):
    """Module k (``depth`` = k - 1): see the module docstring."""

    seams = LOCAL

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__()
        from megatron.model.transformer import TransformerDecoderLayer

        self.enorm = make_norm(cfg)
        self.hnorm = make_norm(cfg)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.transformer_layer = TransformerDecoderLayer(cfg, cfg.num_layers + depth)
        self.final_layernorm = make_norm(cfg)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rotary=None, plan=None) -> torch.Tensor:
        """hidden (the previous depth's output, normed), embedded (the tokens k on): [s, b, h] ([s/tp, b, h] under
        sequence parallelism) -> [s, b, h], after this module's final norm."""
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))  # [s, b, h/tp]
        x = self.seams.scatter_sequence(self.seams.gather_heads(x))
        return self.final_layernorm(self.transformer_layer(x, None, rotary, plan))


class MultiTokenPrediction(nn.Module):
    """The D modules (``layers``), their losses' gradient scales (``before_step``) and the step's records."""

    seams = LOCAL

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_layers, self.factor = cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor
        self.layers = nn.ModuleList(MultiTokenPredictionLayer(cfg, k)
                                    for k in range(cfg.mtp_num_layers))
        self.scales: list[float] | None = None  # per depth; None: each micro-batch's own token mean
        self.reset_stats()

    def reset_stats(self) -> None:
        self.records: list[torch.Tensor] = []  # per micro-batch: [2, D] (loss sums, token counts), on the device

    def forward(self, model: nn.Module, hidden: torch.Tensor, inputs: MTPInputs, losses: torch.Tensor,
                rotary=None, plan=None) -> torch.Tensor:
        """Run the modules from the decoder's normed output ``hidden`` (sequence-sharded under sequence
        parallelism); return the language model's per-token ``losses`` [b, s] with each depth's loss attached to
        their backward (``_AttachLoss``). ``model``: the GPTModel, for its embedding, head and cross entropy."""
        record = []
        for k, layer in enumerate(self.layers):
            embedded = model.embedding(inputs.tokens[..., k], inputs.position_ids[..., k])
            hidden = layer(hidden, embedded, rotary, plan)
            gathered = self.seams.gather_sequence(hidden)
            mask = inputs.loss_mask[..., k]
            loss = (model.loss(gathered, inputs.labels[..., k]) * mask).sum()
            record.append(torch.stack([loss.detach().double(), mask.sum().double()]))
            scale = self.scales[k] if self.scales else self.factor / (self.num_layers * max(float(mask.sum()), 1.0))
            losses = _AttachLoss.apply(losses, loss, scale)
        self.records.append(torch.stack(record, dim=1))
        return losses


def mtp_blocks(model: nn.Module) -> list[MultiTokenPrediction]:
    return [m for m in model.modules() if isinstance(m, MultiTokenPrediction)]


def _depth(model: nn.Module) -> int:
    cfg = next((m.cfg for m in model.modules() if isinstance(getattr(m, "cfg", None), ModelConfig)), None)
    return (cfg.mtp_num_layers or 0) if cfg is not None else 0


def _one_rank(value: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        raise ValueError("a sum over a process group needs the caller's collective (sum_over)")
    return value


def before_step(model: nn.Module, batch: dict, dp_group, loss_scale: float, sum_over: Callable = _one_rank) -> None:
    """Before a training step over this rank's ``batch``: each depth's gradient scale, ``loss_scale x factor / (D x
    the global batch's loss tokens at that depth)`` (``sum_over(tensor, dp_group)``, the caller's all-reduce, sums
    the counts over every rank of the batch: call it on every rank), and the records reset."""
    depth = _depth(model)
    if not depth or "mtp_loss_mask" not in batch:
        return
    counts = sum_over(batch["mtp_loss_mask"].sum(dim=(0, 1)).double(), dp_group).clamp(min=1.0).tolist()
    for block in mtp_blocks(model):
        block.reset_stats()
        block.scales = [loss_scale * block.factor / (depth * n) for n in counts]


def after_step(model: nn.Module, dp_group=None, pp_group=None, sum_over: Callable = _one_rank) -> dict | None:
    """The step's ``mtp_loss`` (one token mean per depth over the global batch, equal on every rank); None without
    multi-token prediction. ``sum_over`` sums the records over the data-parallel and pipeline groups (a
    collective: call it on every rank)."""
    depth = _depth(model)
    if not depth:
        return None
    device = next(model.parameters()).device
    records = torch.zeros(2, depth, dtype=torch.float64, device=device)  # (loss sums, token counts); 0 off the
    for block in mtp_blocks(model):  # last stage
        for record in block.records:
            records += record
    for group in (dp_group, pp_group):
        records = sum_over(records, group)
    records = records.cpu()
    if not bool((records[1] > 0).all()):
        return None
    return {"mtp_loss": (records[0] / records[1]).tolist()}
