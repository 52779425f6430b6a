"""The planner's step-time model: an estimate from FLOPs and communication volumes, not a measurement.

Time (seconds per step; the slowest pipeline stage sets the pace), with ``m`` micro-batches of
``b`` samples of ``s`` tokens, ``s / cp`` of them on each context-parallel rank, hidden size ``h``,
activations of ``a`` bytes (2 in bf16/fp16, 4 in fp32):

- compute: the stage's matmul FLOPs (``metrics.model_flops_per_token``'s count: forward x 3, plus the
  forward that recompute replays: the whole layer for ``full``, the attention block for ``only_attn``,
  ``softmax(QK^T)V`` for ``core_attn``) / (tp x cp x dp x sharding) / (peak TFLOP/s x efficiency).
- tp comm: per micro-batch and layer 4 collectives of ``b (s / cp) h a`` bytes (2 in the forward, 2 in the
  backward; +2 per fully recomputed layer, +1 per recomputed attention block; +1 for the embedding
  on the first stage and +1 for the LM head on the last), each moving ``2 (tp-1)/tp`` of it per rank
  (ring all-reduce, or reduce-scatter + all-gather under sequence parallelism), over the intra-node
  bandwidth (inter-node when tp spans nodes). Not overlapped.
- cp comm (cp > 1), per micro-batch and layer, with ``kv = 2 b (s / cp) (ng / tp) hd a`` (this rank's keys
  and values) and ``dkv = 4 kv / a`` (their fp32 gradients), over the bandwidth of tp x cp neighbouring
  ranks: p2p sends cp - 1 kv blocks round the ring in the forward, and again with cp dkv in the backward,
  each transfer overlapped with a block's attention (``softmax(QK^T)V``): only what exceeds the layer's
  attention FLOPs is counted; all_gather gathers cp - 1 kv blocks in the forward and again in the
  backward, and reduce-scatters cp - 1 dkv (not overlapped); a2a runs 4 all-to-alls (q, k, v, the output;
  each rank sends (cp - 1) / cp of them) in the forward and 4 in the backward (not overlapped). A
  recomputed attention (``full``, ``only_attn``, ``core_attn``) runs its forward exchange again.
- ep comm (a MoE model under expert parallelism; ``megatron.memory.moe``), per micro-batch and MoE layer, with
  ``T`` the tokens a rank routes (``b s / (cp tp)``) and ``p = k T h a`` its (token, expert) pairs' bytes, over
  the bandwidth of the ep x etp neighbouring ranks: the alltoall dispatcher sends ``(ep - 1) / ep`` of ``p``
  and all-gathers the received pairs over etp (``(etp - 1) p``), for the dispatch and the combine, forward and
  backward (4 times); the allgather dispatcher gathers and reduce-scatters ``(ep etp - 1) T h a``, 4 times. A
  fully recomputed layer dispatches again (x 1.5). Not overlapped. Uniform routing: a rank whose experts are
  popular receives more. The MoE layer's own cut and gather of the sequence over tp are counted as the MLP's
  collectives in tp comm.
- dp comm: fp32 gradients (4 bytes per parameter of the rank with the most; a MoE model's: its dense parameters
  and its ep rank's experts, whose reduction over the expert-data-parallel ranks is counted with the dense
  ones') and, with a sharding group, the parameter all-gather after the step: stage 1 an all-reduce over dp x
  sharding (+ the gather), stage
  2 a reduce-scatter over the sharding group, an all-reduce of the shard over the dp replicas and the
  gather, stage 3 the same with the gathers and reduce-scatters of every micro-batch (once per step under
  pipelining). Over the inter-node bandwidth when the group spans nodes (rank grid: tp fastest, then cp,
  sharding, dp, pp; the context-parallel ranks sum their gradients as replicas do: the all-reduce of stage
  1 spans dp x sharding x cp, the replicas' all-reduce dp x cp). Hidden behind compute only with
  overlap_grad_reduce: the gradient reduction behind the backward of the last micro-batch (under
  pipelining, each model chunk's last backward arms it: ``schedules.run_pipeline_table``); under stage 3
  without a pipeline, per micro-batch, the prefetched gather behind its forward and the second gather and
  the reduce-scatter behind its backward. The gather once per step (after it for stages 1 and 2, before it
  for stage 3 under pipelining) and the replicas' all-reduce are exposed.
- bubble: (pp - 1) / (m x vpp) x (compute + tp comm + cp comm + ep comm), 1F1B, interleaved and GPipe alike
  (GPipe's cost is memory: all m micro-batches in flight, which the memory side counts).
- p2p: 2 m vpp messages of ``b (s / cp) h a`` bytes (``/ tp`` under sequence parallelism) per stage and
  step, over the inter-node bandwidth when the job spans nodes (pp is the outermost dimension).
- offload: the fp32 gradient shard to the CPU and the fp32 master shard back, 8 bytes per parameter of the
  rank's offloaded shard (its dense parameters over the ZeRO group, its experts over the expert-data-parallel
  ranks: ``ModelStateBytes.master_weights / 4``, at the stage with the most), over PCIe; not overlapped.
- cpu optimizer (offload): torch's fused CPU AdamW over that shard, at ``cpu_adam_gparams_per_core`` x
  ``cpu_cores_per_device`` parameters per second (defaults 0.4 x 4: one core of this project's machine stepped
  4.6e8 parameters/s, 2026-11-27; 4 cores each serve 8 devices of a 32-core host. AdamW reads and writes about
  28 bytes per parameter, so 1.6e9/s per device is 45 GB/s, 360 GB/s for 8 devices: about what a two-socket
  host's memory delivers, beyond which more cores buy nothing); not overlapped with the device's work.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config import Config
from megatron.distributed.sharding_rule import sharding_stage
from megatron.hardware import PEAK_TFLOPS_16BIT
from megatron.memory.model_states import parameters_per_rank, rank_model_state_bytes
from megatron.metrics import model_flops_per_token
from megatron.planner.stages import representative_stages
from megatron.planner.stages import stage_chunks as _stage_chunks

GIB = 2**30
GB = 1e9  # bandwidths are in GB/s of 10^9 bytes


@dataclass(frozen=True)
class Hardware:
    """The devices and the constants of the time model (each a flag of tools/plan_layout.py)."""

    devices: int
    devices_per_node: int = 8
    device_memory_gb: float = 80.0  # GiB (2^30 bytes) of one device
    peak_tflops: float = 312.0  # dense 16-bit peak of one device
    efficiency: float = 0.5  # achieved fraction of the peak on the matmuls
    intra_node_gbps: float = 150.0  # GB/s per device within a node (NVLink)
    inter_node_gbps: float = 12.5  # GB/s per device across nodes (a 100 Gb/s NIC per device)
    pcie_gbps: float = 12.0  # GB/s between a device and the CPU (PCIe 3.0 x16)
    headroom: float = 0.1  # fraction of the memory kept for what the estimate leaves out
    host_memory_gb: float = 1024.0  # GiB of host memory per node (a DGX A100's 1 TB), for offload
    cpu_cores_per_device: float = 4.0  # host CPU cores stepping one device's offloaded optimizer
    cpu_adam_gparams_per_core: float = 0.4  # 10^9 parameters/s one core's fused AdamW updates

    @property
    def memory_bytes(self) -> float:
        """What a layout's estimate may use: the estimate is a lower bound of the peak (no CUDA context,
        activation gradients or allocator slack), so ``headroom`` of the device is kept free."""
        return self.device_memory_gb * GIB * (1 - self.headroom)

    @property
    def host_memory_bytes(self) -> float:
        """What a node's offloaded states may use: the host memory less the same ``headroom`` (the processes,
        the data loader, pinned buffers)."""
        return self.host_memory_gb * GIB * (1 - self.headroom)

    @property
    def ranks_per_node(self) -> int:
        return min(self.devices_per_node, self.devices)

    @property
    def cpu_adam_params_per_s(self) -> float:
        """Parameters per second the CPU AdamW of one device's offloaded shard updates."""
        return self.cpu_adam_gparams_per_core * 1e9 * self.cpu_cores_per_device


