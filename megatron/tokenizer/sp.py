"""SentencePiece models (Llama 2, T5, Mistral style, or one trained by tools/train_tokenizer.py), under
Megatron-LM's three names for them."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import sentencepiece

from megatron.tokenizer.base import Tokenizer, TokenizerError, as_id_list, check_file


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model read from its serialized ``.model`` file (unigram or BPE).

    As Megatron-LM's SentencePiece library tokenizer: ``tokenize`` is the model's plain ``encode`` (no BOS or
    EOS is added, and text spelling a control piece such as ``</s>`` is ordinary text); ``eod`` is the model's
    EOS id, ``bos`` its BOS id (None if it has none), ``vocab_size`` its number of pieces; ``detokenize`` is
    the model's ``decode`` (control pieces decode to nothing).
    """

    def __init__(self, model_file: str | os.PathLike[str]) -> None:
        self.model_file = check_file(model_file, "--tokenizer-model", self.name)
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.Load(self.model_file)
        except Exception as exc:
            raise TokenizerError(f"Could not read --tokenizer-model {self.model_file} as a SentencePiece model: "
                                 f"{exc}") from exc
        eod = processor.eos_id()
        if eod < 0:
            raise TokenizerError(f"--tokenizer-model {self.model_file} has no EOS piece (it was trained with "
                                 "eos_id=-1), so it has no end-of-document id.")
        self._sp = processor
        self._eod = eod
        self._vocab_size = processor.get_piece_size()

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # SentencePiece encodes a list on its own thread pool.
        return self._sp.encode(list(texts), out_type=int)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode(as_id_list(ids))

    def token_id(self, token: str) -> int | None:
        token_id = self._sp.piece_to_id(token)  # an unknown piece gives the <unk> id
        return token_id if self._sp.id_to_piece(token_id) == token else None

    def spelling(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int | None:
        bos = self._sp.bos_id()
        return bos if bos >= 0 else None

    def _init_args(self) -> dict[str, Any]:
        return {"model_file": self.model_file}


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron-LM's ``GPTSentencePieceTokenizer``: the same SentencePiece library tokenizer in Megatron-LM
    today (its legacy class, removed in February 2026, encoded and decoded the same way too, with
    ``eod`` the model's EOS id)."""


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM's ``Llama2Tokenizer``: the same SentencePiece library tokenizer in Megatron-LM today, so
    ``tokenize`` adds no BOS. (Megatron-LM's legacy class, removed in February 2026, put BOS before every
    document it encoded; data preprocessed with it starts each document with ``bos``.)"""
