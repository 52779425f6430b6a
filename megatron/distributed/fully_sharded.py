"""ZeRO stage 3: parameters stored as a 1/N shard, gathered around their use.

Each decoder layer is one bucket of the parameter buffer; the word embedding is another, and a
model chunk's remaining parameters (position embedding, final LayerNorm) a third. Rank r keeps
only the r-th slice of every bucket. Around each use:

- **forward**: a layer's bucket is all-gathered just before its forward (waiting for the
  prefetch started by the previous layer), the next layer's gather is started, and the layer's
  parameters are freed after its forward;
- **backward**: a hook on the layer's output gathers the bucket again when its gradient arrives
  (and prefetches the previous layer's); once every parameter's gradient is in, the data-parallel
  wrapper reduce-scatters the bucket's gradients into the owner's shard and the parameters and
  full gradients are freed (``on_grads_done``).

The embedding and the other non-layer buckets (the *root*, as in FSDP) are used at both ends of
the model (the LM head is tied to the word embedding), so they are gathered at the start of the
chunk's forward and freed when their gradients are done, at the end of the backward. At any
moment a rank therefore holds the root plus at most two layers' full parameters: the one in use
and the prefetched one.

**With pipeline parallelism** (``keep_gathered``): a stage's forward and backward of different
micro-batches interleave, so the stage's buckets are gathered at its first forward of a step and
kept, with their full gradients, across the micro-batches; the gradients are reduce-scattered
after the last backward (as stage 2) and the parameters freed then. Per step and stage, one
gather; between steps, only the shards exist.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.distributed.bucket import Bucket
from megatron.distributed.param_and_grad_buffer import ParamAndGradBuffer


class FullyShardedParameters:
    """Installs the gather/free hooks on ``chunks`` (this rank's model chunks, in forward order); the
    buckets gather, wait and free themselves. ``layer_buckets``: the decoder layers' buckets;
    ``peak_gathered_layers``: the most of them gathered (or being gathered) at once."""

    def __init__(self, chunks: list[nn.Module], buffer: ParamAndGradBuffer, keep_gathered: bool = False,
                 prefetch: bool = True):
        self.buffer, self.keep_gathered, self.prefetch = buffer, keep_gathered, prefetch
        self.layer_buckets: list[tuple[Bucket, ...]] = []  # per layer: its bucket (and a MoE layer's experts')
        self.peak_gathered_layers = 0
        self._held: list[tuple[Bucket, ...]] = []  # layers gathered or in flight, as last seen
        bucket_of = {id(p): b for b in buffer.buckets for p, _, _ in b.params}
        for chunk in chunks:
            layers = [(module, tuple({bucket_of[id(p)].index: bucket_of[id(p)] for p in module.parameters()}.values()))
                      for module in chunk.layers.values()]
            self.layer_buckets += [b for _, b in layers]
            layer_params = {id(p) for module, _ in layers for p in module.parameters()}
            root = [(b,) for b in {bucket_of[id(p)].index: bucket_of[id(p)] for p in chunk.parameters()
                                   if id(p) not in layer_params}.values()]
            self._install(chunk, root, layers)

    def _install(self, chunk: nn.Module, root: list[tuple[Bucket, ...]],
                 layers: list[tuple[nn.Module, tuple[Bucket, ...]]]) -> None:
        chunk.register_forward_pre_hook(lambda *_: self._chunk_pre_forward(root, layers))
        chunk.register_forward_hook(lambda *_: self._chunk_post_forward(root))
        for i, (module, bucket) in enumerate(layers):
            following = layers[i + 1][1] if i + 1 < len(layers) else None
            previous = layers[i - 1][1] if i > 0 else None
            module.register_forward_pre_hook(lambda *_, b=bucket, n=following: self._pre_forward(b, n))
            module.register_forward_hook(lambda _m, _i, out, b=bucket, p=previous: self._post_forward(b, p, out))

    # Gathering -----------------------------------------------------------------------------------

    def _gather(self, unit: tuple[Bucket, ...], async_op: bool) -> None:
        """Gather a layer's (or a root) buckets, each over its own sharding group."""
        started = [bucket.gather(bucket.groups.sharding, async_op) for bucket in unit]
        if not any(started) or not any(layer == unit for layer in self.layer_buckets):
            return
        # the statistic looks at the few layers held, not at all of them
        self._held = [u for u in self._held if u[0].gathered and u != unit] + [unit]
        self.peak_gathered_layers = max(self.peak_gathered_layers, len(self._held))

    def _wait(self, unit: tuple[Bucket, ...]) -> None:
        if not all([bucket.wait() for bucket in unit]):
            self._gather(unit, async_op=False)

    def _free(self, unit: tuple[Bucket, ...], force: bool = False) -> None:
        """Free the units' gathered parameters (under ``keep_gathered`` only when ``force``d)."""
        if force or not self.keep_gathered:
            for bucket in unit:
                bucket.free()

    def gather_all(self) -> None:
        for bucket in self.buffer.buckets:
            self._gather((bucket,), async_op=False)

    def release(self) -> None:
        """Free every gathered bucket, whatever the mode (after an evaluation under ``keep_gathered``)."""
        for bucket in self.buffer.buckets:
            self._free((bucket,), force=True)

    # Hooks ---------------------------------------------------------------------------------------

    def _chunk_pre_forward(self, root: list[tuple[Bucket, ...]], layers: list) -> None:
        if self.keep_gathered:
            self.gather_all()
            return
        for bucket in root:
            self._gather(bucket, async_op=False)
        if layers and self.prefetch:
            self._gather(layers[0][1], async_op=True)

    def _chunk_post_forward(self, root: list[tuple[Bucket, ...]]) -> None:
        if torch.is_grad_enabled():
            return
        if self.keep_gathered:  # evaluation: no backward will come to free them
            self.release()
        else:
            for bucket in root:
                self._free(bucket)

    def _pre_forward(self, bucket: tuple[Bucket, ...], following: tuple[Bucket, ...] | None) -> None:
        self._wait(bucket)
        if following is not None and self.prefetch:
            self._gather(following, async_op=True)

    def _post_forward(self, bucket: tuple[Bucket, ...], previous: tuple[Bucket, ...] | None,
                      output: torch.Tensor) -> torch.Tensor:
        self._free(bucket)
        if torch.is_grad_enabled() and output.requires_grad and not self.keep_gathered:
            output.register_hook(lambda grad: self._pre_backward(bucket, previous))
        return output

    def _pre_backward(self, bucket: tuple[Bucket, ...], previous: tuple[Bucket, ...] | None) -> None:
        self._wait(bucket)
        if previous is not None and self.prefetch:
            self._gather(previous, async_op=True)

    def on_grads_done(self, bucket: Bucket) -> None:
        """The bucket's gradients are all in and their reduction launched: free its parameters
        (under ``keep_gathered`` this happens after the step's last backward)."""
        self._free((bucket,), force=True)
