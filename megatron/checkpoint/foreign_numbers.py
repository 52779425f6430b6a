"""One rule for the numbers a checkpoint made elsewhere hands us: every weight, fp32 master and optimizer state read
from Megatron-LM (``from-megatron``, legacy and torch_dist, the distributed optimizer's files included) or Hugging
Face (``from-hf``), and every weight ``tools/generate.py`` and ``tools/serve.py`` load, is

- a tensor of a floating-point dtype (an int32 weight is not a weight: transformers cannot run it, and converting it
  to fp32 would hide that);
- finite: no NaN, no infinity (a NaN master passes a "master equals weight" comparison, since every comparison
  with NaN is False, and a model with one NaN weight generates token 0 forever);
- for Adam's second moment (``exp_avg_sq``, a running mean of squared gradients), never negative (its square root
  divides the step).

A tensor that breaks the rule is refused as it is read, in one line naming the tensor and what is wrong with it
(``CheckpointError``: ``holds 3 NaN values``), so nothing is written and the tools exit 2. Where the line comes from
and what it advises are the caller's (``where``, ``todo``); what is checked, and how the problem is said, is decided
here alone (``what_is_wrong``).

The checks are cheap: each tensor is read once, in chunks of 2^24 elements (a chunk's sum, finite only when each
element is; ``torch.isfinite(...).all()`` where it is not), so no temporary beyond one chunk's is made whatever the
tensor's size (0.015-0.03 s for 512 MiB of fp32 on one thread); the counts in a message are taken only once a tensor has
failed.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Mapping

import torch

from megatron.checkpoint.format import CheckpointError
from megatron.config.bounds import MAX_STEPS

SECOND_MOMENT = "exp_avg_sq"
# How each kind of optimizer state is named in a message (Megatron's names: fp32_param, or param in the distributed
# optimizer's files, is the fp32 master weight)
_KINDS = {"exp_avg": "Adam's exp_avg", "exp_avg_sq": "Adam's exp_avg_sq", "fp32_param": "the fp32 master",
          "param": "the fp32 master"}
# Entries of a Hugging Face state dict that are not weights, left to the converters (which drop or refuse them):
# GPT-2's causal-mask buffers (uint8 or bool in older saves), Llama's rotary frequencies, gpt-oss's MXFP4-quantized
# experts (uint8 blocks and scales; hf_gpt_oss says to dequantize them)
HF_NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", "_blocks", "_scales")
_CHUNK = 1 << 24


def _chunks(t: torch.Tensor) -> Iterable[torch.Tensor]:
    """``t``'s elements in pieces of at most ``_CHUNK`` (views of a contiguous tensor; a strided one whole), in a
    dtype ``isfinite`` takes (float8 has no kernel: its chunks are widened)."""
    flat = t.reshape(-1) if t.is_contiguous() else t
    step = _CHUNK if flat.dim() == 1 else max(flat.numel(), 1)
    for start in range(0, flat.numel(), step):
        piece = flat[start:start + step] if flat.dim() == 1 else flat
        yield piece.float() if piece.element_size() == 1 else piece


def _finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite. A sum is finite only if each of its terms is (NaN and infinity carry
    through every IEEE addition), so a chunk whose sum is finite is settled at the cost of reading it (~30x faster
    than ``isfinite``, which writes a mask); a sum that is not (a NaN, or finite terms beyond the type's range) is
    settled by ``isfinite``."""
    return all(bool(torch.isfinite(piece.sum())) or bool(torch.isfinite(piece).all()) for piece in _chunks(t))


def _count(values: int, what: str) -> str:
    return f"{values} {what} value{'' if values == 1 else 's'}"


