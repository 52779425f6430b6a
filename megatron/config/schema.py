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


@dataclass
class OptimizerConfig:
    weight_decay: float = opt(0.01, "AdamW decoupled weight decay; never applied to biases and norms.")
    start_weight_decay: float | None = opt(
        None, "Weight decay at the start of a weight-decay schedule; default weight_decay.")
    end_weight_decay: float | None = opt(None, "Weight decay at the end of training; default weight_decay.")
    weight_decay_incr_style: str = opt(
        "constant", "How the weight decay goes from start_weight_decay to end_weight_decay over training.",
        ("constant", "linear", "cosine"))
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.999, "AdamW beta2.")
    adam_epsilon: float = opt(1.0e-8, "AdamW epsilon.")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    lr: LRConfig = section(LRConfig, "lr", "Learning-rate schedule: linear warm-up, then cosine decay.")


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
                                  "'layer:TransformerDecoderLayer' (even), 'uniform', or counts per stage '4,6,6'.")
    sequence_parallel: bool = opt(False, "Split LayerNorm/dropout regions along the sequence across TP ranks.")
    context_parallel_size: int = opt(
        1, "Context parallelism: each sample's sequence cut into 2 x this many chunks, rank r of the group keeping "
           "chunks r and 2 cp - 1 - r (every rank the same causal work); attention exchanges keys and values.")
    cp_comm_type: str = opt(
        "p2p", "How context-parallel attention exchanges keys and values: p2p (ring attention: blocks sent round "
               "the ring, overlapped with compute), all_gather (keys and values gathered), a2a (Ulysses: "
               "all-to-all to whole sequences of a subset of the heads).", ("p2p", "all_gather", "a2a"))
    use_distributed_optimizer: bool = opt(
        False, "Megatron-LM's distributed optimizer: ZeRO stage 1 over the whole data-parallel group (sets "
               "sharding_degree to it, sharding_stage 1).")
    overlap_param_gather: bool = opt(
        False, "Accepted for Megatron-LM compatibility: the sharded optimizer's parameter all-gather runs after "
               "the step.")
    bucket_size_mb: float = opt(40.0, "Size of a data-parallel gradient all-reduce bucket (fp32 MB).")
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
    no_recompute_layers: list[int] | None = opt(None, "Layer indices excluded from recompute.")
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
