"""Cross-field checks with clear errors, and the derived values, filled in once.

``validate(config, world_size, cuda_available, tokenizer_vocab_size)`` fills every ``None`` that has a
derived value (batch sizes, ffn_hidden_size, dp_degree, decay_steps or decay_samples, recompute granularity,
device) and raises ConfigError on the first inconsistency. It returns the warnings it found (never
fatal). It reads no files: the caller builds the tokenizer and gives its vocabulary size, and whether
the data files exist is the data layer's check (``megatron.data.blended_dataset.parse_input_dir``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from megatron.config.batch_schedule import train_steps
from megatron.config.bounds import config_size_problem
from megatron.config.cli import fail as _fail
from megatron.config.layer_split import DEFAULT_METHOD, chunk_layers, segment
from megatron.config.pipeline_layout import layout_chunks, looks_like_layout
from megatron.config.schema import Config, TokenizerConfig
from megatron.config.syntax import input_dir_words, parse_split
from megatron.config.validate_attention import check_attention, check_mtp
from megatron.config.validate_context import check_context_parallel
from megatron.config.validate_fim import check_fim
from megatron.config.validate_fp8 import check_fp8_settings, check_fp8_sizes
from megatron.config.validate_hybrid import check_hybrid, check_hybrid_pattern
from megatron.config.validate_moe import check_moe
from megatron.config.validate_muon import check_muon, check_qk_clip
from megatron.config.validate_mup import check_mup
from megatron.config.validate_offload import check_offload
from megatron.config.validate_recompute import check_recompute
from megatron.config.validate_rerun import check_rerun
from megatron.config.validate_schedule import (
    check_batch_schedule,
    check_optimizer,
    check_training_length,
    resolve_batch_schedule,
)

MAX_TIMEOUT_MINUTES = 525_600  # a year: beyond it a timer overflows (threading.TIMEOUT_MAX, timedelta)

def _check_syntax(parse: Callable[[str], object], text: str) -> None:
    """``parse(text)`` (a ``syntax`` parser) succeeds; its ValueError becomes the ConfigError."""
    try:
        parse(text)
    except ValueError as err:
        _fail(str(err) + ".")


def infer_tokenizer_type(section: TokenizerConfig) -> None:
    """A vocab.json and a merges.txt given without a tokenizer type are GPT-2 BPE's (Megatron-LM's 175B
    example passes the two files and no --tokenizer-type). Called before the tokenizer is built, and
    again by validation, so both see the same type."""
    if section.tokenizer_type is None and section.vocab_file and section.merge_file:
        section.tokenizer_type = "GPT2BPETokenizer"


def _check_data(config: Config, tokenizer_vocab_size: int | None, training_data: bool = True) -> None:
    """The data source (mock_data, input_dir, or train/valid/test_data_path), and the vocabulary size it implies
    (the tokenizer's, when one is configured)."""
    d, t = config.dataset, config.tokenizer
    infer_tokenizer_type(t)
    _check_data_sources(config, training_data)
    _check_syntax(parse_split, d.split)
    if t.tiktoken_num_special_tokens < 0:
        _fail(f"tiktoken_num_special_tokens must be >= 0, got {t.tiktoken_num_special_tokens}.")
    if d.num_workers < 0:
        _fail(f"num_workers must be >= 0, got {d.num_workers}.")
    if d.mock_document_length < 1:
        _fail(f"mock_document_length (the mock data's mean document length) must be at least 1, got "
              f"{d.mock_document_length}.")
    for name in ("input_dir", "train_data_path", "valid_data_path", "test_data_path"):
        if getattr(d, name):  # whether its prefixes exist is the data layer's question
            _check_syntax(lambda text, name=name: input_dir_words(text, name), getattr(d, name))
    if (d.input_dir or d.train_data_path) and t.tokenizer_type is None:
        _fail(f"{'input_dir' if d.input_dir else 'train_data_path'} needs the tokenizer the data was made with: "
              "give --tokenizer-type with --vocab-file and --merge-file, or --tokenizer-model.")
    if t.tokenizer_type == "NullTokenizer" and config.model.vocab_size is None:
        _fail("--tokenizer-type NullTokenizer needs --vocab-size N: the number of token ids of the pre-tokenized "
              "data (ids 0..N-1; the end-of-document id is N-1).")
    if t.tokenizer_type is not None:  # NullTokenizer and TikTokenizer are built with Model.vocab_size: equal
        if tokenizer_vocab_size is None:
            raise ValueError("validate: Tokenizer.tokenizer_type is set, so the caller builds the tokenizer and "
                             "passes tokenizer_vocab_size (validation reads no files).")
        if config.model.vocab_size is None:
            config.model.vocab_size = tokenizer_vocab_size
        elif config.model.vocab_size < tokenizer_vocab_size:
            _fail(f"Model.vocab_size ({config.model.vocab_size}) is smaller than the tokenizer's vocabulary "
                  f"({tokenizer_vocab_size}); pass --vocab-size {tokenizer_vocab_size} (or more), or drop vocab_size "
                  f"from the YAML and the flags: it then defaults to the tokenizer's.")
    if config.model.vocab_size is None:
        config.model.vocab_size = 50304
    _check_eod_token(config)


def _check_eod_token(config: Config) -> None:
    """``--eod-token`` names the end-of-document token of a Hugging Face tokenizer by its text. Every other
    run's end-of-document id is fixed: the tokenizer's own (GPT-2 BPE's ``<|endoftext|>``, SentencePiece's
    ``</s>``, ...), or the mock data's last id; each is inside the vocabulary by construction (a tokenizer's
    ids are below its vocabulary size, which Model.vocab_size is at least). There the flag would change
    nothing (the loss mask, --reset-attention-mask and --reset-position-ids would still use the fixed id):
    refused, as is a number (a token id given for the text), which names the wrong token or none. With mock data
    and a Hugging Face tokenizer (an imported checkpoint's configuration) it describes that tokenizer for the runs
    and tools that read text later: kept."""
    eod, t = config.tokenizer.eod_token, config.tokenizer
    if eod is None:
        return
    if config.dataset.mock_data and t.tokenizer_type != "HuggingFaceTokenizer":  # a tokenizer's: kept for later
        _fail(f"--eod-token {eod} is not used with --mock-data: the mock data ends its documents with the last "
              f"token id, vocab_size - 1 = {config.model.vocab_size - 1}; drop --eod-token.")
    if t.tokenizer_type != "HuggingFaceTokenizer":
        which = f"--tokenizer-type {t.tokenizer_type}" if t.tokenizer_type else "a run without a tokenizer"
        _fail(f"--eod-token {eod} is read by --tokenizer-type HuggingFaceTokenizer only: {which} ends documents "
              f"with its own end-of-document token, whatever --eod-token says; drop --eod-token.")
    if re.fullmatch(r"\s*[+-]?\d+\s*", eod):
        _fail(f"--eod-token {eod} is a number, but --eod-token takes the token's text as --tokenizer-model's "
              f"tokenizer.json spells it (for example '<|endoftext|>'), not its id (0 to "
              f"{config.model.vocab_size - 1} here); give the text, or drop --eod-token to use the tokenizer's own.")


def _check_data_sources(config: Config, training_data: bool) -> None:
    """One source of training data, as Megatron-LM: mock_data, input_dir (--data-path, cut by split) or
    train_data_path (with valid_data_path and test_data_path, each split its own data, optional)."""
    d = config.dataset
    if d.mock_data and d.input_dir:
        _fail("both mock_data and input_dir are set; choose synthetic data or a dataset: pass --no-mock-data to train "
              "on input_dir (a YAML that sets mock_data: True, as the tiny CPU configs do, needs it), or drop "
              "--input-dir.")
    if d.train_data_path and (d.mock_data or d.input_dir):
        _fail(f"both {'mock_data' if d.mock_data else 'input_dir (--data-path)'} and train_data_path are set; give "
              "one source of training data: --data-path is cut into train, validation and test by --split, while "
              "--train-data-path, --valid-data-path and --test-data-path give each split its own data.")
    if (d.valid_data_path or d.test_data_path) and not d.train_data_path:
        _fail(f"{'valid_data_path' if d.valid_data_path else 'test_data_path'} is set without train_data_path; "
              "give --train-data-path too (each split its own data), or drop it: with --data-path the validation "
              "and test data are cut from it by --split.")
    if training_data and not (d.mock_data or d.input_dir or d.train_data_path):
        _fail("no training data: give --input-dir (a dataset prefix from tools/preprocess_data.py), "
              "--train-data-path or --mock-data.")


def _check_bounds(config: Config) -> None:
    """Every size within its sane maximum (``bounds.MAXIMA``) before any check builds a per-layer list."""
    problem = config_size_problem(config)
    if problem is not None:
        _fail(problem)


def _check_model(config: Config) -> None:
    m = config.model
    for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "max_position_embeddings",
                 "make_vocab_size_divisible_by"):
        if getattr(m, name) < 1:
            _fail(f"Model.{name} must be at least 1, got {getattr(m, name)}.")
    if m.hidden_size % m.num_attention_heads:
        _fail(f"Model.num_attention_heads ({m.num_attention_heads}) must divide Model.hidden_size "
              f"({m.hidden_size}).")
    if m.ffn_hidden_size is None:  # Megatron-LM's defaults: 4h, or with SwiGLU 2/3 of it rounded down to 64
        m.ffn_hidden_size = int(4 * m.hidden_size * 2 / 3 / 64) * 64 if m.swiglu else 4 * m.hidden_size
    if m.ffn_hidden_size < 1:
        _fail(f"Model.ffn_hidden_size must be at least 1, got {m.ffn_hidden_size}; leave it unset for 4 x hidden_size.")
    if config.dataset.max_seq_len < 1:
        _fail(f"dataset.max_seq_len must be at least 1, got {config.dataset.max_seq_len}.")
    if m.type_vocab_size < 0:
        _fail(f"Model.type_vocab_size must be >= 0 (GPT does not use it), got {m.type_vocab_size}.")
    if m.initializer_range <= 0:
        _fail(f"Model.initializer_range (the init std) must be positive, got {m.initializer_range}.")
    if m.embedding_init_method_std is not None and not 0 < m.embedding_init_method_std < float("inf"):
        _fail(f"Model.embedding_init_method_std (the embeddings' init std) must be a positive number, got "
              f"{m.embedding_init_method_std}; leave it unset for initializer_range.")
    if m.layernorm_epsilon <= 0:
        _fail(f"Model.layernorm_epsilon must be positive, got {m.layernorm_epsilon}.")
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if not 0.0 <= getattr(m, name) < 1.0:
            _fail(f"Model.{name} must be in [0, 1), got {getattr(m, name)}.")
    if config.dataset.max_seq_len > m.max_position_embeddings:
        _fail(f"dataset.max_seq_len ({config.dataset.max_seq_len}) exceeds Model.max_position_embeddings "
              f"({m.max_position_embeddings}); raise max_position_embeddings or shorten the sequences.")


