"""Megatron-LM's command line: the one table of what each of its flags does here.

A Megatron-LM user's ``pretrain_gpt.py`` script runs unchanged. Each Megatron flag is one of:

- **implemented**: it is one of our flags (a schema leaf or an alias in ``cli.ALIASES``) or is
  rewritten into ours (``REWRITES``), with Megatron's meaning;
- **accepted, no effect here** (``NO_EFFECT``): it concerns only Megatron's implementation (fusions,
  Transformer Engine, its checkpoint formats, logging we always do); parsed and listed once at start;
- **absent** (``ABSENT``): a feature this framework lacks; refused by name, except with the value
  that makes it a no-op (``--num-distributed-optimizer-instances 1``).

``cli.parse_config`` consults this module: plain data and the rewrite rule, importing nothing of ours but its two
tables (``megatron_no_effect.py``, ``megatron_absent.py``) and the layout-string parser (``pipeline_layout.py``, pure).
``python -m megatron.config.docs --megatron`` renders docs/megatron.md from the same tables, so the two
cannot drift (a test compares them).

A command line that names its training length the Megatron way (``--train-iters`` or
``--train-samples``; Megatron-LM has no default length, so every Megatron script has one) gets
Megatron-LM's defaults where they differ from FleetX's (``MEGATRON_DEFAULTS``); a YAML file, ``-o``
or a flag still sets any of them. Without those flags the defaults are FleetX's.
"""

from __future__ import annotations

from megatron.config import (
    megatron_absent,
    megatron_more_data,
    megatron_more_training,
    megatron_no_effect,
    pipeline_layout,
)
from megatron.config.megatron_absent import _ABSENT_PREFIXES, Absent  # noqa: F401

# --- accepted, no effect here; absent: refused by name (their modules: the curated tables, then the rest of
# core_v0.16.1's parser by group) ----------------------------------------------------------------------------
NO_EFFECT: dict[str, str] = {**megatron_no_effect.NO_EFFECT, **megatron_more_training.NO_EFFECT,
                             **megatron_more_data.NO_EFFECT}
ABSENT: dict[str, Absent] = {**megatron_absent.ABSENT, **{
    flag: Absent(feature, noop) for more in (megatron_more_training, megatron_more_data)
    for flag, (feature, noop) in more.ABSENT.items()}}

# Our flags kept for Megatron-LM's command lines that do nothing here: named with the flags accepted without effect.
ACCEPTED_LEAVES = {"overlap_param_gather": "--overlap-param-gather"}


def accepted_leaves(given: dict) -> list[str]:
    """Those of ``ACCEPTED_LEAVES`` set (true) on a command line, as flags."""
    return [flag for leaf, flag in ACCEPTED_LEAVES.items() if given.get(leaf)]


# --- accepted, with a line of its own at start: what to do instead --------------------------------------
def said_instead(flag: str, values: list[str]) -> str | None:
    """The start-up line of an accepted flag whose user needs more than "no effect here", or None."""
    if flag == "--ckpt-format" and values:
        fmt = {"torch": "legacy", "torch_dist": "torch_dist"}.get(values[0])
        convert = (f"`python tools/convert_checkpoint.py to-megatron RUN OUT --format {fmt}` converts a checkpoint "
                   f"of this run into Megatron-LM's {values[0]} format" if fmt else
                   "tools/convert_checkpoint.py to-megatron converts them into Megatron-LM's torch or torch_dist")
        return (f"--ckpt-format {values[0]}: checkpoints here are written in this project's format (atomic, "
                f"checksummed, loadable under any layout); {convert} (docs/checkpoints.md, section 7).")
    return None



