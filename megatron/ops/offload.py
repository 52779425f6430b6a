"""Activation offloading (Megatron-LM's ``--cpu-offloading-num-layers`` and ``--fine-grained-activation-offloading``):
what chosen parts of the decoder layers save for the backward goes to host memory in the forward and comes back in
the backward, through ``torch.autograd.graph.saved_tensors_hooks`` (torch's ``save_on_cpu`` pattern).

The model runs each such part through its one seam, ``ops.seams.maybe_checkpoint(..., offload=region)``; the recipe
step ``megatron.offload.apply_offload`` hands the modules their regions (``ActivationOffload.region``: one offloader
per model chunk, the layer's ``"layer"`` region and its modules' by Megatron's names). A recomputed part has no
region: the checkpoint keeps nothing of it to offload.

- **pack** (in the forward): a saved tensor whose storage holds at least ``min_elements`` elements (Megatron's
  ``--min-offloaded-tensor-size``, here counted on the storage, so all views of one storage go alike) is copied to
  host, its whole storage once per layer (q, k and v, views of the QKV output, share one copy), unless it is a
  parameter or one of the region's further arguments (the rope tables every layer shares, the experts' stacked
  weights; the attention core's region offloads all of its arguments, q, k and v).
  The packed device tensors are held until the layer's forward ends (a copy then has completed and no address is
  reused while storages are matched by address), then dropped: their memory is free for the next layers.
- **unpack** (in the backward): the storage copied back to the device and the view rebuilt on it, bitwise equal.
- **prefetch** (double buffering): the backward of a layer's output brings back that layer's tensors (when not
  brought yet) and starts bringing back those of the layer before it in the same micro-batch, so one layer's copy
  runs while the other computes; at most two layers' tensors are on the device at a time.

On CUDA the host buffers are pinned, the copies asynchronous on two side streams (``device.CopyStream``: to host,
to the device). On the CPU, where device memory is host memory, the same path copies into a separate buffer and
back: it exercises the mechanism and saves nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from megatron.device import CopyStream

NO_OFFLOAD: Mapping[str, OffloadRegion] = MappingProxyType({})  # every module's default: nothing offloaded


class ActivationOffload:
    """One model chunk's offloader. ``packed_bytes``: host bytes packed so far (each storage once per layer and
    micro-batch; ``reset``); ``trace`` (tests): ``packed`` lists ``(region, layer, shape)`` of every tensor
    packed."""

    def __init__(self, min_elements: int = 1 << 20, trace: bool = False):
        self.min_elements = min_elements
        self.packed_bytes = 0
        self.packed: list[tuple[str, int, tuple[int, ...]]] | None = [] if trace else None
        self._open: _Group | None = None  # the layer being run forward
        self._last: weakref.ref | None = None  # the layer run forward before it
        self._streams: dict[torch.device, tuple[CopyStream, CopyStream]] = {}

    def region(self, name: str, layer_number: int, packs: bool = True) -> OffloadRegion:
        """The region of part ``name`` of layer ``layer_number``; ``packs`` False: it only opens the layer's group
        (its modules' regions pack into it), so that the layer's backward prefetches."""
        return OffloadRegion(self, name, layer_number, packs, all_arguments=name == "core_attn")

    def reset(self) -> None:
        self.packed_bytes = 0
        if self.packed is not None:
            self.packed.clear()

    def streams(self, device: torch.device) -> tuple[CopyStream, CopyStream]:
        """(to host, to the device) side streams of ``device``."""
        if device not in self._streams:
            self._streams[device] = (CopyStream(device), CopyStream(device))
        return self._streams[device]


class OffloadRegion:
    """A part of a layer whose saves go to host: ``run(fn, *args)`` is ``fn(*args)`` with them offloaded."""

    def __init__(self, offload: ActivationOffload, name: str, layer_number: int, packs: bool,
                 all_arguments: bool = False):
        self.offload, self.name, self.layer_number, self.packs = offload, name, layer_number, packs
        self.all_arguments = all_arguments  # else only the first: the others stay on the device

    def __repr__(self) -> str:
        return f"OffloadRegion({self.name!r}, layer={self.layer_number}, packs={self.packs})"

    def run(self, fn: Callable, *args: Any) -> Any:
        off = self.offload
        group = None
        if off._open is None:  # the outermost region of a layer opens its group
            group = off._open = _Group(off, self.layer_number)
        try:
            if self.packs:
                # hooks already active (a memory meter) still see what this region leaves on the device
                outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
                kept = set() if self.all_arguments else _storages_of(args[1:])
                pack = partial(off._open.pack, self.name, kept, outer)
                with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                    out = fn(*args)
            else:
                out = fn(*args)
        finally:
            if group is not None:
                off._open = None
                group.close()
        if group is not None and torch.is_tensor(out) and out.requires_grad:
            return _Reload.apply(out, group)
        return out


def _storages_of(args: Iterable[Any]) -> set[int]:
    """The storages of the tensors among ``args`` (a tuple's too: rope's cos, sin)."""
    return {t.untyped_storage().data_ptr() for arg in args for t in (arg if isinstance(arg, (tuple, list)) else (arg,))
            if torch.is_tensor(t) and t.device.type != "meta"}


class _Stored:
    """One storage packed: its host copy, and its device copy once brought back."""

    __slots__ = ("host", "device", "nbytes")

    def __init__(self, host: torch.Tensor, nbytes: int):
        self.host, self.device, self.nbytes = host, None, nbytes


class _Group:
    """What one layer's forward packed, by storage address; ``previous``: the layer packed before it in the same
    micro-batch (its backward comes next)."""

    def __init__(self, offload: ActivationOffload, layer_number: int):
        self.offload, self.layer_number = offload, layer_number
        self.stored: dict[int, _Stored] = {}
        self.alive: list[torch.Tensor] = []  # the device tensors packed, until the layer's forward ends
        self.copied = self.loaded = None  # events: the copies to host, back to the device (CUDA)
        self.device: torch.device | None = None  # of the tensors packed
        last = offload._last() if offload._last is not None else None
        self.previous = last if last is not None and last.layer_number < layer_number else None

    def pack(self, name: str, kept: set[int], outer: tuple[Callable, Callable] | None, t: torch.Tensor) -> Any:
        if not self._offloads(t, kept):
            return t if outer is None else _Outer(outer[0](t), outer[1])
        storage = t.untyped_storage()
        key, off = storage.data_ptr(), self.offload
        if key not in self.stored:
            to_host, _ = off.streams(t.device)
            host = CopyStream.host_bytes(storage.nbytes(), t.device)
            with to_host:
                host.copy_(_bytes_of(storage, t.device), non_blocking=True)
            self.stored[key] = _Stored(host, storage.nbytes())
            self.device = t.device
            self.alive.append(t)
            off.packed_bytes += storage.nbytes()
        if off.packed is not None:
            off.packed.append((name, self.layer_number, tuple(t.shape)))
        return self, key, t.dtype, t.device, t.storage_offset(), t.size(), t.stride()

    def _offloads(self, t: torch.Tensor, kept: set[int]) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # a weight, or its transpose
            return False
        if t.layout != torch.strided or t.device.type == "meta":
            return False
        storage = t.untyped_storage()
        return storage.nbytes() >= self.offload.min_elements * t.element_size() and storage.data_ptr() not in kept

    def close(self) -> None:
        """The layer's forward has ended: the device tensors packed are dropped once their copies are done."""
        if self.alive:
            self.copied = self.offload.streams(self.device)[0].done(*self.alive)
        self.alive = []
        self.offload._last = weakref.ref(self)

    def reload(self) -> None:
        """Bring every storage of the layer back to the device (asynchronously on CUDA), once."""
        waiting = [s for s in self.stored.values() if s.device is None]
        if not waiting:
            return
        _, to_device = self.offload.streams(self.device)
        with to_device:
            to_device.after(self.copied)
            for s in waiting:
                s.device = torch.empty(s.nbytes, dtype=torch.uint8, device=self.device)
                s.device.copy_(s.host, non_blocking=True)
        self.loaded = to_device.done()

    def unpack(self, key: int, dtype: torch.dtype, offset: int, size: torch.Size, stride: tuple[int, ...],
               device: torch.device) -> torch.Tensor:
        self.reload()
        buf = self.stored[key].device
        CopyStream.wait(self.loaded, buf)
        return torch.empty(0, dtype=dtype, device=device).set_(buf.untyped_storage(), offset, size, stride)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The whole ``storage`` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class _Outer:
    """A tensor left on the device, packed by the hooks that were active around the region."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable):
        self.packed, self.unpack = packed, unpack


def _unpack(packed: Any) -> torch.Tensor:
    if torch.is_tensor(packed):
        return packed
    if isinstance(packed, _Outer):
        return packed.unpack(packed.packed)
    group, key, dtype, device, offset, size, stride = packed
    return group.unpack(key, dtype, offset, size, stride, device)


class _Reload(torch.autograd.Function):
    """Identity on a layer's output; its backward, which runs before the layer's, brings the layer's tensors back
    and starts bringing back those of the layer before it (the prefetch)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: _Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.group.reload()
        if ctx.group.previous is not None:
            ctx.group.previous.reload()
        return grad, None
