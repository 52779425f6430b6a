"""Per-rank bytes of model states: parameters, gradients, fp32 master weights, AdamW states.

With P parameters on a rank (its tensor/pipeline share of the model), N = the ranks of a ZeRO shard group
(``Config.zero_shards``: the sharding degree, x cp when the shards span the context-parallel ranks):

| state | fp32 training | bf16 / fp16 training | sharded from stage |
| --- | --- | --- | --- |
| parameters | 4P | 2P | 3 |
| gradients (main grads: fp32; bf16 with ``grad_reduce_in_bf16``) | 4P | 4P (2P) | 2 |
| master weights (fp32) | 0 (the parameters are the masters) | 4P | 1 |
| AdamW exp_avg + exp_avg_sq (fp32; SGD: its momentum, 4P, none at momentum 0) | 8P | 8P | 1 |

A sharded state is 1/N of the table per rank; which states a stage shards, and that without a
sharding group (N = 1) the stage in effect is 1, is read from ``megatron/distributed/sharding_rule.py``, the
rule the run itself applies (``ShardingPlan``). ZeRO's 2Psi + 2Psi + K Psi with K = 12 (Adam, mixed
precision) is this table with fp32 gradients (4P rather than 2P: main grads are accumulated in fp32 here, as
Megatron-LM does for bf16 unless ``--grad-reduce-in-bf16``, which gives ZeRO's 2P). The figures are those held between
steps: under stage 2 the full 4P gradient buffer also exists during the backward, and under stage 3
the full parameters (and gradients) of the layers being used: at most the non-layer parameters
plus two layers at once: ``step_transient_bytes`` counts those. (bf16 main grads are upcast into an fp32 copy of
this rank's shard, 4P/N, for the optimizer step only, when no activations are held: not counted.)

Offload (``sharding_offload``): the master weights (fp32 even when training in fp32) and the AdamW
states live on the CPU, with a CPU copy of the gradient shard (4P/N) that the step reads.

Standard library only: the layout planner counts without importing torch. What an optimizer holds, measured,
is ``megatron.memory.measure.measured_model_state_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.schema import Config, padded_vocab_size
from megatron.config.validate_hybrid import hybrid_layer_kind, is_linear_attention_layer
from megatron.config.validate_moe import is_moe_layer
from megatron.distributed.sharding_rule import sharding_stage, shards_grads, shards_params


@dataclass(frozen=True)
class ModelStateBytes:
    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int
    cpu_gradients: int = 0  # offload: the CPU copy of the gradient shard
    offload: bool = False  # master weights and optimizer states on the CPU

    @property
    def total(self) -> int:
        return self.device_total + self.cpu_total

    @property
    def device_total(self) -> int:
        on_device = self.parameters + self.gradients
        return on_device if self.offload else on_device + self.master_weights + self.optimizer_states

    @property
    def cpu_total(self) -> int:
        return self.master_weights + self.optimizer_states + self.cpu_gradients if self.offload else 0

    def __add__(self, other: ModelStateBytes) -> ModelStateBytes:
        """Two groups of parameters of one rank (the dense ones and the experts), by the same headings."""
        return ModelStateBytes(self.parameters + other.parameters, self.gradients + other.gradients,
                               self.master_weights + other.master_weights,
                               self.optimizer_states + other.optimizer_states,
                               self.cpu_gradients + other.cpu_gradients, self.offload or other.offload)


def model_state_bytes(num_params: int, precision: str = "fp32", sharding: int = 1, stage: int = 1,
                      offload: bool = False, grad_bytes: int = 4, state_bytes: int = 8) -> ModelStateBytes:
    """Bytes one rank holds between steps for ``num_params`` parameters (its share after tp/pp); ``grad_bytes`` per
    main-grad element (``gradient_bytes``), ``state_bytes`` of optimizer states per element (``state_bytes_of``)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"sharding stage must be 1, 2 or 3, got {stage}")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"unknown precision {precision!r}")
    in_effect = sharding_stage(sharding, stage)  # what the run would shard
    shard = -(-num_params // sharding)  # shards are padded to equal size
    low = precision != "fp32"
    params = shard if shards_params(in_effect) else num_params
    grads = shard if shards_grads(in_effect) else num_params
    return ModelStateBytes(parameters=params * (2 if low else 4), gradients=grad_bytes * grads,
                           master_weights=4 * shard if low or offload else 0, optimizer_states=state_bytes * shard,
                           cpu_gradients=4 * shard if offload else 0, offload=offload)


def expert_grid(config: Config) -> tuple[int, int, int]:
    """(ep, etp, edp) of a validated configuration: within a pipeline stage the tp x cp x dp x sharding ranks are
    re-cut for the experts as etp x ep x edp (etp fastest); etp defaults to the model's tp."""
    d = config.distributed
    ep, etp = d.expert_model_parallel_size, d.expert_tensor_parallel_size or d.mp_degree
    stage_ranks = d.mp_degree * d.context_parallel_size * (d.dp_degree or 1) * d.sharding.sharding_degree
    return ep, etp, max(1, stage_ranks // (ep * etp))


def training_precision(config: Config) -> str:
    """"fp32", "bf16" or "fp16": the parameters' dtype (``mix_precision``)."""
    mp = config.mix_precision
    return "bf16" if mp.bf16 else "fp16" if mp.use_pure_fp16 else "fp32"


def gradient_bytes(config: Config) -> int:
    """Bytes of a main-grad element: 2 under ``grad_reduce_in_bf16`` (bf16 buffers), else 4 (fp32)."""
    return 2 if config.mix_precision.grad_reduce_in_bf16 else 4


def state_bytes_of(config: Config) -> int:
    """Optimizer-state bytes per element: AdamW's two fp32 moments, 8; SGD's fp32 momentum, 4 (0 without momentum).
    (Muon's matrices keep one momentum, 4, and AdamW the rest: counted as AdamW's here.)"""
    o = config.optimizer
    if o.optimizer == "sgd":
        return 4 if o.sgd_momentum else 0
    return 8


def expert_shards(config: Config) -> int:
    """The ranks the experts' states are sharded over: every expert-data-parallel rank (edp, no replicas) when
    the optimizer is sharded (the dense states over ``zero_shards`` > 1), else 1 (all-reduced over edp)."""
    return expert_grid(config)[2] if config.zero_shards > 1 else 1


def rank_model_state_bytes(config: Config, pp_rank: int = 0) -> ModelStateBytes:
    """What a rank of pipeline stage ``pp_rank`` holds between steps: its dense parameters' states over the
    ZeRO shard group (``zero_shards``) plus, for a MoE model, its experts' (``parameter_split``) over
    ``expert_shards``, by the same stage rule and offload."""
    d = config.distributed
    dense, experts = parameter_split(config, d.mp_degree, d.pp_degree, pp_rank)
    precision, stage, offload = training_precision(config), d.sharding.sharding_stage, d.sharding.sharding_offload
    sizes = {"grad_bytes": gradient_bytes(config), "state_bytes": state_bytes_of(config)}
    states = model_state_bytes(dense, precision, config.zero_shards, stage, offload, **sizes)
    if experts:
        states = states + model_state_bytes(experts, precision, expert_shards(config), stage, offload, **sizes)
    return states


def step_transient_bytes(config: Config, pp_rank: int = 0) -> int:
    """Device bytes of model states that exist only during a step, beyond ``model_state_bytes``:
    under stage 2 the full gradient buffer (4P, or 2P in bf16, of which the 1/N shard stays between steps);
    under stage 3 the full parameters and gradients of what is gathered: without pipelining the
    non-layer parameters (the root) and two decoder layers, with pipelining the whole stage (gathered at
    its first forward, kept until the reduce-scatter after its last backward). Stage 1: none. The experts
    (their own shards over ``expert_shards``) likewise, a layer's gathered with it."""
    d = config.distributed
    tp, pp, sharding = d.mp_degree, d.pp_degree, config.zero_shards
    stage = sharding_stage(sharding, d.sharding.sharding_stage)
    dense, experts = parameter_split(config, tp, pp, pp_rank)
    num_params = dense + experts
    shard = -(-dense // sharding) + (-(-experts // expert_shards(config)) if experts else 0)
    if stage == 1:
        return 0
    if stage == 2:
        return gradient_bytes(config) * (num_params - shard)
    param_bytes = 4 if training_precision(config) == "fp32" else 2
    if pp > 1:
        gathered = num_params
    else:
        kinds = _layer_kinds(config, tp, range(config.model.num_layers))
        layers = sum(count * (dense + expert) for dense, expert, count in kinds)
        largest = sorted((dense + expert for dense, expert, count in kinds for _ in range(min(count, 2))), reverse=True)
        gathered = num_params - layers + sum(largest[:2])  # the two largest layers gathered at once
    return (param_bytes + gradient_bytes(config)) * max(0, gathered - shard)


def parameters_per_rank(config: Config, tp: int = 1, pp: int = 1, pp_rank: int = 0, ep: int | None = None,
                        etp: int | None = None) -> int:
    """Parameters held by a rank at (tp, pp): ``parameter_split``'s dense and expert parameters together."""
    return sum(parameter_split(config, tp, pp, pp_rank, ep, etp))


def parameter_split(config: Config, tp: int = 1, pp: int = 1, pp_rank: int = 0, ep: int | None = None,
                    etp: int | None = None) -> tuple[int, int]:
    """(dense, expert) parameters held by a rank at (tp, pp): its stage's layers with the tensor-parallel
    matrices split over tp, the word embedding (split over tp) and the learned position embedding on the first
    stage, the final norm and the LM head on the last: the untied output layer (split over tp), or
    under pipelining the tied embedding's copy. The experts of its MoE layers are this rank's E / ep, each
    split over etp (``layer_split``; ep and etp the configuration's unless given: 1 and 1 count them all)."""
    from megatron.config.layer_split import rank_chunks

    m, d = config.model, config.distributed
    vpp = d.virtual_pp_degree if pp > 1 else 1  # interleaved: this rank's chunks
    layers = [i for chunk, _, _ in rank_chunks(m.num_layers, pp, vpp, d.pipeline_partition, pp_rank) for i in chunk]
    h = m.hidden_size
    vocab = padded_vocab_size(m.vocab_size, tp, m.make_vocab_size_divisible_by)
    norm = 2 * h if m.normalization == "LayerNorm" else h
    total, experts = 0, 0
    for dense, expert, count in _layer_kinds(config, tp, layers, ep, etp):
        total, experts = total + count * dense, experts + count * expert
    if pp_rank == 0:
        total += vocab // tp * h + (m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute"
                                    else 0)
    if pp_rank == pp - 1:
        untied = m.untie_embeddings_and_output_weights
        total += norm + (vocab // tp * h if untied or pp > 1 else 0)  # final norm, the head's own weight
        if m.mtp_num_layers:  # multi-token prediction: its modules, and a copy of the whole embedding off stage 0
            for k in range(m.mtp_num_layers):
                dense, expert = layer_split(config, tp, m.num_layers + k, ep, etp)
                total, experts = total + dense + 3 * norm + 2 * h * h // tp, experts + expert
            if pp > 1:
                total += (vocab // tp * h if untied else 0) + (
                    m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" else 0)
    return total, experts


def _layer_kinds(config: Config, tp: int, layers, ep: int | None = None,
                 etp: int | None = None) -> list[tuple[int, int, int]]:
    """(dense, expert, how many) of ``layers``, a ``layer_split`` per kind of layer (MoE or not, linear attention or
    not: all it depends on): a deep model's stages repeat a few kinds, and the layout planner asks for thousands of
    stages."""
    counts: dict[tuple, list] = {}
    for i in layers:
        kind = (is_moe_layer(config.model, i), is_linear_attention_layer(config.model, i),
                hybrid_layer_kind(config.model, i))
        if kind in counts:
            counts[kind][1] += 1
        else:
            counts[kind] = [i, 1]
    return [(*layer_split(config, tp, first, ep, etp), count) for first, count in counts.values()]


def layer_parameters(config: Config, tp: int = 1, layer: int = 0) -> int:
    """Decoder layer ``layer``'s parameters on a rank: ``layer_split``'s dense and expert ones together."""
    return sum(layer_split(config, tp, layer))


def layer_split(config: Config, tp: int = 1, layer: int = 0, ep: int | None = None,
                etp: int | None = None) -> tuple[int, int]:
    """(dense, expert) parameters of decoder layer ``layer`` on a rank of a tensor-parallel group of ``tp``:
    QKV [(nq + 2 ng) hd, h] and the MLP's first matmul ([ffn, h], SwiGLU [2 ffn, h]) split by rows with
    their biases, the output projections split by columns (biases replicated), two norms replicated.
    Learnable attention sinks: one per head, split over tp. A MoE layer (``megatron.moe``): the router [E, h] (and
    its bias [E] with linear biases) and the shared expert (split over tp) are dense; its
    experts are this rank's E / ep (``expert_grid``), each shaped like the MLP and split over etp (the second
    matmul's bias replicated over etp)."""
    m = config.model
    h, f = m.hidden_size, m.ffn_hidden_size or 4 * m.hidden_size
    nq = m.num_attention_heads
    ng = m.num_query_groups if m.group_query_attention else nq
    hd = m.kv_channels or h // nq
    bias = 0 if m.disable_bias_linear else 1

    def mlp(width: int, split: int) -> int:  # (split, replicated)
        fc1 = (2 if m.swiglu or m.quick_geglu else 1) * width
        return (fc1 * h + bias * fc1 + width * h) // split + bias * h

    qkv = (nq * (2 if m.attention_output_gate else 1) + 2 * ng) * hd  # (each query head's gate: as many rows)
    per_norm = 2 if m.normalization == "LayerNorm" else 1  # weight (and bias) per channel
    qkv_bias = 1 if bias or m.add_qkv_bias else 0
    attention = (qkv * h + qkv_bias * qkv + nq * hd * h) // tp + bias * h + (2 * per_norm * hd if m.qk_layernorm else 0)
    attention += nq // tp if m.softmax_type == "learnable" else 0  # the sinks of this rank's heads
    if m.multi_latent_attention:
        attention = _mla_parameters(m, tp, per_norm)
    if is_linear_attention_layer(m, layer):
        attention = _linear_attention_parameters(m, tp, per_norm)
    kind = hybrid_layer_kind(m, layer)  # a hybrid model's layer: its one part and its norm
    if kind in ("M", "*"):
        return (_mamba_parameters(m, tp) if kind == "M" else attention) + per_norm * h, 0
    norms = per_norm * h if kind else 2 * per_norm * h
    attention = 0 if kind else attention  # an MLP or MoE layer of a hybrid model
    if not is_moe_layer(m, layer):
        return attention + mlp(f, tp) + norms, 0
    grid = expert_grid(config)
    ep, etp = ep or grid[0], etp or grid[1]
    shared = m.moe_shared_expert_intermediate_size
    dense = attention + m.num_experts * (h + bias) + (mlp(shared, tp) if shared else 0) + norms  # router (+ bias)
    dense += h if shared and m.moe_shared_expert_gate else 0  # the shared expert's gate [1, h], replicated
    return dense, m.num_experts // ep * mlp(m.moe_ffn_hidden_size or f, etp)


def _mamba_parameters(m, tp: int) -> int:
    """A Mamba-2 mixer's parameters on a rank (``megatron.hybrid.mamba``), all split by groups over tp: ``in_proj``,
    the convolution's weight and bias, ``dt_bias``, ``A_log``, ``D``, the gated norm's weight, ``out_proj``."""
    from megatron.hybrid.mamba import D_CONV, mamba_shape

    heads, width, groups, state = mamba_shape(m)
    inner, channels = heads * width, heads * width + 2 * groups * state
    return ((2 * inner + 2 * groups * state + heads) * m.hidden_size + channels * (D_CONV + 1) + 3 * heads + inner
            + inner * m.hidden_size) // tp


def _linear_attention_parameters(m, tp: int, per_norm: int) -> int:
    """A Gated DeltaNet layer's parameters on a rank (``megatron.hybrid``): ``in_proj``, the convolution, ``dt_bias``,
    ``A_log`` and ``out_proj`` split by key heads over tp, the output norm (over a value head) replicated."""
    h, nk, nv, dk, dv = (m.hidden_size, m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim,
                         m.linear_value_head_dim)
    r = nv // nk
    split = nk * (2 * dk + 2 * r * dv + 2 * r) * h + nk * (2 * dk + r * dv) * m.linear_conv_kernel_dim + 2 * nv \
        + nv * dv * h
    return split // tp + per_norm * dv


def _mla_parameters(m, tp: int, per_norm: int) -> int:
    """Multi-latent attention's parameters on a rank (``megatron.model.mla``): the down-projections and latent norms
    replicated, the up-projections split by rows and the output projection by columns over tp."""
    a, h = m.num_attention_heads, m.hidden_size
    q_width, norms = a * (m.qk_head_dim + m.qk_pos_emb_head_dim), per_norm if m.qk_layernorm else 0
    if m.q_lora_rank is None:
        query = q_width * h // tp
    else:
        query = m.q_lora_rank * h + norms * m.q_lora_rank + q_width * m.q_lora_rank // tp
    keys_values = ((m.kv_lora_rank + m.qk_pos_emb_head_dim) * h + norms * m.kv_lora_rank
                   + a * (m.qk_head_dim + m.v_head_dim) * m.kv_lora_rank // tp)
    return query + keys_values + a * m.v_head_dim * h // tp + (0 if m.disable_bias_linear else h)
