"""Random streams for tensor-parallel regions, and activation recompute that replays them.

Dropout on a *replicated* activation (e.g. after the row-parallel reduction) must draw the
same mask on every tensor-parallel rank, so it uses the default generator, seeded with the
same ``seed`` on all of them. Dropout on a *sharded* activation (attention probabilities of
this rank's heads) must draw independent masks per rank, or the shards' masks would be
copies of each other; it runs inside ``get_rng_tracker().fork()``, the tensor-parallel stream
seeded with ``seed + 2718 + tp_rank`` (Megatron-LM's offset) by ``tensor_parallel_seed``.

``fork`` swaps the tracked state into the default generator of the tracker's device (the
CPU generator, or the current CUDA device's), runs the block, stores the advanced state back
and restores the default one, so the default stream is unaffected by forked draws.

``checkpoint(function, *args)`` recomputes ``function`` in the backward (non-reentrant
``torch.utils.checkpoint``) with the default generator *and* every tracked stream reset to
their states at the forward, so both kinds of dropout masks replay exactly; both are put back
afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from megatron import device as dev

# The per-tensor-parallel-rank stream. Its name is Megatron-LM's, and the key of the state saved in
# checkpoints' RNG files: keep it, or older checkpoints lose the stream on resume.
TENSOR_PARALLEL_RNG = "model-parallel"
TENSOR_PARALLEL_SEED_OFFSET = 2718
CONTEXT_PARALLEL_SEED_OFFSET = 100_003  # x cp_rank: beyond every tensor-parallel stream's seed + 2718 + tp_rank
# The seeds of positional attention dropout (megatron.attention.dropout): one draw per micro-batch, alike on
# every rank (seed + 2717: no tp or cp offset, below every tensor-parallel stream's seed).
ATTENTION_DROPOUT_RNG = "positional-dropout"  # after "model-parallel" in sorted order (checkpoints list them so)
ATTENTION_DROPOUT_SEED_OFFSET = 2717


class RNGStatesTracker:
    """Named generator states for one device, swapped into its default generator by ``fork``."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self, device: torch.device | str | None = None) -> None:
        if device is not None:
            self.device = torch.device(device)
        self._states.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int) -> None:
        if seed in self._seeds:
            raise ValueError(f"seed {seed} already tracked")
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already tracked")
        self._seeds.add(seed)
        self._states[name] = dev.seeded_rng_state(seed, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every tracked state (to save, or to restore with ``set_states``)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Those of ``states`` (a checkpoint's older set keeps the streams it lacks as seeded)."""
        self._states.update({name: state.clone() for name, state in states.items()})

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the default generator in the tracked state ``name``."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} is not tracked (call tensor_parallel_seed first)")
        outside = dev.rng_state(self.device)
        dev.set_rng_state(self._states[name], self.device)
        try:
            yield
        finally:
            self._states[name] = dev.rng_state(self.device)
            dev.set_rng_state(outside, self.device)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Megatron-LM's ``get_cuda_rng_tracker``)."""
    return _TRACKER


def tensor_parallel_seed(seed: int, tp_rank: int, device: torch.device | str | None = None, cp_rank: int = 0) -> None:
    """Seed the default generators with ``seed`` (equal on the tensor-parallel ranks) and track the
    tensor-parallel stream (``TENSOR_PARALLEL_RNG``) seeded with ``seed + 2718 + tp_rank`` (distinct
    per rank) on ``device`` (default: torch's default device).

    Context-parallel ranks hold different tokens (and, with a2a attention, different heads): both
    streams move by ``CONTEXT_PARALLEL_SEED_OFFSET x cp_rank``, so no two chunks of a sample draw the
    same dropout mask. The ``ATTENTION_DROPOUT_RNG`` stream (seed + 2717) is alike on every rank: positional
    attention dropout draws its masks from global positions (``megatron.attention.dropout``)."""
    device = torch.get_default_device() if device is None else torch.device(device)
    device = dev.with_index(device)
    _TRACKER.reset(device)
    offset = seed + CONTEXT_PARALLEL_SEED_OFFSET * cp_rank
    torch.manual_seed(offset)
    _TRACKER.add(TENSOR_PARALLEL_RNG, offset + TENSOR_PARALLEL_SEED_OFFSET + tp_rank)
    _TRACKER.add(ATTENTION_DROPOUT_RNG, seed + ATTENTION_DROPOUT_SEED_OFFSET)  # alike on every rank


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, its activations recomputed in the backward instead of stored.

    The recompute runs with the default generator of the tracker's device and all tracked
    states reset to their values when this was called (torch's checkpoint also restores the
    CPU generator and those of the inputs' devices), then puts the states of the backward
    back, so dropout inside and outside ``fork`` replays the forward's masks exactly.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    replay = _ReplayRNG(get_rng_tracker())
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=lambda: (contextlib.nullcontext(), replay))


class _ReplayRNG:
    """Context manager (re-enterable: one entry per recompute) that swaps in the RNG states
    captured at construction and restores the current ones on exit."""

    def __init__(self, tracker: RNGStatesTracker):
        self.tracker = tracker
        self.forward = (tracker.get_states(), dev.rng_state(tracker.device))
        self._outer: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []

    def __enter__(self) -> None:
        self._outer.append((self.tracker.get_states(), dev.rng_state(self.tracker.device)))
        self.tracker.set_states(self.forward[0])
        dev.set_rng_state(self.forward[1], self.tracker.device)

    def __exit__(self, *exc: object) -> None:
        states, default = self._outer.pop()
        self.tracker.set_states(states)
        dev.set_rng_state(default, self.tracker.device)