def _check_model_variants(config: Config) -> None:
    """Megatron-LM's GPT variants (grouped-query attention, head width, rotary embeddings), after mp_degree
    is known to be at least 1: tensor-parallel ranks hold whole key/value groups."""
    m, tp = config.model, config.distributed.mp_degree
    if m.group_query_attention and m.num_query_groups is None:
        _fail("group_query_attention needs num_query_groups (the number of key/value heads): give "
              "--num-query-groups N.")
    if m.num_query_groups is not None and not m.group_query_attention:
        _fail(f"num_query_groups ({m.num_query_groups}) is set but group_query_attention is not: give "
              f"--group-query-attention too, or drop --num-query-groups.")
    if m.group_query_attention:
        groups = m.num_query_groups
        if groups < 1 or m.num_attention_heads % groups:
            _fail(f"Model.num_query_groups ({groups}) must divide Model.num_attention_heads "
                  f"({m.num_attention_heads}): each key/value head serves a whole group of query heads.")
        if groups % tp:
            _fail(f"Model.num_query_groups ({groups}) must be divisible by the tensor-parallel size mp_degree "
                  f"({tp}): each tensor-parallel rank holds whole key/value groups.")
    if m.rotary_base < 1 or not 0.0 < m.rotary_percent <= 1.0:  # refused even when rope is off: never meant
        _fail(f"rotary_base must be at least 1 and rotary_percent in (0, 1], got {m.rotary_base} and "
              f"{m.rotary_percent}.")
    if m.kv_channels is not None and m.kv_channels < 1:
        _fail(f"Model.kv_channels must be at least 1, got {m.kv_channels}; leave it unset for hidden_size / "
              f"num_attention_heads.")
    if m.position_embedding_type in ("rope", "yarn"):
        head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
        rotated = int(head_dim * m.rotary_percent)
        if not 0.0 < m.rotary_percent <= 1.0 or rotated < 2 or rotated % 2:
            _fail(f"rotary_percent ({m.rotary_percent}) x the head width ({head_dim}) must be an even number of "
                  f"channels, at least 2 ({rotated} here), with rotary_percent in (0, 1].")
        if m.rotary_base <= 0:
            _fail(f"rotary_base must be positive, got {m.rotary_base}.")


