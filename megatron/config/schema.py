"""The configuration schema: one dataclass per YAML section, one help text per field.

The YAML structure follows the FleetX GPT configs (optionally wrapped in ``PreTraining:``)::

    Model: {...}            -> ModelConfig
    Optimizer: {..., lr: {...}}
    Distributed: {..., sharding: {...}}
    device, max_steps, ..., batch_size: {...}, mix_precision: {...}, dataset: {...}, save_load: {...}

Every leaf name is unique across sections, so every leaf is also a command-line flag
(``hidden_size`` -> ``--hidden-size``). Fields whose default is ``None`` are derived during
validation (see ``validate.py``) unless the user sets them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.fields import opt, section
from megatron.config.schema_model import ModelConfig


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """The word embedding's rows: ``vocab_size`` rounded up to a multiple of ``divisible_by x tp``
    (Megatron-LM's rule and its ``--make-vocab-size-divisible-by``, default 128), so every
    tensor-parallel shard has the same, aligned number of rows."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


# The parts of a decoder layer a selective recompute may cover (Megatron-LM's --recompute-modules choices).
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "shared_experts", "layernorm", "mla_up_proj")
# The parts of a decoder layer whose saved activations may go to host memory (Megatron-LM's --offload-modules).
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")


@dataclass
class LRConfig:
    decay_steps: int | None = opt(None, "Step at which cosine decay reaches min_lr; default max_steps.")
    warmup_rate: float = opt(0.01, "Fraction of decay_steps spent in linear warm-up.")
    warmup_steps: int | None = opt(None, "Warm-up steps; when set, overrides warmup_rate.")
    max_lr: float = opt(1.0e-4, "Peak learning rate, reached at the end of warm-up.")
    min_lr: float = opt(1.0e-5, "Learning rate at and after decay_steps.")
    decay_style: str = opt("cosine", "Shape of the decay from max_lr to min_lr after warm-up.",
                           ("cosine", "linear", "constant", "inverse-square-root", "WSD"))
    warmup_init: float = opt(0.0, "Learning rate at the start of warm-up (Megatron-LM's --lr-warmup-init).")
    decay_samples: int | None = opt(
        None, "Sample-based schedule: samples over which the learning rate decays (Megatron-LM's "
              "--lr-decay-samples); default train_samples.")
    warmup_samples: int | None = opt(None, "Sample-based schedule: warm-up samples (--lr-warmup-samples).")
    wsd_decay_steps: int | None = opt(None, "WSD: steps of the final decay (--lr-wsd-decay-iters).")
    wsd_decay_samples: int | None = opt(None, "WSD, sample-based: samples of the final decay (--lr-wsd-decay-samples).")
    wsd_decay_style: str = opt("exponential", "WSD: shape of the final decay.",
                               ("exponential", "linear", "cosine", "minus_sqrt"))
    decoupled_lr: float | None = opt(
        None, "A peak learning rate of its own for the word embedding and the output layer (Megatron-LM's "
              "--decoupled-lr): their schedule is the others' with this in place of max_lr; None: max_lr.")
    decoupled_min_lr: float | None = opt(
        None, "With decoupled_lr: the embedding's and output layer's min_lr (Megatron-LM's --decoupled-min-lr); "
              "None: min_lr.")


@dataclass
class MuonConfig:
    """Megatron-LM's Muon (``--optimizer muon`` / ``dist_muon``): the transformer layers' matrices stepped by their
    orthogonalised momentum (docs/muon.md); every other parameter by AdamW."""

    muon_momentum: float = opt(0.9, "Muon's momentum (the EMA coefficient of its gradient average).")
    muon_split_qkv: bool = opt(True, "Orthogonalise the fused QKV weight's query, key and value blocks (each over "
                                     "every group) separately (Megatron-LM's --muon-no-split-qkv turns it off).")
    muon_use_nesterov: bool = opt(False, "Nesterov momentum: orthogonalise the gradient moved towards the momentum.")
    muon_scale_mode: str = opt("spectral", "The update's scale of an out x in matrix: spectral sqrt(max(out, in)), "
                                           "unit_rms_norm sqrt(out / in), shape_scaling sqrt(max(1, out / in)).",
                               ("spectral", "unit_rms_norm", "shape_scaling"))
    muon_fp32_matmul_prec: str = opt("medium", "Newton-Schulz matmuls: medium in bf16, high in fp32 (TF32 on "
                                               "GPUs), low at torch's current setting (fp32 unless changed).",
                                     ("low", "medium", "high"))
    muon_num_ns_steps: int = opt(5, "Newton-Schulz iterations: a multiple of 5 (the quintic coefficients' cycle).")
    muon_tp_mode: str = opt("blockwise", "A tensor-parallel matrix: blockwise orthogonalises each rank's block, "
                                         "duplicated the gathered whole, distributed the whole with the Gram "
                                         "matrices all-reduced.", ("blockwise", "duplicated", "distributed"))
    muon_extra_scale_factor: float = opt(1.0, "A further factor on every Muon update.")


