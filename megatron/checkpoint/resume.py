"""What a resumed run inherits: the saved run's configuration, as the base of the one given now.

A run started with ``ckpt_dir`` (and not ``finetune``) takes the ``config.yaml`` of the checkpoint it
loads as its base configuration; the YAML file and flags given now are applied over it
(``megatron.config.parse_config(argv, base)``). Not inherited: the parallel layout (the Distributed
section) and the per-replica batch, which belong to the launch, and how to load (``NOT_INHERITED``),
which is asked now. ``--save X --load X`` with no checkpoint yet in X has no base: the run starts from
scratch, as the loader decides (``find_checkpoint``). A damaged checkpoint is a CheckpointError, the
same on every rank, raised before any process group exists.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from megatron.checkpoint.format import find_checkpoint, same_folder, verify_file
from megatron.checkpoint.tokenizer_files import find_tokenizer_files
from megatron.config import Config, ConfigError, load_yaml, megatron_flags, parse_config, set_value
from megatron.config.cli import megatron_defaults
from megatron.config.schema import ModelConfig, SaveLoadConfig
from megatron.config.syntax import input_dir_words

__all__ = ["MODEL_MAY_CHANGE", "MODEL_NOT_CHANGED", "NOT_INHERITED", "check_resume_settings", "resume_base",
           "resumed_config", "saved_config_path", "schedule_kept_warning", "scheduler_on_resume"]

NOT_INHERITED = ("ckpt_dir", "local_batch_size", "finetune", "load_optim", "load_rng", "exit_duration_in_mins",
                 "exit_interval", "use_checkpoint_args", "override_data_order", "override_model_settings",
                 "overwrite_output_dir")
# Where a run writes: inherited only by a resume of the run's own folder (the saved output_dir is the folder
# loaded from); a copy of a run folder, or a downloaded one, never steers this launch's writes elsewhere.
WRITE_PATHS = ("output_dir", "tensorboard_dir", "wandb_save_dir", "data_cache_path")
NOT_INHERITED_SECTION = "Distributed"  # the parallel layout is the launch's


def saved_config_path(ckpt_dir: str | None) -> str | None:
    """The config.yaml of the checkpoint ``ckpt_dir`` resolves to, checked against its checksum; None when
    there is none: no ``ckpt_dir``, or no checkpoint there at all (a first launch of ``--save X --load X``).
    A damaged checkpoint (a ``latest`` naming a missing folder, a corrupt config.yaml) is a CheckpointError."""
    if not ckpt_dir:
        return None
    step_dir = find_checkpoint(ckpt_dir)
    if step_dir is None:
        return None
    verify_file(step_dir, "config.yaml")
    path = os.path.join(step_dir, "config.yaml")
    return path if os.path.isfile(path) else None


def resume_base(save_load: SaveLoadConfig) -> Config | None:
    """The base configuration of a run with this ``save_load`` section: the saved run's, without the
    Distributed section and the ``NOT_INHERITED`` keys; None for ``finetune`` (only what is given now) or
    when there is no checkpoint to resume. CheckpointError for a damaged checkpoint, ConfigError for a
    saved config.yaml that does not parse."""
    if save_load.finetune:
        return None
    path = saved_config_path(save_load.ckpt_dir)
    if path is None:
        return None
    base = Config()
    saved = load_yaml(path)
    output_dir = next((value for leaf, value in saved if leaf.name == "output_dir"), None)
    own = isinstance(output_dir, str) and same_folder(output_dir, os.path.dirname(os.path.dirname(path)))
    for leaf, value in saved:
        if leaf.path[0] != NOT_INHERITED_SECTION and leaf.name not in NOT_INHERITED and (
                own or leaf.name not in WRITE_PATHS):
            set_value(base, leaf, value)
    find_tokenizer_files(base.tokenizer, os.path.dirname(path))  # paths relative to where the run was launched
    return base


def schedule_kept_warning(base: Config, config: Config) -> str | None:
    """A resumed run keeps the saved run's resolved schedule (its decay_steps was derived from its
    max_steps): a sentence saying so when ``config`` (parsed over ``base``) changed max_steps but not
    decay_steps, rather than silently decaying over the old length; None otherwise, and when the saved
    configuration has no decay_steps (not a resolved one, e.g. a converted checkpoint's: nothing is kept)."""
    saved_steps, decay_steps = base.max_steps, base.optimizer.lr.decay_steps
    if decay_steps is None or config.max_steps == saved_steps or config.optimizer.lr.decay_steps != decay_steps:
        return None
    return (f"resuming with max_steps {config.max_steps} while the saved run's learning rate decays over "
            f"{decay_steps} steps (its decay_steps, kept); pass --lr-decay-iters (decay_steps) to change it.")


# What a resume may not change. Every setting of the Model section but those of MODEL_MAY_CHANGE: the model's
# settings that no tensor shape shows (heads over the same hidden size, RoPE's base, the norm's epsilon, the
# router's top-k and score function, an expert's capacity, ...) would read the saved weights as another model, and a
# new model setting is held by default (listing it here is a decision). MODEL_MAY_CHANGE: what the training
# objective, the precision or the speed use, not the function the weights compute. Those that decide which sample
# comes next (once the saved run has consumed any): the data would be another order from here on.
MODEL_MAY_CHANGE = ("hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range",
                    "embedding_init_method_std", "moe_router_dtype",
                    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                    "moe_router_bias_update_rate", "moe_pad_expert_input_to_capacity", "moe_shared_expert_overlap",
                    "delay_wgrad_compute",
                    "moe_grouped_gemm", "moe_token_dispatcher_type", "mtp_loss_scaling_factor")
MODEL_NOT_CHANGED = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in MODEL_MAY_CHANGE)
DATA_ORDER_NOT_CHANGED = (("seed",), ("dataset", "input_dir"), ("dataset", "train_data_path"), ("dataset", "split"),
                          ("dataset", "max_seq_len"), ("dataset", "mock_data"), ("dataset", "mock_document_length"),
                          ("tokenizer", "tokenizer_type"), ("tokenizer", "eod_token"))


