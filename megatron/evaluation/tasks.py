"""The evaluation tasks' samples: which tokens a window holds and which of its predictions count.

A ``Sample`` is up to ``seq_len + 1`` token ids and a mask over its ``len - 1`` predictions (the
prediction at ``j`` is of token ``j + 1``). The figures are lm-eval's (lm-evaluation-harness 0.4):

- **Perplexity: rolling windows per document** (lm-eval's ``loglikelihood_rolling`` with its ``hf``
  backend: ``get_rolling_token_windows(context_len=1)``). Each document is scored on its own, its first
  token predicted after the *prefix token* (the tokenizer's BOS where it has one, else its
  end-of-document token: lm-eval's ``prefix_token_id``), in windows of ``seq_len`` predictions,
  each token predicted once (``rolling_samples`` says how the windows fall). Words and bytes are
  counted as lm-eval's rolling tasks count them (``count_words``: ``len(re.split(r"\\s+", doc))``, so
  leading or trailing whitespace counts one more; ``count_bytes``: UTF-8 bytes).
- **Perplexity with overlapping (strided) windows** (Megatron-LM's ``--overlapping-eval``, transformers'
  strided recipe with ``max_length = seq_len + 1``): over the documents joined by the end-of-document
  token, window ``k`` holds tokens ``[k s, k s + seq_len]`` (``s`` the stride); the first window scores
  all its predictions, each later one only its last ``s``, so every token but the very first is scored
  once, each with at least ``seq_len - s`` tokens of context.
- **LAMBADA** (a cloze: predict a passage's last word). *Strict* (lm-eval's ``lambada_openai``): the
  context is the text before the last word, the target ``" " + last word``; as lm-eval's
  ``_encode_pair``, ``context + target`` is tokenized whole and the target is what follows the
  context's own tokens. The answer counts when every target token is the model's argmax.
  *Non-strict* (Megatron-LM's default): the whole text is tokenized and only its last token is the
  target, so a last word split into several tokens needs only its final piece right, given the
  others: an easier and less meaningful score, kept to compare with published figures.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass
class Sample:
    tokens: list[int]
    mask: list[int]  # len(tokens) - 1 entries: 1 where the prediction counts


@dataclass
class ClozeItem:
    """One LAMBADA example in one mode: its context and target, as text and ids, and the sample scoring it."""
    context: str
    target: str
    context_ids: list[int]
    target_ids: list[int]
    sample: Sample


def read_texts(path: str, key: str = "text") -> list[str]:
    """The documents of ``path``: a ``.jsonl``/``.json`` file's ``key`` on each line, or a plain text
    file as one document. ValueError naming the line for a JSON line without the key."""
    with open(path, encoding="utf-8") as f:
        if not path.endswith((".jsonl", ".json")):
            return [f.read()]
        texts = []
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)[key]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}, line {number}: expected a JSON object with a {key!r} string "
                                 f"({type(err).__name__}).") from err
            if not isinstance(value, str):
                raise ValueError(f"{path}, line {number}: {key!r} is not a string.")
            texts.append(value)
    return texts


def check_stride(stride: int | None, seq_len: int) -> int:
    """``stride`` (``--overlapping-eval``; None: ``seq_len``), ValueError unless from 1 to ``seq_len``."""
    stride = stride or seq_len
    if not 0 < stride <= seq_len:
        raise ValueError(f"the stride (--overlapping-eval) must be from 1 to max_seq_len ({seq_len}), got {stride}.")
    return stride


def perplexity_samples(ids: list[int], seq_len: int, stride: int | None = None) -> list[Sample]:
    """Overlapping windows over the token ids ``ids`` (see the module's docstring): every id but the
    first is scored once."""
    stride = check_stride(stride, seq_len)
    targets = len(ids) - 1
    if targets < 1:
        raise ValueError("the text has fewer than 2 tokens: nothing to score.")
    windows = max(-(-max(targets - stride, 0) // stride) + 1, 1)
    samples = []
    for k in range(windows):
        tokens = ids[k * stride: k * stride + seq_len + 1]
        first_scored = 0 if k == 0 else seq_len - stride
        mask = [1 if j >= first_scored else 0 for j in range(len(tokens) - 1)]
        if any(mask):
            samples.append(Sample(tokens, mask))
    return samples


def rolling_samples(doc_ids: list[int], prefix: int, seq_len: int) -> list[Sample]:
    """lm-eval's rolling windows of one document (``get_rolling_token_windows`` with ``context_len=1``):
    every token of ``doc_ids`` scored once, the first after ``prefix``. The first window predicts up to
    ``seq_len`` tokens; each later one the next ``seq_len`` after one token of context, but the last, which
    predicts what remains, takes the ``seq_len + 1`` tokens that end the document (its context reaches back
    into the previous window). No window for an empty document."""
    ids, n = [prefix, *doc_ids], len(doc_ids)
    if n == 0:
        return []
    first = min(seq_len, n)
    samples, predicted = [Sample(ids[:first + 1], [1] * first)], first
    while predicted < n:
        count = min(n - predicted, seq_len)
        end = predicted + count + 1  # ids[predicted + 1:end] are predicted (ids is doc_ids after the prefix)
        tokens = ids[max(0, end - seq_len - 1):end]
        samples.append(Sample(tokens, [0] * (len(tokens) - 1 - count) + [1] * count))
        predicted += count
    return samples


def prefix_token(tokenizer) -> int:
    """What a document's first token is predicted after: BOS where the tokenizer has one, else the
    end-of-document token (lm-eval's ``prefix_token_id``)."""
    return tokenizer.bos if tokenizer.bos is not None else tokenizer.eod


def count_words(text: str) -> int:
    """lm-eval's word count of a rolling-perplexity document (``Task.count_words``)."""
    return len(re.split(r"\s+", text))


def count_bytes(text: str) -> int:
    """lm-eval's byte count of a rolling-perplexity document (``Task.count_bytes``)."""
    return len(text.encode("utf-8"))


def whitespace_words(texts: list[str]) -> int:
    """Whitespace-separated words: the denominator of Megatron-LM's adjusted (strided) perplexity."""
    return sum(len(t.split()) for t in texts)


def cloze_items(texts: list[str], tokenizer, seq_len: int, strict: bool) -> list[ClozeItem]:
    """One item per text: the context and the target (see the module's docstring); a text longer than
    ``seq_len + 1`` tokens keeps its last ones. ValueError naming the text for one that has nothing to
    predict."""
    items = []
    for number, text in enumerate(texts, 1):
        words = text.split()
        if len(words) < 2:
            raise ValueError(f"LAMBADA text {number} has fewer than two words: nothing to predict from.")
        if strict:
            last = words[-1]
            context, target = text[:text.rfind(last)].strip(), " " + last
            context_ids = tokenizer.tokenize(context)
            target_ids = tokenizer.tokenize(context + target)[len(context_ids):]
            if not target_ids:
                raise ValueError(f"LAMBADA text {number}: its last word adds no token to the context's.")
        else:
            ids = tokenizer.tokenize(text)
            context_ids, target_ids = ids[:-1], ids[-1:]
            context, target = tokenizer.detokenize(context_ids), tokenizer.detokenize(target_ids)
        tokens = (context_ids + target_ids)[-(seq_len + 1):]
        n = len(tokens) - 1
        sample = Sample(tokens, [1 if j >= n - len(target_ids) else 0 for j in range(n)])
        items.append(ClozeItem(context, target, context_ids, target_ids, sample))
    return items