@dataclass
class OptimizerConfig:
    optimizer: str = opt("adam", "adam: AdamW for every parameter; sgd: torch's SGD with momentum (sgd_momentum) and "
                                 "coupled (L2) weight decay; muon: Muon for the transformer layers' matrices, "
                                 "AdamW for the rest; dist_muon: muon with the optimizer states sharded over the "
                                 "data-parallel group (use_distributed_optimizer).",
                         ("adam", "sgd", "muon", "dist_muon"))
    weight_decay: float = opt(0.01, "Weight decay (AdamW's and Muon's decoupled, SGD's coupled L2); never applied to "
                                    "biases and norms (but see apply_wd_to_qk_layernorm).")
    apply_wd_to_qk_layernorm: bool = opt(
        False, "Weight decay on the query and key norms' weights and biases too (Megatron-LM's "
               "--apply-wd-to-qk-layernorm, Qwen3-Next's rule); the other norms and biases still get none.")
    no_weight_decay_cond_type: str | None = opt(
        None, "Megatron-LM's deprecated spelling of apply_wd_to_qk_layernorm (--no-weight-decay-cond-type "
              "apply_wd_to_qk_layernorm).", ("apply_wd_to_qk_layernorm",))
    start_weight_decay: float | None = opt(
        None, "Weight decay at the start of a weight-decay schedule; default weight_decay.")
    end_weight_decay: float | None = opt(None, "Weight decay at the end of training; default weight_decay.")
    weight_decay_incr_style: str = opt(
        "constant", "How the weight decay goes from start_weight_decay to end_weight_decay over training.",
        ("constant", "linear", "cosine"))
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.999, "AdamW beta2.")
    adam_epsilon: float = opt(1.0e-8, "AdamW epsilon.")
    sgd_momentum: float = opt(0.9, "optimizer sgd: the momentum factor (torch.optim.SGD's, no dampening, no Nesterov); "
                                   "0: plain SGD, no momentum buffer.")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    qk_clip: bool = opt(
        False, "QK-clip (MuonClip, Megatron-LM's --qk-clip): after each step, the query and key weights of every "
               "attention head whose largest logit of the step passed qk_clip_threshold scaled so that it would sit "
               "there (docs/muon.md); the largest logit is logged too.")
    qk_clip_alpha: float = opt(0.5, "QK-clip: the share of the scaling the queries take (eta^alpha), the keys taking "
                                    "the rest (eta^(1 - alpha)); in (0, 1).")
    qk_clip_threshold: float = opt(100.0, "QK-clip: the largest attention logit a head may keep; eta = threshold / "
                                          "its largest logit where that is larger.")
    log_max_attention_logit: bool = opt(
        False, "Log the largest attention logit of each step (max_attention_logit), without clipping "
               "(Megatron-LM's --log-max-attention-logit).")
    lr: LRConfig = section(LRConfig, "lr", "Learning-rate schedule: linear warm-up, then cosine decay.")
    muon: MuonConfig = section(MuonConfig, "muon", "Muon (optimizer muon or dist_muon).")


@dataclass
class ShardingConfig:
    sharding_degree: int = opt(1, "Ranks that shard optimizer states (ZeRO) within a data-parallel group.")
    sharding_stage: int = opt(1, "1: optimizer states, 2: + gradients, 3: + parameters.", (1, 2, 3))
    sharding_offload: bool = opt(False, "Keep fp32 master weights and optimizer states on the CPU.")


