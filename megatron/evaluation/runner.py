"""Scoring samples with the training forward, under any layout the training runs under.

The model is built, parallelised and loaded exactly as a training run would (``parallel_model``,
``load_checkpoint`` without optimizer state), so tp, pp (forward-only pipeline schedules), dp and
the sharded optimizer's stages all evaluate, and a checkpoint of any layout evaluates under any
other. Samples are padded to ``max_seq_len`` and dealt to the data-parallel ranks in global
batches (the last one filled with empty samples, so every rank runs the same micro-batches); the
sums are reduced over the pipeline and data-parallel groups.

- ``loss``: the training forward's per-token losses (vocabulary-parallel cross entropy), masked
  and summed.
- ``cloze``: the last stage gathers the logits and counts the samples whose every counted
  prediction is the argmax (Megatron-LM's LAMBADA rule).
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import torch.distributed as dist

from megatron.checkpoint import load_checkpoint
from megatron.config import Config
from megatron.data.loader import split_micro_batches
from megatron.evaluation.tasks import Sample
from megatron.training import ParallelModel


def batch_of(samples: list[Sample], seq_len: int, device: torch.device) -> dict:
    """The training batch (tokens, labels, loss_mask, position_ids) of ``samples``, padded to ``seq_len``."""
    n = len(samples)
    tokens = torch.zeros(n, seq_len + 1, dtype=torch.long)
    mask = torch.zeros(n, seq_len)
    for i, s in enumerate(samples):
        tokens[i, :len(s.tokens)] = torch.tensor(s.tokens)
        mask[i, :len(s.mask)] = torch.tensor(s.mask, dtype=torch.float32)
    positions = torch.arange(seq_len).expand(n, seq_len)
    return {"tokens": tokens[:, :-1].contiguous().to(device), "labels": tokens[:, 1:].contiguous().to(device),
            "loss_mask": mask.to(device), "position_ids": positions.contiguous().to(device)}


def loss_step(batch: dict, model: torch.nn.Module):
    """The forward step of ``kind="loss"``: the training forward's per-token losses, masked and summed."""
    token_losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    return token_losses, partial(_masked_sum, batch["loss_mask"])


def _masked_sum(mask: torch.Tensor, token_losses: torch.Tensor):
    return (token_losses.double() * mask).sum(), mask.sum()


def _cloze_step(vocab_size: int, batch: dict, model: torch.nn.Module):
    logits = model(batch["tokens"], batch["position_ids"])  # the last stage: [b, s, V] gathered
    return logits, partial(_count_correct, vocab_size, batch["labels"], batch["loss_mask"])


def _count_correct(vocab_size: int, labels: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor):
    counted = mask.bool()
    right = (logits[..., :vocab_size].argmax(dim=-1) == labels) | ~counted
    return (right.all(dim=-1) & counted.any(dim=-1)).double().sum(), counted.any(dim=-1).sum()


class Evaluator:
    """Loads ``config.save_load.ckpt_dir`` into ``run`` (the parallel model) and scores samples."""

    def __init__(self, config: Config, run: ParallelModel, device: torch.device, progress: bool = True):
        from megatron import parallel_state

        self.config, self.run, self.device = config, run, device
        self.ps = parallel_state.get()
        self.progress = progress and self.ps.rank == 0
        loaded = load_checkpoint(config.save_load.ckpt_dir, run.model, run.optimizer, self.ps, config,
                                 load_optim=False, load_rng=False)
        self.step, self.path = loaded["step"], loaded["path"]

    def score(self, samples: list[Sample], kind: str, label: str = "") -> float:
        """The sum over ``samples`` of the masked token losses (``kind="loss"``) or of the samples
        answered right (``"cloze"``). Collective: every rank passes the same samples."""
        c, ps = self.config, self.ps
        mbs, dp = c.batch_size.micro_batch_size, ps.data_parallel_size
        per_rank = mbs * max(1, ps.pp_size)  # enough micro-batches to fill the pipeline
        per_batch = per_rank * dp
        padded = samples + [Sample([0], [])] * (-len(samples) % per_batch)
        step = loss_step if kind == "loss" else partial(_cloze_step, c.model.vocab_size)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = len(padded) // per_batch
        self.run.model.eval()
        with torch.no_grad():
            for b in range(batches):
                start = b * per_batch + ps.data_parallel_rank * per_rank
                batch = batch_of(padded[start:start + per_rank], c.dataset.max_seq_len, self.device)
                out = self.run.forward_backward(step, split_micro_batches(batch, mbs), self.run.model, 1.0,
                                                forward_only=True)
                if out is not None:
                    total += out.double()
                if self.progress:
                    print(f"\r{label}batch {b + 1}/{batches}", end="" if b + 1 < batches else "\n", file=sys.stderr,
                          flush=True)
        for group in (self.run.pp_group, self.run.dp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
        return float(total)
