"""Megatron-LM's ``TikTokenizer``: a byte-level BPE in Megatron-LM's tiktoken vocabulary file, run by the
``tiktoken`` library (``pip install tiktoken``; the ``test`` extra installs it)."""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Iterable
from typing import Any

from megatron.tokenizer.base import Tokenizer, TokenizerError, as_id_list, check_file

# Megatron-LM's pre-tokenization patterns (--tiktoken-pattern v1 / v2), for tiktoken's regex engine.
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
          r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
DEFAULT_VOCAB_SIZE = 2**17  # Megatron-LM's when --vocab-size is not given
# Megatron-LM's special tokens take ids 0..6; <SPECIAL_7> ... fill the rest of the reserved ids.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")


class TikTokenizer(Tokenizer):
    """Megatron-LM's tiktoken tokenizer (its ``TikTokenTokenizer``), id for id.

    The vocabulary file (``--tokenizer-model``) is a JSON list of ``{"rank": i, "token_bytes": base64,
    "token_str": str}`` in rank order, the first 256 the single bytes. With ``S = num_special_tokens``
    (``--tiktoken-num-special-tokens``, default 1000) and ``V = vocab_size`` (``--vocab-size``, default
    131072): ids ``0..S-1`` are the special tokens (:data:`SPECIAL_TOKENS`, then ``<SPECIAL_7>`` ... up to
    ``S``), and the file's first ``V - S`` tokens take ids ``S..V-1`` (rank + S); the file must hold at least
    ``V - S`` tokens. ``eod`` is ``</s>`` (2), ``bos`` ``<s>`` (1); ``vocab_size`` is ``V``.

    ``tokenize`` adds no BOS/EOS and, as Megatron-LM's (``allowed_special="all"``), text that spells a special
    token (``</s>``, ``<SPECIAL_9>``) becomes its id. ``detokenize`` is tiktoken's ``decode`` (special tokens
    appear as their text, invalid UTF-8 as U+FFFD).
    """

    def __init__(self, vocab_file: str | os.PathLike[str], pattern: str | None = None,
                 vocab_size: int | None = None, num_special_tokens: int = 1000) -> None:
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError("--tokenizer-type TikTokenizer needs the tiktoken package: pip install tiktoken "
                                 "(the project's test extra installs it).") from None
        self.vocab_file = check_file(vocab_file, "--tokenizer-model", "TikTokenizer")
        self.pattern = "v2" if pattern is None else pattern  # Megatron-LM's default
        if self.pattern not in PATTERNS:
            raise TokenizerError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}.")
        self._vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        self.num_special_tokens = num_special_tokens
        if not len(SPECIAL_TOKENS) <= num_special_tokens < self._vocab_size:
            raise TokenizerError(f"TikTokenizer needs {len(SPECIAL_TOKENS)} <= --tiktoken-num-special-tokens "
                                 f"({num_special_tokens}) < --vocab-size ({self._vocab_size}).")
        ranks = _read_ranks(self.vocab_file, self._vocab_size - num_special_tokens, num_special_tokens)
        specials = [*SPECIAL_TOKENS, *(f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), num_special_tokens))]
        self._encoding = tiktoken.Encoding(name=os.path.basename(os.path.dirname(self.vocab_file)) or "tiktoken",
                                           pat_str=PATTERNS[self.pattern], mergeable_ranks=ranks,
                                           special_tokens={t: i for i, t in enumerate(specials)})

    def tokenize(self, text: str) -> list[int]:
        return self._encoding.encode(text, allowed_special="all")

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # tiktoken encodes a list on a thread pool, without the GIL.
        return self._encoding.encode_batch(list(texts), allowed_special="all")

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._encoding.decode(as_id_list(ids))

    def token_id(self, token: str) -> int | None:
        try:  # a special token's name, or the UTF-8 bytes of one BPE rank
            return self._encoding.encode_single_token(token)
        except KeyError:
            return None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return SPECIAL_TOKENS.index("</s>")

    @property
    def bos(self) -> int:
        return SPECIAL_TOKENS.index("<s>")

    def _init_args(self) -> dict[str, Any]:
        return {"vocab_file": self.vocab_file, "pattern": self.pattern, "vocab_size": self._vocab_size,
                "num_special_tokens": self.num_special_tokens}


def _read_ranks(path: str, count: int, offset: int) -> dict[bytes, int]:
    """The first ``count`` tokens of Megatron-LM's tiktoken vocabulary file, as ``{token bytes: rank + offset}``
    (Megatron-LM's ``reload_mergeable_ranks``, its assertions as TokenizerErrors naming the entry)."""
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"Could not read --tokenizer-model {path} as a tiktoken vocabulary (JSON): "
                             f"{exc}") from None
    if not isinstance(vocab, list):
        raise TokenizerError(f"--tokenizer-model {path} is not a tiktoken vocabulary: expected a JSON list of "
                             f"{{rank, token_bytes, token_str}} objects.")
    if len(vocab) < count:
        raise TokenizerError(f"--tokenizer-model {path} holds {len(vocab)} tokens, but --vocab-size minus "
                             f"--tiktoken-num-special-tokens asks for {count}; give --vocab-size "
                             f"{len(vocab) + offset} or less.")
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(vocab[:count]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise TokenizerError(f"--tokenizer-model {path}: entry {i} is not {{rank: {i}, token_bytes, "
                                 f"token_str}}.")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise TokenizerError(f"--tokenizer-model {path}: entry {i}'s token_bytes is not base64.") from None
        if i < 256 and token != bytes([i]):
            raise TokenizerError(f"--tokenizer-model {path}: entry {i} must be the single byte {i} (the first 256 "
                                 f"tokens are the bytes).")
        if token in ranks:
            raise TokenizerError(f"--tokenizer-model {path}: entry {i} repeats the bytes of entry "
                                 f"{ranks[token] - offset}.")
        ranks[token] = i + offset
    return ranks
