"""Memory measured: the storages autograd saves for the backward (via ``saved_tensors_hooks``), and the model
states an optimizer holds (``measured_model_state_bytes``, by ``model_states``' headings).

``SavedActivations(exclude)`` is a context manager. Every tensor saved for the backward inside it
is counted by its storage (``untyped_storage().data_ptr()`` on its device), each storage once: a
view saved by two ops, or the QKV output that a view of v keeps alive, costs its storage's bytes
once. Storages of ``exclude`` (the parameters: model states, not activations) are left out.

- ``total``: bytes of the storages saved inside the block (for one forward: what
  ``megatron.memory.activations.activation_bytes_per_microbatch`` predicts);
- ``live`` / ``peak``: bytes of those storages still referenced by a graph now / at most. The hooks
  wrap each saved tensor in a holder; when autograd drops it (the backward has used it, or the graph is
  freed) the holder's release is counted, so a pipeline schedule's peak can be read across its
  forwards and backwards.

What the hooks do not see: tensors a ``torch.utils.checkpoint`` region saves inside itself (recomputed
in the backward: by design), and the checkpoint's non-tensor arguments (the rope cos/sin tuple of a
recomputed layer: alive, referenced by the checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from megatron.memory.model_states import ModelStateBytes


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


class _Holder:
    """A saved tensor as autograd keeps it; its release is reported to the meter."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: SavedActivations, key: tuple[str, int]):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedActivations:
    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.exclude = {storage_key(t) for t in exclude}
        self.refs: dict[tuple[str, int], int] = {}  # storage -> holders alive
        self.sizes: dict[tuple[str, int], int] = {}
        self.total = self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        key = storage_key(t)
        nbytes = t.untyped_storage().nbytes()
        if key in self.exclude or nbytes == 0:
            return t
        if not self.refs.get(key):
            self.sizes[key] = nbytes
            self.total += nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Holder(t, self, key)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Holder) else packed

    def _release(self, key: tuple[str, int]) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def measure_microbatch(model: torch.nn.Module, forward_step: Callable, micro_batch: Any) -> int:
    """Bytes saved for the backward by one micro-batch's training forward: ``forward_step(micro_batch,
    model)`` and its ``loss_fn`` (the contract of ``megatron.pipeline_parallel.schedules``), parameters
    excluded. The backward is then run, which releases the graph."""
    with SavedActivations(exclude=model.parameters()) as saved:
        output, loss_fn = forward_step(micro_batch, model)
        loss, _ = loss_fn(output)
    loss.backward()
    return saved.total


def measured_model_state_bytes(optimizer) -> ModelStateBytes:
    """What a ``MixedPrecisionOptimizer`` and its buffer hold now, by the same headings (AdamW's
    scalar step counters left out)."""
    def nbytes(t) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    buf = optimizer.buffer
    states = sum(nbytes(t) for state in optimizer.inner.state.values() for t in state.values()
                 if torch.is_tensor(t) and t.numel() > 1)
    return ModelStateBytes(parameters=nbytes(buf.param_data) + nbytes(buf.param_shard),
                           gradients=nbytes(buf.grad_data) + nbytes(buf.grad_shard),
                           master_weights=nbytes(optimizer.master_data), optimizer_states=states,
                           cpu_gradients=nbytes(optimizer.cpu_grad), offload=optimizer.offload)
