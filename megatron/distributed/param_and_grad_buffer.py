"""Contiguous parameter and gradient buffers, cut into buckets, each bucket sharded N ways.

All trainable parameters are re-pointed into one flat tensor in the model's dtype, and their
fp32 gradients ("main grads") live in one flat fp32 tensor with the same layout. The layout is
a sequence of **buckets**, in reverse parameter order (the backward produces the last layers'
gradients first, so the first buckets fill first). Within a bucket the weight-decay parameters
(matrices) come first, then the others (biases, norms); each bucket is padded with zeros to a
multiple of the sharding degree N, and rank r of the sharding group **owns the r-th contiguous
slice of every bucket** (ZeRO, as Megatron-LM's distributed optimizer). A bucket is the unit of
communication: all-reduced (stage 0/1), reduce-scattered into the owner's gradient shard
(stage 2/3), and, under stage 3, all-gathered before use and freed after.

Storage by sharding stage (P = parameters on this rank):

| stage | parameters | full gradients | gradient shard |
| --- | --- | --- | --- |
| 0, 1 | P, one flat tensor | P, persistent | (a view of the full gradients) |
| 2 | P, one flat tensor | P during the backward, then freed | P/N, persistent |
| 3 | P/N persistent shard; a bucket's P_b while gathered | P_b while its backward runs | P/N, persistent |

Gradient flow: for fp32 parameters ``param.grad`` *is* the main-grad view, and autograd
accumulates into it in place (a hook repairs the link if ``param.grad`` was reset). For
bf16/fp16 parameters a post-accumulate hook adds ``param.grad`` into the fp32
``param.main_grad`` and frees it, so accumulation over micro-batches happens in fp32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn


@dataclass(frozen=True)
class ParamRange:
    name: str
    start: int
    end: int
    shape: torch.Size


@dataclass
class Bucket:
    """``[start, end)`` in the buffer; ``[start, decay_end)`` holds weight-decay parameters;
    ``shard``: this rank's ``[a, b)`` slice; ``shard_offset``: where it starts in the shard tensors."""

    index: int
    start: int
    end: int
    decay_end: int
    shard: tuple[int, int]
    shard_offset: int
    params: list = field(default_factory=list)  # (parameter, start, end)
    param_data: torch.Tensor | None = None  # the gathered parameters (stage 3: own storage, freed between uses)
    grad_data: torch.Tensor | None = None  # the full gradients, while they exist

    @property
    def numel(self) -> int:
        return self.end - self.start


