"""The evaluation tasks' samples: which tokens a window holds and which of its predictions count.

A ``Sample`` is up to ``seq_len + 1`` token ids and a mask over its ``len - 1`` predictions (the
prediction at ``j`` is of token ``j + 1``). Both tasks follow Megatron-LM's ``tasks/zeroshot_gpt``
(and FleetX's ``tools/eval.py``):

- **Perplexity with overlapping windows.** Window ``k`` holds tokens ``[k s, k s + seq_len]``
  (``s`` the stride, ``--overlapping-eval``); the first window scores all its predictions, each later
  one only its last ``s``, so every token but the first is scored exactly once, each with at least
  ``seq_len - s`` tokens of context. (This is also transformers' strided-perplexity recipe with
  ``max_length = seq_len + 1``.)
- **LAMBADA** (a cloze: predict a passage's last word). *Strict*: the context is the text before the
  last word, the target every token of ``" " + last word`` (tokenized with its leading space, as it
  appears in running text); the answer counts when every target token is the model's argmax.
  *Non-strict* (Megatron-LM's default): the whole text is tokenized and only its last token is the
  target, so a last word split into several tokens needs only its final piece right, given the
  others: an easier and less meaningful score, kept to compare with published figures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class Sample:
    tokens: list[int]
    mask: list[int]  # len(tokens) - 1 entries: 1 where the prediction counts


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


def perplexity_samples(ids: list[int], seq_len: int, stride: int | None = None) -> list[Sample]:
    """Overlapping windows over the token ids ``ids`` (see the module's docstring)."""
    stride = stride or seq_len
    if not 0 < stride <= seq_len:
        raise ValueError(f"the stride (--overlapping-eval) must be from 1 to max_seq_len ({seq_len}), got {stride}.")
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


def lambada_samples(texts: list[str], tokenize, seq_len: int, strict: bool) -> list[Sample]:
    """One sample per text: the context and the target (see the module's docstring); a text longer than
    ``seq_len + 1`` tokens keeps its last ones."""
    samples = []
    for number, text in enumerate(texts, 1):
        words = text.split()
        if len(words) < 2:
            raise ValueError(f"LAMBADA text {number} has fewer than two words: nothing to predict from.")
        if strict:
            last = words[-1]
            context, target = tokenize(text[:text.rfind(last)].strip()), tokenize(" " + last)
        else:
            ids = tokenize(text)
            context, target = ids[:-1], ids[-1:]
        tokens = (context + target)[-(seq_len + 1):]
        n = len(tokens) - 1
        samples.append(Sample(tokens, [1 if j >= n - len(target) else 0 for j in range(n)]))
    return samples


def word_count(texts: list[str]) -> int:
    """Whitespace-separated words: the denominator of the word-level ("adjusted") perplexity."""
    return sum(len(t.split()) for t in texts)