def _check_distributed(config: Config, world_size: int) -> None:
    d = config.distributed
    for name in ("mp_degree", "pp_degree", "virtual_pp_degree", "context_parallel_size"):
        if getattr(d, name) < 1:
            _fail(f"Distributed.{name} must be at least 1, got {getattr(d, name)}.")
    if d.sharding.sharding_degree < 1:
        _fail(f"sharding_degree must be at least 1, got {d.sharding.sharding_degree}.")
    tp, m = d.mp_degree, config.model
    if m.num_attention_heads % tp:
        _fail(f"mp_degree ({tp}) must divide Model.num_attention_heads ({m.num_attention_heads}): each tensor-"
              f"parallel rank holds whole heads.")
    _check_model_variants(config)
    if m.ffn_hidden_size % tp:
        _fail(f"mp_degree ({tp}) must divide Model.ffn_hidden_size ({m.ffn_hidden_size}).")
    if d.sequence_parallel and config.dataset.max_seq_len % tp:
        _fail(f"sequence_parallel splits the sequence over mp_degree ({tp}) ranks: max_seq_len "
              f"({config.dataset.max_seq_len}) must be divisible by it.")
    check_context_parallel(config)
    cp = d.context_parallel_size
    ranks_per_replica = d.mp_degree * d.pp_degree * d.sharding.sharding_degree * cp
    names = "mp_degree x pp_degree x sharding_degree" + (" x context_parallel_size" if cp > 1 else "")
    flags = "--tp / --pp / --sharding" + (" / --context-parallel-size" if cp > 1 else "")
    if d.dp_degree is None:
        if world_size % ranks_per_replica:
            _fail(f"world size {world_size} is not divisible by {names} = {ranks_per_replica}; launch a multiple of "
                  f"{ranks_per_replica} processes (torchrun --nproc-per-node) or change {flags}.")
        d.dp_degree = world_size // ranks_per_replica
    if d.dp_degree < 1 or d.dp_degree * ranks_per_replica != world_size:
        _fail(f"dp_degree x {names} = {d.dp_degree * ranks_per_replica} "
              f"but {world_size} process(es) were launched; make them equal (or drop --dp, which is then the world "
              f"size / {ranks_per_replica}).")
    _check_pipeline(config)
    if d.bucket_size_mb <= 0:
        _fail(f"bucket_size_mb must be positive, got {d.bucket_size_mb}.")
    if not 0 < d.distributed_timeout_minutes <= MAX_TIMEOUT_MINUTES:
        _fail(f"distributed_timeout_minutes must be positive and at most {MAX_TIMEOUT_MINUTES:g} (a year), got "
              f"{d.distributed_timeout_minutes}.")


