"""``pretrain()``: the whole run on every rank of a launch, and what it logs at start.

``pretrain_gpt.py`` supplies what is GPT-specific (the model provider, the datasets provider and
``forward_step``), as in Megatron-LM; ``megatron/training/`` holds the loop.
"""

from __future__ import annotations

import os

from megatron import cpu_threads
from megatron import device as dev
from megatron.checkpoint.ownership import release as release_output_dir
from megatron.config import Config, save_yaml, to_yaml
from megatron.distributed.parallelize import plan_sharding
from megatron.initialize import initialize_distributed, launch_env, local_ranks
from megatron.memory.model_states import parameters_per_rank
from megatron.metrics import get_logger
from megatron.model import num_parameters
from megatron.pipeline_parallel.schedules import ForwardStep
from megatron.tensor_parallel import tensor_parallel_seed
from megatron.training import DatasetsProvider, ModelProvider, Trainer, TrainState, set_seed


def _parameters_shown(config: Config, on_rank: int, ps) -> str:
    """Rank 0's parameter count; split by tp, pp or ep (rank 0 then holds a share), with the whole model's (as
    exported: unpadded by tp, every expert)."""
    if ps.tp_size * ps.pp_size * ps.ep_size * ps.etp_size == 1:
        return f"{on_rank / 1e6:.2f}M parameters"
    whole = parameters_per_rank(config, ep=1, etp=1)
    where = "tp rank 0, pipeline stage 0" + (", ep rank 0" if ps.ep_size > 1 else "")
    return f"{on_rank / 1e6:.2f}M parameters on rank 0 ({where}) of {whole / 1e6:.2f}M in the model"


def _axes(ps, config: Config, zero_stage: int) -> str:
    """Every axis of the layout, for the start-up line: dp, tp, pp, sharding (and the ZeRO stage when the optimizer
    is sharded), the experts' ep and etp in a MoE model, cp."""
    parts = [f"dp {ps.dp_size}", f"tp {ps.tp_size}", f"pp {ps.pp_size}", f"sharding {ps.sharding_size}"]
    if ps.sharding_size > 1 or ps.shard_over_cp:
        parts.append(f"ZeRO stage {zero_stage}")
    if config.model.num_experts:
        parts += [f"ep {ps.ep_size}", f"etp {ps.etp_size}"]
    return ", ".join(parts) + _context_parallel(ps, config)


def _log_segmentation(config: Config, ps, log) -> None:
    """The seed's "start segment network.. / segment result:0, 3, 7 / stage=..." lines."""
    from megatron.config.layer_split import segment
    from megatron.pipeline_parallel.partition import item_descriptions, segmentation_log

    bounds = segment(config.model.num_layers, ps.pp_size, config.distributed.pipeline_partition)
    owners = [ps.ranks["pp"][stage] for stage in range(ps.pp_size)]  # rank 0's pipeline: tp = dp = 0
    for line in segmentation_log(bounds, item_descriptions(config.model, config.padded_vocab_size), owners):
        log.info(line)


def _fp8(config: Config) -> str:
    mp = config.mix_precision
    return "" if mp.fp8_format is None else f" (linear layers in FP8: {mp.fp8_format}, {mp.fp8_recipe})"


def _threads(choice: cpu_threads.ThreadChoice | None) -> str:
    return f", {choice.describe()}" if choice else ""


def _context_parallel(ps, config: Config) -> str:
    """The start-up line's cp part: the size, the communication type, whether the optimizer's shards span it."""
    if ps.cp_size == 1:
        return ""
    shards = f": ZeRO shards over sharding x cp = {ps.shard_group_size}" if ps.shard_over_cp else ""
    levels = f" {ps.cp_inner_size} x {ps.cp_size // ps.cp_inner_size}" if ps.cp_inner_size else ""
    return f", cp {ps.cp_size} ({config.distributed.cp_comm_type}{levels}){shards}"


def _packing(config: Config) -> str:
    d = config.dataset
    parts = (["attention within each document (reset_attention_mask)"] if d.reset_attention_mask else [])
    parts += ["positions restart at each document (reset_position_ids)"] if d.reset_position_ids else []
    parts += ["the end-of-document token's loss masked (eod_mask_loss)"] if d.eod_mask_loss else []
    return ", ".join(parts)


def pretrain(config: Config, model_provider: ModelProvider, datasets_provider: DatasetsProvider,
             forward_step: ForwardStep, warnings: tuple[str, ...] = ()) -> TrainState:
    """Build everything from ``config`` and train, on every rank of a torchrun launch."""
    _, rank, local_rank = launch_env()
    ps = initialize_distributed(config)
    log = get_logger()
    if ps.rank == 0:
        for warning in warnings:
            log.warning(warning)
        log.info("resolved configuration:\n" + to_yaml(config))
    set_seed(config.seed)
    device = dev.get_device(config.device, local_rank)
    threads = cpu_threads.apply(config.cpu_threads, local_ranks()) if device.type == "cpu" else None
    dev.set_matmul_reduction(device, not config.mix_precision.disable_bf16_reduced_precision_matmul)
    tensor_parallel_seed(config.seed, ps.tp_rank, device, ps.cp_rank)
    plan = plan_sharding(config, ps)  # decided once: the model is built for it (stage 3: on the meta device)
    model = model_provider(config, device, meta_init=plan.meta_init)
    if ps.rank == 0:
        described, precision_warning = dev.describe_precision(device, config.params_dtype_name)
        shown = _parameters_shown(config, num_parameters(model), ps)
        log.info(f"model: {shown}, dtype {config.params_dtype_name}{_fp8(config)}, "
                 f"device {described}{_threads(threads)}, world size {ps.world_size} ({_axes(ps, config, plan.stage)})")
        if config.dataset.reset_attention_mask or config.dataset.reset_position_ids:
            log.info(f"packed documents: {_packing(config)}")
        if precision_warning:
            log.warning(precision_warning)
    if ps.rank == 0 and ps.pp_size > 1 and config.distributed.virtual_pp_degree == 1:
        _log_segmentation(config, ps, log)
    try:
        trainer = Trainer(config, model, forward_step, datasets_provider(config), device, plan)
        if ps.rank == 0:  # once the checkpoint (if any) has loaded: a failed start overwrites nothing
            save_yaml(config, os.path.join(config.save_load.output_dir, "config.yaml"))
        return trainer.run()
    finally:
        release_output_dir(config.save_load.output_dir)  # the folder's lock (rank 0's), however the run ended
