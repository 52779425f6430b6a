"""Validation: derived values, inconsistent settings and values that cannot train, refused with one
sentence before any process group exists."""

from __future__ import annotations

import re

import pytest

from megatron.config import Config, ConfigError, parse_config, validate
from megatron.optimizer import build_param_schedule
from tests.unit.test_config import check, valid_config, write

# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("argv, sizes", [
    ([], (8, 8, 8)),
    (["--global-batch-size", "16"], (16, 16, 16)),
    (["--local-batch-size", "12"], (12, 12, 12)),
    (["--micro-batch-size", "2"], (2, 2, 2)),
    (["--global-batch-size", "16", "--micro-batch-size", "4"], (16, 16, 4)),
    (["--local-batch-size", "16", "--micro-batch-size", "2"], (16, 16, 2)),
    (["--global-batch-size", "8", "--local-batch-size", "8", "--micro-batch-size", "1"], (8, 8, 1)),
])
def test_batch_sizes_derived(argv, sizes):
    config = valid_config(*argv)
    check(config)
    b = config.batch_size
    assert (b.global_batch_size, b.local_batch_size, b.micro_batch_size) == sizes
    assert config.num_micro_batches == sizes[1] // sizes[2]


@pytest.mark.parametrize("argv, message", [
    (["--global-batch-size", "16", "--local-batch-size", "8"], "must equal local_batch_size"),
    (["--global-batch-size", "16", "--micro-batch-size", "5"], "multiple of micro_batch_size"),
    (["--local-batch-size", "10", "--micro-batch-size", "4"], "multiple of micro_batch_size"),
    (["--micro-batch-size", "0"], "at least 1"),
])
def test_inconsistent_batch_sizes_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        check(valid_config(*argv))


def test_heads_must_divide_hidden():
    with pytest.raises(ConfigError, match="num_attention_heads.*must divide"):
        check(valid_config("--hidden-size", "100", "--num-attention-heads", "16"))


def test_seq_len_longer_than_positions_refused():
    with pytest.raises(ConfigError, match="max_seq_len"):
        check(valid_config("--seq-length", "2048", "--max-position-embeddings", "1024"))
    check(valid_config("--seq-length", "1024", "--max-position-embeddings", "1024"))  # equal is fine


def test_max_lr_below_min_lr_is_a_warning():
    config = valid_config("--max-lr", "1e-5", "--min-lr", "1e-4")
    warnings = check(config)
    assert len(warnings) == 1 and "max_lr" in warnings[0] and "min_lr" in warnings[0]
    assert config.optimizer.lr.max_lr == 1e-5  # kept as given


@pytest.mark.parametrize("stage", ["0", "4"])
def test_sharding_stage_outside_1_to_3_refused(stage):
    with pytest.raises(ConfigError, match=f"sharding_stage must be one of 1, 2, 3, got {stage}"):
        valid_config("--sharding", "2", "--sharding-stage", stage)


def test_sharding_degree_must_divide_the_data_parallel_ranks():
    message = "world size 6 is not divisible by mp_degree x pp_degree x sharding_degree = 4"
    with pytest.raises(ConfigError, match=message):
        validate(valid_config("--sharding", "4"), world_size=6)


