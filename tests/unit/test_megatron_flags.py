"""A Megatron-LM user's command line: every flag implemented, accepted without effect, or refused by name."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest

from megatron.config import ConfigError, infer_tokenizer_type, megatron_flags, parse_config, validate
from megatron.config.cli import build_parser
from megatron.config.docs import render_markdown as render_configuration
from megatron.config.docs import render_megatron_markdown
from megatron.tokenizer import configured_tokenizer
from tests.unit.megatron_example_scripts import EXAMPLE_GPT_OSS, EXAMPLE_QWEN3_30B_A3B
from tests.unit.megatron_flag_sets import ALL_FUNCTIONAL_FLAGS, EXAMPLE_175B, FUNCTIONAL

ROOT = Path(__file__).resolve().parents[2]
GPT2_VOCAB = 50257  # the vocabulary of Megatron-LM's GPT-2 vocab.json / merges.txt

# The flags of each refused command line that name a feature absent here; every other flag must pass.
REFUSED = {
    "gpt3_mcore_te_tp2_pp1_multi_dist_optimizer_instances": {"--num-distributed-optimizer-instances"},
}
# Command lines whose flags are all taken, refused by validation in one line: what they combine is not built.
NOT_BUILT = {"gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split":
             "uneven stages.* is not built with the interleaved schedule"}
COMMAND_LINES = {"examples/gpt3/train_gpt3_175b_distributed.sh": EXAMPLE_175B, **FUNCTIONAL,
                 "examples/rl/model_configs/qwen3_30b_a3b_moe.sh": EXAMPLE_QWEN3_30B_A3B,
                 "examples/gptoss/02_train.sh": EXAMPLE_GPT_OSS}


def _argv(text: str, tmp_path: Path) -> list[str]:
    """The command line with its environment's paths filled in (validation reads no files)."""
    for var in ("DATA_PATH", "VOCAB_FILE", "MERGE_FILE", "CHECKPOINT_PATH", "CHECKPOINT_SAVE_PATH",
                "CHECKPOINT_LOAD_PATH", "TENSORBOARD_PATH", "TENSORBOARD_LOGS_PATH", "DATA_CACHE_PATH",
                "WANDB_SAVE_PATH", "WANDB_EXPERIMENT", "DATA_BLEND"):
        path = str(tmp_path / var.lower())
        text = text.replace("${" + var + "}", path).replace("$" + var, path)
    return shlex.split(text)


def _without(argv: list[str], flags: set[str]) -> list[str]:
    """``argv`` without ``flags`` and their values."""
    kept, dropping = [], False
    for arg in argv:
        dropping = arg in flags or (dropping and not arg.startswith("--"))
        if not dropping:
            kept.append(arg)
    return kept


def _world_size(argv: list[str]) -> int:
    """tp x pp x cp x the fewest data-parallel ranks the experts need (a stage's tp x cp x dp ranks hold ep x etp
    expert groups)."""
    sizes = {"--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--context-parallel-size": 1,
             "--expert-model-parallel-size": 1, "--expert-tensor-parallel-size": 0}
    for flag in sizes:
        if flag in argv:
            sizes[flag] = int(argv[argv.index(flag) + 1])
    tp, pp, cp, ep, etp = sizes.values()
    experts = ep * (etp or tp)
    return tp * pp * cp * experts // math.gcd(experts, tp * cp)


def _validated(argv: list[str], notices: list[str] | None = None):
    config = parse_config(argv, warnings=notices)
    infer_tokenizer_type(config.tokenizer)  # the 175B example gives GPT-2's files and no --tokenizer-type
    null = config.tokenizer.tokenizer_type == "NullTokenizer"
    tokenizer = configured_tokenizer(config.tokenizer, config.model.vocab_size) if null else None
    vocab = tokenizer.vocab_size if tokenizer else (GPT2_VOCAB if config.tokenizer.tokenizer_type else None)
    validate(config, world_size=_world_size(argv), tokenizer_vocab_size=vocab)
    return config