# --- rewritten into our flags -----------------------------------------------------------------------------
# Megatron flag -> (our flags it stands for; "{}" is the flag's value, None when it takes none), meaning.
REWRITES: dict[str, tuple[tuple[str, ...], str]] = {
    "--loss-scale": (("--scale-loss", "{}", "--no-dynamic-loss-scale"), "a static fp16 loss scale"),
    "--recompute-activations": (("--use-recompute", "--recompute-granularity", "selective"),
                                "recompute the core attention (selective granularity)"),
    "--recompute-granularity": (("--use-recompute", "--recompute-granularity", "{}"),
                                "recompute on, at this granularity (full or selective)"),
    "--use-rotary-position-embeddings": (("--position-embedding-type", "rope"), "rotary position embeddings"),
    "--enable-gpt-oss": (("--position-embedding-type", "yarn", "--rotary-scaling-factor", "32",
                          "--original-max-position-embeddings", "131072", "--yarn-beta-fast", "32", "--yarn-beta-slow",
                          "1", "--mscale", "1", "--mscale-all-dim", "0", "--no-yarn-correction-range-round-to-int"),
                         "gpt-oss's YaRN rotary embeddings, as Megatron-LM sets them (factor 32 over 131072 original "
                         "positions, betas 32 and 1, mscale 1 and 0, the ramp unrounded); they override the same "
                         "flags given anywhere on the line"),
    "--encoder-num-layers": (("--num-layers", "{}"), "the number of layers (Megatron-LM reads it as --num-layers for "
                                                     "a GPT)"),
    "--encoder-seq-length": (("--seq-length", "{}"), "the sequence length (Megatron-LM reads it as --seq-length for a "
                                                     "GPT)"),
    "--persistent-save-interval": (("--save-interval", "{}"), "another name of --save-interval"),
    "--muon-no-split-qkv": (("--no-muon-split-qkv",), "Muon orthogonalises the fused QKV weight whole"),
    "--optimizer-cpu-offload": (("--sharding-offload",), "the optimizer states (fp32 masters, AdamW moments) and their "
                                                         "step on the CPU, at any sharding"),
    "--use-torch-fsdp2": (("--use-distributed-optimizer", "--sharding-stage", "3"),
                          "PyTorch FSDP2 (fully_shard): parameters, gradients and optimizer states sharded over the "
                          "data-parallel group, which is ZeRO stage 3 here"),
}
REWRITE_LAST = {"--enable-gpt-oss"}  # Megatron-LM applies it after parsing: it overrides the flags it sets
REWRITE_TAKES_VALUE = {flag: "{}" in ours for flag, (ours, _) in REWRITES.items()}

