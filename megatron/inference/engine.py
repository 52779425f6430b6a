"""Generation with a KV cache: a batch of prompts in, tokens streamed out as they are decided.

``InferenceEngine.stream(requests)`` runs one batch (call it on every tensor-parallel rank with the
same requests): the prompts, left-padded to the longest, go through the model in one forward that
fills the KV cache (the *prefill*); then each step feeds every unfinished row's last token (one
forward of ``[1, b]``) and chooses the next ones (``sampling.choose``). A row finishes on the end-of-
document token, a stop string, its ``max_tokens``, the model's last position, or cancellation; it is
then dropped from the cache, so finished rows cost nothing. The model is the training model
(``GPTModel.hidden_states`` with a ``KVCache``): the attention is the same code with and without it.

Cancellation (a server's client that went away) is decided on tensor-parallel rank 0 and shared
with each step, so every rank drops the same rows. The same exchange carries each rank's "this step
failed" flag (an error in the host-side work between the collectives: setting up the batch, the text
of a token): every rank then raises ``BatchError`` at the same point, so the ranks stay in step and
a server can fail that batch and keep serving. An error inside a collective (the model's forward)
cannot be agreed on that way.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.inference.kv_cache import KVCache
from megatron.inference.sampling import RequestError, RowState, SamplingParams, VocabShard, choose
from megatron.inference.text import TextTracker


@dataclass
class Request:
    prompt: list[int]  # token ids
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Event:
    """What happened to request ``index`` in one step: a new ``token`` (None in the final event of a
    row that ended without one), the text it made final, and, in the row's last event, why it ended
    (``stop``, ``length`` or ``cancelled``)."""

    index: int
    token: int | None
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None


@dataclass
class Completion:
    """The whole result of one request (``InferenceEngine.generate``)."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None  # None for the first token (nothing before it)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finish_reason: str | None = None


class BatchError(RuntimeError):
    """The batch failed on some tensor-parallel rank, and every rank raised this at the same step: the
    ranks are still in step (the next batch can run)."""


class PromptError(RequestError):
    """A prompt this model cannot take (empty, out of the vocabulary, or with ``max_tokens`` longer than
    its positions); ``param`` is ``prompt`` or ``max_tokens``."""


class _Row:
    def __init__(self, index: int, request: Request, seed: int, detokenize: Callable):
        self.index, self.request, self.params = index, request, request.params
        generator = torch.Generator().manual_seed(seed)
        self.state = RowState(request.params, list(request.prompt), generator)
        self.text = TextTracker(detokenize, request.params.stop, request.prompt)
        self.last = request.prompt[-1]
        self.rest = ""  # the text held back until the row ended (set when it ends)