@dataclass
class DistributedConfig:
    dp_degree: int | None = opt(None, "Data-parallel replicas; default world / (mp x pp x sharding).")
    mp_degree: int = opt(1, "Tensor (model) parallel size.")
    pp_degree: int = opt(1, "Pipeline parallel stages.")
    virtual_pp_degree: int = opt(1, "Model chunks per pipeline stage (interleaved 1F1B).")
    pipeline_schedule: str = opt("1f1b", "Pipeline schedule with pp_degree > 1 (interleaved 1F1B when "
                                 "virtual_pp_degree > 1).", ("1f1b", "gpipe"))
    pipeline_partition: str = opt("layer:TransformerDecoderLayer", "How layers are cut into stages: "
                                  "'layer:TransformerDecoderLayer' (even), 'uniform', counts per stage '4,6,6', or a "
                                  "Megatron-LM layout string naming each (virtual) stage's layers: E embedding, t "
                                  "transformer layer, m multi-token prediction, L loss, a vertical bar between stages, "
                                  "'t*4' or '(tt,t)*2' repeats; its stages / pp_degree set virtual_pp_degree "
                                  "(docs/pipeline_layout.md; Megatron-LM's --pipeline-model-parallel-layout).")
    sequence_parallel: bool = opt(False, "Split LayerNorm/dropout regions along the sequence across TP ranks.")
    context_parallel_size: int = opt(
        1, "Context parallelism: each sample's sequence cut into 2 x this many chunks, rank r of the group keeping "
           "chunks r and 2 cp - 1 - r (every rank the same causal work); attention exchanges keys and values.")
    cp_comm_type: str = opt(
        "p2p", "How context-parallel attention exchanges keys and values: p2p (ring attention: blocks sent round "
               "the ring, overlapped with compute), all_gather (keys and values gathered), a2a (Ulysses: "
               "all-to-all to whole sequences of a subset of the heads), a2a+p2p (hierarchical: a2a within groups of "
               "hierarchical_context_parallel_sizes[0] neighbouring cp ranks, then a ring over the groups).",
        ("p2p", "all_gather", "a2a", "a2a+p2p"))
    hierarchical_context_parallel_sizes: list[int] | None = opt(
        None, "INNER OUTER: the two levels of the context-parallel group for cp_comm_type a2a+p2p (their product "
              "context_parallel_size): all-to-all within groups of INNER neighbouring cp ranks (a node's), a ring "
              "of OUTER steps across the groups (Megatron-LM's --hierarchical-context-parallel-sizes).")
    use_distributed_optimizer: bool = opt(
        False, "Megatron-LM's distributed optimizer: ZeRO stage 1 over the whole data-parallel group (sets "
               "sharding_degree to it, sharding_stage 1).")
    overlap_param_gather: bool = opt(
        False, "Accepted for Megatron-LM compatibility: the sharded optimizer's parameter all-gather runs after "
               "the step.")
    bucket_size_mb: float = opt(40.0, "Size of a data-parallel gradient all-reduce bucket (MB of gradients: fp32, "
                                      "bf16 with grad_reduce_in_bf16).")
    ddp_reduce_scatter_with_fp32_accumulation: bool = opt(
        False, "With grad_reduce_in_bf16 and sharded gradients (ZeRO 2, 3): each bucket's reduce-scatter sends bf16 "
               "(an all-to-all) and sums every rank's part in fp32, rounded once (Megatron-LM's); fp32 gradients "
               "are summed in fp32 anyway.")
    overlap_grad_reduce: bool | None = opt(
        None, "Start each bucket's all-reduce as soon as its gradients are ready; default on for GPUs, off on the "
              "CPU, where gloo's thread competes with the compute for the cores (docs/benchmarks.md).")
    expert_model_parallel_size: int = opt(
        1, "Expert parallelism: the ranks each MoE layer's experts are split over (each holds num_experts / this), "
           "taken from the data-parallel (and tensor/context-parallel) ranks of a pipeline stage; tokens travel to "
           "their experts by moe_token_dispatcher_type.")
    expert_tensor_parallel_size: int | None = opt(
        None, "The experts' own tensor-parallel size: each expert's MLP cut over this many ranks; None: mp_degree. "
              "expert_model_parallel_size x this must divide the ranks of a pipeline stage.")
    distributed_timeout_minutes: float = opt(
        10.0, "Timeout of every collective and point-to-point operation (Megatron-LM's flag).")
    sharding: ShardingConfig = section(ShardingConfig, "sharding", "Group-sharded (ZeRO) optimizer.")