@pytest.mark.parametrize("name", list(COMMAND_LINES))
def test_megatron_command_lines_parse_and_validate(name, tmp_path):
    argv = _argv(COMMAND_LINES[name], tmp_path)
    notices: list[str] = []
    if name in REFUSED:
        with pytest.raises(ConfigError) as err:
            parse_config(argv, warnings=notices)
        refused = {flag for flag in argv if flag.startswith("--") and flag in str(err.value)}
        assert refused == REFUSED[name], str(err.value)
        assert "unknown argument" not in str(err.value)
        return
    if name in NOT_BUILT:
        with pytest.raises(ConfigError, match=NOT_BUILT[name]):
            _validated(argv)
        return
    fp8 = {flag for flag in argv if flag.startswith("--fp8-")}
    if fp8:  # taken, and refused by validation on a CPU in one line (tests/functional/test_megatron_script.py)
        with pytest.raises(ConfigError, match=r"^--fp8-format needs an NVIDIA GPU with FP8 tensor cores"):
            _validated(argv)
        argv = _without(argv, fp8)  # FP8 aside, the command line is taken
    config = _validated(argv, notices)
    assert any(n.startswith("Megatron-LM command line") for n in notices)
    # what the flags say is what the configuration holds
    assert config.model.num_layers == int(argv[argv.index("--num-layers") + 1])
    d = config.distributed
    assert d.mp_degree * d.pp_degree * d.context_parallel_size * d.dp_degree * d.sharding.sharding_degree == \
        _world_size(argv)
    if "--lr" in argv:
        assert config.optimizer.lr.max_lr == float(argv[argv.index("--lr") + 1])
    if "--seq-length" in argv:
        assert config.dataset.max_seq_len == int(argv[argv.index("--seq-length") + 1])


def test_accepted_flags_are_listed_once_at_start():
    notices: list[str] = []
    parse_config(["--mock-data", "--use-mcore-models", "--transformer-impl", "transformer_engine",
                  "--num-distributed-optimizer-instances", "1", "--manual-gc"], warnings=notices)
    accepted = [n for n in notices if n.startswith("accepted, no effect here")]
    assert accepted == ["accepted, no effect here: --use-mcore-models, --transformer-impl transformer_engine, "
                        "--num-distributed-optimizer-instances 1, --manual-gc (docs/megatron.md says why)."]


@pytest.mark.parametrize("fmt, says", [
    ("torch_dist", "`python tools/convert_checkpoint.py to-megatron RUN OUT --format torch_dist` converts"),
    ("torch", "`python tools/convert_checkpoint.py to-megatron RUN OUT --format legacy` converts"),
    ("zarr", "tools/convert_checkpoint.py to-megatron converts them into Megatron-LM's torch or torch_dist")])
def test_a_megatron_checkpoint_format_says_how_to_get_one(fmt, says):
    """--ckpt-format is accepted (a Megatron script runs unchanged) and its own line names the converter."""
    notices: list[str] = []
    parse_config(["--mock-data", "--ckpt-format", fmt], warnings=notices)
    assert len(notices) == 1 and notices[0].startswith(
        f"--ckpt-format {fmt}: checkpoints here are written in this project's format (atomic, checksummed, ")
    assert says in notices[0]


def test_unknown_and_absent_flags_are_reported_together():
    with pytest.raises(ConfigError) as err:
        parse_config(["--num-layer", "2", "--mrope-section", "16", "24", "24",
                      "--moe-router-bias-kind", "2", "--hiden-size", "8"])
    text = str(err.value)
    assert "2 unknown arguments: '--num-layer' (did you mean '--num-layers'?), '--hiden-size' (did you mean " \
           "'--hidden-size'?)" in text
    assert "--mrope-section 16 24 24 (multimodal rotary embeddings" in text
    assert "--moe-router-bias-kind (a mixture-of-experts option not built here" in text


def test_megatron_defaults_apply_to_a_megatron_command_line_only(tmp_path):
    fleetx = parse_config(["--mock-data"])
    megatron = parse_config(["--mock-data", "--train-iters", "10"])
    for name, value in megatron_flags.MEGATRON_DEFAULTS.items():
        from megatron.config.cli import get
        assert get(megatron, name) == value
        assert get(fleetx, name) != value
    # anything given still wins: a flag, -o, and a YAML file
    yaml = tmp_path / "c.yaml"
    yaml.write_text("seed: 7\n")
    given = parse_config(["-c", str(yaml), "--train-samples", "100", "--min-lr", "1e-6", "-o", "eval_iters=3"])
    assert (given.seed, given.optimizer.lr.min_lr, given.eval_iters) == (7, 1e-6, 3)
    assert given.optimizer.lr.decay_style == "linear"