@pytest.mark.parametrize("argv, message", [
    (["--tp", "2"], "world size 1 is not divisible by mp_degree x pp_degree x sharding_degree = 2"),
    (["--tp", "3", "--hidden-size", "96", "--num-attention-heads", "4"], "must divide Model.num_attention_heads"),
    (["--tp", "2", "--ffn-hidden-size", "33"], "must divide Model.ffn_hidden_size"),
    (["--tp", "2", "--sequence-parallel", "--seq-length", "33", "--max-position-embeddings", "64"],
     "must be divisible"),
])
def test_tensor_parallel_checks(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config = valid_config(*argv)
        validate(config, world_size=1 if "must" not in message else config.distributed.mp_degree)


def test_bf16_and_fp16_refused():
    with pytest.raises(ConfigError, match="bf16 and use_pure_fp16"):
        check(valid_config("--bf16", "--fp16"))


def test_derived_defaults():
    config = valid_config("--train-iters", "1000", "--lr-warmup-fraction", "0.05")
    check(config)
    lr = config.optimizer.lr
    # decay_steps is filled in (Megatron's --lr-decay-iters default); the warm-up is warmup_rate x the decay,
    # kept fractional in samples as Megatron's, so warmup_steps stays unset: 0.05 x 1000 steps x 8 samples
    assert (lr.decay_steps, lr.warmup_steps) == (1000, None)
    assert build_param_schedule(config).warmup == 0.05 * 1000 * 8
    assert config.distributed.dp_degree == 1 and config.device == "cpu"
    assert config.model.ffn_hidden_size == 4 * config.model.hidden_size


# ---------------------------------------------------------------- values that cannot train


@pytest.mark.parametrize("argv, message", [
    (["--max-seq-len", "0"], "max_seq_len must be at least 1, got 0"),
    (["--ffn-hidden-size", "0"], "ffn_hidden_size must be at least 1, got 0"),
    (["--lr=-1e-4"], "max_lr and min_lr must be >= 0"),
    (["--min-lr=-1"], "max_lr and min_lr must be >= 0"),
    (["--init-method-std=-0.02"], "initializer_range .* must be positive"),
    (["--layernorm-epsilon=-1e-5"], "layernorm_epsilon must be positive"),
    (["--weight-decay=-0.1"], "weight_decay must be >= 0"),
    (["--adam-eps", "0"], "adam_epsilon must be positive"),
    (["--max-steps", "0"], "max_steps must be at least 1, got 0"),
    (["--hysteresis", "0"], "hysteresis at least 1"),
    (["--distributed-timeout-minutes", "0"], "distributed_timeout_minutes must be positive"),
    (["--watchdog-timeout-minutes=-1"], "watchdog_timeout_minutes must be from 0"),
    (["--watchdog-timeout-minutes", "1e9"], "watchdog_timeout_minutes must be from 0 .0 disables the watchdog. to "
                                            "525600"),  # was accepted: the watchdog's timer overflowed, silently
    (["--distributed-timeout-minutes", "1e308"], "distributed_timeout_minutes must be positive and at most 525600"),
    (["--max-consecutive-skipped-steps=-1"], "max_consecutive_skipped_steps must be >= 0"),
    (["--loss-spike-factor", "0.5"], "loss_spike_factor must be above 1"),
    (["--seed=-1"], r"seed must be in \[0, 2\^32 - 1\]"),
    (["--seed", str(2**32)], r"seed must be in \[0, 2\^32 - 1\]"),
    (["--lr", "nan"], "max_lr must be a finite number, got 'nan'"),
    (["--initial-loss-scale", "inf"], "scale_loss must be a finite number, got 'inf'"),
])
def test_values_that_cannot_train_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        check(valid_config(*argv))


REAL_DATA = ["--device", "cpu", "--input-dir", "data/x_text_document", "--vocab-size", "1000"]
HF = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "tokenizer.json"]
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "vocab.json", "--merge-file", "merges.txt"]


@pytest.mark.parametrize("argv, message", [
    (["--mock-data", "--eod-token", "100000", "--reset-attention-mask"],
     "--eod-token 100000 is not used with --mock-data: the mock data ends its documents with the last token id, "
     "vocab_size - 1 = 999; drop --eod-token."),
    ([*REAL_DATA, *GPT2, "--eod-token=-1", "--reset-position-ids"],
     "--eod-token -1 is read by --tokenizer-type HuggingFaceTokenizer only: --tokenizer-type GPT2BPETokenizer ends "
     "documents with its own end-of-document token, whatever --eod-token says; drop --eod-token."),
    ([*REAL_DATA, *HF, "--eod-token", "100000", "--eod-mask-loss"],
     "--eod-token 100000 is a number, but --eod-token takes the token's text as --tokenizer-model's tokenizer.json "
     "spells it (for example '<|endoftext|>'), not its id (0 to 999 here); give the text, or drop --eod-token to use "
     "the tokenizer's own."),
    ([*REAL_DATA, *HF, "--eod-token", "<|im_end|>", "--reset-attention-mask"], None),
    ([*REAL_DATA, *GPT2, "--reset-attention-mask"], None),
], ids=["mock-data", "not-hugging-face", "a-number", "hugging-face-text", "none"])
def test_an_eod_token_that_would_change_nothing_is_refused(argv, message):
    """--eod-token is a Hugging Face tokenizer's end-of-document token, by its text: where the end-of-document id
    is fixed (another tokenizer, the mock data), or given a number (an id, or a token that is not the one meant),
    the loss mask and --reset-attention-mask / --reset-position-ids would use another token than asked: one line
    at validation (on every rank, before the data or the model is built)."""
    config = parse_config([*argv] if "--mock-data" not in argv else ["--device", "cpu", "--vocab-size", "1000", *argv])
    vocab = None if config.dataset.mock_data else 1000
    if message is None:
        validate(config, tokenizer_vocab_size=vocab)
        return
    with pytest.raises(ConfigError) as raised:
        validate(config, tokenizer_vocab_size=vocab)
    assert str(raised.value) == message


def _numeric_leaves() -> list:
    from megatron.config.cli import LEAVES, _strip_optional
    return [leaf for leaf in LEAVES.values() if _strip_optional(leaf.type)[0] in (int, float)]


def test_every_numeric_flag_refuses_negative_and_non_finite_spellings_in_one_line():
    """``--lr -1e-3``, ``--clip-grad=-inf``, ``--max-steps -1``: the value reaches validation (argparse alone
    takes only -1 and -.5 for values: '--lr -1e-3' was "expected one argument"), and every numeric key refuses
    it naming itself. No numeric key has a meaning for a negative value."""
    spellings = ["-1", "-1e-3", "-.5", "-inf", "-Infinity", "nan", "inf", "-nan"]
    for leaf in _numeric_leaves():
        for value in spellings:
            for argv in ([leaf.flag, value], [f"{leaf.flag}={value}"]):
                with pytest.raises(ConfigError) as err:
                    check(valid_config(*argv))
                message = str(err.value)
                assert leaf.name in message and "expected one argument" not in message, (argv, message)
                assert "\n" not in message


