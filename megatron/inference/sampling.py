"""Choosing the next token from vocabulary-parallel logits, the same on every tensor-parallel rank.

Rank ``r`` of ``t`` holds the logits of vocabulary ids ``[r V/t, (r+1) V/t)`` (``V`` the padded
vocabulary; ids ``>= vocab_size`` are padding and never chosen). Nothing here gathers the full
logits unless a row samples from the whole vocabulary:

- **log-probabilities** are of the model's own distribution (before penalties and temperature,
  as vLLM reports them): ``z_y - logsumexp(z)``, the normaliser from an all-reduce MAX and SUM;
- **candidates**: each rank's top ``k``, all-gathered, merged into the global top ``k`` in one
  order on every rank (by value, ties by id). Greedy is ``k = 1``; top-k sampling ``k = top_k``;
  a row with no top-k (temperature or top-p only) takes every id, the one case the full logits are
  gathered;
- **sampling** draws ``u ~ U[0, 1)`` from the row's own generator (seeded by the request, or by a
  seed rank 0 drew and broadcast) and takes the first candidate whose cumulative probability passes
  ``u``. Every rank holds the same candidates and the same generator, so every rank picks the same
  token with no broadcast, and a tp-2 run samples what a tp-1 run samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class RequestError(ValueError):
    """A request this engine will not run; ``param`` names the field at fault (as OpenAI's errors do)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


MAX_LOGPROBS = 20  # top alternatives per token a request may ask for (OpenAI's API allows 5; vLLM 20)
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range)
SEED_RANGE = (-2**63, 2**63 - 1)  # what torch.Generator.manual_seed and an int64 broadcast both take


