"""Bytes that autograd saves for the backward, measured with ``saved_tensors_hooks``.

``SavedBytes(model, owners)`` is a context manager: every tensor saved for the backward inside it
is counted by its storage, each storage once (views of one tensor, or a tensor saved by two
operations, cost its bytes once), parameters excluded (they are model states, not activations).
``owners``: module types whose forwards are tracked; a storage saved while one of them runs is
attributed to it (the innermost), so ``by_owner[ColumnParallelLinear]`` is what those layers keep.
The graph must stay alive while counting (keep the output): a freed storage's address can be reused.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


class SavedBytes:
    def __init__(self, model: nn.Module, owners: tuple[type, ...] = ()):
        self.params = {_storage_key(p) for p in model.parameters()}
        self.storages: dict[tuple[str, int], tuple[int, type | None]] = {}  # key -> (bytes, owner)
        self._running: list[type] = []
        self._handles = []
        for module in model.modules():
            if isinstance(module, owners):
                self._handles.append(module.register_forward_pre_hook(self._enter_owner))
                self._handles.append(module.register_forward_hook(self._leave_owner))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _enter_owner(self, module: nn.Module, _args) -> None:
        self._running.append(type(module))

    def _leave_owner(self, *_) -> None:  # returns None: the module's output stays as it is
        self._running.pop()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.params and key not in self.storages and t.untyped_storage().nbytes():
            self.storages[key] = (t.untyped_storage().nbytes(), self._running[-1] if self._running else None)
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()

    @property
    def total(self) -> int:
        return sum(n for n, _ in self.storages.values())

    @property
    def by_owner(self) -> dict[type | None, int]:
        out: dict[type | None, int] = defaultdict(int)
        for n, owner in self.storages.values():
            out[owner] += n
        return dict(out)