@dataclass
class BatchSizeConfig:
    global_batch_size: int | None = opt(None, "Samples per optimizer step over all data-parallel ranks.")
    local_batch_size: int | None = opt(None, "Samples per optimizer step on one data-parallel rank.")
    micro_batch_size: int | None = opt(None, "Samples per forward/backward; local / micro = accumulation steps.")
    rampup_batch_size: list[int] | None = opt(
        None, "START INCR SAMPLES: the global batch grows from START by INCR over the first SAMPLES samples to "
              "global_batch_size (Megatron-LM's ramp-up; needs train_samples).")
    step_batch_size_schedule: str | None = opt(
        None, "'TOKENS:BATCH ...': the global batch from each number of consumed tokens on (K/M/B/T suffixes), "
              "e.g. '0:16 2.4B:320'; the last batch is global_batch_size.")


@dataclass
class MixPrecisionConfig:
    use_pure_fp16: bool = opt(False, "fp16 parameters and compute, fp32 master weights, loss scaling.")
    bf16: bool = opt(False, "bf16 parameters and compute, fp32 master weights and gradients.")
    grad_reduce_in_bf16: bool = opt(
        False, "With bf16: the gradient buffers in bf16, so micro-batches accumulate and the data-parallel reduction "
               "runs in bf16 (half the bytes); the optimizer upcasts them to fp32 for its step (Megatron-LM's flag).")
    scale_loss: float = opt(32768.0, "Initial (or static) loss scale for fp16.")
    dynamic_loss_scale: bool = opt(
        True, "Adjust the fp16 loss scale on overflow; --no-dynamic-loss-scale keeps it static.")
    loss_scale_window: int = opt(1000, "Clean steps before the dynamic loss scale doubles.")
    hysteresis: int = opt(2, "Overflows tolerated before the dynamic loss scale halves.")
    min_loss_scale: float = opt(1.0, "Floor of the dynamic loss scale.")
    disable_bf16_reduced_precision_matmul: bool = opt(
        False, "On GPUs, bf16 matmuls reduce in fp32 only (torch.backends.cuda.matmul."
               "allow_bf16_reduced_precision_reduction off, Megatron-LM's flag); no effect on the CPU.")
    fp8_format: str | None = opt(
        None, "FP8 matmuls in the tensor-parallel linear layers (docs/fp8.md): e4m3 (every operand E4M3) or hybrid "
              "(the output gradient E5M2); needs a GPU of compute capability 8.9 or newer.", ("e4m3", "hybrid"))
    fp8_recipe: str = opt(
        "tensorwise", "FP8 scaling: tensorwise (each tensor by its own amax, the whole tensor's over the ranks "
                      "that split it). delayed, mxfp8 and blockwise are refused (not built).",
        ("tensorwise", "delayed", "mxfp8", "blockwise"))
    fp8_amax_history_len: int = opt(1, "Delayed scaling's amax history (Megatron-LM's); without effect under "
                                       "tensorwise.")
    fp8_amax_compute_algo: str = opt("most_recent", "Delayed scaling's amax from the history (Megatron-LM's); "
                                                    "without effect under tensorwise.", ("most_recent", "max"))
    fp8_param_gather: bool = opt(False, "Gather ZeRO-sharded parameters in FP8 (refused: not built; they are "
                                        "gathered in the training dtype).")