@dataclass
class SamplingParams:
    """How one sequence is generated. ``temperature 0`` is greedy (as in OpenAI's API). The
    penalties follow vLLM: ``repetition_penalty`` (> 1 discourages) divides the positive logits and
    multiplies the negative ones of every id in the prompt or the output; ``presence_penalty`` and
    ``frequency_penalty`` subtract from the logits of ids already in the output (once, and per
    occurrence). ``logprobs``: None for none, ``n >= 0`` for the chosen token's and the ``n`` most
    likely ones; ``prompt_logprobs``: also those of the prompt's tokens (scoring)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def check(self) -> None:
        """RequestError naming the first field out of range."""
        def bad(name: str, rule: str):
            raise RequestError(f"{name} must be {rule}, got {getattr(self, name)!r}.", name)

        for name in ("max_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                bad(name, "a non-negative integer")
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                bad(name, "a finite number")
        if self.temperature < 0:
            bad("temperature", "at least 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "positive")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                bad(name, f"from {-MAX_PENALTY} to {MAX_PENALTY}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad("seed", f"an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]} (a 64-bit signed integer)")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"an integer from 0 to {MAX_LOGPROBS}")


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice ``[start, end)`` of the padded vocabulary; ``vocab_size`` real ids."""

    start: int
    end: int
    vocab_size: int
    group: object = None  # the tensor-parallel process group (None: one rank)
    world: int = 1

    def real(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits with the padding ids at -inf."""
        logits = logits.float()
        if self.end > self.vocab_size:
            logits = logits.clone()
            logits[..., max(0, self.vocab_size - self.start):] = -math.inf
        return logits

    def log_normalizer(self, logits: torch.Tensor) -> torch.Tensor:
        """``logsumexp`` over the whole vocabulary of fp32 logits [n, V/t] -> [n]."""
        local_max = logits.max(dim=-1).values
        top = local_max.clone()
        if self.world > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        total = torch.exp(logits - top.unsqueeze(-1)).sum(dim=-1)
        if self.world > 1:
            dist.all_reduce(total, group=self.group)
        return top + torch.log(total)

    def pick(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The logits [n] at global ``ids`` [n] (each held by one rank)."""
        inside = (ids >= self.start) & (ids < self.end)
        local = (ids - self.start).clamp(0, self.end - self.start - 1)
        out = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        if self.world > 1:
            dist.all_reduce(out, group=self.group)
        return out

    def top(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global top ``k`` [n, k] (values, ids), by value and then by id, the same on every rank."""
        k_local = min(k, self.end - self.start)
        values, ids = logits.topk(k_local, dim=-1)
        ids = ids + self.start
        if self.world > 1:
            all_values = [torch.empty_like(values) for _ in range(self.world)]
            all_ids = [torch.empty_like(ids) for _ in range(self.world)]
            dist.all_gather(all_values, values.contiguous(), group=self.group)
            dist.all_gather(all_ids, ids.contiguous(), group=self.group)
            values, ids = torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1)
        by_id = ids.argsort(dim=-1, stable=True)
        values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
        by_value = values.argsort(dim=-1, descending=True, stable=True)
        return values.gather(-1, by_value)[..., :k], ids.gather(-1, by_value)[..., :k]


@dataclass
class RowState:
    """What sampling needs to remember of one sequence."""

    params: SamplingParams
    prompt: list[int]
    generator: torch.Generator
    output: list[int] = field(default_factory=list)


def apply_penalties(logits: torch.Tensor, rows: list[RowState], shard: VocabShard) -> torch.Tensor:
    """The penalised logits (this rank's shard), a copy when any row has a penalty."""
    if all(r.params.repetition_penalty == 1 and r.params.presence_penalty == 0 and r.params.frequency_penalty == 0
           for r in rows):
        return logits
    logits, size = logits.clone(), shard.end - shard.start
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(row.prompt) | set(row.output)), dtype=torch.long, device=logits.device)
            seen = seen[(seen >= shard.start) & (seen < shard.end)] - shard.start
            z = logits[i, seen]
            logits[i, seen] = torch.where(z > 0, z / p.repetition_penalty, z * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output:
            out = torch.tensor(row.output, dtype=torch.long, device=logits.device)
            out = out[(out >= shard.start) & (out < shard.end)] - shard.start
            counts = torch.bincount(out, minlength=size).to(logits.dtype)
            logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype) + p.frequency_penalty * counts
    return logits


@dataclass
class Choice:
    """The tokens chosen for a batch, with their log-probabilities (None where not asked for)."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def choose(logits: torch.Tensor, rows: list[RowState], shard: VocabShard) -> Choice:
    """The next token of every row from this rank's logits [n, V/t]. Collective over the
    tensor-parallel group (every rank calls it with the same rows)."""
    raw = shard.real(logits)
    wanted = [r.params.logprobs for r in rows]
    lse = shard.log_normalizer(raw) if any(n is not None for n in wanted) else None
    # A penalty can overflow a logit to +inf (several +inf would make the probabilities NaN): the
    # largest finite float keeps the order; NaN (a broken model) is never a candidate.
    scaled = torch.nan_to_num(apply_penalties(raw, rows, shard), nan=-math.inf, posinf=torch.finfo(raw.dtype).max,
                              neginf=-math.inf)
    counts = [1 if r.params.greedy else min(r.params.top_k or shard.vocab_size, shard.vocab_size) for r in rows]
    values, ids = shard.top(scaled, max(counts))  # the temperature does not change the order: applied in _sample
    values, ids = values.cpu(), ids.cpu()
    tokens = []
    for i, row in enumerate(rows):
        k = counts[i]
        tokens.append(int(ids[i, 0]) if k == 1 else _sample(values[i, :k], ids[i, :k], row, shard.vocab_size))
    if lse is None:  # no row asked for log-probabilities: nothing more to compute
        return Choice(tokens, [None] * len(rows), [None] * len(rows))
    chosen = torch.tensor(tokens, device=raw.device)
    logprob = (shard.pick(raw, chosen) - lse).tolist()
    top_lp: list[list[tuple[int, float]] | None] = [None] * len(rows)
    n_top = max((n for n in wanted if n), default=0)
    if n_top:
        top_values, top_ids = shard.top(raw, n_top)
        top_values = (top_values - lse.unsqueeze(-1)).cpu()
        for i, n in enumerate(wanted):
            if n:
                top_lp[i] = list(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist(), strict=True))
    return Choice(tokens, [lp if n is not None else None for lp, n in zip(logprob, wanted, strict=True)], top_lp)


def _sample(values: torch.Tensor, ids: torch.Tensor, row: RowState, vocab_size: int) -> int:
    """One id from candidates sorted by (penalised) logit, with the row's temperature, top-p and
    generator. Only ids with a finite logit are candidates (a prefix: the padding ids are -inf), so
    the choice is a real id whatever the temperature (1e-300 or 1e300) or the logits."""
    values = values.double()
    if values[-1] == -math.inf:
        finite = int((values > -math.inf).sum())
        if finite == 0:  # every logit -inf or NaN (a broken model): the first real id
            return int(ids[ids < vocab_size][0])
        values = values[:finite]
    # Subtracting the largest first keeps a tiny temperature finite: 0 for the best, -inf at worst.
    probs = torch.softmax(values.sub(values[0]).div_(row.params.temperature), dim=-1)
    cumulative = probs.cumsum(dim=-1)
    if row.params.top_p < 1:
        keep = int(((cumulative - probs) < row.params.top_p).sum())  # the smallest prefix reaching top_p
        cumulative = cumulative[:max(1, keep)]
    u = torch.rand((), generator=row.generator, dtype=torch.float64) * cumulative[-1]
    index = min(int(torch.searchsorted(cumulative, u, right=True)), cumulative.numel() - 1)
    return int(ids[index])