def _get(config: Config, path: tuple[str, ...]):
    value = config
    for name in path:
        value = getattr(value, name)
    return value


def _data_words(value):
    """A data path setting as what decides the order: its weights and its datasets' file names (a folder
    moved, or a node-local copy, is the same data; the content itself is compared at load, by fingerprint)."""
    if not isinstance(value, str):
        return value
    try:
        prefixes, weights = input_dir_words(value)
    except ValueError:
        return value.split()
    return [os.path.basename(os.path.normpath(p)) for p in prefixes], weights


def _effective(model, name: str):
    """A model setting as the model uses it: an unset kv_channels or num_query_groups is its derived value (a
    resume that gives the derived value explicitly changes nothing, and a refusal names numbers)."""
    value = getattr(model, name)
    if value is None and name == "kv_channels" and model.hidden_size and model.num_attention_heads:
        return model.hidden_size // model.num_attention_heads
    if value is None and name == "num_query_groups" and not model.group_query_attention:
        return model.num_attention_heads
    return value


def check_resume_settings(base: Config, config: Config, ckpt_dir: str, saved_step: int) -> None:
    """ConfigError, one line naming both values, when ``config`` (a resume over the saved ``base``) changes a
    setting of the model (``MODEL_NOT_CHANGED``), unless ``override_model_settings`` is given, or (once the saved
    run has trained: ``saved_step`` > 0) the data order, unless ``override_data_order`` is given."""
    dense = not config.model.num_experts and not base.model.num_experts  # the router's settings are unused
    for name in () if config.save_load.override_model_settings else MODEL_NOT_CHANGED:
        if dense and name.startswith("moe_"):
            continue
        now, saved = _effective(config.model, name), _effective(base.model, name)
        if now != saved:
            raise ConfigError(f"resuming {ckpt_dir} with {name} {now!r}, but the saved run has {saved!r}: a setting "
                              f"of the model (its shape or what it computes) must stay as saved; drop it, pass "
                              f"--override-model-settings to change it from here on, or start a new run from these "
                              f"weights with --finetune.")
    if saved_step == 0 or config.save_load.override_data_order:
        return
    for path in DATA_ORDER_NOT_CHANGED:
        now, saved = _get(config, path), _get(base, path)
        if _data_words(now) != _data_words(saved):
            raise ConfigError(f"resuming {ckpt_dir} with {path[-1]} {now!r}, but the saved run has {saved!r}: the "
                              f"data would be read in another order from step {saved_step} on; drop it, pass "
                              f"--override-data-order to change the data from here on, or use --finetune.")


# --use-checkpoint-args (Megatron-LM's load_args_from_checkpoint): the model's shape comes from the checkpoint
# unless given now; its kind (these keys) comes from the checkpoint even when given now.
CHECKPOINT_SHAPE = ("Model", "Tokenizer", "max_seq_len")
CHECKPOINT_FORCED = ("position_embedding_type", "rotary_base", "rotary_percent", "rotary_interleaved", "normalization",
                     "swiglu",
                     "group_query_attention", "num_query_groups", "untie_embeddings_and_output_weights",
                     "disable_bias_linear", "hidden_dropout_prob", "attention_probs_dropout_prob")


def _checkpoint_model(save_load: SaveLoadConfig) -> list:
    """The (leaf, value) pairs of the Model and tokenizer sections (and max_seq_len) of the checkpoint that
    ``--use-checkpoint-args`` reads; ConfigError when there is none to read."""
    path = saved_config_path(save_load.ckpt_dir)
    if path is None:
        where = f"--load {save_load.ckpt_dir} holds none" if save_load.ckpt_dir else "give --load"
        raise ConfigError(f"use_checkpoint_args takes the model's shape from a checkpoint: {where}.")
    return [(leaf, value) for leaf, value in load_yaml(path)
            if leaf.path[0] in ("Model", "tokenizer") or leaf.name == "max_seq_len"]