def gpu_peak_tflops(name: str) -> float:
    """The dense 16-bit peak of a GPU named in megatron/hardware.py's table ("V100", "a100", ...)."""
    for key, value in PEAK_TFLOPS_16BIT.items():
        if key.lower() == name.lower():
            return value
    raise ValueError(f"unknown GPU {name!r}: known are {', '.join(sorted(PEAK_TFLOPS_16BIT))}; or give "
                     f"--peak-tflops")


@dataclass(frozen=True)
class TimeTerms:
    """Seconds per step (estimates). ``dp_comm`` is the whole data-parallel traffic, ``dp_exposed`` the
    part not hidden behind compute; the step time counts the exposed part."""

    compute: float
    tp_comm: float
    dp_comm: float
    dp_exposed: float
    bubble: float
    p2p: float
    offload: float
    micro_batches: int
    model_flops: float  # the whole step, all devices (metrics.model_flops_per_token x tokens)
    hardware_flops: float  # the same with the recomputed forward
    cp_comm: float = 0.0  # context parallelism's exchanges, the part not hidden behind attention
    ep_comm: float = 0.0  # expert parallelism's token dispatch and combine
    cpu_optimizer: float = 0.0  # offload: the CPU's AdamW over the rank's offloaded shard

    @property
    def step(self) -> float:
        return (self.compute + self.tp_comm + self.cp_comm + self.ep_comm + self.dp_exposed + self.bubble + self.p2p
                + self.offload + self.cpu_optimizer)