class InferenceEngine:
    """Generates from ``model`` (a ``GPTModel`` of this rank's tensor-parallel shard, in eval mode)."""

    def __init__(self, model, config, tokenizer, device: torch.device | str = "cpu"):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.device = torch.device(device)
        ps = parallel_state.get()
        self.tp_group, self.tp_rank, self.tp_size = ps.group("tp"), ps.tp_rank, ps.tp_size
        self.tp_source = ps.ranks.get("tp", [0])[0] if dist.is_initialized() else 0
        self.max_positions = config.model.max_position_embeddings
        self.eod = tokenizer.eod if tokenizer is not None else None
        padded = config.padded_vocab_size
        per_rank = padded // self.tp_size
        # The ids a prompt may hold and sampling may choose: the model's (never the padding rows of the
        # padded vocabulary), and only those the tokenizer can decode.
        self.vocab_size = config.model.vocab_size if tokenizer is None else \
            min(config.model.vocab_size, tokenizer.vocab_size)
        self.shard = VocabShard(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank, self.vocab_size,
                                self.tp_group, self.tp_size)
        # what each layer's attention keeps per token in the KV cache: (heads, key width, value width)
        mixers = [m for layer in model.layers.values()
                  for m in (layer.self_attention, getattr(layer, "mixer", None)) if m is not None]
        self.cache_shapes = {m.layer_number: m.cache_shape for m in mixers if hasattr(m, "cache_shape")}
        # a recurrent layer's (Gated DeltaNet's) fixed-size states per row, in place of keys and values
        self.state_shapes = {m.layer_number: m.state_shapes for m in mixers if hasattr(m, "state_shapes")}
        # the sliding window of each layer that has one: its cache keeps only the keys the window still reaches
        self.cache_windows = {m.layer_number: getattr(m, "window", None) for m in mixers if hasattr(m, "cache_shape")}
        self.dtype = next(model.parameters()).dtype

    # Checking ------------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """RequestError (PromptError for the prompt) naming what is wrong with ``request``, before any work."""
        request.params.check()
        if not request.prompt:
            raise PromptError("prompt is empty: give at least one token.", "prompt")
        n, room, wanted = len(request.prompt), self.max_positions, request.params.max_tokens
        if n + wanted > room:
            tokens = f"{n} token{'s' if n != 1 else ''}"
            raise PromptError(f"prompt has {tokens} and max_tokens is {wanted}, but the model has {room} positions: "
                              f"shorten the prompt or lower max_tokens.", "max_tokens" if wanted >= room else "prompt")
        vocab = self.vocab_size
        bad = [t for t in request.prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise PromptError(f"prompt has token id {bad[0]}, outside the vocabulary (0..{vocab - 1}).", "prompt")

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.detokenize(ids) if self.tokenizer is not None else ""

    # Generating ----------------------------------------------------------------------------------

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Every request's completion (the events of ``stream`` collected)."""
        out = [Completion(list(r.prompt), logprobs=[] if r.params.logprobs is not None else None,
                          top_logprobs=[] if r.params.logprobs else None) for r in requests]
        for events in self.stream(requests):
            for e in events:
                c = out[e.index]
                if isinstance(e, PromptScores):
                    c.prompt_logprobs, c.prompt_top_logprobs = e.logprobs, e.top_logprobs
                    continue
                if e.token is not None:
                    c.tokens.append(e.token)
                    if c.logprobs is not None:
                        c.logprobs.append(e.logprob)
                    if c.top_logprobs is not None:
                        c.top_logprobs.append(e.top_logprobs)
                c.text += e.text
                c.finish_reason = e.finish_reason or c.finish_reason
        return out

    @torch.inference_mode()
    def stream(self, requests: list[Request], cancelled: Callable[[int], bool] | None = None) -> Iterator[list]:
        """Yield, after the prefill and after each step, the events of that step (``Event``, and
        ``PromptScores`` for requests with ``prompt_logprobs``). ``cancelled(index)`` (read on tensor-
        parallel rank 0; the other ranks' answers are ignored) drops a request at the next step. Every rank
        must call this with the same requests."""
        for r in requests:
            self.check(r)  # the same answer on every rank, before any collective
        if not requests:
            return
        failure, rows = None, []
        try:
            longest = max(len(r.prompt) for r in requests)
            pad = torch.tensor([longest - len(r.prompt) for r in requests])
            cache = KVCache(self.cache_shapes, len(requests), longest + max(r.params.max_tokens for r in requests),
                            pad, self.dtype, self.device, self.cache_windows, self.state_shapes)
            tokens = torch.tensor([[0] * (longest - len(r.prompt)) + list(r.prompt) for r in requests],
                                  device=self.device)
        except Exception as error:  # out of memory, say: agreed below, before the first forward
            failure = error
        seeds = self._agree([r.params.seed if r.params.seed is not None else random.SystemRandom().randrange(2**62)
                             for r in requests], failure, "setting up the batch")
        try:
            rows = [_Row(i, r, s, self.detokenize) for i, r, s in zip(range(len(requests)), requests, seeds,
                                                                       strict=True)]
        except Exception as error:
            failure = error
        self._agree([], failure, "setting up the batch")
        hidden = self._forward(tokens, cache)
        first = self._prompt_scores(hidden, tokens, rows, cache)
        logits = self.model.parallel_logits(hidden[-1])
        events: list = list(first)
        rows, logits = self._retire(rows, logits, cache, events, [r.params.max_tokens == 0 for r in rows], "length")
        yield events
        while rows:
            choice = choose(logits, [r.state for r in rows], self.shard)
            events, why, failure = [], [None] * len(rows), None
            try:
                self._step(rows, choice, events, why)
            except Exception as error:
                failure = error
            flags = [bool(cancelled(row.index)) if cancelled is not None and self.tp_rank == 0 else False
                     for row in rows]
            for i, flag in enumerate(self._agree(flags, failure, "a generation step")):
                why[i] = why[i] or ("cancelled" if flag else None)
            for row, reason in zip(rows, why, strict=True):
                if reason is not None:
                    events.append(Event(row.index, None, "" if reason == "cancelled" else row.rest,
                                        finish_reason=reason))
            keep = [i for i, reason in enumerate(why) if reason is None]
            if len(keep) < len(rows) and keep:
                cache.keep(torch.tensor(keep, device=self.device))
            rows = [rows[i] for i in keep]
            yield events
            if rows:
                step = torch.tensor([[row.last for row in rows]], device=self.device).t()
                logits = self.model.parallel_logits(self._forward(step, cache)[-1])

    def _step(self, rows: list[_Row], choice, events: list, why: list) -> None:
        """Record each row's chosen token: its events and, in ``why``, why the row ends (or None)."""
        for i, row in enumerate(rows):
            token = choice.tokens[i]
            row.state.output.append(token)
            row.last = token
            ended = self._ended(row, token)
            if ended != "eod":  # the end-of-document token ends the text; it is not part of it
                text = row.text.add(token)
                events.append(Event(row.index, token, text, choice.logprobs[i], choice.top_logprobs[i]))
                ended = ended or ("stop" if row.text.stopped else None)
            why[i] = "stop" if ended == "eod" else ended
            if why[i] is not None:
                row.rest = row.text.finish()  # the text held back, final now
    def _forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run ``tokens`` [b, s] through the model after the cached slots; the hidden states [s, b, h]."""
        count = tokens.shape[1]
        cache.begin(count)
        positions = cache.positions(cache.length, count)
        hidden = self.model.hidden_states(tokens, positions, cache)
        cache.commit()
        return hidden

    def _ended(self, row: _Row, token: int) -> str | None:
        """Why ``row`` ends with ``token`` ("eod", "stop" is found by the text tracker, "length"), or None."""
        if token == self.eod and not row.params.ignore_eos:
            return "eod"
        produced = len(row.state.output)
        if produced >= row.params.max_tokens or len(row.request.prompt) + produced >= self.max_positions:
            return "length"
        return None

    def _retire(self, rows, logits, cache, events, done, why):
        """Drop the rows flagged in ``done`` (after the prefill: ``max_tokens`` 0, scoring only)."""
        if not any(done):
            return rows, logits
        for row, d in zip(rows, done, strict=True):
            if d:
                events.append(Event(row.index, None, "", finish_reason=why))
        keep = [i for i, d in enumerate(done) if not d]
        if keep:
            index = torch.tensor(keep, device=self.device)
            cache.keep(index)
            logits = logits.index_select(0, index)
        return [rows[i] for i in keep], logits

    def _prompt_scores(self, hidden, tokens, rows, cache) -> list:
        """The log-probability of each prompt token given those before it (and, with ``logprobs n``,
        the ``n`` most likely tokens there), for the rows that ask."""
        wanted = [i for i, r in enumerate(rows) if r.params.prompt_logprobs]
        if not wanted or tokens.shape[1] < 2:
            return [PromptScores(rows[i].index, [None] * len(rows[i].request.prompt)) for i in wanted]
        index = torch.tensor(wanted, device=self.device)
        logits = self.shard.real(self.model.parallel_logits(hidden[:-1].index_select(1, index)))  # [s-1, n, V/tp]
        flat = logits.reshape(-1, logits.shape[-1])
        lse = self.shard.log_normalizer(flat)
        labels = tokens.index_select(0, index)[:, 1:].t().reshape(-1)
        logprob = (self.shard.pick(flat, labels) - lse).view(logits.shape[:2]).cpu()
        n_top = max(rows[i].params.logprobs or 0 for i in wanted)
        if n_top:
            values, ids = self.shard.top(flat, n_top)
            top_values = (values - lse.unsqueeze(-1)).view(*logits.shape[:2], n_top).cpu()
            top_ids = ids.view(*logits.shape[:2], n_top).cpu()
        pads = cache.pad.index_select(0, index).tolist()
        scores = []
        for j, (i, pad) in enumerate(zip(wanted, pads, strict=True)):
            n = rows[i].params.logprobs or 0
            top = None
            if n:
                top = [None] + [list(zip(top_ids[s, j, :n].tolist(), top_values[s, j, :n].tolist(), strict=True))
                                for s in range(pad, logits.shape[0])]
            scores.append(PromptScores(rows[i].index, [None] + logprob[pad:, j].tolist(), top))
        return scores

    # Agreement between tensor-parallel ranks ----------------------------------------------------

    def _agree(self, values: list[int], failure: Exception | None, where: str) -> list[int]:
        """Tensor-parallel rank 0's ``values`` (seeds, cancellation flags), on every rank; then, when
        any rank's ``failure`` is set, ``BatchError`` on every rank at this same point. One all-reduce
        (a sum: the other ranks add zeros) carries both; one rank needs none."""
        failed = [self.tp_rank] if failure is not None else []
        if self.tp_size > 1:
            box = torch.zeros(len(values) + self.tp_size, dtype=torch.long, device=self.device)
            if self.tp_rank == 0:
                box[:len(values)] = torch.tensor(values, dtype=torch.long)
            box[len(values) + self.tp_rank] = failure is not None
            dist.all_reduce(box, group=self.tp_group)
            values = box[:len(values)].tolist()
            failed = [r for r, flag in enumerate(box[len(values):].tolist()) if flag]
        if failed:
            if failure is not None:
                raise BatchError(f"{where} failed: {type(failure).__name__}: {_first_line(failure)}") from failure
            raise BatchError(f"{where} failed on tensor-parallel rank{'s' if len(failed) > 1 else ''} "
                             f"{', '.join(map(str, failed))} (its log says why)")
        return values


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


@dataclass
class PromptScores:
    """The prompt's per-token log-probabilities of request ``index`` (sent once, after the prefill)."""

    index: int
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None] | None = None  # with logprobs n > 0; None for the first