def what_is_wrong(t, second_moment: bool = False) -> str | None:
    """What breaks the rule in ``t`` (``is a str, not a tensor``, ``is torch.int32, not a floating-point type``,
    ``holds 3 NaN values and 1 infinite value``, ``holds 2 negative values (...)``), None when nothing does.
    ``second_moment``: ``t`` is Adam's ``exp_avg_sq``, which must not be negative either."""
    if not isinstance(t, torch.Tensor):
        return f"is a {type(t).__name__}, not a tensor"
    if not t.is_floating_point():
        return f"is {t.dtype}, not a floating-point type"
    if not _finite(t):
        nan = sum(int(torch.isnan(piece).sum()) for piece in _chunks(t))
        inf = sum(int(torch.isinf(piece).sum()) for piece in _chunks(t))
        found = [_count(n, what) for n, what in ((nan, "NaN"), (inf, "infinite")) if n]
        return f"holds {' and '.join(found)}"
    if second_moment and t.numel() and float(min(piece.min() for piece in _chunks(t))) < 0:
        negative = sum(int((piece < 0).sum()) for piece in _chunks(t))
        return f"holds {_count(negative, 'negative')} (Adam's second moment is a mean of squares, never negative)"
    return None


def step_problem(value) -> str | None:
    """What is wrong with ``value`` as Adam's step (one number, as a tensor of one element or a plain number; whole,
    finite, from 0 to ``MAX_STEPS``: a step of NaN makes every update NaN, a negative one a bias correction above 1),
    None when nothing is."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return f"is a tensor of {value.numel()} values, not one number"
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is a {type(value).__name__}, not a number"
    if not math.isfinite(value) or value != int(value) or not 0 <= value <= MAX_STEPS:
        return f"is {value!r}, not a whole number from 0 to 2^40"
    return None


def check_weight(name: str, t, where: str, todo: str) -> torch.Tensor:
    """``t``, the weight ``name`` read from ``where``; CheckpointError (``where: the weight NAME holds ...; todo.``)
    when it breaks the rule."""
    wrong = what_is_wrong(t)
    if wrong is not None:
        raise CheckpointError(f"{where}: the weight {name} {wrong}; {todo}.")
    return t


def check_weights(tensors: Mapping[str, object], where: str, todo: str, skip: tuple[str, ...] = ()) -> None:
    """``check_weight`` of each entry of ``tensors`` but those whose name ends with one of ``skip``."""
    for name, t in tensors.items():
        if not name.endswith(skip):
            check_weight(name, t, where, todo)


def check_state(kind: str, name: str, t, where: str, todo: str, shape: tuple | None = None) -> torch.Tensor:
    """``t``, the optimizer state ``kind`` (``exp_avg``, ``exp_avg_sq``, ``fp32_param`` / ``param``: the fp32
    master) of the parameter ``name``, read from ``where``; CheckpointError when it breaks the rule or, given its
    parameter's ``shape``, has another."""
    label = f"{_KINDS.get(kind, kind)} of {name}"
    wrong = what_is_wrong(t, second_moment=kind == SECOND_MOMENT)
    if wrong is None and shape is not None and tuple(t.shape) != tuple(shape):
        wrong = f"has shape {list(t.shape)}, not its parameter's {list(shape)}"
    if wrong is not None:
        raise CheckpointError(f"{where}: {label} {wrong}; {todo}.")
    return t


def check_states(states: Mapping[str, Mapping[str, object]], where: str, todo: str,
                 shapes: Mapping[str, tuple] | None = None) -> None:
    """``check_state`` of every tensor of ``states`` ({kind: {name: tensor}}), against ``shapes`` ({name: the
    parameter's shape}) when given."""
    for kind, by_name in states.items():
        for name, t in by_name.items():
            check_state(kind, name, t, where, todo, None if shapes is None else shapes.get(name))


def first_wrong(named: Iterable[tuple[str, object]]) -> tuple[str, str] | None:
    """(name, what is wrong) of the first tensor of ``named`` that breaks the rule, None when none does."""
    for name, t in named:
        wrong = what_is_wrong(t)
        if wrong is not None:
            return name, wrong
    return None


def checked_hf_weights(read: Callable[[str], dict]) -> Callable[[str], dict]:
    """``read(hf_dir)`` (a Hugging Face folder's state dict), each weight checked as it comes back (not the entries
    ``HF_NOT_WEIGHTS`` names, left to the converters)."""
    @functools.wraps(read)
    def checked(hf_dir: str) -> dict:
        state = read(hf_dir)
        check_weights(state, os.path.normpath(hf_dir), "the folder's weights are damaged (a model with such a weight "
                      "cannot be trained or run): download or save them again", skip=HF_NOT_WEIGHTS)
        return state
    return checked