# --- implemented: Megatron flags that are our flags (leaves or aliases), for the table --------------------
IMPLEMENTED: tuple[str, ...] = (
    "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--kv-channels",
    "--seq-length", "--max-position-embeddings", "--make-vocab-size-divisible-by", "--vocab-size",
    "--position-embedding-type", "--rotary-base", "--rotary-percent", "--rotary-interleaved", "--normalization",
    "--norm-epsilon", "--apply-layernorm-1p", "--squared-relu",
    "--swiglu", "--group-query-attention", "--num-query-groups", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--hidden-dropout", "--attention-dropout", "--init-method-std",
    "--micro-batch-size", "--global-batch-size", "--rampup-batch-size", "--step-batch-size-schedule",
    "--train-iters", "--train-samples", "--exit-interval", "--exit-duration-in-mins",
    "--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters", "--lr-decay-samples", "--lr-warmup-fraction",
    "--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-init", "--lr-wsd-decay-iters",
    "--lr-wsd-decay-samples", "--lr-wsd-decay-style", "--decoupled-lr", "--decoupled-min-lr",
    "--apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type", "--weight-decay", "--start-weight-decay",
    "--end-weight-decay", "--weight-decay-incr-style", "--adam-beta1", "--adam-beta2", "--adam-eps", "--clip-grad",
    "--fp16", "--bf16", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis",
    "--recompute-method", "--recompute-num-layers", "--recompute-modules", "--moe-layer-recompute", "--seed",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--virtual-pipeline-model-parallel-size",
    "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank", "--sequence-parallel",
    "--context-parallel-size", "--cp-comm-type", "--hierarchical-context-parallel-sizes",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--optimizer", "--sgd-momentum", "--grad-reduce-in-bf16",
    "--muon-momentum", "--muon-use-nesterov", "--muon-scale-mode", "--muon-fp32-matmul-prec",
    "--muon-num-ns-steps", "--muon-tp-mode", "--muon-extra-scale-factor",
    "--qk-clip", "--qk-clip-alpha", "--qk-clip-threshold", "--log-max-attention-logit",
    "--distributed-timeout-minutes",
    "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--split", "--data-cache-path",
    "--mock-data", "--num-workers", "--eod-mask-loss", "--reset-attention-mask", "--reset-position-ids",
    "--fim-data", "--fim-rate", "--fim-spm-rate", "--fim-split-sample", "--fim-fragment-rate", "--fim-no-prefix",
    "--fim-prefix-token", "--fim-middle-token", "--fim-suffix-token", "--fim-pad-token", "--fim-eod-token",
    "--tokenizer-type", "--tokenizer-model", "--vocab-file",
    "--merge-file", "--tiktoken-pattern", "--tiktoken-num-special-tokens",
    "--save", "--load", "--save-interval", "--finetune", "--no-load-optim", "--no-load-rng", "--use-checkpoint-args",
    "--async-save",
    "--log-interval", "--eval-interval", "--eval-iters", "--tensorboard-dir", "--wandb-project", "--wandb-exp-name",
    "--wandb-save-dir",
    "--num-experts", "--moe-layer-freq", "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-router-pre-softmax",
    "--moe-router-score-function", "--moe-router-dtype", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
    "--moe-z-loss-coeff", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
    "--moe-router-num-groups", "--moe-router-group-topk", "--moe-router-topk-scaling-factor", "--qk-layernorm",
    "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
    "--v-head-dim", "--rope-type", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim",
    "--mtp-num-layers", "--mtp-loss-scaling-factor", "--no-bias-gelu-fusion", "--disable-bf16-reduced-precision-matmul",
    "--moe-expert-capacity-factor", "--moe-token-drop-policy", "--moe-pad-expert-input-to-capacity",
    "--moe-shared-expert-intermediate-size", "--moe-shared-expert-overlap", "--delay-wgrad-compute",
    "--moe-grouped-gemm", "--ddp-reduce-scatter-with-fp32-accumulation", "--attention-output-gate",
    "--experimental-attention-variant", "--linear-attention-freq",
    "--linear-conv-kernel-dim", "--linear-key-head-dim", "--linear-value-head-dim", "--linear-num-key-heads",
    "--linear-num-value-heads", "--is-hybrid-model", "--hybrid-override-pattern", "--mamba-state-dim",
    "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads",
    "--moe-shared-expert-gate", "--moe-router-force-load-balancing", "--moe-input-jitter-eps",
    "--fp8-format", "--fp8-recipe", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather",
    "--moe-token-dispatcher-type", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
    "--embedding-init-method-std", "--add-qkv-bias", "--eval-global-batch-size", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout",
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--override-opt_param-scheduler",
    "--override-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
    "--profile", "--profile-step-start", "--profile-step-end", "--profile-ranks",
    "--window-size", "--window-attn-skip-freq", "--softmax-type", "--quick-geglu", "--glu-linear-offset",
    "--activation-func-clamp-value", "--yarn-original-max-position-embeddings", "--yarn-beta-fast", "--yarn-beta-slow",
    "--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int",
    "--rerun-mode", "--error-injection-rate", "--error-injection-type", "--no-check-for-nan-in-loss-and-grad",
    "--check-for-spiky-loss", "--check-for-large-grads", "--result-rejected-tracker-filename",
    "--cpu-offloading-num-layers", "--fine-grained-activation-offloading", "--offload-modules",
    "--min-offloaded-tensor-size",
    "--use-mup", "--mup-base-hidden-size", "--mup-embedding-mult", "--mup-output-mult", "--mup-base-head-dim",
    "--mup-attn-scale-power",
)
# Megatron flags handled after parsing, from other values (cli.parse_config): flag -> meaning.
DERIVED = {
    "--num-layers-per-virtual-pipeline-stage": "virtual_pp_degree = num_layers / (pp x this)",
    "--use-megatron-fsdp": ("Megatron FSDP: the data-parallel group shards what --data-parallel-sharding-strategy "
                            "names (default optim_grads_params), which is ZeRO over the whole data-parallel group "
                            "here (use_distributed_optimizer, sharding_stage 1-3; no_shard: plain data parallelism)"),
    "--data-parallel-sharding-strategy": ("with --use-megatron-fsdp, sharding_stage: optim 1, optim_grads 2, "
                                          "optim_grads_params 3 (no_shard: none); without it no effect, as in "
                                          "Megatron-LM"),
}
_UNEVEN_STAGES = ("Megatron-LM's uneven pipeline stages, as pipeline_partition's per-stage layer counts (without the "
                  "interleaved schedule; megatron_flags.uneven_stages): ")
