"""Megatron-LM's ``NullTokenizer``: no vocabulary file, for data that is already token ids."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from megatron.tokenizer.base import Tokenizer, TokenizerError, as_id_list


class NullTokenizer(Tokenizer):
    """Ids written as text: ``tokenize("11 325 97") == [11, 325, 97]`` and ``detokenize`` joins them with
    single spaces.

    As Megatron-LM's (since April 2026): ``vocab_size`` is ``--vocab-size`` ``N`` exactly, and the
    end-of-document id is its last id, ``N - 1`` (so ``--vocab-size 50257`` gives GPT-2's ``<|endoftext|>``,
    50256). Megatron-LM's legacy class had ``N + 1`` ids with ``eod = N``: for data made that way, pass
    ``--vocab-size N+1``. Any whitespace separates ids (Megatron-LM splits on single spaces); a word that is
    not an integer in ``[0, N)`` is a TokenizerError naming it. No BOS.
    """

    def __init__(self, vocab_size: int | None) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size N: the number of token ids of "
                                 "the pre-tokenized data (ids 0..N-1, end-of-document N-1).")
        if vocab_size < 2:
            raise TokenizerError(f"--tokenizer-type NullTokenizer needs --vocab-size of at least 2 (ids and an "
                                 f"end-of-document id), got {vocab_size}.")
        self._vocab_size = vocab_size

    def tokenize(self, text: str) -> list[int]:
        words = text.split()
        try:
            ids = [int(word) for word in words]
        except ValueError:
            bad = next(w for w in words if not _is_int(w))
            raise TokenizerError(f"NullTokenizer reads whitespace-separated integer token ids, but the text holds "
                                 f"{bad[:40]!r}; give pre-tokenized text such as '11 325 97'.") from None
        out = [i for i in ids if not 0 <= i < self._vocab_size]
        if out:
            raise TokenizerError(f"NullTokenizer: token id {out[0]} is outside --vocab-size {self._vocab_size} "
                                 f"(ids 0..{self._vocab_size - 1}); raise --vocab-size to cover the data's ids.")
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(i) for i in as_id_list(ids))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    def _init_args(self) -> dict[str, Any]:
        return {"vocab_size": self._vocab_size}


def _is_int(word: str) -> bool:
    try:
        int(word)
    except ValueError:
        return False
    return True