def _check_pipeline(config: Config) -> None:
    """The layers cut into stages (and chunks) by the rule the model is built with (``layer_split``)."""
    d, layers = config.distributed, config.model.num_layers
    if looks_like_layout(d.pipeline_partition):  # Megatron-LM's layout: its stages give virtual_pp_degree
        try:
            d.virtual_pp_degree = layout_chunks(d.pipeline_partition, d.pp_degree, d.virtual_pp_degree, layers,
                                                config.model.mtp_num_layers)
        except ValueError as err:
            _fail(str(err))
    if d.virtual_pp_degree > 1 and d.pp_degree == 1:
        _fail("virtual_pp_degree > 1 interleaves model chunks over pipeline stages: it needs pp_degree > 1.")
    if d.pp_degree == 1 or looks_like_layout(d.pipeline_partition):
        return
    if d.virtual_pp_degree > 1 and d.pipeline_partition != DEFAULT_METHOD:
        _fail(f"pipeline_partition {d.pipeline_partition!r} (uneven stages: Megatron-LM's --decoder-first/last-"
              f"pipeline-num-layers, --account-for-*-in-pipeline-split) is not built with the interleaved schedule "
              f"(virtual_pp_degree {d.virtual_pp_degree}), whose chunks hold equal layers; drop one of them, or "
              f"write each chunk's layers as a layout string (--pipeline-model-parallel-layout 'Et|t|tt|L').")
    try:
        if d.virtual_pp_degree > 1:
            chunk_layers(layers, d.pp_degree, d.virtual_pp_degree, 0, 0)
        else:
            segment(layers, d.pp_degree, d.pipeline_partition)
    except ValueError as err:
        _fail(str(err))


