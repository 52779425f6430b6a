"""Tokenizers built on the Hugging Face ``tokenizers`` library: GPT-2's byte-level BPE and any tokenizer.json."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from megatron.tokenizer.base import Tokenizer, TokenizerError, as_id_list, check_file

GPT2_EOD_TOKEN = "<|endoftext|>"

# End-of-document tokens looked for, in this order, when HuggingFaceTokenizer is given no eod_token:
# GPT-2 / GPT-NeoX / StarCoder, Llama 2 / Mistral / T5, Llama 3 base, Gemma, Llama 3 instruct.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


def _vocab_size(tok: tokenizers.Tokenizer) -> int:
    """Model vocabulary plus added tokens, as the library counts it; max id + 1 should the ids have gaps."""
    size = tok.get_vocab_size(with_added_tokens=True)
    vocab = tok.get_vocab(with_added_tokens=True)
    return max(size, max(vocab.values(), default=-1) + 1)


class _LibraryTokenizer(Tokenizer):
    """Encoding and decoding through a ``tokenizers.Tokenizer`` held in ``self._tok``."""

    _tok: tokenizers.Tokenizer
    _vocab_size: int
    _eod: int

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.21) skips the offsets, which are not needed here; both run
        # in parallel on the library's thread pool (TOKENIZERS_PARALLELISM=false turns that off).
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [encoding.ids for encoding in encode(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode(as_id_list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def spelling(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or self.detokenize([token_id])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod


class GPT2BPETokenizer(_LibraryTokenizer):
    """GPT-2's byte-level BPE, read from a GPT-2 ``vocab.json`` (token -> id) and ``merges.txt`` (ranked merges).

    The pipeline is GPT-2's: its regex pre-tokenizer on bytes mapped to printable characters, no prefix space,
    merges applied by rank, no unknown token. As in OpenAI's encoder and Megatron-LM, ``<|endoftext|>`` is
    only the end-of-document id (``eod``): the literal text "<|endoftext|>" inside a document is encoded as
    ordinary text, so documents cannot forge document boundaries.
    """

    def __init__(self, vocab_file: str | os.PathLike[str], merge_file: str | os.PathLike[str]) -> None:
        self.vocab_file = check_file(vocab_file, "--vocab-file", "GPT2BPETokenizer")
        self.merge_file = check_file(merge_file, "--merge-file", "GPT2BPETokenizer")
        try:
            model = models.BPE.from_file(self.vocab_file, self.merge_file)
        except Exception as exc:
            raise TokenizerError(f"Could not read the GPT-2 BPE from --vocab-file {self.vocab_file} and "
                                 f"--merge-file {self.merge_file}: {exc}") from exc
        tok = tokenizers.Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        eod = tok.token_to_id(GPT2_EOD_TOKEN)
        if eod is None:
            raise TokenizerError(f"--vocab-file {self.vocab_file} has no {GPT2_EOD_TOKEN} token, GPT-2's "
                                 "end-of-document token.")
        self._tok = tok
        self._eod = eod
        self._vocab_size = _vocab_size(tok)

    def _init_args(self) -> dict[str, Any]:
        return {"vocab_file": self.vocab_file, "merge_file": self.merge_file}


class HuggingFaceTokenizer(_LibraryTokenizer):
    """Any tokenizer saved as a Hugging Face ``tokenizer.json`` (the file, or a folder that holds it).

    Encoding adds no special tokens (no BOS/EOS from the post-processor), and truncation and padding saved in
    the file are turned off. Text that spells one of the file's added tokens still becomes that token's id, as
    the file specifies. ``eod`` is ``eod_token``'s id, or else the first of :data:`EOD_CANDIDATES` in the
    vocabulary.
    """

    def __init__(self, tokenizer_json: str | os.PathLike[str], eod_token: str | None = None) -> None:
        path = tokenizer_json
        if path is not None and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
            if not os.path.isfile(path):
                raise TokenizerError(f"--tokenizer-model folder {os.path.abspath(tokenizer_json)} has no "
                                     "tokenizer.json.")
        self.tokenizer_json = check_file(path, "--tokenizer-model", "HuggingFaceTokenizer")
        try:
            tok = tokenizers.Tokenizer.from_file(self.tokenizer_json)
        except Exception as exc:
            raise TokenizerError(f"Could not read --tokenizer-model {self.tokenizer_json} as a Hugging Face "
                                 f"tokenizer.json: {exc}") from exc
        tok.no_truncation()
        tok.no_padding()
        self.eod_token = eod_token
        if eod_token is not None:
            eod = tok.token_to_id(eod_token)
            if eod is None:
                raise TokenizerError(f"The eod token {eod_token!r} is not in the vocabulary of --tokenizer-model "
                                     f"{self.tokenizer_json}.")
        else:
            found = [tok.token_to_id(t) for t in EOD_CANDIDATES if tok.token_to_id(t) is not None]
            if not found:
                raise TokenizerError(f"--tokenizer-model {self.tokenizer_json} has none of the known end-of-document "
                                     f"tokens {', '.join(EOD_CANDIDATES)}; pass --eod-token naming it.")
            eod = found[0]
        self._tok = tok
        self._eod = eod
        self._vocab_size = _vocab_size(tok)

    def _init_args(self) -> dict[str, Any]:
        return {"tokenizer_json": self.tokenizer_json, "eod_token": self.eod_token}
