"""The one place a GPT is put together for a launch, read top to bottom (torchtitan's ``parallelize.py``).

``build_model``: this rank's part of the plain GPT (``megatron.model``: built from its configuration alone), made
parallel and ready, one step per axis, each a function of its own package that is handed the process groups it
needs (``parallel_state`` is read here, once):

1. the pipeline: which layers (and embedding, head) each of this rank's model chunks holds
   (``pipeline_parallel.partition.stage_chunks``);
2. each chunk: the whole plain GPT built on the meta device (``model.gpt.GPTModel``: no memory) and cut to the
   chunk (``pipeline_parallel.partition.cut_stage``), then split over the tensor-parallel group
   (``tensor_parallel.parallelize.apply_tensor_parallel``: the parallel layers from one table, the seams'
   collectives), its MoE layers cut to this rank's experts (``moe.parallelize.apply_expert_parallel``), its attention
   given the context-parallel split (``context_parallel.parallelize``), its recompute set (``megatron.recompute``)
   and its activation offload (``megatron.offload``),
   its attention's largest logits tracked for QK-clip (``optimizer.qk_clip.track``, with --qk-clip),
   then materialised and initialised layout-invariantly (by parameter name: ``model.init``), or, under
   ZeRO stage 3, its initialisation deferred to the buffer's shards;
3. FP8 matmuls in the tensor-parallel linear layers (``tensor_parallel.layers.apply_fp8``);
4. ``--compile`` (``megatron.compile``).

``parallelize_gpt``: then data parallelism / ZeRO (``distributed.parallelize``: the buffer and its hooks), the
optimizer over the buffer, and the pipeline schedule: the ``ParallelModel`` that training and evaluation run.

Training (``pretrain_gpt.model_provider``, the Trainer), evaluation, generation, conversion and the benchmarks all
build their model here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from megatron import parallel_state
from megatron.config.schema import Config
from megatron.context_parallel.attention import CpLevels
from megatron.context_parallel.parallelize import apply_context_parallel
from megatron.distributed.parallelize import ShardingPlan, parallelize, plan_sharding
from megatron.model.gpt import GPTModel
from megatron.model.init import defer_initialization, init_parameters, materialize
from megatron.moe.parallelize import ExpertLayout, apply_expert_parallel
from megatron.offload import apply_offload
from megatron.optimizer import build_optimizer
from megatron.optimizer.qk_clip import track as track_max_logits
from megatron.pipeline_parallel.partition import cut_stage, stage_chunks
from megatron.pipeline_parallel.schedules import forward_backward_no_pipelining, forward_backward_pipelining
from megatron.recompute import apply_recompute
from megatron.tensor_parallel.layers import apply_fp8
from megatron.tensor_parallel.parallelize import apply_tensor_parallel


@dataclass
class ParallelModel:
    """A model made ready to run under the launch's layout (training, or evaluation through the same
    forward): its parameter buffer and hooks (``parallelize``), the optimizer whose masters a checkpoint
    loads into, the groups its sums are reduced over, and the schedule that runs micro-batches through
    it (pipelined when pp > 1)."""

    model: torch.nn.Module
    buffer: object
    fully_sharded: bool
    optimizer: object
    plan: ShardingPlan
    dp_group: object
    pp_group: object
    forward_backward: Callable


def build_model(config: Config, device: torch.device | str = "cpu", meta_init: bool = False) -> nn.Module:
    """This rank's part of the GPT of ``config``, initialised layout-invariantly, in the training dtype: the whole
    model, a pipeline stage, or (interleaved schedule) a ModuleList of chunks. ``meta_init`` (ZeRO stage 3:
    ``ShardingPlan.meta_init``): built on the meta device, each parameter initialised later by the buffer, bucket
    by bucket, straight into the shards."""
    ps, d, m = parallel_state.get(), config.distributed, config.model
    recompute = config.recompute_granularity if config.use_recompute else None
    dtype = getattr(torch, config.params_dtype_name)
    chunks = []
    for layers, first, last in stage_chunks(config, ps.pp_rank, ps.pp_size):
        with torch.device("meta"):
            chunk = cut_stage(GPTModel(m, config.padded_vocab_size), layers, first, last)
        apply_tensor_parallel(chunk, ps.group("tp") if ps.tp_size > 1 else None, d.sequence_parallel)
        apply_expert_parallel(chunk, ExpertLayout.of(ps))
        apply_context_parallel(chunk, ps.cp_size, ps.cp_rank, ps.group("cp"), d.cp_comm_type,
                               CpLevels.of(ps) if ps.cp_inner_size else None)
        apply_recompute(chunk, recompute, config.no_recompute_layers, config.recompute_method,
                        config.recompute_num_layers, config.recompute_modules)
        apply_offload(chunk, config.cpu_offloading_num_layers, config.offload_modules
                      if config.fine_grained_activation_offloading else None, config.min_offloaded_tensor_size)
        if config.optimizer.qk_clip or config.optimizer.log_max_attention_logit:
            track_max_logits(chunk)  # QK-clip: the decoder's attention keeps its heads' largest logits
        if meta_init:
            defer_initialization(chunk.to(dtype=dtype), config.seed, m, device, dtype)
        else:
            init_parameters(materialize(chunk, "cpu"), config.seed, m)
            chunk = chunk.to(device=device, dtype=dtype)
        _zero_expert_biases(chunk, device)
        chunks.append(chunk)
    if config.mix_precision.fp8_format is not None:
        apply_fp8(chunks, config.mix_precision.fp8_format, torch.device(device), ps.group("cp") if ps.cp_size > 1
                  else None)
    if config.compile:
        from megatron.compile import compile_model

        compile_model(chunks, torch.device(device).type, d.context_parallel_size > 1 or
                      config.dataset.reset_attention_mask, ps.tp_size)
    return chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)


def parallelize_gpt(config: Config, device: torch.device, plan: ShardingPlan | None = None,
                    model: nn.Module | None = None) -> ParallelModel:
    """The model to train or evaluate under the launch's layout: ``model`` (default: ``build_model``'s) with its
    parameter buffer and data-parallel / ZeRO hooks (``plan``: what is sharded over which ranks, decided once),
    the optimizer whose masters a checkpoint loads into, and the schedule that runs micro-batches through it
    (pipelined when pp > 1)."""
    ps = parallel_state.get()
    plan = plan or plan_sharding(config, ps)
    model = model if model is not None else build_model(config, device, meta_init=plan.meta_init)
    model, buffer, fully_sharded = parallelize(model, plan)
    optimizer = build_optimizer(buffer, plan, config)
    pp_group, forward_backward = None, forward_backward_no_pipelining
    if ps.pp_size > 1:
        d, b = config.distributed, config.batch_size
        seq = config.dataset.max_seq_len // ps.cp_size // (ps.tp_size if d.sequence_parallel else 1)
        pp_group = ps.group("pp")
        forward_backward = partial(forward_backward_pipelining, ps=ps, schedule=d.pipeline_schedule,
                                   shape=(seq, b.micro_batch_size, config.model.hidden_size),
                                   dtype=getattr(torch, config.params_dtype_name), device=device)
    return ParallelModel(model, buffer, fully_sharded, optimizer, plan, plan.data_parallel_group, pp_group,
                         forward_backward)


def model_to_load(config: Config, padded_vocab: int | None = None) -> nn.Module:
    """The GPT of ``config`` on the meta device, split over the launch's tensor-parallel group (without sequence
    parallelism) and its expert layout, its values to come from a checkpoint: what generation and the converters
    load into (each parameter's tensor-parallel attributes say which slice it takes). ``padded_vocab``: the
    vocabulary rows (default: the configuration's)."""
    ps = parallel_state.get()
    with torch.device("meta"):
        model = GPTModel(config.model, config.padded_vocab_size if padded_vocab is None else padded_vocab)
    apply_tensor_parallel(model, ps.group("tp") if ps.tp_size > 1 else None, False)
    return apply_expert_parallel(model, ExpertLayout.of(ps))


def _zero_expert_biases(chunk: nn.Module, device: torch.device | str) -> None:
    """The MoE routers' expert biases (buffers, not parameters: neither initialised nor deferred) start at 0, in
    fp32, on ``device``."""
    for module in chunk.modules():
        bias = getattr(module, "expert_bias", None)
        if isinstance(bias, torch.Tensor):
            module.expert_bias = torch.zeros(bias.shape, dtype=torch.float32, device=device)
