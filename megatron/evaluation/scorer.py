"""Per-sample results of the training forward, under any layout the training runs under: what an lm-eval
model (``megatron.evaluation.lm_eval_model``) asks of a checkpoint.

- ``loglikelihoods``: for each sample (token ids, and how many of its last tokens are the continuation),
  the sum of the continuation's log-probabilities given everything before it, and whether every one of its
  tokens is the model's argmax (lm-eval's ``(logprob, is_greedy)``).
- ``next_logprobs``: for each context, the log-probabilities of the next token ([n, vocab_size]).

The model is the ``Evaluator``'s (built, parallelised and loaded as a training run would be), and the
samples go through the forward-only schedules as ``Evaluator.score``'s do: one call deals the samples to
the data-parallel ranks in micro-batches (padded with empty samples so every rank runs the same number),
and the last pipeline stage turns each micro-batch's gathered logits into one row of results per sample.
The schedules sum what a micro-batch's loss function returns, so each micro-batch returns a vector with
its own rows filled and zeros elsewhere: the sum is the rows side by side, exactly (x + 0 is x). The
schedules carry fp32; a log-likelihood goes through as two fp32 numbers (its fp32 rounding and the rest)
and is put back together in fp64. The rows are then summed over the pipeline group (the stages before the
last contribute zeros) and the data-parallel group (each rank fills its own rows), so every rank returns
every sample's results. Collective: every rank calls with the same samples.

Samples are padded to the longest of the call, or to ``max_seq_len`` when the pipeline's point-to-point
shapes (pp > 1) or sequence parallelism need a fixed length; padding on the right changes nothing before
it (the attention is causal).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.data.loader import split_micro_batches
from megatron.evaluation.runner import Evaluator


class Scorer:
    def __init__(self, evaluator: Evaluator):
        self.evaluator, self.config, self.ps = evaluator, evaluator.config, evaluator.ps
        self.run, self.device = evaluator.run, evaluator.device
        self.max_length = self.config.dataset.max_seq_len  # tokens one forward takes
        self.vocab_size = self.config.model.vocab_size

    def loglikelihoods(self, samples: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each (tokens, continuation length): ``tokens`` at most
        ``max_length + 1`` ids, the continuation its last ones (at least one, and not all)."""
        for tokens, n in samples:
            if not 0 < n < len(tokens) <= self.max_length + 1:
                raise ValueError(f"a sample of {len(tokens)} tokens with a continuation of {n}: expected 1 to "
                                 f"{self.max_length + 1} tokens, the continuation not all of them.")
        inputs = [tokens[:-1] for tokens, _ in samples]
        labels = [tokens[1:] for tokens, _ in samples]
        first = [len(tokens) - 1 - n for tokens, n in samples]  # the first prediction that counts
        rows = self._forward(inputs, 4, partial(_loglikelihood_rows, self.vocab_size), labels=labels, first=first)
        sums = rows[:, 0].double() + rows[:, 1].double()  # fp32 rounding + the rest: the fp64 sum
        greedy = rows[:, 2] > 0.5
        return [(float(s), bool(g)) for s, g in zip(sums.tolist(), greedy.tolist(), strict=True)]

    def next_logprobs(self, contexts: list[list[int]]) -> torch.Tensor:
        """[len(contexts), vocab_size] log-probabilities (fp32, on the CPU) of the token after each context
        (1 to ``max_length`` ids)."""
        for context in contexts:
            if not 0 < len(context) <= self.max_length:
                raise ValueError(f"a context of {len(context)} tokens: expected 1 to {self.max_length}.")
        return self._forward(contexts, self.vocab_size, partial(_last_rows, self.vocab_size))

    def _forward(self, inputs: list[list[int]], width: int, rows_of, labels=None, first=None) -> torch.Tensor:
        """[len(inputs), width] fp32 rows (see the module's docstring); ``rows_of(logits, micro_batch)`` makes
        a micro-batch's [b, width] rows on the last stage."""
        ps, mbs = self.ps, self.config.batch_size.micro_batch_size
        dp, n = ps.data_parallel_size, len(inputs)
        if n == 0:
            return torch.zeros(0, width)
        per_rank = -(-n // (dp * mbs)) * mbs
        fixed = ps.pp_size > 1 or self.config.distributed.sequence_parallel
        seq = self.max_length if fixed else max(len(x) for x in inputs)
        start = ps.data_parallel_rank * per_rank
        mine = range(start, start + per_rank)
        tokens = torch.zeros(per_rank, seq, dtype=torch.long)
        target = torch.zeros(per_rank, seq, dtype=torch.long)
        counted = torch.zeros(per_rank, seq, dtype=torch.bool)
        last = torch.zeros(per_rank, dtype=torch.long)
        for row, i in enumerate(i for i in mine if i < n):
            tokens[row, :len(inputs[i])] = torch.tensor(inputs[i])
            last[row] = len(inputs[i]) - 1
            if labels is not None:
                target[row, :len(labels[i])] = torch.tensor(labels[i])
                counted[row, first[i]:len(labels[i])] = True
        batch = {"tokens": tokens, "position_ids": torch.arange(seq).expand(per_rank, seq).contiguous(),
                 "labels": target, "counted": counted, "last": last, "row": torch.arange(per_rank)}
        batch = {k: v.to(self.device) for k, v in batch.items()}
        step = partial(_step, rows_of, per_rank, width)
        self.run.model.eval()
        with torch.no_grad():
            out = self.run.forward_backward(step, split_micro_batches(batch, mbs), self.run.model, 1.0,
                                            forward_only=True)
        result = torch.zeros(dp * per_rank, width, dtype=torch.float32, device=self.device)
        if out is not None and out.dim() == 1:  # the last stage's rows (the other stages return a 0)
            result[start:start + per_rank] = out.view(per_rank, width)
        for group in (self.run.pp_group, self.run.dp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(result, group=group)
        return result[:n].cpu()


def _step(rows_of, per_rank: int, width: int, batch: dict, model: torch.nn.Module):
    logits = model(batch["tokens"], batch["position_ids"])  # the last stage: [b, s, V] gathered
    return logits, partial(_place, rows_of, per_rank, width, batch)


def _place(rows_of, per_rank: int, width: int, batch: dict, logits: torch.Tensor):
    """This micro-batch's rows in a zero [per_rank x width] vector (the schedules sum them over micro-batches)."""
    out = torch.zeros(per_rank, width, dtype=torch.float32, device=logits.device)
    out[batch["row"]] = rows_of(logits, batch)
    return out.view(-1), None


def _loglikelihood_rows(vocab_size: int, logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """[b, 4]: the continuation's log-likelihood as its fp32 rounding and the rest, greedy (1/0), 0."""
    logprobs = F.log_softmax(logits[..., :vocab_size].float(), dim=-1)
    picked = logprobs.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    counted = batch["counted"]
    total = (picked.double() * counted).sum(-1)
    high = total.float()
    greedy = ((logprobs.argmax(-1) == batch["labels"]) | ~counted).all(-1) & counted.any(-1)
    return torch.stack([high, (total - high.double()).float(), greedy.float(), torch.zeros_like(high)], dim=-1)


def _last_rows(vocab_size: int, logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """[b, vocab_size]: the log-probabilities after each sample's last token."""
    index = batch["last"].view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
    return F.log_softmax(logits.gather(1, index).squeeze(1)[..., :vocab_size].float(), dim=-1)