@pytest.mark.parametrize("argv", [["--window-size", "-1,0"], ["--window-size=-1,0"], ["--window-size", "-1, 0"]])
def test_a_list_that_starts_with_a_negative_number_is_a_value(argv):
    """docs/attention.md's ``--window-size -1,0`` (no limit): argparse took '-1,0' for an option ("expected one
    argument"); only the '=' spelling parsed."""
    assert parse_config(argv).model.window_size.replace(" ", "") == "-1,0"


@pytest.mark.parametrize("window", ["134217728,0", "99999999999999999999999,0"])
def test_a_window_beyond_any_position_count_is_one_line(window):
    """It trained (no window at all), and its Hugging Face export held a sliding_window that from-hf refuses."""
    with pytest.raises(ConfigError, match=r"^window_size's LEFT is [\d,]+, not below the most positions this "
                                          r"framework accepts \(134,217,728\): for no limit give -1,0\.$"):
        check(valid_config("--window-size", window))


@pytest.mark.parametrize("quoted", ["'99,1,0'", '"99,1,0"'])
def test_a_split_with_its_shell_quotes_reads_as_megatron_reads_it(quoted):
    """Megatron-LM's Llama 3 and gpt-oss scripts pass --split "'99,1,0'" (quotes and all); Megatron accepts it."""
    from megatron.config.syntax import parse_split

    assert parse_split(quoted) == parse_split("99,1,0") == [0.99, 0.01, 0.0]
    check(valid_config("--split", quoted))
    with pytest.raises(ConfigError, match="must be up to three numbers"):  # quotes that do not pair are refused
        check(valid_config("--split", quoted[:-1]))


@pytest.mark.parametrize("split", ["nan,1,1", "inf,1,1", "1,-1e-3,1", "-inf"])
def test_a_split_of_non_finite_or_negative_numbers_refused(split):
    """'--split nan,1,1' was normalized to NaN fractions (and 'inf,1,1' to nan, 0, 0) without a word."""
    with pytest.raises(ConfigError, match=f"split '{re.escape(split)}' must be up to three finite non-negative"):
        check(valid_config("--split", split))


def test_yaml_negative_and_non_finite_values_refused(tmp_path):
    for leaf in _numeric_leaves():
        nested = ""
        for depth, key in enumerate(leaf.path[:-1]):
            nested += "  " * depth + key + ":\n"
        for value in ("-1", "-1.0e-3", ".nan", "-.inf", ".inf"):
            text = nested + "  " * (len(leaf.path) - 1) + f"{leaf.name}: {value}\n"
            with pytest.raises(ConfigError, match=leaf.name):
                check(valid_config("-c", write(tmp_path, text)))


def test_watchdog_timeout_defaults_to_the_collective_timeout():
    config = valid_config("--distributed-timeout-minutes", "3")
    check(config)
    assert config.watchdog_timeout_minutes == 3.0
    config = valid_config("--distributed-timeout-minutes", "3", "--watchdog-timeout-minutes", "0")
    check(config)
    assert config.watchdog_timeout_minutes == 0.0  # disabled, not replaced by the default


@pytest.mark.parametrize("body", ["", "# only a comment\n", "PreTraining:\n"])
def test_empty_yaml_is_a_warning(tmp_path, body):
    warnings: list[str] = []
    config = parse_config(["-c", write(tmp_path, body), "--mock-data", "--device", "cpu"], warnings=warnings)
    assert len(warnings) == 1 and "sets nothing" in warnings[0]
    assert config.model.hidden_size == Config().model.hidden_size
    warnings.clear()
    parse_config(["-c", write(tmp_path, "max_steps: 5\n", "full.yaml")], warnings=warnings)
    assert warnings == []


def test_the_data_and_vocabulary_errors_name_the_flag_that_fixes_them(tmp_path):
    """Adapting the tiny CPU config (mock_data: True, vocab_size set) to real data: each error says what to pass."""
    yaml_path = write(tmp_path, "dataset:\n  mock_data: True\nModel:\n  vocab_size: 1024\n")
    with pytest.raises(ConfigError, match="pass --no-mock-data to train on input_dir"):
        check(parse_config(["-c", yaml_path, "--device", "cpu", "--input-dir", "data/corpus_text_document"]))
    config = parse_config(["-c", yaml_path, "--device", "cpu", "--tokenizer-type", "NullTokenizer"])
    with pytest.raises(ConfigError) as raised:
        validate(config, world_size=1, cuda_available=False, tokenizer_vocab_size=50257)
    message = str(raised.value)
    assert "pass --vocab-size 50257 (or more), or drop vocab_size from the YAML" in message and "\n" not in message
    config = parse_config(["-c", yaml_path, "--device", "cpu", "--no-mock-data", "--input-dir", "data/x_document",
                           "--tokenizer-type", "NullTokenizer"])
    validate(config, world_size=1, cuda_available=False, tokenizer_vocab_size=1024)  # the fix the first message names
    assert not config.dataset.mock_data and config.dataset.input_dir