DERIVED.update({
    "--decoder-first-pipeline-num-layers": _UNEVEN_STAGES + "the first stage holds this many layers, the middle ones "
                                                            "share the rest evenly",
    "--decoder-last-pipeline-num-layers": _UNEVEN_STAGES + "the last stage holds this many layers",
    "--account-for-embedding-in-pipeline-split": _UNEVEN_STAGES + "the embedding counts as a layer of the first stage",
    "--account-for-loss-in-pipeline-split": _UNEVEN_STAGES + "the loss counts as a layer of the last stage",
    "--pipeline-model-parallel-layout": ("Megatron-LM's layout string (each stage's layers written out: "
                                         "megatron.config.pipeline_layout), as pipeline_partition; its stages over "
                                         "the pipeline size give virtual_pp_degree (docs/pipeline_layout.md)"),
})
_SCHEDULE_WINS = ("a resumed Megatron-LM command line whose schedule (lr, min_lr, warmup, decay, weight-decay ramp) "
                  "differs from the saved run's: {} (checkpoint/resume.scheduler_on_resume); neither stops the run, as "
                  "in Megatron-LM")
DERIVED.update({
    "--override-opt_param-scheduler": _SCHEDULE_WINS.format("the values given now win"),
    "--override-opt-param-scheduler": _SCHEDULE_WINS.format("the values given now win"),
    "--use-checkpoint-opt_param-scheduler": _SCHEDULE_WINS.format("the saved values win"),
    "--use-checkpoint-opt-param-scheduler": _SCHEDULE_WINS.format("the saved values win"),
})
# Megatron FSDP's --data-parallel-sharding-strategy -> our ZeRO stage (0: no sharding, plain data parallelism)
FSDP_STAGES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}

# --- Megatron-LM's defaults where FleetX's differ ---------------------------------------------------------
MEGATRON_DEFAULTS: dict[str, object] = {
    "seed": 1234,
    "decay_style": "linear",
    "min_lr": 0.0,
    "warmup_rate": 0.0,
    "eod_mask_loss": False,
    "split": "969,30,1",
    "eval_iters": 100,
    "logging_freq": 100,
    "scale_loss": 2.0 ** 32,
    "fp8_recipe": "delayed",  # refused with --fp8-format (not built); --fp8-recipe tensorwise is
}
MEGATRON_LENGTH_FLAGS = ("--train-iters", "--train-samples")

# FP8 recipes Megatron-LM has and this framework does not build (its default, delayed, among them)
FP8_RECIPES_NOT_BUILT = {
    "delayed": "delayed scaling (an amax history) is not built here",
    "mxfp8": "MXFP8 (32-element blocks, Blackwell's compute capability 10.0) is not built here",
    "blockwise": "blockwise scaling (1x128 / 128x128 blocks) is not built here",
}


