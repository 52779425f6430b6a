"""An lm-evaluation-harness model backed by a checkpoint of this project, at any layout.

    import lm_eval
    from megatron.evaluation.lm_eval_model import MegatronLM

    lm = MegatronLM("output/run", args=["--tp", "2"], batch_size=16)   # under torchrun --nproc-per-node 2
    results = lm_eval.simple_evaluate(model=lm, tasks=["lambada_openai"])
    if lm.is_main:
        print(results["results"])

Registered with lm-eval as ``megatron-gpt`` (``simple_evaluate(model="megatron-gpt", model_args="load=RUN")``
once this module is imported). ``args``: pretrain_gpt.py flags, as tools/evaluate.py takes them: the
checkpoint's saved configuration is the base, the flags set the layout (``--tp``, ``--pp``, ``--dp``,
``--sharding-stage``, ...), ``--micro-batch-size`` and, if you like, a shorter ``--max-seq-len`` (the
model's ``max_length`` for lm-eval). The tokenizer is the checkpoint's.

The requests are answered as lm-eval's Hugging Face backend (``HFLM``) answers them, so the numbers can
stand next to a published lm-eval table:

- ``loglikelihood``: (context, continuation) encoded by lm-eval's ``TemplateLM`` (trailing spaces of the
  context move to the continuation; an empty context is the end-of-document token), sorted longest first,
  ``batch_size`` per forward; ``(context + continuation)[-(max_length + 1):]`` goes in, the continuation's
  log-probabilities are summed, and ``is_greedy`` says every continuation token is the argmax.
- ``loglikelihood_rolling``: lm-eval's rolling windows of ``max_length`` tokens (``get_rolling_token_windows``
  with one token of context, made disjoint): the document's first token is scored after the end-of-document
  token, each later window scores only its new tokens; the windows' log-likelihoods are summed per document.
- ``generate_until``: the context left-truncated to ``max_length - max_gen_toks`` tokens; greedy (or sampled
  with ``do_sample``/``temperature``/``top_k``/``top_p``, from a generator seeded by ``seed``) until the
  end-of-document token, ``max_gen_toks`` tokens or one of the ``until`` strings (the text is cut before
  the first one). Each new token is one forward of the whole sequence (the training forward, at any
  layout; there is no KV cache here: tools/serve.py has one, at tensor parallelism).

Under torchrun every rank runs lm-eval's evaluator on the same requests (lm-eval sees one process: ``rank``
0 of ``world_size`` 1, so it does not split the data itself), and each model call is one collective call of
``Scorer``, whose results every rank gets; ``is_main`` (global rank 0) is the one that writes.
"""

from __future__ import annotations

import shlex

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megatron.evaluation.loading import configure, load_evaluator
from megatron.evaluation.scorer import Scorer
from megatron.progress import Progress