@dataclass
class DatasetConfig:
    input_dir: str | None = opt(None, "Data prefix, a folder of prefixes, or 'w1 prefix1 w2 prefix2 ...'.")
    train_data_path: str | None = opt(
        None, "Training data only ('w1 prefix1 ...'), instead of splitting input_dir; with valid_data_path and "
              "test_data_path (Megatron-LM's).")
    valid_data_path: str | None = opt(None, "Validation data ('w1 prefix1 ...') with train_data_path.")
    test_data_path: str | None = opt(None, "Test data ('w1 prefix1 ...') with train_data_path.")
    split: str = opt("949,50,1", "Train, validation and test proportions.")
    max_seq_len: int = opt(1024, "Tokens per sample.")
    mock_data: bool = opt(False, "Train on deterministic synthetic data (a fixed random bigram language).")
    mock_document_length: int = opt(
        128, "Mean document length of the mock data (each position ends a document with probability 1 / this).")
    data_cache_path: str | None = opt(None, "Folder for the cached sample indices; default beside each dataset.")
    num_workers: int = opt(1, "DataLoader worker processes that prefetch batches (0: load in the main process).")
    eod_mask_loss: bool = opt(
        True, "Mask the loss where the input token is end-of-document; --no-eod-mask-loss keeps it.")
    reset_attention_mask: bool = opt(
        False, "Packed documents: attention stays inside each document (the token after an end-of-document "
               "starts a new one), as Megatron-LM's flag; computed from document boundaries, no sequence x "
               "sequence mask.")
    reset_position_ids: bool = opt(
        False, "Packed documents: positions restart at 0 after each end-of-document token (Megatron-LM's flag).")
    # fill-in-the-middle (Megatron-LM's --fim-* flags, its defaults; megatron/data/fim.py, docs/data.md)
    fim_data: bool = opt(False, "Fill-in-the-middle: rearrange documents of the samples as prefix/suffix/middle "
                                "(megatron/data/fim.py); needs real data and a tokenizer holding the FIM tokens.")
    fim_rate: float = opt(0.5, "FIM: probability that a document of a sample is rearranged.")
    fim_spm_rate: float = opt(0.5, "FIM: probability that a rearranged document is SPM (else PSM).")
    fim_split_sample: str | None = opt(
        None, "FIM: a token that cuts documents into fragments (files of a repository), each rearranged on its own "
              "with probability fim_fragment_rate.")
    fim_fragment_rate: float | None = opt(None, "FIM: probability per fragment (with fim_split_sample).")
    fim_no_prefix: str | None = opt(None, "FIM: leave a document (fragment) whose text starts with this as it is.")
    fim_prefix_token: str = opt("<fim_prefix>", "FIM: the prefix sentinel, as the tokenizer spells it.")
    fim_middle_token: str = opt("<fim_middle>", "FIM: the middle sentinel.")
    fim_suffix_token: str = opt("<fim_suffix>", "FIM: the suffix sentinel.")
    fim_pad_token: str = opt("<fim_pad>", "FIM: the token that pads a sample the rearrangement shortened.")
    fim_eod_token: str = opt("<|endoftext|>", "FIM: the end-of-document token that cuts a sample into documents.")


@dataclass
class TokenizerConfig:
    tokenizer_type: str | None = opt(None, "Tokenizer for real data.",
                                     ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                                      "Llama2Tokenizer", "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer"))
    vocab_file: str | None = opt(None, "GPT-2 BPE vocab.json.")
    merge_file: str | None = opt(None, "GPT-2 BPE merges.txt.")
    tokenizer_model: str | None = opt(None, "SentencePiece .model, or a Hugging Face tokenizer.json (or its folder).")
    eod_token: str | None = opt(None, "End-of-document token of a Hugging Face tokenizer, when not a usual name.")
    tiktoken_pattern: str | None = opt(None, "TikTokenizer: the pre-tokenization pattern.", ("v1", "v2"))
    tiktoken_num_special_tokens: int = opt(1000, "TikTokenizer: ids reserved for special tokens below the BPE ranks.")


