"""The ``Model:`` section of the configuration schema (``schema.py`` holds the others): the model's shape, its
attention and MLP variants, rotary embeddings, multi-token prediction and the mixture of experts."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.fields import opt


@dataclass
class ModelConfig:
    vocab_size: int | None = opt(
        None, "Vocabulary size; default the tokenizer's (50304 for mock data); padded to a multiple of "
              "make_vocab_size_divisible_by x tp.")
    make_vocab_size_divisible_by: int = opt(
        128, "The word embedding's rows are vocab_size rounded up to a multiple of this x tp (the padding rows "
             "never enter the loss).")
    hidden_size: int = opt(1024, "Width of the residual stream.")
    num_layers: int = opt(24, "Number of transformer decoder layers.")
    num_attention_heads: int = opt(16, "Attention heads per layer; must divide hidden_size.")
    ffn_hidden_size: int | None = opt(None, "Width of the MLP; default 4 x hidden_size.")
    hidden_dropout_prob: float = opt(0.1, "Dropout on embeddings and on each residual branch.")
    attention_probs_dropout_prob: float = opt(0.1, "Dropout on the attention probabilities.")
    attention_dropout_masks: str = opt(
        "kernel", "How attention dropout draws its masks in one process and under cp a2a: kernel (the fused "
                  "kernel's own random stream) or positional (each entry's from the seed, layer, sample, head and "
                  "global query and key positions, as cp p2p and all_gather always draw them: every layout then "
                  "draws the same masks; the blocks run in plain operations, slower).", ("kernel", "positional"))
    max_position_embeddings: int = opt(1024, "Rows of the learned position embedding.")
    type_vocab_size: int = opt(16, "Accepted for FleetX compatibility; GPT does not use it.")
    initializer_range: float = opt(0.02, "Std of the normal init; output projections get std / sqrt(2 x num_layers).")
    embedding_init_method_std: float | None = opt(
        None, "Std of the normal init of the word and position embeddings (Megatron-LM's --embedding-init-method-std); "
              "None: initializer_range.")
    use_mup: bool = opt(
        False, "Maximal Update Parametrization (Megatron-LM's --use-mup; docs/mup.md): with m = hidden_size / "
               "mup_base_hidden_size, hidden matrices drawn with std / sqrt(m), logits x mup_output_mult, attention "
               "scaled by mup_attn_scale_power, and AdamW's lr and eps / m on hidden matrices.")
    mup_base_hidden_size: int | None = opt(
        None, "muP: the base (proxy) model's hidden_size, whose hyperparameters transfer; None: hidden_size (m = 1).")
    mup_embedding_mult: float = opt(1.0, "muP: a multiplier on the embedding's output.")
    mup_output_mult: float = opt(
        1.0, "muP: a multiplier on the logits; 1.0 (the default) means 1 / m, as Megatron-LM reads it.")
    mup_base_head_dim: float | None = opt(
        None, "muP: the attention scale is sqrt(this) / head_dim^mup_attn_scale_power; None: 1 / "
              "head_dim^mup_attn_scale_power. Multi-latent attention keeps its own scale (Megatron Core's).")
    mup_attn_scale_power: float = opt(
        1.0, "muP: the power of the head width in the attention scale: 1 (muP's 1 / d) or 0.5 (the usual "
             "1 / sqrt(d)).")
    layernorm_epsilon: float = opt(1e-5, "Epsilon of every normalization layer (LayerNorm or RMSNorm).")
    position_embedding_type: str = opt(
        "learned_absolute", "Positions: a learned embedding added to the input (GPT-2), rotary embeddings on the "
                            "queries and keys (rope, Llama; yarn: with YaRN's scaled frequencies, gpt-oss), or none.",
        ("learned_absolute", "rope", "yarn", "none"))
    rotary_base: int = opt(10000, "Base of the rotary embedding's frequencies (rope).")
    rotary_percent: float = opt(1.0, "Fraction of each head's channels that are rotated (rope).")
    rotary_interleaved: bool = opt(
        False, "Rotate adjacent channel pairs (2j, 2j + 1) instead of the two halves of the rotated channels (rope).")
    normalization: str = opt("LayerNorm", "Normalization of every layer and of the output.", ("LayerNorm", "RMSNorm"))
    apply_layernorm_1p: bool = opt(
        False, "Zero-centred norm weights (Megatron-LM's --apply-layernorm-1p): every LayerNorm or RMSNorm scales by "
               "1 + w, w initialised to 0 (so weight decay pulls the scale towards 1, not 0); an export to Hugging "
               "Face writes 1 + w.")
    swiglu: bool = opt(False, "SwiGLU MLP (silu(x W_gate) * x W_up) instead of GELU; ffn_hidden_size then defaults "
                              "to int(8 x hidden_size / 3 / 64) x 64, as Megatron-LM.")
    bias_gelu_fusion: bool = opt(
        True, "GELU MLP: the tanh approximation (Megatron-LM's fused bias-GELU, GPT-2's) when on and the linear layers "
              "have biases; exact (erf) GELU otherwise, as Megatron Core computes it (--no-bias-gelu-fusion, or "
              "--disable-bias-linear, which turns the fusion off there).")
    quick_geglu: bool = opt(
        False, "Gated MLP with quick GELU (x sigmoid(1.702 x)) on the gate (gpt-oss; Megatron-LM's --quick-geglu): "
               "fc2(quick_gelu(x W_gate) * (x W_up + glu_linear_offset)).")
    squared_relu: bool = opt(
        False, "Squared-ReLU MLP, fc2(relu(x W_1)^2) (Megatron-LM's --squared-relu, Nemotron's), instead of GELU; "
               "in the experts too.")
    glu_linear_offset: float = opt(0.0, "Gated MLPs: added to the linear (up) half before the product (gpt-oss: 1).")
    activation_func_clamp_value: float | None = opt(
        None, "Gated MLPs: clamp the gate half to at most this and the linear half to [-this, this] before the "
              "activation (gpt-oss: 7); None: no clamp.")
    group_query_attention: bool = opt(False, "Grouped-query attention: num_query_groups key/value heads shared by "
                                             "the query heads.")
    num_query_groups: int | None = opt(None, "Key/value heads with group_query_attention; must divide "
                                             "num_attention_heads and be divisible by the tensor-parallel size.")
    kv_channels: int | None = opt(None, "Channels per attention head; default hidden_size / num_attention_heads.")
    untie_embeddings_and_output_weights: bool = opt(
        False, "Give the output layer its own weight instead of the word embedding's.")
    disable_bias_linear: bool = opt(False, "No biases in the attention and MLP linear layers (Llama).")
    add_qkv_bias: bool = opt(False, "A bias on the fused query/key/value projection even without linear biases "
                                    "(disable_bias_linear): Qwen2 / Qwen2.5's attention; Megatron-LM's --add-qkv-bias.")
    qk_layernorm: bool = opt(
        False, "Normalise each attention head's queries and keys (the model's normalization over the head width) "
               "before rotary embeddings (Qwen3; Megatron-LM's --qk-layernorm). With multi_latent_attention: the "
               "RMSNorms of the compressed queries and keys/values (DeepSeek-V3).")
    window_size: str | None = opt(
        None, "Sliding-window attention (Megatron-LM's --window-size LEFT,RIGHT; gpt-oss: 127,0): each query sees "
              "itself and the LEFT keys before it (RIGHT must be 0: causal; LEFT -1: no limit). The layers it applies "
              "to: window_attn_skip_freq. None: full causal attention.")
    window_attn_skip_freq: str | None = opt(
        None, "With window_size, which layers keep full attention: N (the layers whose number counted from 1 is a "
              "multiple of N, e.g. 2: every second layer, gpt-oss), or a pattern of num_layers 0/1 entries "
              "('[1,1,1,0]*3'; 1: sliding window); None: every layer has the window.")
    softmax_type: str = opt(
        "vanilla", "The attention softmax: vanilla; off-by-one (a zero logit in every row's denominator, "
                   "softmax_1); learnable (a trained logit per head, gpt-oss's attention sinks).",
        ("vanilla", "off-by-one", "learnable"))
    attention_output_gate: bool = opt(
        False, "Gate each attention head's output by sigmoid of a second query-shaped projection (Qwen3-Next's full "
               "attention): the QKV projection holds each group's queries, their gates, key and value.")
    experimental_attention_variant: str | None = opt(
        None, "gated_delta_net: the layers linear_attention_freq chooses are Gated DeltaNet linear attention "
              "(Qwen3-Next; docs/hybrid.md) instead of softmax attention. None: attention everywhere.")
    linear_attention_freq: str | None = opt(
        None, "With experimental_attention_variant, which layers are linear attention: N ((N-1) linear layers, then "
              "one attention layer, repeated) or a pattern of num_layers 0/1 entries ('([1]*3+[0]*1)*2'; 1: linear).")
    linear_conv_kernel_dim: int = opt(4, "Gated DeltaNet: the causal convolution's kernel width.")
    linear_key_head_dim: int = opt(128, "Gated DeltaNet: the width of a query and key head.")
    linear_value_head_dim: int = opt(128, "Gated DeltaNet: the width of a value head.")
    linear_num_key_heads: int = opt(16, "Gated DeltaNet: the query and key heads.")
    linear_num_value_heads: int = opt(32, "Gated DeltaNet: the value heads (a multiple of the key heads).")
    is_hybrid_model: bool = opt(
        False, "A hybrid model whose layers hybrid_override_pattern gives one by one (Megatron-LM's pretrain_mamba.py "
               "models, Nemotron-H; docs/hybrid.md).")
    hybrid_override_pattern: str | None = opt(
        None, "A hybrid model's layers, one character each (num_layers of them): M a Mamba-2 mixer, * attention, - an "
              "MLP, E a mixture of experts; each with its norm and residual (e.g. 'M-M-M*-M-').")
    mamba_state_dim: int = opt(128, "Mamba-2: the state size N of each head.")
    mamba_head_dim: int = opt(64, "Mamba-2: the width P of a head.")
    mamba_num_groups: int = opt(8, "Mamba-2: the groups G, each sharing B and C among its heads.")
    mamba_num_heads: int | None = opt(None, "Mamba-2: the heads; None: 2 x hidden_size / mamba_head_dim.")
    multi_latent_attention: bool = opt(
        False, "Multi-latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank down-projections, "
               "a rotary part of each query and one shared by the heads for the keys (docs/attention.md).")
    q_lora_rank: int | None = opt(
        None, "Multi-latent attention: the rank of the queries' down-projection; None: one query projection.")
    kv_lora_rank: int = opt(32, "Multi-latent attention: the rank of the keys' and values' down-projection.")
    qk_head_dim: int = opt(128, "Multi-latent attention: a query's and key's channels without rotary embeddings.")
    qk_pos_emb_head_dim: int = opt(64, "Multi-latent attention: a query's and key's rotary channels.")
    v_head_dim: int = opt(128, "Multi-latent attention: a value's channels.")
    rope_type: str | None = opt(
        None, "Rotary embeddings of multi-latent attention: rope, or yarn (YaRN's scaled frequencies); default yarn "
              "(Megatron-LM's). Other attention takes YaRN from position_embedding_type yarn.", ("rope", "yarn"))
    rotary_scaling_factor: float = opt(1.0, "YaRN: the context extension factor (1: the plain frequencies).")
    original_max_position_embeddings: int = opt(
        4096, "YaRN: the context the frequencies were trained for (transformers' original_max_position_embeddings).")
    mscale: float = opt(1.0, "YaRN: the concentration factor's mscale (cos and sin scaled by mscale(f, mscale) / "
                             "mscale(f, mscale_all_dim)).")
    mscale_all_dim: float = opt(0.0, "YaRN: mscale_all_dim; the softmax scale is mscale(f, mscale_all_dim)^2 / "
                                     "sqrt(qk_head_dim + qk_pos_emb_head_dim).")
    yarn_beta_fast: float = opt(32.0, "YaRN: channels turning at least this often over the original context keep "
                                      "their frequency.")
    yarn_beta_slow: float = opt(1.0, "YaRN: channels turning at most this often are fully interpolated.")
    yarn_correction_range_round_to_int: bool = opt(
        True, "YaRN: round the ends of the ramp between beta_fast's and beta_slow's channels to whole channels "
              "(gpt-oss: off; transformers' truncate).")
    mtp_num_layers: int | None = opt(
        None, "Multi-token prediction (DeepSeek-V3): this many sequential modules after the decoder, the k-th "
              "predicting each token k + 1 positions further from the previous one's hidden state and the next "
              "token's embedding (docs/moe.md, DeepSeek-V3); their losses join the objective, logged apart. None: off.")
    mtp_loss_scaling_factor: float = opt(
        0.1, "Multi-token prediction: the weight of the modules' mean loss in the objective.")
    num_experts: int | None = opt(
        None, "Mixture of experts: experts per MoE layer (Megatron-LM's --num-experts); None: every layer's MLP is "
              "dense (docs/moe.md).")
    moe_layer_freq: str = opt(
        "1", "Which layers are MoE layers: an integer N (every N-th layer, from layer 0) or a pattern of num_layers "
             "0/1 entries, Megatron-LM's forms '[1,0,1,0]' or '([0]*1+[1]*3)*2' (1: MoE).")
    moe_ffn_hidden_size: int | None = opt(None, "Width of each expert's MLP; default ffn_hidden_size.")
    moe_router_topk: int = opt(2, "Experts each token is routed to.")
    moe_router_pre_softmax: bool = opt(
        False, "Softmax router: softmax over all experts, then the top k (their probabilities unnormalised); by "
               "default the top k logits, then a softmax over those k.")
    moe_router_score_function: str = opt(
        "softmax", "The router's scores: softmax of the logits, or sigmoid (the top k then normalised to sum to 1 "
                   "when k > 1, DeepSeek-V3).", ("softmax", "sigmoid"))
    moe_router_num_groups: int | None = opt(
        None, "Group-limited routing (DeepSeek-V2/V3): the experts in this many equal groups (its devices or nodes); "
              "each token chooses among the experts of its moe_router_group_topk best groups.")
    moe_router_group_topk: int | None = opt(
        None, "Group-limited routing: the groups each token's experts come from, a group scored by the sum of its "
              "top moe_router_topk / moe_router_group_topk scores.")
    moe_router_topk_scaling_factor: float | None = opt(
        None, "Multiply the chosen experts' routing probabilities by this (DeepSeek-V3's routed_scaling_factor); "
              "None: 1.")
    moe_router_dtype: str | None = opt(
        None, "Precision of the router's logits and scores (default fp32).", ("fp32", "fp64"))
    moe_router_load_balancing_type: list[str] | str = opt(
        "aux_loss", "Load balancing: aux_loss (the Switch Transformer's loss over the micro-batch), seq_aux_loss "
                    "(the same per sequence, DeepSeek-V2), global_aux_loss (the same over the micro-batches of every "
                    "data-parallel rank, its counts averaged over the step's micro-batches so far), sinkhorn (the "
                    "choice balanced by Sinkhorn's algorithm in training, S-BASE; no loss) or none. Several losses "
                    "together as a list ('aux_loss,global_aux_loss', Megatron-LM's 'aux_loss global_aux_loss'), "
                    "with one moe_aux_loss_coeff each.",
        ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"))
    moe_aux_loss_coeff: list[float] | float = opt(
        0.0, "Coefficient of the load-balancing loss in the objective; a list, one per type, when "
             "moe_router_load_balancing_type lists several.")
    moe_z_loss_coeff: float | None = opt(
        None, "Coefficient of the router z-loss, mean(logsumexp(logits)^2) (ST-MoE); None: no z-loss.")
    moe_router_enable_expert_bias: bool = opt(
        False, "Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for choosing the "
               "experts only, moved after every step by moe_router_bias_update_rate x sign(mean load - load).")
    moe_router_bias_update_rate: float = opt(1e-3, "Step of the expert bias's update.")
    moe_router_force_load_balancing: bool = opt(
        False, "Benchmarking only: the router's logits replaced by random N(0, 1) values (their gradient passed "
               "to the real logits unchanged), so the experts get balanced loads whatever the weights.")
    moe_input_jitter_eps: float | None = opt(
        None, "Training: multiply the router's input by noise uniform in [1 - eps, 1 + eps] (the Switch "
              "Transformer's jitter; the experts see the input unchanged); None: off.")
    moe_expert_capacity_factor: float | None = opt(
        None, "Each expert takes at most ceil(tokens x topk / experts x this) tokens of a micro-batch, the rest "
              "dropped (their share of the expert's output is 0); None: dropless.")
    moe_token_drop_policy: str = opt(
        "probs", "Which tokens an expert over capacity keeps: the highest routing probabilities (probs) or the first "
                 "in the sequence (position).", ("probs", "position"))
    moe_pad_expert_input_to_capacity: bool = opt(
        False, "With a capacity: every expert computes on exactly capacity rows (padded with zeros), as Megatron-LM.")
    moe_shared_expert_intermediate_size: int | None = opt(
        None, "Width of a shared expert (an MLP every token goes through, added to the routed experts' output); "
              "None: no shared expert.")
    moe_shared_expert_gate: bool = opt(
        False, "Scale the shared expert's output by sigmoid(x g), g a trained [1, h] weight of each MoE layer "
               "(Qwen2-MoE's shared_expert_gate).")
    moe_shared_expert_overlap: bool = opt(
        False, "Run the shared expert's forward while the token exchange to the experts is in flight (the alltoall "
               "dispatcher at expert-parallel size > 1; the same values).")
    delay_wgrad_compute: bool = opt(
        False, "Compute the routed experts' weight gradients while the exchange of their input gradients is in "
               "flight, after the activation gradients (the alltoall dispatcher at expert-parallel size > 1; the "
               "same values).")
    moe_grouped_gemm: bool | None = opt(
        None, "Run the experts as one grouped matmul (torch._grouped_mm, CUDA in bf16); elsewhere (the CPU) they run "
              "one after another on their tokens. Default: grouped on Hopper and Blackwell GPUs, where torch has its "
              "own kernel (1.45x the loop's tokens/s on an H200, docs/benchmarks.md), for widths in multiples of 8; "
              "--moe-grouped-gemm: wherever it runs; --no-moe-grouped-gemm: never. The parameters are the same either "
              "way (a Megatron-LM export writes grouped-GEMM experts only when it is set).")
    moe_token_dispatcher_type: str = opt(
        "alltoall", "How tokens reach the experts' ranks: alltoall (each (token, expert) pair to the rank holding "
                    "the expert) or allgather (every token to every rank of the ep x etp group); the same result.",
        ("alltoall", "allgather"))

    def __setattr__(self, name: str, value) -> None:
        """A one-entry list of a field that takes one value or a list is its entry (as Megatron-LM's arguments.py
        reads --moe-router-load-balancing-type aux_loss): the single form is the one every reader sees."""
        if name in ONE_OR_MANY and isinstance(value, list) and len(value) == 1:
            value = value[0]
        super().__setattr__(name, value)


ONE_OR_MANY = ("moe_router_load_balancing_type", "moe_aux_loss_coeff")


def attention_shape(cfg: ModelConfig) -> tuple[int, int, int]:
    """(query heads nq, key/value groups ng, head width hd) of the whole model."""
    nq = cfg.num_attention_heads
    ng = cfg.num_query_groups if cfg.group_query_attention else nq
    return nq, ng, cfg.kv_channels or cfg.hidden_size // nq


# The normalization weights, by the end of their names (every layer's and the final ``...layernorm.weight``, the
# query/key norms', multi-token prediction's ``enorm`` and ``hnorm``): initialised to 1 (0 with apply_layernorm_1p).
NORM_WEIGHTS = ("layernorm.weight", ".enorm.weight", ".hnorm.weight", ".out_norm.weight")  # (Gated DeltaNet's)


def is_norm_weight(name: str) -> bool:
    return name.endswith(NORM_WEIGHTS)


TIED_EMBEDDING = "embedding.word_embeddings.weight"  # the tied word embedding's name, on every stage holding it


def shared_embedding_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The parameters the first and last pipeline stages both hold, their gradients summed (``shared_embedding``):
    the tied word embedding; the whole embedding with multi-token prediction (the last stage's modules embed)."""
    if cfg.mtp_num_layers and cfg.position_embedding_type == "learned_absolute":
        return TIED_EMBEDDING, "embedding.position_embeddings.weight"
    return (TIED_EMBEDDING,)