@register_model("megatron-gpt")
class MegatronLM(TemplateLM):
    """lm-eval's ``LM`` over the checkpoint ``load`` (a run folder or a step folder)."""

    def __init__(self, load: str | None = None, args: list[str] | str = (), batch_size: int | str | None = None,
                 max_gen_toks: int = 256, seed: int = 1234, evaluator=None, tokenizer=None, **_lm_eval_options):
        super().__init__()
        if evaluator is None:
            args = shlex.split(args) if isinstance(args, str) else list(args)
            config, tokenizer = configure([*(["--load", load] if load else []), *args])
            evaluator = load_evaluator(config, progress=False)
        self.evaluator, self.scorer, self.tok = evaluator, Scorer(evaluator), tokenizer
        self.is_main = evaluator.ps.rank == 0
        mbs = evaluator.config.batch_size.micro_batch_size
        default = mbs * max(1, evaluator.ps.pp_size) * evaluator.ps.data_parallel_size
        self.batch_size = int(batch_size) if str(batch_size).isdigit() and int(batch_size) > 0 else default
        self._max_gen_toks = int(max_gen_toks)
        self.generator = torch.Generator().manual_seed(int(seed))

    # What lm-eval asks of a model -------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.tokenize(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.detokenize(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results = []
        bar = Progress("loglikelihood", total=len(requests), unit="requests", enabled=not disable_tqdm and self.is_main)
        for chunk in order.get_batched(n=override_bs or self.batch_size):
            samples = []
            for _, context, continuation in chunk:
                tokens = (context + continuation)[-(self.max_length + 1):]
                samples.append((tokens, min(len(continuation), len(tokens) - 1)))
            scored = iter(self.scorer.loglikelihoods([s for s in samples if s[1] > 0]))
            answers = [next(scored) if n > 0 else (0.0, True) for _, n in samples]  # nothing to score: HFLM's too
            for (request, _, _), answer in zip(chunk, answers, strict=True):
                results.append(answer)
                if request is not None:  # rolling windows are cached per document instead
                    self.cache_hook.add_partial("loglikelihood", request, answer)
                bar.update(1)
        bar.close()
        return order.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, counts = [], []
        for (text,) in (r.args for r in requests):
            made = [(None, *make_disjoint_window(w)) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            windows += made
            counts.append(len(made))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals, at = [], 0
        for request, count in zip(requests, counts, strict=True):
            total = sum(score for score, _ in scores[at:at + count])
            at += count
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        order = Collator([r.args for r in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])
        results = []
        bar = Progress("generate_until", total=len(requests), unit="requests",
                       enabled=not disable_tqdm and self.is_main)
        for chunk in order.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id]))
            budget = kwargs.pop("max_gen_toks")
            if budget >= self.max_length:
                raise ValueError(f"max_gen_toks ({budget}) must be less than the model's max_length "
                                 f"({self.max_length}): lower it in the task's generation_kwargs or --gen-kwargs.")
            prompts = [self.tok_encode(c)[-(self.max_length - budget):] for c in contexts]
            for context, text in zip(chunk, self._generate(prompts, until, budget, kwargs), strict=True):
                results.append(text)
                self.cache_hook.add_partial("generate_until", context, text)
                bar.update(1)
        bar.close()
        return order.get_original(results)

    def _generate(self, prompts: list[list[int]], until: list[str], budget: int, kwargs: dict) -> list[str]:
        """Each prompt's continuation, cut before the first ``until`` string (see the module's docstring)."""
        made: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        while active:
            logprobs = self.scorer.next_logprobs([prompts[i] + made[i] for i in active])
            chosen = self._choose(logprobs, kwargs)
            still = []
            for i, token in zip(active, chosen, strict=True):
                if token == self.eot_token_id:
                    continue
                made[i].append(token)
                text = self.tok_decode(made[i])
                if len(made[i]) < budget and not any(s and s in text for s in until):
                    still.append(i)
            active = still
        return [postprocess_generated_text(self.tok_decode(m), until, None) for m in made]

    def _choose(self, logprobs: torch.Tensor, kwargs: dict) -> list[int]:
        """The next token of each row: the argmax, or a draw (the same on every rank: the same generator)."""
        temperature = float(kwargs.get("temperature") or 0.0)
        if not kwargs.get("do_sample") or temperature == 0.0:
            return logprobs.argmax(-1).tolist()
        scores = logprobs / temperature
        top_k = int(kwargs.get("top_k") or 0)
        if 0 < top_k < scores.shape[-1]:
            kth = scores.topk(top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        top_p = float(kwargs.get("top_p") or 1.0)
        if top_p < 1.0:
            ordered, index = scores.sort(dim=-1, descending=True)
            before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # the mass ahead of each token
            scores = scores.scatter(-1, index, ordered.masked_fill(before >= top_p, float("-inf")))
        return torch.multinomial(scores.softmax(-1), 1, generator=self.generator).squeeze(-1).tolist()