def fp8_recipe_refusal(recipe: str) -> str | None:
    """The one line refusing an FP8 recipe not built here; None for tensorwise. ``parse_config`` asks it of a recipe
    given on the command line, FP8 on or off (Megatron-LM's default recipe, delayed, is refused only where FP8 is on:
    a Megatron-LM command line without FP8 carries it unused)."""
    if recipe not in FP8_RECIPES_NOT_BUILT:
        return None
    return (f"--fp8-recipe {recipe}: {FP8_RECIPES_NOT_BUILT[recipe]}; --fp8-recipe tensorwise is (each tensor "
            f"scaled by its own amax, the same whatever the layout).")


def absent_feature(flag: str) -> str | None:
    """The feature a Megatron flag needs that this framework lacks; None when the flag is not absent."""
    if flag in ABSENT:
        return ABSENT[flag].feature
    return next((feature for prefix, feature in _ABSENT_PREFIXES.items() if flag.startswith(prefix)), None)


def derived(given: dict[str, list[str]], num_layers: int, pp: int) -> tuple[dict[str, object], list[str]]:
    """(values, notices) of the ``DERIVED`` flags of ``given`` (flag -> its values): the configuration values
    they set (leaf name -> value) and the lines to print at start. ValueError, one sentence, for a value
    Megatron-LM would refuse."""
    values: dict[str, object] = {}
    notices: list[str] = []
    layout = layout_flag(given, pp)  # first: refused with the flags below that also cut the layers
    if layout is not None:
        values["pipeline_partition"] = layout  # validate checks it against the model, sets virtual_pp_degree
    flag = "--num-layers-per-virtual-pipeline-stage"
    if flag in given:
        text = " ".join(given[flag])
        per_stage = int(text) if text.isdigit() and len(given[flag]) == 1 else -1
        if per_stage < 1 or num_layers % (per_stage * pp):
            raise ValueError(f"{flag} must be a positive integer that, times the pipeline size ({pp}), divides "
                             f"num_layers ({num_layers}); got {text or 'no value'}.")
        values["virtual_pp_degree"] = num_layers // (per_stage * pp)
    fsdp, strategy_flag = "--use-megatron-fsdp", "--data-parallel-sharding-strategy"
    if fsdp in given and given[fsdp]:
        raise ValueError(f"{fsdp} takes no value; got {' '.join(given[fsdp])}.")
    strategy = " ".join(given.get(strategy_flag, ["optim_grads_params"]))
    if strategy not in FSDP_STAGES:
        raise ValueError(f"{strategy_flag} must be one of {', '.join(FSDP_STAGES)}; got {strategy or 'no value'}.")
    if fsdp in given:
        stage = FSDP_STAGES[strategy]
        values.update({"use_distributed_optimizer": stage > 0, "sharding_stage": max(stage, 1)})
        if not stage:
            values["sharding_degree"] = 1
        zero = f"ZeRO stage {stage} over the whole data-parallel group" if stage else "plain data parallelism"
        notices.append(f"{fsdp} --data-parallel-sharding-strategy {strategy}: {zero} here (docs/megatron.md).")
    elif strategy_flag in given:
        notices.append(f"{strategy_flag} {strategy}: no effect without {fsdp}, as in Megatron-LM.")
    counts = uneven_stages(given, num_layers, pp)
    if counts is not None:
        values["pipeline_partition"] = ",".join(map(str, counts))
    return values, notices


LAYOUT_FLAG = "--pipeline-model-parallel-layout"
_NOT_WITH_LAYOUT = ("--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
                    "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
                    "--account-for-loss-in-pipeline-split")