@pytest.mark.parametrize("argv, expect", [
    (["--loss-scale", "128"], {"scale_loss": 128.0, "dynamic_loss_scale": False}),
    (["--loss-scale=64"], {"scale_loss": 64.0, "dynamic_loss_scale": False}),
    (["--recompute-activations"], {"use_recompute": True, "recompute_granularity": "selective"}),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"],
     {"use_recompute": True, "recompute_granularity": "full", "recompute_method": "uniform"}),
    (["--recompute-granularity=full", "--no-use-recompute"], {"use_recompute": False}),
    (["--use-rotary-position-embeddings"], {"position_embedding_type": "rope"}),
    (["--position-embedding-type", "none"], {"position_embedding_type": "none"}),
    (["--pp", "2", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2"], {"virtual_pp_degree": 2}),
    (["--num-virtual-stages-per-pipeline-rank", "3"], {"virtual_pp_degree": 3}),
])
def test_megatron_flags_mean_what_they_mean_in_megatron(argv, expect):
    from megatron.config.cli import get

    config = parse_config(["--mock-data", *argv])
    assert {name: get(config, name) for name in expect} == expect


def test_layers_per_virtual_stage_must_divide_the_layers():
    with pytest.raises(ConfigError, match="num-layers-per-virtual-pipeline-stage must be a positive integer"):
        parse_config(["--pp", "2", "--num-layers", "6", "--num-layers-per-virtual-pipeline-stage", "2"])


def test_distributed_optimizer_shards_over_the_data_parallel_group():
    config = parse_config(["--mock-data", "--use-distributed-optimizer", "--tp", "2", "--global-batch-size", "8"])
    validate(config, world_size=8)
    d = config.distributed
    assert (d.dp_degree, d.sharding.sharding_degree, d.sharding.sharding_stage) == (1, 4, 1)
    clash = parse_config(["--mock-data", "--use-distributed-optimizer", "--dp", "2", "--global-batch-size", "8"])
    with pytest.raises(ConfigError, match="use_distributed_optimizer shards the optimizer over the whole"):
        validate(clash, world_size=4)


def test_tables_never_shadow_our_flags():
    ours = {s for a in build_parser()._actions for s in a.option_strings if not a.dest.startswith("megatron:")}
    tables = set(megatron_flags.NO_EFFECT) | set(megatron_flags.ABSENT) | set(megatron_flags.DERIVED)
    assert not ours & tables
    assert not set(megatron_flags.REWRITES) - {"--recompute-granularity"} & ours
    for flag in megatron_flags.IMPLEMENTED:
        assert flag in ours or flag in megatron_flags.DERIVED, flag
    for targets, _ in megatron_flags.REWRITES.values():
        assert {t for t in targets if t.startswith("--")} <= ours


def test_reference_documents_are_current():
    assert (ROOT / "docs" / "megatron.md").read_text() == render_megatron_markdown(), \
        "regenerate with: python -m megatron.config.docs --megatron > docs/megatron.md"
    assert (ROOT / "docs" / "configuration.md").read_text() == render_configuration()


def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(tmp_path):
    from megatron import parallel_state
    from megatron.checkpoint import resumed_config
    from megatron.checkpoint.convert import write_params
    from megatron.model.gpt import GPTModel

    saved = parse_config(["--mock-data", "--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "4",
                          "--swiglu", "--normalization", "RMSNorm", "--max-seq-len", "32", "--vocab-size", "99"])
    validate(saved)
    parallel_state.initialize()
    model = GPTModel(saved.model, saved.padded_vocab_size)
    write_params(str(tmp_path / "run"), saved, {n: p.detach() for n, p in model.named_parameters()})
    load = ["--load", str(tmp_path / "run"), "--mock-data", "--use-checkpoint-args"]
    # finetune inherits nothing, except with --use-checkpoint-args: the model's shape and kind
    config = resumed_config([*load, "--finetune", "--hidden-size", "64", "--no-swiglu", "--lr", "1e-3"])
    m = config.model
    assert (m.num_layers, m.num_attention_heads, m.vocab_size, config.dataset.max_seq_len) == (3, 4, 99, 32)
    assert m.hidden_size == 64  # a shape given now wins, as in Megatron-LM
    assert m.swiglu and m.normalization == "RMSNorm"  # the kind is the checkpoint's, as in Megatron-LM
    assert config.optimizer.lr.max_lr == 1e-3
    assert not resumed_config([*load[:-1], "--finetune"]).model.swiglu  # without the flag: nothing inherited
    with pytest.raises(ConfigError, match="use_checkpoint_args takes the model's shape from a checkpoint: --load"):
        resumed_config(["--load", str(tmp_path / "empty"), "--mock-data", "--use-checkpoint-args"])


def test_every_flag_of_megatrons_gpt_tests_has_its_row():
    """All 272 flags of Megatron-LM's GPT functional tests are implemented, accepted or absent by name: none
    gets the unknown-flag answer."""
    ours = {s for a in build_parser()._actions for s in a.option_strings if not a.dest.startswith("megatron:")}
    rows = {"implemented": [], "accepted": [], "absent": [], "unknown": []}
    in_lines = {arg for text in FUNCTIONAL.values() for arg in shlex.split(text) if arg.startswith("--")}
    for flag in sorted(set(ALL_FUNCTIONAL_FLAGS) | in_lines):
        if flag in ours or flag in megatron_flags.REWRITES or flag in megatron_flags.DERIVED:
            rows["implemented"].append(flag)
        elif flag in megatron_flags.NO_EFFECT:
            rows["accepted"].append(flag)
        elif megatron_flags.absent_feature(flag):
            rows["absent"].append(flag)
        else:
            rows["unknown"].append(flag)
    assert rows["unknown"] == []
    assert len(rows["implemented"]) >= 80


def test_the_megatron_defaults_notice_names_only_the_defaults_that_apply():
    """A Megatron command line that sets --seed and --eod-mask-loss itself is not told they are Megatron's defaults."""
    notices: list[str] = []
    config = parse_config(["--mock-data", "--train-iters", "2", "--eod-mask-loss", "--seed", "7"], warnings=notices)
    notice = next(n for n in notices if n.startswith("Megatron-LM command line"))
    assert "seed" not in notice and "eod_mask_loss" not in notice and "decay_style linear" in notice
    assert (config.seed, config.dataset.eod_mask_loss) == (7, True)


@pytest.mark.parametrize("strategy, stage", [(None, 3), ("optim", 1), ("optim_grads", 2), ("optim_grads_params", 3),
                                             ("no_shard", 0)])
def test_megatron_fsdp_is_zero_over_the_data_parallel_group(strategy, stage):
    """--use-megatron-fsdp shards what --data-parallel-sharding-strategy names (Megatron's default
    optim_grads_params) over the whole data-parallel group: ZeRO at that stage here; no_shard is plain data
    parallelism. Its line at start says so."""
    notices: list[str] = []
    given = [] if strategy is None else ["--data-parallel-sharding-strategy", strategy]
    config = parse_config(["--mock-data", "--use-megatron-fsdp", *given, "--global-batch-size", "8"],
                          warnings=notices)
    validate(config, world_size=4)
    d = config.distributed
    if stage:
        assert (d.use_distributed_optimizer, d.sharding.sharding_stage, d.sharding.sharding_degree, d.dp_degree) \
            == (True, stage, 4, 1)
        assert f"ZeRO stage {stage} over the whole data-parallel group here" in notices[-1]
    else:
        assert (d.use_distributed_optimizer, d.sharding.sharding_degree, d.dp_degree) == (False, 1, 4)
        assert "no_shard: plain data parallelism here" in notices[-1]


def test_torch_fsdp2_is_zero3_and_a_sharding_strategy_alone_changes_nothing():
    d = parse_config(["--mock-data", "--use-torch-fsdp2"]).distributed
    assert (d.use_distributed_optimizer, d.sharding.sharding_stage) == (True, 3)
    notices: list[str] = []
    d = parse_config(["--mock-data", "--data-parallel-sharding-strategy", "optim_grads"], warnings=notices).distributed
    assert (d.use_distributed_optimizer, d.sharding.sharding_stage) == (False, 1)  # as in Megatron-LM
    assert notices == ["--data-parallel-sharding-strategy optim_grads: no effect without --use-megatron-fsdp, as in "
                       "Megatron-LM."]
    for bad, says in ((["--data-parallel-sharding-strategy", "zero3"], "--data-parallel-sharding-strategy must be one "
                       "of no_shard, optim, optim_grads, optim_grads_params; got zero3."),
                      (["--use-megatron-fsdp", "yes"], "--use-megatron-fsdp takes no value; got yes.")):
        with pytest.raises(ConfigError) as err:
            parse_config(["--mock-data", *bad])
        assert str(err.value) == says


def test_hybrid_fsdp_is_refused_unless_off():
    notices: list[str] = []
    parse_config(["--mock-data", "--outer-dp-sharding-strategy", "no_shard"], warnings=notices)
    assert notices == ["accepted, no effect here: --outer-dp-sharding-strategy no_shard (docs/megatron.md says why)."]
    with pytest.raises(ConfigError, match="--outer-dp-sharding-strategy optim \\(hybrid-sharded data parallelism "
                                          ".*; accepted only as --outer-dp-sharding-strategy no_shard\\)"):
        parse_config(["--mock-data", "--outer-dp-sharding-strategy", "optim"])


def test_what_megatron_only_checks_or_fuses_is_accepted():
    notices: list[str] = []
    config = parse_config(["--mock-data", "--moe-permute-fusion", "--moe-router-fusion",
                           "--no-check-for-nan-in-loss-and-grad", "--logging-level", "40"], warnings=notices)
    assert notices == ["accepted, no effect here: --moe-permute-fusion, --moe-router-fusion, --logging-level 40 "
                       "(docs/megatron.md says why)."]
    assert config.rerun.check_for_nan_in_loss_and_grad is False  # the rerun machine's check (rerun.py)


def test_fp8_flags_are_ours_and_refused_on_a_cpu_in_one_line_naming_the_gpu_they_need():
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "16"]
    config = parse_config(["--mock-data", "--bf16", *fp8])
    mp = config.mix_precision
    assert (mp.fp8_format, mp.fp8_recipe, mp.fp8_amax_history_len) == ("hybrid", "tensorwise", 16)
    with pytest.raises(ConfigError) as err:
        validate(config)
    text = str(err.value)
    assert "\n" not in text and text.startswith(
        "--fp8-format needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
        "Blackwell); on the CPU")
    with pytest.raises(ConfigError) as err:  # what is still not built is refused at parsing, in the same line
        parse_config(["--mock-data", *fp8, "--fp8-margin", "0", "--export-te-mcore-model"])
    assert str(err.value).startswith("not available here: --fp8-margin 0 (an FP8 option not built here (docs/fp8.md "
                                     "lists those built)), --export-te-mcore-model (Megatron's ModelOpt export and "
                                     "distillation); remove them")


