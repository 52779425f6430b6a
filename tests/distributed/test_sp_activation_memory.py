"""Sequence parallelism stores only the shard: a decoder layer's column-parallel linears (QKV and
``dense_h_to_4h``) save their ``[s/t, b, h]`` input for the backward, not the gathered ``[s, b, h]``.

Measured on 2 gloo ranks (tp 2) with ``saved_tensors_hooks`` (``saved_bytes.SavedBytes``: each
storage once, parameters excluded), fp32. Three versions of the same layer, same weights:

- ``sp``: sequence parallelism as built (``ColumnParallelLinear``'s own autograd function);
- ``sp-gather-saved``: the same layer with the composition used before (all-gather, then
  ``F.linear``, which saves the gathered input), patched into its column-parallel linears;
- ``no-sp``: tensor parallelism alone (the column-parallel linears see the whole sequence).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from megatron import parallel_state
from megatron.config import parse_config, validate
from megatron.model.transformer import TransformerDecoderLayer
from megatron.tensor_parallel import ColumnParallelLinear, gather_from_sequence_region
from megatron.tensor_parallel.parallelize import apply_tensor_parallel
from tests.distributed.harness import run_distributed
from tests.distributed.saved_bytes import SavedBytes

S, B, H = 16, 2, 32
RTOL, ATOL = 1e-5, 1e-6  # fp32 round-off (as tests/distributed/test_tensor_parallel.py)


def _gather_then_linear(self, x):
    """``ColumnParallelLinear.forward`` before the fix: the gathered input is what F.linear saves."""
    x = gather_from_sequence_region(x, self.group, tensor_parallel_output_grad=True)
    return F.linear(x, self.weight, self.bias)


def _layer(sequence_parallel: bool, gather_saved: bool = False) -> TransformerDecoderLayer:
    config = parse_config(["--mock-data", "--device", "cpu", "--num-layers", "1", "--hidden-size", str(H),
                           "--num-attention-heads", "4", "--vocab-size", "64", "--max-seq-len", str(S),
                           "--max-position-embeddings", str(S), "--hidden-dropout-prob", "0",
                           "--attention-probs-dropout-prob", "0", "--tp", "2"])
    validate(config, world_size=2)  # derives ffn_hidden_size
    torch.manual_seed(3)  # the same (layout-invariant) weights in every version
    layer = TransformerDecoderLayer(config.model, 0)
    apply_tensor_parallel(layer, parallel_state.get().group("tp"), sequence_parallel)
    if gather_saved:
        for module in layer.modules():
            if isinstance(module, ColumnParallelLinear):
                module.forward = types.MethodType(_gather_then_linear, module)
    return layer


def _measure(layer, x: torch.Tensor, dy: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    with SavedBytes(layer, owners=(ColumnParallelLinear,)) as saved:
        y = layer(x)
    y.backward(dy)
    return {"total": saved.total, "column": saved.by_owner.get(ColumnParallelLinear, 0), "y": y.detach(),
            "grads": [x.grad] + [p.grad for p in layer.parameters()]}


def _run(rank: int, world: int) -> dict:
    ps = parallel_state.initialize(tp=world)
    torch.manual_seed(0)
    x, dy = torch.randn(S, B, H), torch.randn(S, B, H)
    shard, dy_shard = x.chunk(world, 0)[ps.tp_rank], dy.chunk(world, 0)[ps.tp_rank]
    sp = _measure(_layer(True), shard, dy_shard)
    gather_saved = _measure(_layer(True, gather_saved=True), shard, dy_shard)
    no_sp = _measure(_layer(False), x, dy)
    for a, b in zip(sp["grads"] + [sp["y"]], gather_saved["grads"] + [gather_saved["y"]]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)  # the fix changes what is stored, not the math
    return {name: (m["total"], m["column"]) for name, m in
            (("sp", sp), ("sp-gather-saved", gather_saved), ("no-sp", no_sp))}


def test_sequence_parallel_column_linears_save_only_the_shard():
    for result in run_distributed(_run, 2):
        (sp_total, sp_column), (old_total, old_column) = result["sp"], result["sp-gather-saved"]
        _, no_sp_column = result["no-sp"]
        shard_bytes = S // 2 * B * H * 4  # one fp32 [s/2, b, h] input
        assert sp_column == 2 * shard_bytes  # QKV's and dense_h_to_4h's inputs, the shards only
        assert 2 * sp_column == old_column == no_sp_column  # the gathered (or whole) sequence: twice that
        assert sp_total == old_total - old_column // 2  # and nothing else in the layer changed
