"""The tokenizer interface, its error type and the vocabulary padding rule."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any


class TokenizerError(ValueError):
    """A tokenizer could not be built: a missing argument, a missing or unreadable file, no end-of-document token."""


class Tokenizer(ABC):
    """Text <-> token ids, as the data pipeline needs them.

    Subclasses read their vocabulary from files given to the constructor. Pickling sends only the constructor's
    arguments (absolute file paths), and unpickling reloads from those files, so a tokenizer is cheap to send to
    DataLoader workers or multiprocessing pools on the same machine.
    """

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The ids of ``text``; no BOS/EOS or other special tokens are added."""

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """``[self.tokenize(t) for t in texts]``; subclasses use their library's batch encoder."""
        return [self.tokenize(text) for text in texts]

    @abstractmethod
    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` (a list, tuple, NumPy array or 1-D tensor of ints); special tokens are kept."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The number of ids the tokenizer can produce (max id + 1), special tokens included; not padded."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """The end-of-document id that separates documents in the token stream."""

    @property
    def bos(self) -> int | None:
        """The beginning-of-sequence id, or None when the tokenizer has none. Informational: ``tokenize``
        never adds it."""
        return None

    def token_id(self, token: str) -> int | None:
        """The id of the vocabulary entry spelled ``token`` as the tokenizer's files spell it (a special token
        such as ``<fim_prefix>`` or ``</s>``), or None when the vocabulary has no such single entry; ``token`` is
        looked up, not encoded. None here: a tokenizer without token spellings (NullTokenizer)."""
        return None

    def spelling(self, token_id: int) -> str:
        """How the tokenizer's files spell ``token_id`` (a special token's name, such as ``<|endoftext|>`` or
        ``</s>``, where ``detokenize`` may give nothing); the id's text by default."""
        return self.detokenize([token_id])

    @property
    def name(self) -> str:
        """The ``--tokenizer-type`` of this tokenizer (Megatron-LM's class names)."""
        return type(self).__name__

    # Pickling: the constructor's keyword arguments only; __setstate__ reloads the files.
    @abstractmethod
    def _init_args(self) -> dict[str, Any]:
        """The keyword arguments that rebuild this tokenizer with ``type(self)(**args)``."""

    def __getstate__(self) -> dict[str, Any]:
        return self._init_args()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._init_args().items())
        return f"{self.name}({args})"


def pad_vocab_size(vocab_size: int, tensor_parallel_size: int = 1, multiple: int = 128) -> int:
    """Round ``vocab_size`` up to a multiple of ``multiple * tensor_parallel_size`` (Megatron's padded vocab).

    The embedding and output layers are split across tensor-parallel ranks, and each shard should be a
    multiple of ``multiple`` rows for efficient kernels: 50257 -> 50304, and 51200 with 8 ranks.
    """
    for arg, value in (("vocab_size", vocab_size), ("tensor_parallel_size", tensor_parallel_size),
                       ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pad_vocab_size: {arg} must be a positive integer, got {value!r}")
    step = multiple * tensor_parallel_size
    return -(-vocab_size // step) * step


def check_file(path: str | os.PathLike[str] | None, flag: str, tokenizer_type: str) -> str:
    """The absolute path of an existing file passed as ``flag``, else a TokenizerError naming the flag."""
    if path is None or str(path) == "":
        raise TokenizerError(f"{tokenizer_type} needs {flag}, which was not given.")
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise TokenizerError(f"{flag} {path} does not exist.")
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} {path} is not a file.")
    return path


def as_id_list(ids: Iterable[int]) -> list[int]:
    """Plain Python ints from a list, tuple, NumPy array or tensor of ids."""
    tolist = getattr(ids, "tolist", None)
    if tolist is not None:
        ids = tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]