def test_kv_channels_is_accepted_and_unused_under_multi_latent_attention():
    """Megatron-LM's DeepSeek scripts give --kv-channels with --multi-latent-attention, whose heads it does not
    shape there either: taken, with a line saying so (grouped-query attention stays refused)."""
    mla = ["--mock-data", "--multi-latent-attention", "--position-embedding-type", "rope", "--num-attention-heads", "4"]
    config = parse_config([*mla, "--kv-channels", "128"])
    warnings = validate(config)
    assert config.model.kv_channels == 128  # as given: a resume giving it again changes nothing
    assert any(w.startswith("kv_channels (128) shapes nothing under multi-latent attention") for w in warnings)
    with pytest.raises(ConfigError, match="group_query_attention shapes SelfAttention's heads"):
        validate(parse_config([*mla, "--group-query-attention", "--num-query-groups", "2"]))


@pytest.mark.parametrize("flags, partition", [
    (["--pp", "4", "--num-layers", "10", "--decoder-first-pipeline-num-layers", "1",
      "--decoder-last-pipeline-num-layers", "3"], "1,3,3,3"),
    (["--pp", "2", "--num-layers", "5", "--decoder-first-pipeline-num-layers", "2"], "2,3"),
    (["--pp", "3", "--num-layers", "7", "--decoder-last-pipeline-num-layers", "1"], "3,3,1"),
    (["--pp", "4", "--num-layers", "6", "--account-for-embedding-in-pipeline-split",
      "--account-for-loss-in-pipeline-split"], "1,2,2,1"),
    (["--pp", "2", "--num-layers", "5", "--account-for-loss-in-pipeline-split"], "3,2"),
])
def test_megatron_s_uneven_pipeline_stages_are_per_stage_layer_counts(flags, partition):
    config = parse_config(["--train-iters", "10", *flags])
    assert config.distributed.pipeline_partition == partition