def resumed_config(argv: Sequence[str] | None = None, warnings: list[str] | None = None,
                   training: bool = True) -> Config:
    """The (not yet validated) configuration of a run started with ``argv``: parsed once to learn where it
    loads from, then again over that checkpoint's saved configuration (``resume_base``), if any. Warnings
    (an empty YAML file, a kept schedule) are appended to ``warnings`` when a list is given.

    ``--use-checkpoint-args`` (also with ``--finetune``): the checkpoint's model and tokenizer are the base
    of those given now, and its ``CHECKPOINT_FORCED`` keys replace what is given now, as Megatron-LM does.

    A resume that changes a setting shaping the model (or, ``training``, the data order) is a ConfigError
    (``check_resume_settings``); an evaluation (not ``training``) may read other data and tokenizers."""
    first = parse_config(argv)
    base = resume_base(first.save_load)
    saved_model = _checkpoint_model(first.save_load) if first.save_load.use_checkpoint_args else []
    if saved_model and base is None:  # --finetune: only the model and tokenizer are the checkpoint's
        base = megatron_defaults() if megatron_flags.is_megatron_command_line(_argv(argv)) else Config()
        for leaf, value in saved_model:
            set_value(base, leaf, value)
    config = parse_config(argv, base, warnings=warnings)
    for leaf, value in saved_model:
        if leaf.name in CHECKPOINT_FORCED:
            set_value(config, leaf, value)
    if base is not None and not first.save_load.finetune:
        saved_step = _saved_step(first.save_load.ckpt_dir) if training else 0  # 0: no data order to keep
        check_resume_settings(base, config, first.save_load.ckpt_dir, saved_step)
    if base is not None and not first.save_load.finetune and training:
        scheduler_on_resume(base, config, _argv(argv), first.save_load.ckpt_dir)
    kept = None if base is None else schedule_kept_warning(base, config)
    if kept is not None and warnings is not None:
        warnings.append(kept)
    return config


# Megatron-LM's OptimizerParamScheduler.load_state_dict: the schedule's values a resume compares with the saved
# run's, and the flags that say which win when they differ (a Megatron-LM command line stops otherwise).
SCHEDULE = (("optimizer", "lr", "max_lr"), ("optimizer", "lr", "min_lr"), ("optimizer", "lr", "warmup_steps"),
            ("optimizer", "lr", "warmup_rate"), ("optimizer", "lr", "decay_steps"), ("optimizer", "lr", "decay_style"),
            ("optimizer", "start_weight_decay"), ("optimizer", "end_weight_decay"),
            ("optimizer", "weight_decay_incr_style"))
OVERRIDE_SCHEDULE = ("--override-opt_param-scheduler", "--override-opt-param-scheduler")
KEEP_SCHEDULE = ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler")


def scheduler_on_resume(base: Config, config: Config, argv: list[str], ckpt_dir: str) -> None:
    """Megatron-LM's rule for a resumed Megatron-LM command line (``--train-iters`` / ``--train-samples``) that
    gives a schedule value other than the saved run's (``SCHEDULE``): ``--override-opt_param-scheduler``, the values
    given now; ``--use-checkpoint-opt_param-scheduler``, the saved ones (set in ``config``); neither, a ConfigError
    naming both values and the two flags, as Megatron-LM stops. Another command line's flags always win (a resume
    continues the saved schedule unless a flag given now changes it)."""
    if not megatron_flags.is_megatron_command_line(argv) or any(flag in argv for flag in OVERRIDE_SCHEDULE):
        return
    keep = any(flag in argv for flag in KEEP_SCHEDULE)
    for path in SCHEDULE:
        now, saved = _get(config, path), _get(base, path)
        if now == saved or saved is None:
            continue
        if keep:
            setattr(_get(config, path[:-1]), path[-1], saved)
            continue
        raise ConfigError(f"resuming {ckpt_dir} with {path[-1]} {now!r}, but the saved run's schedule has {saved!r} "
                          f"(Megatron-LM stops here too); pass --override-opt_param-scheduler to use the values given "
                          f"now, or --use-checkpoint-opt_param-scheduler to keep the saved ones.")


FOREIGN_DATA_ORDER = ("from-megatron",)  # converted_by of checkpoints whose data position is another framework's


def _saved_step(ckpt_dir: str) -> int:
    """The step of the checkpoint ``ckpt_dir`` resolves to (0 for an import: no data consumed yet; 0 for a
    conversion of another framework's run, ``from-megatron``: its data order is not ours, nothing to keep)."""
    import json

    step_dir = find_checkpoint(ckpt_dir)
    with open(os.path.join(step_dir, "metadata.json")) as f:
        metadata = json.load(f)
    step = metadata.get("step", 0)
    layout = metadata.get("layout")
    if isinstance(layout, dict) and layout.get("converted_by") in FOREIGN_DATA_ORDER:
        return 0
    return step if isinstance(step, int) else 0


def _argv(argv: Sequence[str] | None) -> list[str]:
    import sys

    return list(sys.argv[1:] if argv is None else argv)
