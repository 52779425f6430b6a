"""Tokenizers for real data, by Megatron-LM's ``--tokenizer-type`` names: GPT-2 byte-level BPE, SentencePiece
(three names), Hugging Face tokenizer.json, tiktoken, and the NullTokenizer of pre-tokenized data.

``build_tokenizer`` takes a type and the files and arguments of the ``tokenizer:`` config section (plus
``--vocab-size`` for NullTokenizer and TikTokenizer); ``pad_vocab_size`` gives the embedding's padded row count.
Every problem with the arguments or the files is a :class:`TokenizerError` (a ``ValueError``) whose message
names the flag and the path. tools/train_tokenizer.py trains tokenizers that these classes load.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from megatron.tokenizer.base import Tokenizer, TokenizerError, pad_vocab_size
from megatron.tokenizer.hf import EOD_CANDIDATES, GPT2_EOD_TOKEN, GPT2BPETokenizer, HuggingFaceTokenizer
from megatron.tokenizer.null import NullTokenizer
from megatron.tokenizer.sp import GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer
from megatron.tokenizer.tik import TikTokenizer

if TYPE_CHECKING:
    from megatron.config.schema import TokenizerConfig

__all__ = [
    "EOD_CANDIDATES",
    "GPT2_EOD_TOKEN",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TOKENIZER_TYPES",
    "TikTokenizer",
    "Tokenizer",
    "TokenizerError",
    "build_tokenizer",
    "configured_tokenizer",
    "pad_vocab_size",
]

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer")
_SENTENCEPIECE = {"SentencePieceTokenizer": SentencePieceTokenizer,
                  "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer, "Llama2Tokenizer": Llama2Tokenizer}

PathArg = str | os.PathLike[str] | None


def _require(value: PathArg, flag: str, tokenizer_type: str) -> PathArg:
    if value is None or str(value) == "":
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag}, which was not given.")
    return value


def build_tokenizer(tokenizer_type: str, vocab_file: PathArg = None, merge_file: PathArg = None,
                    tokenizer_model: PathArg = None, eod_token: str | None = None, *, vocab_size: int | None = None,
                    tiktoken_pattern: str | None = None, tiktoken_num_special_tokens: int = 1000) -> Tokenizer:
    """The tokenizer named by ``tokenizer_type`` (one of :data:`TOKENIZER_TYPES`), loaded from its files.

    - ``GPT2BPETokenizer``: ``vocab_file`` (vocab.json) and ``merge_file`` (merges.txt).
    - ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``: ``tokenizer_model``
      (a SentencePiece .model).
    - ``HuggingFaceTokenizer``: ``tokenizer_model`` (a tokenizer.json, or a folder holding one); ``eod_token``
      overrides the end-of-document token it would otherwise look up.
    - ``TikTokenizer``: ``tokenizer_model`` (Megatron-LM's tiktoken vocabulary JSON), ``tiktoken_pattern``
      (v1 or v2, default v2), ``tiktoken_num_special_tokens`` and ``vocab_size`` (default 131072).
    - ``NullTokenizer``: ``vocab_size`` (required); no files.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_require(vocab_file, "--vocab-file", tokenizer_type),
                                _require(merge_file, "--merge-file", tokenizer_type))
    if tokenizer_type in _SENTENCEPIECE:
        return _SENTENCEPIECE[tokenizer_type](_require(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_require(tokenizer_model, "--tokenizer-model", tokenizer_type), eod_token)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(_require(tokenizer_model, "--tokenizer-model", tokenizer_type), tiktoken_pattern,
                            vocab_size, tiktoken_num_special_tokens)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}.")


def configured_tokenizer(section: TokenizerConfig, vocab_size: int | None = None) -> Tokenizer | None:
    """The tokenizer the config's ``tokenizer:`` section names, loaded from its files (built once per run:
    its vocabulary size goes to validation, the tokenizer itself to the datasets); None when the section names
    none (mock data). ``vocab_size`` is the config's ``Model.vocab_size`` (``--vocab-size``): NullTokenizer's
    and TikTokenizer's argument, as in Megatron-LM; the other types ignore it. TokenizerError as
    ``build_tokenizer``."""
    from megatron.config import infer_tokenizer_type

    infer_tokenizer_type(section)  # vocab and merges files without a type: GPT-2 BPE, as Megatron-LM's examples
    if section.tokenizer_type is None:
        return None
    return build_tokenizer(section.tokenizer_type, section.vocab_file, section.merge_file, section.tokenizer_model,
                           section.eod_token, vocab_size=vocab_size, tiktoken_pattern=section.tiktoken_pattern,
                           tiktoken_num_special_tokens=section.tiktoken_num_special_tokens)
