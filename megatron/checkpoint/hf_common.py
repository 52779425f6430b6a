"""What the Hugging Face mappings (``hf_gpt2``, ``hf_llama``) share: the error, the name check, the
vocabulary padding rows, and turning derived config values into our command-line flags."""

from __future__ import annotations

import torch


class ConversionError(ValueError):
    """A state dict or configuration that does not describe our GPT (the message says what differs)."""


def check_names(got: set[str], want: set[str], what: str, hint: str = "check num_layers") -> None:
    """ConversionError naming the first missing and the first unexpected tensor, if any."""
    missing, extra = sorted(want - got), sorted(got - want)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} (first {missing[0]!r})")
        if extra:
            parts.append(f"unexpected {len(extra)} (first {extra[0]!r})")
        raise ConversionError(f"{what} does not match the model configuration: {', '.join(parts)}; {hint}.")


def unpad_vocab(t: torch.Tensor, vocab: int, name: str) -> torch.Tensor:
    """The first ``vocab`` rows of a ``[padded_vocab, h]`` tensor (the padding rows are dropped)."""
    if t.shape[0] < vocab:
        raise ConversionError(f"{name} has {t.shape[0]} rows, fewer than vocab_size {vocab}.")
    return t[:vocab]


def pad_vocab(t: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """``[V, h]`` -> ``[padded_vocab, h]``, the added rows zero."""
    return torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])


def check_vocab_shape(t: torch.Tensor, name: str, vocab: int, hidden: int, padded_vocab: int) -> None:
    if tuple(t.shape) != (vocab, hidden):
        raise ConversionError(f"{name} has shape {list(t.shape)}, expected [{vocab}, {hidden}] "
                              f"(vocab_size, hidden_size).")
    if padded_vocab < vocab:
        raise ConversionError(f"padded_vocab ({padded_vocab}) is smaller than vocab_size ({vocab}).")


def to_flags(values: dict) -> list[str]:
    """``{"hidden_size": 64, "swiglu": True, "untie_...": False}`` -> ``["--hidden-size", "64", "--swiglu"]``
    (a True boolean is its bare flag, a False one is left out: every boolean model flag defaults to off)."""
    flags = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags
