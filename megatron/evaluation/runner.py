"""Scoring samples with the training forward, under any layout the training runs under.

The model is built, parallelised and loaded exactly as a training run would (``parallelize_gpt``,
``load_checkpoint`` without optimizer state), so tp, pp (forward-only pipeline schedules), dp and
the sharded optimizer's stages all evaluate, and a checkpoint of any layout evaluates under any
other. Samples are padded to ``max_seq_len`` and dealt to the data-parallel ranks in global
batches (the last one filled with empty samples, so every rank runs the same micro-batches); the
sums are reduced over the pipeline and data-parallel groups.

- ``loss``: the training forward's per-token losses (vocabulary-parallel cross entropy), masked
  and summed.
- ``cloze``: the last stage gathers the logits and gives each sample's log-likelihood of its counted
  tokens, whether every counted prediction is the argmax (lm-eval's ``is_greedy``, Megatron-LM's
  LAMBADA rule) and the argmax at each counted position; the per-sample rows are reduced to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from megatron.checkpoint import load_checkpoint
from megatron.config import Config
from megatron.data.loader import split_micro_batches
from megatron.evaluation.tasks import Sample
from megatron.parallelize_gpt import ParallelModel
from megatron.progress import Progress


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


@dataclass
class ClozeScore:
    loglikelihood: float  # of the counted tokens, summed (natural log)
    right: bool  # every counted token is the argmax
    predicted: list[int]  # the argmax at each counted position, given the sample's earlier tokens


def _cloze_step(vocab_size: int, rows: torch.Tensor, batch: dict, model: torch.nn.Module):
    logits = model(batch["tokens"], batch["position_ids"])  # the last stage: [b, s, V] gathered
    return logits, partial(_cloze_rows, vocab_size, rows, batch)


def _cloze_rows(vocab_size: int, rows: torch.Tensor, batch: dict, logits: torch.Tensor):
    """Fill ``rows[index]`` = (log-likelihood, right, argmax at each counted position) for each sample of
    the micro-batch; return (samples right, samples)."""
    labels, mask = batch["labels"], batch["loss_mask"].bool()
    where = mask.nonzero()  # [k, 2]: (row, position) of each counted prediction, in order
    picked = logits[where[:, 0], where[:, 1], :vocab_size].float()  # [k, V]: only the counted positions
    wanted = labels[where[:, 0], where[:, 1]]
    loglik = picked.log_softmax(-1).gather(-1, wanted[:, None])[:, 0].double()
    predicted = picked.argmax(-1)
    n = mask.shape[0]
    sums = torch.zeros(n, dtype=torch.float64, device=logits.device).index_add_(0, where[:, 0], loglik)
    wrong = torch.zeros(n, dtype=torch.float64, device=logits.device).index_add_(
        0, where[:, 0], (predicted != wanted).double())
    right = (wrong == 0) & mask.any(dim=-1)
    counts = mask.sum(dim=-1).tolist()
    start = 0
    for i, index in enumerate(batch["index"].tolist()):
        if index >= 0:
            rows[index, 0], rows[index, 1] = sums[i], right[i].double()
            rows[index, 2:2 + counts[i]] = predicted[start:start + counts[i]].double()
        start += counts[i]
    return right.double().sum(), mask.any(dim=-1).sum()


class Evaluator:
    """Loads ``config.save_load.ckpt_dir`` into ``run`` (the parallel model) and scores samples."""

    def __init__(self, config: Config, run: ParallelModel, device: torch.device, progress: bool = True):
        from megatron import parallel_state

        self.config, self.run, self.device = config, run, device
        self.ps = parallel_state.get()
        self.progress = progress and self.ps.rank == 0
        loaded = load_checkpoint(config.save_load.ckpt_dir, run.model, run.optimizer, self.ps, config,
                                 load_optim=False, load_rng=False)
        if loaded.get("moe_expert_bias"):  # a MoE router's expert bias: no parameter, kept in the train state
            from megatron import moe

            moe.set_expert_biases(run.model, loaded["moe_expert_bias"])
        self.step, self.path = loaded["step"], loaded["path"]

    def score(self, samples: list[Sample], label: str = "", unit: str = "samples") -> float:
        """The sum over ``samples`` of the masked token losses (nats). Collective: every rank passes the
        same samples. ``label`` (with ``unit``): the progress report's name; none without one."""
        return self._run(samples, loss_step, label, unit)

    def cloze(self, samples: list[Sample], label: str = "", unit: str = "samples") -> list[ClozeScore]:
        """Each sample's log-likelihood of its counted tokens, whether they are all the argmax, and the
        argmax at each (see the module's docstring). Collective: every rank passes the same samples."""
        width = max((sum(s.mask) for s in samples), default=0)
        rows = torch.zeros(len(samples), 2 + width, dtype=torch.float64, device=self.device)
        self._run(samples, partial(_cloze_step, self.config.model.vocab_size, rows), label, unit)
        self._reduce(rows)
        return [ClozeScore(float(r[0]), bool(r[1]), [int(t) for t in r[2:2 + sum(s.mask)].tolist()])
                for r, s in zip(rows.cpu(), samples)]

    def _reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the pipeline (only the last stage computed) and data-parallel ranks."""
        for group in (self.run.pp_group, self.run.dp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(tensor, group=group)

    def _run(self, samples: list[Sample], step, label: str, unit: str) -> float:
        """``step`` (a forward step) over ``samples`` in global batches; the sum of its loss function's
        first values over every micro-batch and rank. Progress (megatron/progress.py, rank 0): the samples
        scored, a bar on a terminal or a line every 10 seconds in a file."""
        c, ps = self.config, self.ps
        mbs, dp = c.batch_size.micro_batch_size, ps.data_parallel_size
        per_rank = mbs * max(1, ps.pp_size)  # enough micro-batches to fill the pipeline
        per_batch = per_rank * dp
        padded = samples + [Sample([0], [])] * (-len(samples) % per_batch)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = len(padded) // per_batch
        self.run.model.eval()
        enabled = self.progress and bool(label)
        with torch.no_grad(), Progress(label, total=len(samples), unit=unit, enabled=enabled) as progress:
            for b in range(batches):
                start = b * per_batch + ps.data_parallel_rank * per_rank
                batch = batch_of(padded[start:start + per_rank], c.dataset.max_seq_len, self.device)
                batch["index"] = torch.tensor([i if i < len(samples) else -1
                                               for i in range(start, start + per_rank)], device=self.device)
                out = self.run.forward_backward(step, split_micro_batches(batch, mbs), self.run.model, 1.0,
                                                forward_only=True)
                if out is not None:
                    total += out.double()
                progress.update(min(per_batch, len(samples) - b * per_batch))
        self._reduce(total)
        return float(total)