def _check_micro_batches(config: Config) -> None:
    d = config.distributed
    if d.virtual_pp_degree > 1 and config.num_micro_batches % d.pp_degree:
        _fail(f"the interleaved schedule needs the number of micro-batches per step (local_batch_size / "
              f"micro_batch_size = {config.num_micro_batches}) to be a multiple of pp_degree ({d.pp_degree}).")


def _check_batch(config: Config) -> None:
    b, dp = config.batch_size, config.data_parallel_size
    for name in ("global_batch_size", "local_batch_size", "micro_batch_size"):
        value = getattr(b, name)
        if value is not None and value < 1:
            _fail(f"batch_size.{name} must be at least 1, got {value}.")
    if b.global_batch_size is None and b.local_batch_size is None:
        b.local_batch_size = b.micro_batch_size or 8
    if b.local_batch_size is None:
        if b.global_batch_size % dp:
            _fail(f"global_batch_size ({b.global_batch_size}) must be divisible by the data-parallel size "
                  f"dp_degree x sharding_degree = {dp}.")
        b.local_batch_size = b.global_batch_size // dp
    if b.global_batch_size is None:
        b.global_batch_size = b.local_batch_size * dp
    if b.global_batch_size != b.local_batch_size * dp:
        _fail(f"global_batch_size ({b.global_batch_size}) must equal local_batch_size ({b.local_batch_size}) "
              f"x data-parallel size ({dp}).")
    if b.micro_batch_size is None:
        b.micro_batch_size = b.local_batch_size
    if b.local_batch_size % b.micro_batch_size:
        _fail(f"local_batch_size ({b.local_batch_size}) must be a multiple of micro_batch_size "
              f"({b.micro_batch_size}).")