def layout_flag(given: dict[str, list[str]], pp: int) -> str | None:
    """The layout string of ``--pipeline-model-parallel-layout`` (None: not given), parsed over ``pp`` ranks as
    Megatron-LM parses it. ValueError, one sentence, for Megatron's refusals: a character that is no layer, a
    number of stages not a multiple of ``pp``, the other ways of cutting the layers given with it."""
    if LAYOUT_FLAG not in given:
        return None
    values = given[LAYOUT_FLAG]
    if len(values) != 1:
        raise ValueError(f"{LAYOUT_FLAG} takes one string, such as 'E|(tt|)*2,tL' (quoted for the shell); got "
                         f"{' '.join(values) or 'no value'}.")
    others = [flag for flag in _NOT_WITH_LAYOUT if flag in given]
    if others:
        raise ValueError(f"{LAYOUT_FLAG} cannot be given with {', '.join(others)} (as in Megatron-LM): the layout "
                         f"names every stage's layers itself; drop one of them.")
    pipeline_layout.parse(values[0], pp)
    return values[0]


def _count(given: dict[str, list[str]], flag: str) -> int | None:
    if flag not in given:
        return None
    text = " ".join(given[flag])
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{flag} must be a positive number of layers, got {text or 'no value'}.")
    return int(text)


def uneven_stages(given: dict[str, list[str]], num_layers: int, pp: int) -> list[int] | None:
    """Each pipeline stage's decoder layers under Megatron-LM's uneven-stage flags (None: none given), by its rules
    (TransformerConfig): ``--decoder-first/last-pipeline-num-layers`` give the first / last stage's, the middle
    stages share the rest evenly (there must be as many middle layers as stages, and they must divide); with
    ``--account-for-embedding/loss-in-pipeline-split`` the embedding and the loss count as a layer of the first and
    last stage, all layers then divided evenly. ValueError, Megatron's refusals in one sentence."""
    first = _count(given, "--decoder-first-pipeline-num-layers")
    last = _count(given, "--decoder-last-pipeline-num-layers")
    embedding = "--account-for-embedding-in-pipeline-split" in given
    loss = "--account-for-loss-in-pipeline-split" in given
    if first is None and last is None and not (embedding or loss):
        return None
    if (first is not None or last is not None) and (embedding or loss):
        raise ValueError("--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split cannot be "
                         "given together (as in Megatron-LM).")
    if embedding or loss:
        total = num_layers + embedding + loss
        if total % pp:
            raise ValueError(f"num_layers ({num_layers}) plus the embedding and loss counted as layers ({total}) must "
                             f"be divisible by the pipeline size ({pp}).")
        counts = [total // pp] * pp
        counts[0] -= embedding
        counts[-1] -= loss
        return counts
    middle_stages = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    if middle_stages < 0 or bool(middle) != bool(middle_stages) or middle < 0:
        raise ValueError(f"{middle} layers remain for the {max(middle_stages, 0)} middle pipeline stages of {pp} "
                         f"(num_layers {num_layers}, first {first}, last {last}): Megatron-LM refuses the mismatch.")
    if middle_stages and middle % middle_stages:
        raise ValueError(f"the {middle} middle layers must be divisible by the {middle_stages} middle pipeline stages.")
    return [*([first] if first is not None else []), *([middle // middle_stages] * middle_stages if middle_stages
                                                        else []), *([last] if last is not None else [])]


def is_megatron_command_line(argv: list[str]) -> bool:
    """Whether ``argv`` names its training length the Megatron way (see the module docstring)."""
    return any(arg.split("=")[0] in MEGATRON_LENGTH_FLAGS for arg in argv)


def rewrite(argv: list[str]) -> list[str]:
    """``argv`` with each ``REWRITES`` flag replaced by the flags of ours it stands for."""
    out: list[str] = []
    last: list[str] = []  # REWRITE_LAST flags' expansions: after everything else, so that they win as in Megatron
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if name in REWRITES:
            ours, _ = REWRITES[name]
            value = None
            if REWRITE_TAKES_VALUE[name]:
                if eq:
                    value = inline
                elif i + 1 < len(argv):
                    i += 1
                    value = argv[i]
                else:
                    value = ""  # argparse reports the missing value on our flag
            parts = [value if part == "{}" else part for part in ours if not (part == "{}" and value == "")]
            (last if name in REWRITE_LAST else out).extend(parts)
        else:
            out.append(arg)
        i += 1
    return out + last