@dataclass
class SaveLoadConfig:
    save_steps: int | None = opt(None, "Save a checkpoint every this many steps.")
    save_at_end: bool = opt(
        True, "Save a checkpoint when training ends (its last step, or when the data ran out), as Megatron-LM does "
              "with --save; --no-save-at-end saves only every save_steps.")
    output_dir: str = opt("./output", "Where config.yaml, metrics.jsonl, TensorBoard events and checkpoints go.")
    overwrite_output_dir: bool = opt(
        False, "Start this run in output_dir even though it holds another run (one this run does not resume): "
               "that run's step_N folders, latest, metrics.jsonl, config.yaml and default TensorBoard events are "
               "deleted first; without it such a start is refused.")
    ckpt_dir: str | None = opt(None, "Checkpoint to load at start: a run's output_dir (its latest step) or a "
                                     "step_N folder; any parallel layout; checksums verified. The run's own "
                                     "output_dir holding no checkpoint yet (--save X --load X) starts from scratch.")
    use_checkpoint_args: bool = opt(
        False, "Take the model's shape and tokenizer from the loaded checkpoint's config.yaml, even with finetune.")
    keep_last_checkpoints: int | None = opt(None, "Keep only this many most recent checkpoints.")
    async_save: bool = opt(
        False, "Write checkpoints in the background (Megatron-LM's --async-save): training stops only while each "
               "rank copies its pieces to a reusable host buffer; the files are written by a thread while training "
               "goes on, and the checkpoint is sealed (renamed, 'latest', pruning) at a later step boundary. The next "
               "save, a stop signal, a divergence stop and the end of training wait for a pending write.")
    load_optim: bool = opt(True, "Load the optimizer states and loss scaler; --no-load-optim starts them afresh.")
    load_rng: bool = opt(True, "Restore the RNG streams (same layout only); --no-load-rng reseeds.")
    finetune: bool = opt(False, "Load the weights only: step, data position and optimizer start from zero.")
    override_data_order: bool = opt(
        False, "Resume with other data settings (seed, data paths or weights, split, max_seq_len, tokenizer) than "
               "the saved run's: the data is read in another order from the saved step on. Without it such a change "
               "is refused.")
    override_model_settings: bool = opt(
        False, "Resume with model settings that keep every tensor's shape but change what the model computes (heads, "
               "RoPE, epsilon, the router's top-k, score function or capacity, ...): the saved weights are read as "
               "that model from the saved step on. Without it such a change is refused.")
    exit_duration_in_mins: float | None = opt(
        None, "Save and exit (status 0) once the run has trained this many minutes (a job's time limit).")
    exit_interval: int | None = opt(
        None, "Save and exit (status 0) after the first step that is a multiple of this (Megatron-LM's "
              "--exit-interval).")
    tensorboard_dir: str | None = opt(None, "TensorBoard event folder; default output_dir/tensorboard.")
    wandb_project: str | None = opt(
        None, "Also log the metrics to this Weights & Biases project, from the rank that writes metrics.jsonl "
              "(needs pip install wandb); a resumed run continues the same W&B run.")
    wandb_exp_name: str | None = opt(None, "Name of the W&B run; default W&B's generated name.")
    wandb_save_dir: str | None = opt(None, "Folder of W&B's local files; default output_dir/wandb.")


@dataclass
class RerunConfig:
    """Megatron's rerun state machine (megatron/training/rerun.py, docs/reliability.md)."""

    rerun_mode: str = opt(
        "disabled", "Megatron-LM's --rerun-mode: validate_results re-runs a step whose result fails a check (the "
                    "checks below) to tell a transient fault (exit 17) from a reproducible one (a checkpoint, then "
                    "exit 16: resume to re-run the step elsewhere); report_stats re-runs every step and logs how far "
                    "the results moved. disabled (default here; Megatron-LM's is validate_results): the run's health "
                    "checks alone (a non-finite loss stops the run, exit 3).", ("disabled", "validate_results",
                                                                                "report_stats"))
    error_injection_rate: int = opt(
        0, "Inject a rejected result at about one check in this many (0: never), to exercise the re-runs.")
    error_injection_type: str = opt(
        "transient_error", "The diagnosis an injected rejection leads the re-runs to.",
        ("correct_result", "transient_error", "persistent_error"))
    check_for_nan_in_loss_and_grad: bool = opt(
        True, "With rerun_mode validate_results: a NaN or Inf in this rank's loss or gradient norm is re-run "
              "(fatal); --no-check-for-nan-in-loss-and-grad turns it off. Off by itself under fp16's dynamic loss "
              "scale (overflows are expected), as in Megatron-LM.")
    check_for_spiky_loss: bool = opt(
        False, "With rerun_mode validate_results: a loss 10x the largest of the first 100 is re-run (not fatal).")
    check_for_large_grads: bool = opt(
        False, "With rerun_mode validate_results: a gradient norm 10x the largest of the first 100 is re-run (not "
               "fatal).")
    result_rejected_tracker_filename: str | None = opt(
        None, "Append a line per rejected result and per diagnosis to this file (Megatron-LM's format).")