def _check_eval_batch(config: Config) -> None:
    """An evaluation's own global batch: whole micro-batches on every data-parallel rank (and, under the interleaved
    schedule, a multiple of pp_degree of them, as a training step's)."""
    e, b, d = config.eval_global_batch_size, config.batch_size, config.distributed
    if e is None:
        return
    share = config.data_parallel_size * b.micro_batch_size
    if e < 1 or e % share:
        _fail(f"eval_global_batch_size ({e}) must be a positive multiple of micro_batch_size x data-parallel size "
              f"({b.micro_batch_size} x {config.data_parallel_size} = {share}).")
    if d.virtual_pp_degree > 1 and (e // share) % d.pp_degree:
        _fail(f"the interleaved schedule needs an evaluation's micro-batches per rank (eval_global_batch_size / "
              f"{share} = {e // share}) to be a multiple of pp_degree ({d.pp_degree}).")


def _check_counts(config: Config) -> None:
    """Step counts, before anything is derived from them (decay_steps defaults to max_steps)."""
    for name in ("max_steps", "logging_freq", "eval_freq", "num_train_epochs"):
        if getattr(config, name) is not None and getattr(config, name) < 1:  # num_train_epochs None: no cap
            _fail(f"{name} must be at least 1, got {getattr(config, name)}.")
    if config.eval_iters < 0:
        _fail(f"eval_iters must be >= 0, got {config.eval_iters}.")
    if not 0 <= config.seed < 2**32:
        _fail(f"seed must be in [0, 2^32 - 1] (NumPy's seed range), got {config.seed}.")


def _check_training(config: Config, cuda_available: bool) -> None:
    if config.device is None:
        config.device = "gpu" if cuda_available else "cpu"
    if config.distributed.overlap_grad_reduce is None:
        config.distributed.overlap_grad_reduce = config.device == "gpu"
    if config.device == "gpu" and not cuda_available:
        _fail("device is gpu but no CUDA device is visible; pass --device cpu or run on a GPU machine.")
    mp = config.mix_precision
    if mp.bf16 and mp.use_pure_fp16:
        _fail("bf16 and use_pure_fp16 are both set; choose one precision.")
    if mp.grad_reduce_in_bf16 and not mp.bf16:
        _fail("grad_reduce_in_bf16 keeps the gradients in bf16, which needs bf16 training; add --bf16 or drop "
              "--grad-reduce-in-bf16.")
    if mp.scale_loss <= 0:
        _fail(f"scale_loss must be positive, got {mp.scale_loss}.")
    if mp.min_loss_scale <= 0 or mp.loss_scale_window < 1 or mp.hysteresis < 1:
        _fail(f"min_loss_scale must be positive and loss_scale_window and hysteresis at least 1, got "
              f"{mp.min_loss_scale:g}, {mp.loss_scale_window} and {mp.hysteresis}.")
    check_recompute(config)
    check_offload(config)
    for layer in config.no_recompute_layers or []:
        if not 0 <= layer < config.model.num_layers:
            _fail(f"no_recompute_layers holds {layer}, but layers are numbered 0..{config.model.num_layers - 1}.")
    if config.save_load.save_steps is not None and config.save_load.save_steps < 1:
        _fail(f"save_steps must be at least 1, got {config.save_load.save_steps}.")
    minutes = config.save_load.exit_duration_in_mins
    if minutes is not None and minutes <= 0:
        _fail(f"exit_duration_in_mins must be positive, got {minutes}.")
    interval = config.save_load.exit_interval
    if interval is not None and interval < 1:
        _fail(f"exit_interval must be at least 1, got {interval}.")
    keep = config.save_load.keep_last_checkpoints
    if keep is not None and keep < 1:
        _fail(f"keep_last_checkpoints must be at least 1, got {keep}.")
    if config.peak_tflops is not None and config.peak_tflops <= 0:
        _fail(f"peak_tflops must be positive, got {config.peak_tflops}.")
    _check_wandb(config)
    _check_run_health(config)


def _check_wandb(config: Config) -> None:
    """A W&B run name or folder without a project would be silently unused: W&B logs only with a project."""
    sl = config.save_load
    for name in ("wandb_exp_name", "wandb_save_dir"):
        if getattr(sl, name) is not None and not sl.wandb_project:
            _fail(f"{name} is set but wandb_project is not: give --wandb-project to log to Weights & Biases, "
                  f"or drop --{name.replace('_', '-')}.")


def _check_run_health(config: Config) -> None:
    if config.cpu_threads is not None and config.cpu_threads < 1:
        _fail(f"cpu_threads must be at least 1, got {config.cpu_threads}; leave it unset to let the run choose.")
    if config.max_consecutive_skipped_steps < 0:
        _fail(f"max_consecutive_skipped_steps must be >= 0 (0 never stops), got "
              f"{config.max_consecutive_skipped_steps}.")
    if config.loss_spike_factor < 0 or 0 < config.loss_spike_factor <= 1:
        _fail(f"loss_spike_factor must be above 1 (or 0 to disable), got {config.loss_spike_factor}.")
    if config.watchdog_timeout_minutes is None:
        config.watchdog_timeout_minutes = config.distributed.distributed_timeout_minutes
    if not 0 <= config.watchdog_timeout_minutes <= MAX_TIMEOUT_MINUTES:
        _fail(f"watchdog_timeout_minutes must be from 0 (0 disables the watchdog) to {MAX_TIMEOUT_MINUTES:g} (a "
              f"year), got {config.watchdog_timeout_minutes}.")


def _check_profile(config: Config, world_size: int, warnings: list[str]) -> None:
    """--profile's window, in the log's step numbers (megatron/training/profiler.py): steps profile_step_start ..
    profile_step_end - 1 (a start of 0 is Megatron-LM's "from the first step"), on ranks of this launch."""
    c = config
    for name in ("profile_step_start", "profile_step_end"):  # checked without --profile too: a typo is never meant
        if getattr(c, name) < 0:
            _fail(f"{name} must be a step number (0 or more), got {getattr(c, name)}.")
    if not c.profile:
        return
    start, end, first = c.profile_step_start, c.profile_step_end, max(c.profile_step_start, 1)
    if start < 0 or end <= first:
        _fail(f"the profiled steps are profile_step_start ({start}) .. profile_step_end - 1 ({end - 1}), steps "
              f"numbered from 1 as the log does: give --profile-step-start >= 0 and --profile-step-end above it "
              f"(and above 1).")
    outside = [rank for rank in c.profile_ranks if not 0 <= rank < world_size]
    if outside:
        _fail(f"profile_ranks holds {outside[0]}, but this launch has ranks 0..{world_size - 1}; give "
              f"--profile-ranks within them (or none: every rank profiles).")
    steps = train_steps(c)
    if end - 1 > steps:
        what = "nothing is profiled" if first > steps else f"profiling stops at the run's end (step {steps})"
        warnings.append(f"the profiled steps ({start} .. {end - 1}) go past the run's last step ({steps}): {what}; "
                        f"lower --profile-step-start / --profile-step-end to profile within the run.")


def _resolve_distributed_optimizer(config: Config, world_size: int) -> None:
    """Megatron-LM's --use-distributed-optimizer: the optimizer states sharded (ZeRO stage 1 unless another
    stage is asked for) over the whole data-parallel group, i.e. sharding_degree = world / (tp x pp x cp); the
    context-parallel ranks hold the same shards."""
    d = config.distributed
    if not d.use_distributed_optimizer:
        return
    replica = d.mp_degree * d.pp_degree * max(1, d.context_parallel_size)
    if d.mp_degree < 1 or d.pp_degree < 1 or world_size % replica:
        return  # _check_distributed says what is wrong with the layout
    group = world_size // replica
    if d.dp_degree not in (None, 1) or d.sharding.sharding_degree not in (1, group):
        span = f"{group * d.context_parallel_size} ranks: dp x cp" if d.context_parallel_size > 1 else f"{group} ranks"
        _fail(f"use_distributed_optimizer shards the optimizer over the whole data-parallel group ({span}); "
              f"drop dp_degree ({d.dp_degree}) and sharding_degree ({d.sharding.sharding_degree}), or drop "
              f"--use-distributed-optimizer and set them.")
    d.dp_degree, d.sharding.sharding_degree = 1, group


def validate(config: Config, world_size: int = 1, cuda_available: bool = False,
             tokenizer_vocab_size: int | None = None, training_data: bool = True) -> list[str]:
    """Check ``config`` in place and fill its derived values; return warnings. Reads no files: when a
    tokenizer is configured the caller has built it and gives its ``tokenizer_vocab_size`` (the default
    Model.vocab_size, and its lower bound). ``training_data=False`` (evaluation, whose data is the task's
    file): no training data is asked for."""
    warnings: list[str] = []
    _check_bounds(config)
    check_fp8_settings(config, cuda_available, warnings)
    _check_counts(config)
    _check_data(config, tokenizer_vocab_size, training_data)
    check_fim(config)
    _check_model(config)
    check_muon(config)  # before the layout: dist_muon is the distributed optimizer
    check_qk_clip(config)
    check_mup(config, warnings)
    _resolve_distributed_optimizer(config, world_size)
    _check_distributed(config, world_size)
    check_hybrid_pattern(config)  # first: it fills moe_layer_freq from the pattern's E layers
    check_moe(config)
    check_hybrid(config)
    check_attention(config, warnings)
    check_mtp(config)
    check_training_length(config)
    resolve_batch_schedule(config)
    _check_batch(config)
    _check_eval_batch(config)
    _check_micro_batches(config)
    check_batch_schedule(config, warnings)
    check_optimizer(config, warnings)
    _check_training(config, cuda_available)
    check_fp8_sizes(config)
    _check_profile(config, world_size, warnings)
    check_rerun(config, warnings)
    return warnings