@pytest.mark.parametrize("flags, message", [
    (["--pp", "4", "--num-layers", "10", "--decoder-first-pipeline-num-layers", "2"], "the 8 middle layers must be "
     "divisible by the 3 middle pipeline stages"),
    (["--pp", "2", "--num-layers", "4", "--decoder-first-pipeline-num-layers", "1",
      "--decoder-last-pipeline-num-layers", "1"], "2 layers remain for the 0 middle pipeline stages of 2"),
    (["--pp", "2", "--num-layers", "4", "--decoder-first-pipeline-num-layers", "0"], "must be a positive number"),
    (["--pp", "2", "--num-layers", "4", "--decoder-first-pipeline-num-layers", "1",
      "--account-for-loss-in-pipeline-split"], "cannot be given together"),
    (["--pp", "4", "--num-layers", "5", "--account-for-loss-in-pipeline-split"], "must be divisible by the pipeline"),
])
def test_megatron_s_uneven_stage_refusals(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(["--train-iters", "10", *flags])


def test_uneven_stages_are_refused_with_the_interleaved_schedule():
    config = parse_config(["--train-iters", "10", "--pp", "2", "--vpp", "2", "--num-layers", "8",
                           "--decoder-first-pipeline-num-layers", "2", "--global-batch-size", "8",
                           "--micro-batch-size", "1"])
    with pytest.raises(ConfigError, match="is not built with the interleaved schedule"):
        validate(config, world_size=2, training_data=False)
