"""The perplexity task's figures: lm-eval's (rolling windows per document) and, on request, the
overlapping-window (strided) figures of Megatron-LM and transformers' recipe (see ``tasks``).

lm-eval's rolling-perplexity metrics (``lm_eval/api/metrics.py``), over documents ``d`` with
log-likelihood ``ll_d`` (every token, the first after the prefix token), words ``w_d`` and UTF-8 bytes
``b_d`` (``tasks.count_words`` / ``count_bytes``): ``word_perplexity = exp(-sum ll / sum w)``,
``byte_perplexity = exp(-sum ll / sum b)``, ``bits_per_byte = -sum ll / sum b / ln 2``: weighted over
the corpus, not means of per-document figures. ``token_perplexity = exp(-sum ll / tokens)`` is ours (lm-eval
has no per-token figure; it depends on the tokenizer).
"""

from __future__ import annotations

import math

from megatron.evaluation.tasks import (
    check_stride,
    count_bytes,
    count_words,
    perplexity_samples,
    prefix_token,
    rolling_samples,
    whitespace_words,
)


def plan(texts: list[str], tokenizer, seq_len: int, stride: int | None) -> dict:
    """The samples to score: lm-eval's rolling windows (``"rolling"``) and, when ``stride`` is given, the
    strided windows over the documents joined by the end-of-document token (``"strided"``). ValueError
    for a bad stride or a text of fewer than 2 tokens in all."""
    if stride is not None:
        check_stride(stride, seq_len)
    docs = [tokenizer.tokenize(text) for text in texts]
    prefix = prefix_token(tokenizer)
    samples = {"rolling": [s for ids in docs for s in rolling_samples(ids, prefix, seq_len)]}
    if stride is not None:
        stream = []
        for ids in docs:  # documents joined by the end-of-document token, as the training data is
            stream += ids + [tokenizer.eod]
        samples["strided"] = perplexity_samples(stream[:-1], seq_len, stride)
    return {"samples": samples, "tokens": sum(len(ids) for ids in docs), "seq_len": seq_len, "stride": stride}


def figures(evaluator, texts: list[str], planned: dict) -> dict:
    """The results' fields (see the module's docstring). Collective."""
    rolling = planned["samples"]["rolling"]
    loglikelihood = -evaluator.score(rolling, "perplexity (rolling)", "windows")
    tokens, words, size = planned["tokens"], sum(map(count_words, texts)), sum(map(count_bytes, texts))
    result = {"documents": len(texts), "tokens": tokens, "words": words, "bytes": size, "windows": len(rolling),
              "window": planned["seq_len"], "loglikelihood": loglikelihood,
              "token_perplexity": _exp(-loglikelihood / tokens), "word_perplexity": _exp(-loglikelihood / words),
              "byte_perplexity": _exp(-loglikelihood / size), "bits_per_byte": -loglikelihood / size / math.log(2)}
    if "strided" in planned["samples"]:
        strided = planned["samples"]["strided"]
        scored = sum(sum(s.mask) for s in strided)
        loss = evaluator.score(strided, "perplexity (strided)", "windows") / scored
        megatron_words = whitespace_words(texts)
        ratio = scored / max(megatron_words - 1, 1)  # Megatron-LM's (tokenized - 1) / (words - 1): tokens per word
        result["strided"] = {"stride": planned["stride"], "windows": len(strided), "tokens": scored,
                             "words": megatron_words, "loss": loss, "perplexity": _exp(loss),
                             "adjusted_perplexity": _exp(loss * ratio)}
    return result


def summary(result: dict) -> list[str]:
    """The log lines that name each figure."""
    lines = [f"perplexity, lm-eval's rolling windows ({result['documents']} documents, {result['tokens']} tokens, "
             f"windows of {result['window']}): word_perplexity {result['word_perplexity']:.6g} | byte_perplexity "
             f"{result['byte_perplexity']:.6g} | bits_per_byte {result['bits_per_byte']:.6g} | token_perplexity "
             f"{result['token_perplexity']:.6g}"]
    if "strided" in result:
        s = result["strided"]
        lines.append(f"perplexity, strided windows (stride {s['stride']}, {s['tokens']} tokens): token perplexity "
                     f"{s['perplexity']:.6g} | Megatron-LM's adjusted_perplexity {s['adjusted_perplexity']:.6g}")
    return lines


def _exp(x: float) -> float:
    """exp, infinite past what a float holds (no silent cap: Megatron-LM's min(20, .) hides the number)."""
    return math.exp(x) if x < 709.0 else math.inf