def _model_flops_per_token(config: Config, cache: dict | None) -> float:
    """``metrics.model_flops_per_token``, cached in a planning run by the one thing a layout changes in it: the
    vocabulary padded for tp."""
    if cache is None:
        return model_flops_per_token(config)
    key = ("model flops per token", config.padded_vocab_size)
    if key not in cache:
        cache[key] = model_flops_per_token(config)
    return cache[key]


def _layer_forward_flops(config: Config, cache: dict | None = None) -> tuple[float, float, float]:
    """Forward matmul FLOPs per token of one decoder layer, of its attention block and of its core
    attention (QK^T and x V), from metrics.model_flops_per_token's count."""
    m, s = config.model, config.dataset.max_seq_len
    head = 2 * m.hidden_size * config.padded_vocab_size
    layer = (_model_flops_per_token(config, cache) / 3 - head) / m.num_layers
    mlp = (3 if m.swiglu or m.quick_geglu else 2) * 2 * m.hidden_size * m.ffn_hidden_size
    core = 4 * s * m.num_attention_heads * (m.kv_channels or m.hidden_size // m.num_attention_heads)
    return layer, layer - mlp, core


def _recomputed(config: Config, chunks: tuple[int, ...], cache: dict | None = None) -> tuple[float, int]:
    """Per token: the forward FLOPs recompute replays on a stage, and its extra tp collectives."""
    if not config.use_recompute:
        return 0.0, 0
    layer, attention, core = _layer_forward_flops(config, cache)
    layers, g = sum(chunks), config.recompute_granularity
    if g == "full":
        if config.recompute_method == "block":
            layers = sum(min(config.recompute_num_layers, n) for n in chunks)
        return layers * layer, 2 * layers
    if g in ("only_attn", "full_attn"):
        return layers * attention, layers
    return layers * core, 0  # core_attn


def _replayed_attention(config: Config, chunks: tuple[int, ...]) -> int:
    """The layers of a stage whose attention forward recompute runs again (with its cp exchange)."""
    if not config.use_recompute:
        return 0
    if config.recompute_granularity == "full" and config.recompute_method == "block":
        return sum(min(config.recompute_num_layers, n) for n in chunks)
    return sum(chunks)


def _cp_layer_times(config: Config, hw: Hardware, core_forward: float) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's context-parallel exchange for one micro-batch, the part
    not hidden (p2p: behind the layer's attention, ``core_forward`` seconds forward, twice that backward)."""
    m, d = config.model, config.distributed
    cp, tp, comm = d.context_parallel_size, d.mp_degree, d.cp_comm_type
    if cp == 1:
        return 0.0, 0.0
    a = 4 if config.params_dtype_name == "float32" else 2
    nq = m.num_attention_heads
    ng = m.num_query_groups if m.group_query_attention and m.num_query_groups else nq
    hd = m.kv_channels or m.hidden_size // nq
    tokens = config.batch_size.micro_batch_size * config.dataset.max_seq_len / cp
    kv, q = 2 * tokens * ng / tp * hd * a, tokens * nq / tp * hd * a
    dkv, bandwidth = 4 * kv / a, _bandwidth(hw, tp * cp)
    if comm == "a2a":
        one_way = (cp - 1) / cp * (2 * q + kv) / bandwidth
        return one_way, one_way
    if comm == "all_gather":
        return (cp - 1) * kv / bandwidth, (cp - 1) * (kv + dkv) / bandwidth
    return (max(0.0, (cp - 1) * kv / bandwidth - core_forward),
            max(0.0, ((cp - 1) * kv + cp * dkv) / bandwidth - 2 * core_forward))


def _ep_layer_time(config: Config, hw: Hardware) -> float:
    """Seconds of one MoE layer's token exchange for one micro-batch, forward and backward (see the module
    docstring); 0 without expert parallelism."""
    from megatron.memory.moe import exchanges, moe_dims, routed_tokens

    M = moe_dims(config)
    if M is None or not exchanges(M):
        return 0.0
    a = 4 if config.params_dtype_name == "float32" else 2
    tokens = routed_tokens(M, config.batch_size.micro_batch_size * config.dataset.max_seq_len
                           // config.distributed.context_parallel_size)
    row, group = config.model.hidden_size * a, M.ep * M.etp
    if M.dispatcher == "allgather":
        return 4 * (group - 1) * tokens * row / _bandwidth(hw, group)
    pairs = M.topk * tokens * row
    return 4 * ((M.ep - 1) / M.ep * pairs + (M.etp - 1) * pairs) / _bandwidth(hw, group)


def _moe_layers(config: Config, chunks_layers: list[int]) -> int:
    from megatron.config.validate_moe import is_moe_layer

    return sum(is_moe_layer(config.model, i) for i in chunks_layers)


def _ring(nbytes: float, ranks: int, all_reduce: bool) -> float:
    """Bytes one rank sends in a ring collective over ``ranks`` on a tensor of ``nbytes``."""
    return (2.0 if all_reduce else 1.0) * (ranks - 1) / ranks * nbytes if ranks > 1 else 0.0


def _bandwidth(hw: Hardware, extent: int) -> float:
    """Bytes/s of a group whose ranks lie within ``extent`` consecutive ranks."""
    return (hw.intra_node_gbps if extent <= hw.devices_per_node else hw.inter_node_gbps) * GB


def _stage_times(config: Config, hw: Hardware, cache: dict | None = None
                 ) -> tuple[float, float, float, float, float, float, float, float]:
    """``_slowest_stage`` and the forward FLOPs per token recompute replays over all stages, cached in a planning
    run (one ``hw``) by what they depend on: not the sharding stage, offload or how dp x sharding is split, only
    their product (through the number of micro-batches)."""
    if cache is None:
        return (*_slowest_stage(config, hw, cache), _replayed_flops(config, cache))
    d = config.distributed
    key = ("stage times", d.mp_degree, d.context_parallel_size, d.cp_comm_type, d.pp_degree, d.virtual_pp_degree,
           d.pipeline_partition, d.sequence_parallel, d.expert_model_parallel_size, d.expert_tensor_parallel_size,
           config.batch_size.micro_batch_size, config.num_micro_batches, config.use_recompute,
           config.recompute_granularity, config.recompute_method, config.recompute_num_layers)
    if key not in cache:
        cache[key] = (*_slowest_stage(config, hw, cache), _replayed_flops(config, cache))
    return cache[key]


def _replayed_flops(config: Config, cache: dict | None) -> float:
    """Forward FLOPs per token that recompute replays, summed over the pipeline stages."""
    return sum(_recomputed(config, _stage_chunks(config, st), cache)[0] for st in range(config.distributed.pp_degree))


def _stage_moe_layers(config: Config, stage: int, cache: dict | None) -> int:
    """The MoE layers of a pipeline stage (all its chunks); cached by (pp, vpp, partition, stage)."""
    from megatron.memory.activations import chunk_specs

    d = config.distributed
    key = ("moe layers", d.pp_degree, d.virtual_pp_degree, d.pipeline_partition, stage)
    if cache is None or key not in cache:
        count = _moe_layers(config, [i for layers, _, _ in chunk_specs(config, stage) for i in layers])
        if cache is None:
            return count
        cache[key] = count
    return cache[key]


def _rank_parameters(config: Config, stage: int, cache: dict | None) -> int:
    """``parameters_per_rank`` of a stage's rank under the configuration's tp, pp, vpp, ep and etp; cached by
    those and the stage."""
    d = config.distributed
    tp, pp = d.mp_degree, d.pp_degree
    key = ("rank parameters", tp, pp, d.virtual_pp_degree, d.pipeline_partition, d.expert_model_parallel_size,
           d.expert_tensor_parallel_size, stage)
    if cache is None or key not in cache:
        count = parameters_per_rank(config, tp, pp, stage)
        if cache is None:
            return count
        cache[key] = count
    return cache[key]


def _slowest_stage(config: Config, hw: Hardware, cache: dict | None = None
                   ) -> tuple[float, float, float, float, float, float, float]:
    """Of the slowest stage: (compute, tp comm, cp comm, ep comm) per step, (forward, backward) of one
    micro-batch, and the parameters of the largest rank."""
    m, d, s = config.model, config.distributed, config.dataset.max_seq_len
    tp, pp, mb, count = d.mp_degree, d.pp_degree, config.batch_size.micro_batch_size, config.num_micro_batches
    cp = d.context_parallel_size
    a = 4 if config.params_dtype_name == "float32" else 2  # bytes per activation element
    layer, _, core = _layer_forward_flops(config, cache)
    head = 2 * m.hidden_size * config.padded_vocab_size
    flops_per_s = hw.peak_tflops * 1e12 * hw.efficiency
    collective = _ring(mb * s / cp * m.hidden_size * a, tp, all_reduce=True) / _bandwidth(hw, tp)
    tokens = mb * s / (tp * cp)  # per device and micro-batch
    cp_forward, cp_backward = _cp_layer_times(config, hw, tokens * core / flops_per_s)
    ep_layer = _ep_layer_time(config, hw)
    best = (-1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    for stage in range(pp):
        chunks = _stage_chunks(config, stage)
        forward = sum(chunks) * layer + (head if stage == pp - 1 else 0.0)
        replay, extra = _recomputed(config, chunks, cache)
        compute = count * tokens * (3 * forward + replay) / flops_per_s
        tp_comm = count * (4 * sum(chunks) + extra + (stage == 0) + (stage == pp - 1)) * collective
        cp_comm = count * (sum(chunks) * (cp_forward + cp_backward) + _replayed_attention(config, chunks) * cp_forward)
        ep_comm = 0.0
        if ep_layer:  # a fully recomputed MoE layer exchanges its tokens again (half the forward and backward's)
            moe = _stage_moe_layers(config, stage, cache)
            full = config.use_recompute and config.recompute_granularity == "full"
            ep_comm = count * moe * ep_layer * (1.5 if full else 1.0)
        if compute + tp_comm + cp_comm + ep_comm > sum(best[:4]):
            best = (compute, tp_comm, cp_comm, ep_comm, tokens * forward / flops_per_s,
                    tokens * (2 * forward + replay) / flops_per_s)
    params = max(_rank_parameters(config, stage, cache) for stage in representative_stages(config))
    return (*best, params)


def _dp_times(config: Config, hw: Hardware, params: float, forward: float, backward: float) -> tuple[float, float]:
    """(all data-parallel traffic, the part not hidden) in seconds per step; ``forward`` and ``backward``:
    one micro-batch's on the slowest stage."""
    d = config.distributed
    tp, pp, cp, n = d.mp_degree, d.pp_degree, d.context_parallel_size, config.zero_shards
    dp = d.dp_degree * (1 if config.shards_over_context_parallel else cp)  # the replicas of a shard
    if dp * n == 1:
        return 0.0, 0.0
    stage, overlap = sharding_stage(n, d.sharding.sharding_stage), bool(d.overlap_grad_reduce)
    grads, param_bytes = 4.0 * params, (4.0 if config.params_dtype_name == "float32" else 2.0) * params
    span = tp * cp * d.sharding.sharding_degree  # the ranks a shard group spans (tp x cp apart, or cp inside)
    shard_bw, replica_bw = _bandwidth(hw, span), _bandwidth(hw, span * d.dp_degree)
    gather = _ring(param_bytes, n, all_reduce=False) / shard_bw  # one all-gather of the rank's parameters
    if stage == 1:
        reduce, replicas = _ring(grads, dp * n, all_reduce=True) / replica_bw, 0.0
    else:  # reduce-scatter in the sharding group, then the shards' all-reduce over the replicas (HSDP)
        reduce, replicas = _ring(grads, n, False) / shard_bw, _ring(grads / n, dp, True) / replica_bw
    if stage == 3 and pp == 1:  # every micro-batch: gathered for its forward, again for its backward, reduced
        count = config.num_micro_batches
        total = count * (2 * gather + reduce) + replicas
        per_micro_batch = max(0.0, gather - forward) + max(0.0, gather + reduce - backward)
        return total, (count * per_micro_batch + replicas) if overlap else total
    total = reduce + replicas + gather  # once per step; the gather after the step (stage 3: before it)
    return total, total - (min(reduce, backward) if overlap else 0.0)


def offloaded_parameters(config: Config, cache: dict | None = None) -> int:
    """Parameters of the largest offloaded shard of a rank (the masters it keeps on the host); 0 without offload.
    ``cache``: a planning run's, whose host bytes per rank (``planner.memory.model_states``: 16 per parameter
    of the shard) it reads."""
    from megatron.planner.memory import model_states

    if not config.distributed.sharding.sharding_offload:
        return 0
    if cache is not None:
        return max(model_states(config, stage, cache)[2] for stage in representative_stages(config)) // 16
    return max(rank_model_state_bytes(config, stage).master_weights // 4 for stage in representative_stages(config))


def layout_time(config: Config, hw: Hardware, cache: dict | None = None) -> TimeTerms:
    """The step-time terms of a validated configuration on ``hw`` (see the module docstring). ``cache``: a
    planning run's, for what depends on a few of the layout's axes (``_stage_times``, the offloaded shard)."""
    return step_terms(config, hw, _stage_times(config, hw, cache), offloaded_parameters(config, cache), cache)


def stage_times(config: Config, hw: Hardware, cache: dict | None = None) -> tuple:
    """What ``step_terms`` takes of the pipeline's stages: the same for every sharding stage and offload of a
    layout (``_stage_times``)."""
    return _stage_times(config, hw, cache)


def step_terms(config: Config, hw: Hardware, stages: tuple, shard: int, cache: dict | None = None) -> TimeTerms:
    """``layout_time`` given ``stage_times`` of the layout (the part that depends on its recompute) and its
    offloaded shard (``offloaded_parameters``); ``config`` is read for everything else, not for recompute."""
    m, d, s = config.model, config.distributed, config.dataset.max_seq_len
    tp, pp, vpp, count = d.mp_degree, d.pp_degree, d.virtual_pp_degree, config.num_micro_batches
    mb = config.batch_size.micro_batch_size
    compute, tp_comm, cp_comm, ep_comm, forward, backward, params, replay = stages
    dp_comm, dp_exposed = _dp_times(config, hw, params, forward, backward)
    bubble = (pp - 1) / (count * vpp) * (compute + tp_comm + cp_comm + ep_comm)
    a = 4 if config.params_dtype_name == "float32" else 2
    message = mb * s / d.context_parallel_size * m.hidden_size * a / (tp if d.sequence_parallel else 1)
    p2p = 2 * count * vpp * message / _bandwidth(hw, hw.devices) if pp > 1 else 0.0
    offload, cpu_optimizer = 8.0 * shard / (hw.pcie_gbps * GB), shard / hw.cpu_adam_params_per_s
    tokens = config.batch_size.global_batch_size * s
    model_flops = _model_flops_per_token(config, cache) * tokens
    return TimeTerms(compute, tp_comm, dp_comm, dp_exposed, bubble, p2p, offload, count, model_flops,
                     model_flops + replay * tokens, cp_comm, ep_comm, cpu_optimizer)
