"""A checkpoint made ready to evaluate, under the launch's layout: its configuration (the saved one, with
the layout given now) and the loaded parallel model. ``tools/evaluate.py`` and the lm-eval model
(``megatron.evaluation.lm_eval_model``) both start here."""

from __future__ import annotations

from megatron import cpu_threads
from megatron import device as dev
from megatron.checkpoint import CheckpointError, find_checkpoint, resumed_config
from megatron.config import ConfigError, validate
from megatron.distributed.parallelize import plan_sharding
from megatron.evaluation.runner import Evaluator
from megatron.initialize import initialize_distributed, launch_env, local_ranks
from megatron.parallelize_gpt import build_model, parallelize_gpt
from megatron.tensor_parallel import tensor_parallel_seed
from megatron.tokenizer import configured_tokenizer


def configure(rest: list[str]):
    """The evaluation's validated configuration (the checkpoint's, with the layout given now by the
    pretrain_gpt.py flags ``rest``) and the tokenizer; ConfigError, CheckpointError or TokenizerError
    with one line."""
    warnings: list[str] = []
    config = resumed_config(rest, warnings, training=False)
    if not config.save_load.ckpt_dir:
        raise ConfigError("--load CKPT is required: the checkpoint to evaluate.")
    if find_checkpoint(config.save_load.ckpt_dir) is None:
        raise CheckpointError(f"no checkpoint at {config.save_load.ckpt_dir}: expected a step folder with "
                              f"metadata.json or a run folder with a 'latest' file.")
    config.dataset.input_dir, config.dataset.mock_data = None, False  # the data is the task's file
    tokenizer = configured_tokenizer(config.tokenizer, config.model.vocab_size)
    if tokenizer is None:
        raise ConfigError(f"{config.save_load.ckpt_dir} was trained without a tokenizer (synthetic data): give "
                          f"--tokenizer-type and its files.")
    if config.distributed.context_parallel_size != 1:
        raise ConfigError("tools/evaluate.py scores whole samples on each rank: drop --context-parallel-size (a "
                          "checkpoint trained with context parallelism loads at any layout; use --tp / --pp to "
                          "spread a large model).")
    b = config.batch_size
    b.micro_batch_size = b.micro_batch_size or 4
    b.global_batch_size, b.local_batch_size = None, b.micro_batch_size * config.distributed.pp_degree
    world, _, _ = launch_env()
    validate(config, world_size=world, cuda_available=dev.cuda_available(), tokenizer_vocab_size=tokenizer.vocab_size,
             training_data=False)
    return config, tokenizer


def load_evaluator(config, progress: bool = True) -> Evaluator:
    """Join the launch's ranks in the configured layout, build and parallelise the model, and load the
    checkpoint into it (collective)."""
    ps = initialize_distributed(config)
    device = dev.get_device(config.device, launch_env()[2])
    if device.type == "cpu":
        cpu_threads.apply(config.cpu_threads, local_ranks())
    tensor_parallel_seed(config.seed, ps.tp_rank, device)
    plan = plan_sharding(config, ps)
    run = parallelize_gpt(config, device, plan, build_model(config, device, meta_init=plan.meta_init))
    return Evaluator(config, run, device, progress)