@dataclass
class Config:
    """The whole run. Unsectioned YAML keys (device, max_steps, ...) live here."""

    device: str | None = opt(None, "gpu or cpu; default gpu when one is present.", ("gpu", "cpu"))
    max_steps: int = opt(500000, "Optimizer steps to train.")
    train_samples: int | None = opt(
        None, "Train on this many samples instead of max_steps (Megatron-LM's --train-samples; needed by "
              "rampup_batch_size); the schedule is then counted in samples.")
    num_train_epochs: int | None = opt(
        None, "Cap on passes over the training data: the train split is built for at most this many passes (every "
              "sample once per pass) and training stops there if sooner than max_steps. Default None: no cap, "
              "max_steps decides (as Megatron-LM).")
    seed: int = opt(1024, "Seed of the weights, dropout and data order.")
    use_recompute: bool = opt(False, "Recompute activations in the backward instead of storing them.")
    recompute_granularity: str | None = opt(
        None, "full (whole layer), only_attn / full_attn (attention block), core_attn (softmax(QK^T)V) or "
              "selective (Megatron-LM's name for core_attn).",
        ("full", "only_attn", "full_attn", "core_attn", "selective"))
    recompute_method: str | None = opt(
        None, "With granularity full: uniform (checkpoint every recompute_num_layers layers as one unit) or block "
              "(recompute only the first recompute_num_layers layers of each pipeline stage).", ("uniform", "block"))
    recompute_num_layers: int | None = opt(
        None, "Layers per recomputed unit (uniform) or per stage (block); default 1.")
    recompute_modules: list[str] | None = opt(
        None, "With granularity selective (core_attn): the parts of each layer recomputed (Megatron-LM's "
              "--recompute-modules): core_attn (softmax(QK^T)V), mlp (a dense layer's MLP), moe (a MoE layer's whole "
              "mixture), moe_act (the experts' activation), shared_experts (a MoE layer's shared expert), layernorm "
              "(the two norms of each layer), mla_up_proj (multi-latent attention's up projections, norms and "
              "rotary). Default [core_attn].", RECOMPUTE_MODULES)
    moe_layer_recompute: bool = opt(
        False, "Recompute each MoE layer's mixture (Megatron-LM's deprecated --moe-layer-recompute: selective "
               "granularity with moe added to recompute_modules).")
    no_recompute_layers: list[int] | None = opt(None, "Layer indices excluded from recompute.")
    cpu_offloading_num_layers: int = opt(
        0, "Offload what the first this many decoder layers of each model chunk save for the backward to host memory "
           "in the forward, brought back in the backward with the next layer prefetched (Megatron-LM's; 0: off; "
           "below num_layers). A recomputed layer has nothing to offload.")
    fine_grained_activation_offloading: bool = opt(
        False, "Offload what the parts offload_modules names save for the backward, in every decoder layer, to host "
               "memory (Megatron-LM's; not with cpu_offloading_num_layers).")
    offload_modules: list[str] | None = opt(
        None, "With fine_grained_activation_offloading: attn_norm, qkv_linear (the QKV projection; multi-latent "
              "attention's down and up projections), core_attn (softmax(QK^T)V), attn_proj (the output projection; "
              "with core_attn), mlp_norm, expert_fc1 (the experts' input), moe_act (the experts' activation). A "
              "recomputed part has nothing to offload.", OFFLOAD_MODULES)
    min_offloaded_tensor_size: int = opt(
        1024 * 1024, "Offload only saved tensors whose storage holds at least this many elements (Megatron-LM's).")
    logging_freq: int = opt(1, "Print the log line every this many steps.")
    eval_freq: int = opt(500, "Evaluate on the validation split every this many steps.")
    eval_iters: int = opt(10, "Batches per evaluation (and for the final test pass).")
    eval_global_batch_size: int | None = opt(
        None, "The global batch of an evaluation (validation and test; Megatron-LM's --eval-global-batch-size): "
              "eval_iters batches of this many samples; None: global_batch_size.")
    compile: bool = opt(
        False, "torch.compile each decoder layer and the loss (falls back to eager, with a warning, where the "
               "backend is unavailable).")
    fused_linear: bool = opt(False, "Accepted for FleetX compatibility: F.linear already fuses the bias add.")
    tensor_fusion: bool = opt(
        False, "Accepted for FleetX compatibility: gradients always live in one contiguous buffer.")
    peak_tflops: float | None = opt(None, "Peak TFLOP/s of one device for MFU; default from a table of known GPUs.")
    cpu_threads: int | None = opt(
        None, "Intra-op threads of each rank on the CPU (torch.set_num_threads). Default: the MEGATRON_CPU_THREADS or "
              "OMP_NUM_THREADS environment variable (torchrun sets 1 for several ranks per node), else the cores this "
              "process may use shared among the node's ranks, less the cores other processes keep busy at start "
              "(megatron/cpu_threads.py); the start-up line says which and why.")
    max_consecutive_skipped_steps: int = opt(
        10, "Stop the run (exit 3) after this many skipped steps in a row (non-finite gradients); a skip that "
            "lowers the fp16 loss scale is not counted. 0 never stops.")
    loss_spike_factor: float = opt(
        3.0, "Warn when a step's loss exceeds this multiple of the mean of the previous 100 steps; 0 disables.")
    memory_check: bool = opt(
        True, "Before building anything, compare each rank's predicted peak memory (model states + activations, "
              "megatron/memory/) with the device's (on the CPU: the machine's available RAM) and stop when it does "
              "not fit; --no-memory-check starts anyway.")
    watchdog_timeout_minutes: float | None = opt(
        None, "A rank whose training makes no progress for this long writes every thread's stack to stderr and "
              "output_dir/hang/rank{r}.txt and exits (status 4); default distributed_timeout_minutes; 0 disables.")
    profile: bool = opt(
        False, "Run the PyTorch profiler (CPU and CUDA activity, shapes, memory) over steps profile_step_start to "
               "profile_step_end - 1 and write its trace beside the run (output_dir/profile/, for Perfetto or "
               "TensorBoard), with a table of the slowest operations in the log (Megatron-LM's --profile).")
    profile_step_start: int = opt(10, "The first profiled step (Megatron-LM's --profile-step-start).")
    profile_step_end: int = opt(12, "The step at which profiling stops, not profiled itself (--profile-step-end).")
    profile_ranks: list[int] = opt([0], "The global ranks that profile (Megatron-LM's --profile-ranks).")
    batch_size: BatchSizeConfig = section(BatchSizeConfig, "batch_size", "Global, local and micro batch sizes.")
    mix_precision: MixPrecisionConfig = section(MixPrecisionConfig, "mix_precision", "fp16 / bf16 training.")
    dataset: DatasetConfig = section(DatasetConfig, "dataset", "Training data.")
    tokenizer: TokenizerConfig = section(TokenizerConfig, "tokenizer", "The tokenizer of the data.")
    save_load: SaveLoadConfig = section(SaveLoadConfig, "save_load", "Outputs and checkpoints.")
    model: ModelConfig = section(ModelConfig, "Model", "Model shape.")
    optimizer: OptimizerConfig = section(OptimizerConfig, "Optimizer", "AdamW and its schedule.")
    distributed: DistributedConfig = section(DistributedConfig, "Distributed", "Parallel layout.")
    rerun: RerunConfig = section(RerunConfig, "rerun", "Megatron's rerun state machine (result validation).")

    # Derived values: valid after validate(); never read from YAML.
    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.model.vocab_size, self.distributed.mp_degree,
                                 self.model.make_vocab_size_divisible_by)

    @property
    def data_parallel_size(self) -> int:
        """The ranks the global batch is cut over (context-parallel ranks share their samples)."""
        return self.distributed.dp_degree * self.distributed.sharding.sharding_degree

    @property
    def shards_over_context_parallel(self) -> bool:
        """Whether the ZeRO shards span the context-parallel ranks too (as Megatron-LM's distributed optimizer
        spans dp x cp): with cp > 1 whenever the optimizer is sharded (sharding_degree > 1, or
        use_distributed_optimizer, which may leave sharding_degree at 1 when dp is 1)."""
        d = self.distributed
        return d.context_parallel_size > 1 and (d.sharding.sharding_degree > 1 or d.use_distributed_optimizer)

    @property
    def zero_shards(self) -> int:
        """The ranks one ZeRO shard group spans: sharding_degree, x context_parallel_size when
        ``shards_over_context_parallel``."""
        d = self.distributed
        return d.sharding.sharding_degree * (d.context_parallel_size if self.shards_over_context_parallel else 1)

    @property
    def num_micro_batches(self) -> int:
        return self.batch_size.local_batch_size // self.batch_size.micro_batch_size

    @property
    def params_dtype_name(self) -> str:
        if self.mix_precision.bf16:
            return "bfloat16"
        return "float16" if self.mix_precision.use_pure_fp16 else "float32"
