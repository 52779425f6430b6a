"""A SentencePiece model (Llama 2, T5, Mistral style, or one trained by tools/train_tokenizer.py)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import sentencepiece

from megatron.tokenizer.base import Tokenizer, TokenizerError, as_id_list, check_file


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model read from its serialized ``.model`` file (unigram or BPE).

    No BOS/EOS is added when encoding; ``eod`` is the model's EOS id, and ``vocab_size`` its number of pieces.
    """

    def __init__(self, model_file: str | os.PathLike[str]) -> None:
        self.model_file = check_file(model_file, "--tokenizer-model", "SentencePieceTokenizer")
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

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def _init_args(self) -> dict[str, Any]:
        return {"model_file": self.model_file}