def _decay(p: nn.Parameter) -> bool:
    return p.ndim >= 2  # biases and norm weights (1-D) get no weight decay


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _materialize(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() != nbytes:
        t.untyped_storage().resize_(nbytes)


class ParamAndGradBuffer:
    """``buckets``: lists of (name, parameter), in the order their gradients become ready.
    ``pad_multiple``/``shard_rank``: the sharding degree N and this rank's index in the group.
    ``shard_grads`` (stage >= 2): a persistent gradient shard; the full gradients come and go.
    ``shard_params`` (stage 3): every bucket keeps its own parameter storage, freed after sharding."""

    def __init__(self, buckets: list[list[tuple[str, nn.Parameter]]], pad_multiple: int = 1, shard_rank: int = 0,
                 grad_dtype: torch.dtype = torch.float32, shard_grads: bool = False, shard_params: bool = False):
        params = [p for bucket in buckets for _, p in bucket]
        if not params:
            raise ValueError("no trainable parameters")
        first = params[0]
        self.dtype = first.dtype
        self.device = first.deferred_init.device if first.is_meta else first.device
        self.grad_dtype, self.pad_multiple = grad_dtype, pad_multiple
        self.shard_grads, self.shard_params = shard_grads or shard_params, shard_params
        self.ranges: list[ParamRange] = []
        self.buckets: list[Bucket] = []
        self.params: list[tuple[nn.Parameter, int, int]] = []
        self._location: dict[int, tuple[Bucket, int, int]] = {}
        offset = shard_offset = 0
        for index, bucket_params in enumerate(b for b in buckets if b):
            ordered = [(n, p) for n, p in bucket_params if _decay(p)] + [(n, p) for n, p in bucket_params
                                                                        if not _decay(p)]
            start = offset
            bucket = Bucket(index, start, 0, start, (0, 0), shard_offset)
            for name, p in ordered:
                end = offset + p.numel()
                self.ranges.append(ParamRange(name, offset, end, p.shape))
                bucket.params.append((p, offset, end))
                self.params.append((p, offset, end))
                if _decay(p):
                    bucket.decay_end = end
                offset = end
            offset = start + -(-(offset - start) // pad_multiple) * pad_multiple
            self._location.update({id(p): (bucket, s, e) for p, s, e in bucket.params})
            bucket.end = offset
            size = bucket.numel // pad_multiple
            bucket.shard = (start + shard_rank * size, start + (shard_rank + 1) * size)
            shard_offset += size
            self.buckets.append(bucket)
        self.numel, self.shard_numel = offset, shard_offset
        self.param_data = None if shard_params else torch.zeros(offset, dtype=self.dtype, device=self.device)
        self.param_shard = torch.zeros(shard_offset, dtype=self.dtype, device=self.device) if shard_params else None
        self.grad_data = torch.zeros(0 if self.shard_grads else offset, dtype=grad_dtype, device=self.device)
        self.grad_shard = torch.zeros(shard_offset if self.shard_grads else 0, dtype=grad_dtype, device=self.device)
        for bucket in self.buckets:
            if shard_params:
                bucket.param_data = torch.zeros(bucket.numel, dtype=self.dtype, device=self.device)
            else:
                bucket.param_data = self.param_data[bucket.start:bucket.end]
            for p, start, end in bucket.params:
                local = slice(start - bucket.start, end - bucket.start)
                view = bucket.param_data[local].view_as(p)
                if p.is_meta:  # built on the meta device: initialise now, into the bucket
                    view.copy_(p.deferred_init())
                    _swap_in(p, view)
                else:
                    view.copy_(p.detach())
                    p.data = view
                p.register_post_accumulate_grad_hook(partial(self._accumulate_main_grad, bucket))
            if shard_params:  # keep this rank's slice, free the rest
                a, b = bucket.shard
                self.shard_param(bucket).copy_(bucket.param_data[a - bucket.start:b - bucket.start])
                _free(bucket.param_data)
                self._point_grads(bucket, None)
            elif not self.shard_grads:
                self._point_grads(bucket, self.grad_data[bucket.start:bucket.end])
            else:  # stage 2: the full buffer comes with zero_grad (or bucket by bucket, lazily)
                self._point_grads(bucket, None)

    # Views of this rank's shard ---------------------------------------------------------------

    def _shard_index(self, bucket: Bucket, a: int, b: int) -> slice:
        lo, hi = bucket.shard
        assert lo <= a <= b <= hi, "range outside this rank's shard"
        return slice(bucket.shard_offset + a - lo, bucket.shard_offset + b - lo)

    def shard_param(self, bucket: Bucket, a: int | None = None, b: int | None = None) -> torch.Tensor:
        """The stored parameters of ``[a, b)`` (default: this rank's whole slice of ``bucket``)."""
        a, b = (bucket.shard if a is None else (a, b))
        if self.shard_params:
            return self.param_shard[self._shard_index(bucket, a, b)]
        return self.param_data[a:b]

    def shard_grad(self, bucket: Bucket, a: int | None = None, b: int | None = None) -> torch.Tensor:
        """The reduced gradients of ``[a, b)`` this rank steps (default: its whole slice of ``bucket``)."""
        a, b = (bucket.shard if a is None else (a, b))
        if self.shard_grads:
            return self.grad_shard[self._shard_index(bucket, a, b)]
        return self.grad_data[a:b]

    def pieces(self) -> list[tuple[Bucket, int, int, bool]]:
        """This rank's shard cut at the weight-decay boundary: (bucket, start, end, decay)."""
        out = []
        for bucket in self.buckets:
            a, b = bucket.shard
            for lo, hi, decay in ((a, min(b, bucket.decay_end), True), (max(a, bucket.decay_end), b, False)):
                if lo < hi:
                    out.append((bucket, lo, hi, decay))
        return out

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """After the gradient sync: the part of ``param``'s reduced gradient this rank holds (all of
        it unless the gradients are sharded; None if its shard holds none of ``param``)."""
        bucket, start, end = self._location[id(param)]
        if not self.shard_grads:
            return param.main_grad
        lo, hi = max(start, bucket.shard[0]), min(end, bucket.shard[1])
        return self.shard_grad(bucket, lo, hi) if lo < hi else None

    # Gradients ----------------------------------------------------------------------------------

    def _point_grads(self, bucket: Bucket, grads: torch.Tensor | None) -> None:
        bucket.grad_data = grads
        for p, start, end in bucket.params:
            p.main_grad = None if grads is None else grads[start - bucket.start:end - bucket.start].view_as(p)
            p.grad = p.main_grad if p.dtype == self.grad_dtype else None

    def allocate_bucket_grads(self, bucket: Bucket) -> None:
        """Zeroed full gradients for one bucket (stage 3, before its backward)."""
        if bucket.grad_data is None:
            self._point_grads(bucket, torch.zeros(bucket.numel, dtype=self.grad_dtype, device=self.device))

    def release_bucket_grads(self, bucket: Bucket) -> None:
        self._point_grads(bucket, None)

    def zero_grad(self) -> None:
        """Before a step's first backward: zero the gradients this rank keeps; stage 2 allocates the
        full buffer again, stage 3 allocates each bucket's as its backward begins."""
        self.grad_shard.zero_()
        if self.shard_params:
            return
        if self.shard_grads:
            self.allocate_grads()
        else:
            self.grad_data.zero_()

    def allocate_grads(self) -> None:
        """A fresh zeroed full gradient buffer, the parameters' main grads pointed into it."""
        self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, device=self.device)
        for bucket in self.buckets:
            self._point_grads(bucket, self.grad_data[bucket.start:bucket.end])

    def release_grads(self) -> None:
        """Free the full gradients (stage 2/3, once they have been reduced into the shards)."""
        for bucket in self.buckets:
            self._point_grads(bucket, None)
        self.grad_data = torch.zeros(0, dtype=self.grad_dtype, device=self.device)

    def _accumulate_main_grad(self, bucket: Bucket, param: torch.Tensor) -> None:
        """Move a freshly accumulated ``param.grad`` into the fp32 main grad.

        For fp32 parameters ``param.grad`` normally already is the main grad (nothing to do); if
        something reset it to None (``model.zero_grad()``), autograd stored a new tensor, which is
        folded back here so that no gradient is lost. Under stage 3 a bucket's full gradients are
        allocated here, when its first gradient of a backward arrives.
        """
        grad = param.grad
        if param.main_grad is None:
            self.allocate_bucket_grads(bucket)
        if grad is param.main_grad:
            return
        param.main_grad.add_(grad)
        param.grad = param.main_grad if grad.dtype == param.main_grad.dtype else None

    # Parameters (stage 3) -----------------------------------------------------------------------

    def is_gathered(self, bucket: Bucket) -> bool:
        return bucket.param_data.untyped_storage().size() > 0

    def materialize_params(self, bucket: Bucket) -> None:
        _materialize(bucket.param_data)

    def free_params(self, bucket: Bucket) -> None:
        if self.shard_params:
            _free(bucket.param_data)

    def gathered_numel(self) -> int:
        """Elements of full parameters that exist now (stage 3: the gathered buckets)."""
        if not self.shard_params:
            return self.numel
        return sum(b.numel for b in self.buckets if self.is_gathered(b))


def _swap_in(param: nn.Parameter, data: torch.Tensor) -> None:
    """Turn a meta parameter into one over ``data`` in place (same object, same attributes). Attached
    with ``.data =``, the parameter keeps a version counter of its own: gathering into the bucket
    storage later does not look like an in-place change to what autograd saved."""
    attrs = {k: v for k, v in param.__dict__.items() if k != "deferred_init"}
    real = nn.Parameter(torch.empty(0, dtype=data.dtype, device=data.device), requires_grad=param.requires_grad)
    real.data = data
    real.__dict__.update(attrs)
    torch.utils.swap_tensors(param, real)


def split_into_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_size: int,
                       own_bucket: tuple[str, ...] = ()) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive parameters (already in gradient-ready order) grouped into buckets of at least
    ``bucket_size`` elements (a parameter is never split); a name ending in one of ``own_bucket``
    gets a bucket to itself."""
    buckets, current, size = [], [], 0
    for name, p in named_params:
        if name.endswith(own_bucket):
            buckets += [current, [(name, p)]] if current else [[(name, p)]]
            current, size = [], 0
            continue
        current.append((name, p))
        size += p.numel()
        if size >= bucket_size:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def layer_buckets(named_params: list[tuple[str, nn.Parameter]],
                  own_bucket: tuple[str, ...] = ("word_embeddings.weight",)) -> list[list[tuple[str, nn.Parameter]]]:
    """ZeRO stage 3: one bucket per decoder layer (``...layers.<i>.``), one per name ending in
    ``own_bucket`` (the word embedding), and one for each model chunk's other parameters (position
    embedding, final norm), in the order of ``named_params``."""
    buckets: dict[str, list] = {}
    for name, p in named_params:
        match = _LAYER.match(name)
        if match:
            key = match.group(1)
        elif name.endswith(own_bucket):
            key = name
        else:
            key = name.split("embedding.")[0].split("final_layernorm.")[0] + "<other>"
        buckets.setdefault(key, []).append((name, p))
    return list(buckets.values())
