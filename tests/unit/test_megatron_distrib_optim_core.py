"""Megatron Core 0.16.1's ``DistributedOptimizer`` (``--use-distributed-optimizer``) on the CPU against
``from-megatron`` / ``to-megatron`` (``megatron_core_reference``, skipped when absent; its layout and the schedule
without it: test_megatron_distrib_optim.py):

- over its ``DistributedDataParallel`` (one gloo process, several buckets, or one), trained 2 steps under its
  scheduler and saved by its own code (legacy ``distrib_optim.pt`` by ``save_parameter_state``, torch_dist
  ``dp_reshardable`` and ``fully_reshardable`` by ``dist_checkpointing.save``), it converts with its masters and
  Adam moments exactly (fp32 and bf16), and a run resumed here takes its next step (weights within 1e-6 of the
  largest) at its next learning rate, dense and MoE; its misplaced ``fully_reshardable`` save of several buckets is
  refused;
- the reverse: ``to-megatron --use-distributed-optimizer`` loads into it (legacy ``load_parameter_state``; torch_dist
  through ``dist_checkpointing.load``) with our moments, and its next step is the one it would have taken;
- at dp 2 (two gloo ranks) its saves convert to the same states, and our export loads with each rank's shard ours.

What is patched in Megatron Core is where it assumes CUDA (the parameters' ``type()``, its optimizer's CUDA scalars)
and where its fallback to torch's AdamW (no Transformer Engine or Apex here) meets its loaders (the per-parameter
``step``); its arithmetic and file formats are its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import types

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint
from megatron.checkpoint.megatron_lm.distrib_optim import KINDS
from megatron.checkpoint.megatron_lm.legacy import FILE, TRACKER, safe_load
from tests.functional.launch import run_here
from tests.unit.megatron_core_reference import (
    CORE_WARNINGS,
    LLAMA,
    MOE,
    SEQ,
    build_pair,
    megatron_core,
    tokens_and_labels,
)
from tests.unit.test_megatron_checkpoints import convert, megatron_args
from tests.unit.test_megatron_optimizer_states import mock_batch, ours_of

pytestmark = CORE_WARNINGS

LR, MIN_LR, WD, GBS = 1e-3, 1e-4, 0.1, 4
BUCKET = 1000  # --ddp-bucket-size with --overlap-grad-reduce: several buckets per buffer
SCHEDULE = dict(lr=LR, min_lr=MIN_LR, lr_decay_style="cosine", train_iters=16, lr_decay_iters=None, lr_warmup_iters=1,
                lr_warmup_fraction=None, lr_warmup_init=0.0, global_batch_size=GBS, micro_batch_size=GBS,
                weight_decay=WD, start_weight_decay=WD, end_weight_decay=WD, weight_decay_incr_style="constant",
                clip_grad=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
MOE_ARGS = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=[1, 0], moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=0.1, moe_token_dispatcher_type="allgather")
SHAPES = {"dense": [], "moe": MOE}


def _cuda_type(original):
    """``Tensor.type()`` as on a GPU: the distributed optimizer sorts its parameters by 'torch.cuda.FloatTensor' and
    the like (a CUDA assumption, as the others megatron_core() patches; any other use unchanged)."""
    def cuda_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)
    return cuda_type


@contextlib.contextmanager
def distributed_optimizer(theirs, overlap: bool, bf16: bool = False):
    """Megatron Core's DistributedDataParallel (distributed optimizer on, fp32 grads, ``BUCKET`` buckets with
    ``overlap``, one bucket without) around ``theirs`` and its optimizer as get_megatron_optimizer builds it, on the
    CPU (inside megatron_core()): (the DDP model, the ChainedOptimizer of one, its DistributedOptimizer)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer import optimizer as core_optimizer_module
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    real, set_states = torch.tensor, DistributedOptimizer._set_main_param_and_optimizer_states
    cpu_torch = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")})
    cpu_torch.tensor = lambda *args, device=None, **kwargs: real(*args, **kwargs)

    @torch.no_grad()  # an fp32 run's main params are views of its weights (its loaders copy into them)
    def set_states_keeping_step(self, model_param, tensors):
        """torch's AdamW (its fallback here) keeps a per-parameter step that its GPU optimizers (Transformer Engine's
        / Apex's FusedAdam) keep per group; its loaders do not fill it, and its load_state_dict gives every parameter
        one shared tensor (which torch's AdamW would advance once per parameter): each its own copy."""
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state:
            state["step"] = state["step"].clone()
        return set_states(self, model_param, {**({"step": state["step"]} if "step" in state else {}), **tensors})

    with pytest.MonkeyPatch.context() as patches:
        patches.setattr(DistributedOptimizer, "_set_main_param_and_optimizer_states", set_states_keeping_step)
        patches.setattr(torch.Tensor, "type", _cuda_type(torch.Tensor.type))
        patches.setattr(core_optimizer_module, "torch", cpu_torch)  # its constructor's CUDA scalars
        patches.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)  # dist_checkpointing's
        patches.setattr(filesystem_async, "_process_memory", lambda: 0)
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap,
                                            bucket_size=BUCKET if overlap else None, grad_reduce_in_fp32=True)
        model = DistributedDataParallel(theirs.config, ddp, theirs)
        chain = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD,
                                                       clip_grad=0.0, use_distributed_optimizer=True, bf16=bf16),
                                       [model])
        (inner,) = chain.chained_optimizers
        yield model, chain, inner


def core_train_step(model, inner, tokens, labels, mcore=None) -> None:
    """One step of Megatron Core's model and distributed optimizer (the loss the mean over the tokens; a MoE's aux
    loss at gradient scale 1) at the groups' learning rate and weight decay."""
    if mcore is not None:
        mcore["scaler"].set_loss_scale(torch.tensor(1.0))
    model.zero_grad_buffer()
    inner.zero_grad()
    batch, seq = tokens.shape
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    model(tokens, torch.arange(seq).expand(batch, seq), causal, labels=labels).mean().backward()
    model.finish_grad_sync()
    assert inner.step()[0]


def core_states(theirs, inner, ours: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """{kind (param, exp_avg, exp_avg_sq): {our name (Megatron Core's without ``ours``): tensor}} of the distributed
    optimizer (dp 1: whole)."""
    params = dict(theirs.named_parameters())
    states = {kind: {n: inner._get_main_param_and_optimizer_states(p)[kind].detach().clone().view(p.shape)
                     for n, p in params.items()} for kind in KINDS}
    return {kind: ours_of(by_name) for kind, by_name in states.items()} if ours else states


def _args(config, shape: str, overlap: bool, **changes):
    args = megatron_args(config)
    args.__dict__.update(SCHEDULE, iteration=2, consumed_train_samples=2 * GBS, use_distributed_optimizer=True,
                         overlap_grad_reduce=overlap, ddp_bucket_size=BUCKET if overlap else None,
                         data_parallel_size=1, hidden_dropout=0.0, attention_dropout=0.0,  # as its model here
                         **(MOE_ARGS if shape == "moe" else {}))
    args.__dict__.update(changes)
    return args


def _save(folder, kind: str, theirs, chain, scheduler, args) -> None:
    """``folder/kind`` as Megatron-LM saves it (legacy: the rank file and save_parameter_state's distrib_optim.pt;
    else torch_dist with that sharding type, Megatron-LM's content metadata)."""
    from megatron.core import dist_checkpointing

    entries = {"args": args, "checkpoint_version": 3.0, "iteration": 2, "opt_param_scheduler": scheduler.state_dict()}
    iteration = folder / kind / "iter_0000002"
    if kind == "legacy":
        (iteration / "mp_rank_00").mkdir(parents=True)
        torch.save({**entries, "model": theirs.state_dict(), "optimizer": chain.state_dict()},
                   iteration / "mp_rank_00" / FILE)
        chain.save_parameter_state(str(iteration / "mp_rank_00" / "distrib_optim.pt"))
    else:
        meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "distrib_optim_sharding_type": kind,
                "distrib_optim_fully_reshardable_mem_efficient": True}  # gathered over gloo
        iteration.mkdir(parents=True, exist_ok=True)  # every rank saves its shards
        model = theirs.sharded_state_dict(metadata=meta)
        optimizer = chain.sharded_state_dict(model, metadata=meta)
        dist_checkpointing.save({**entries, "model": model, "optimizer": optimizer}, str(iteration),
                                content_metadata=meta)
    (folder / kind / TRACKER).write_text("2")


def _megatron_run(folder, shape: str, overlap: bool, kinds: tuple[str, ...], bf16: bool = False) -> dict:
    """Megatron Core's model (``shape``) and distributed optimizer trained 2 steps of its scheduler (warm-up 1
    iteration, cosine), saved in each of ``kinds``, then its next step on the mock batch our run trains step 3 on:
    {"states": its saved states, "lr": its next learning rate, "next": its weights after that step (ours)}."""
    with megatron_core() as mcore:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        config, _, theirs = build_pair(mcore, *LLAMA, *SHAPES[shape])
        if bf16:  # a bf16 run: bf16 weights, the optimizer's fp32 masters (Megatron-LM's Float16Module's cast)
            theirs.bfloat16()
            theirs.config.bf16, theirs.config.params_dtype = True, torch.bfloat16
        with distributed_optimizer(theirs, overlap, bf16) as (model, chain, inner):
            scheduler = OptimizerParamScheduler(chain, 0.0, LR, MIN_LR, GBS, 16 * GBS, "cosine", WD, WD, 16 * GBS,
                                                "constant")
            for _ in range(2):
                core_train_step(model, inner, *tokens_and_labels(), mcore)
                scheduler.step(increment=GBS)
            states, core = core_states(theirs, inner), core_states(theirs, inner, ours=False)
            args = _args(config, shape, overlap, **({"bf16": True, "params_dtype": torch.bfloat16,
                                                     "accumulate_allreduce_grads_in_fp32": True} if bf16 else {}))
            for kind in kinds:
                _save(folder, kind, theirs, chain, scheduler, args)
            if bf16:
                return {"config": config, "states": states, "core_states": core}
            lr = inner.param_groups[0]["lr"]
            core_train_step(model, inner, *mock_batch(config, 2 * GBS), mcore)
            return {"config": config, "states": states, "core_states": core, "lr": lr,
                    "next": ours_of(dict(theirs.named_parameters()))}


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    """Megatron Core's runs, saved as Megatron-LM saves them: dense and MoE with several buckets (legacy,
    dp_reshardable), dense with one bucket (fully_reshardable, whose save is right only then), and dense with several
    buckets saved fully_reshardable (misplaced by Megatron Core itself)."""
    root = tmp_path_factory.mktemp("megatron_distrib_optim")
    runs = {}
    for name, shape, overlap, kinds in (("dense", "dense", True, ("legacy", "dp_reshardable")),
                                        ("moe", "moe", True, ("legacy", "dp_reshardable")),
                                        ("one_bucket", "dense", False, ("fully_reshardable", "legacy")),
                                        ("misplaced", "dense", True, ("fully_reshardable",)),
                                        ("bf16", "moe", True, ("legacy", "dp_reshardable"))):
        runs[name] = {**_megatron_run(root / name, shape, overlap, kinds, bf16=name == "bf16"), "folder": root / name}
    return runs


def resume(converted, out, *flags: str):
    """Our run resuming ``converted`` for one step (step 3), with no schedule flags: Megatron's, carried."""
    result = run_here("--mock-data", "--device", "cpu", "--load", str(converted), "--save", str(out),
                      "--micro-batch-size", str(GBS), "--max-steps", "3", "--save-interval", "1", "--num-workers", "0",
                      "--eval-freq", "100", "--logging-freq", "1", "--max-seq-len", str(SEQ), "--no-eod-mask-loss",
                      *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = [json.loads(t) for t in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in t]
    return open_checkpoint(str(out / "step_3"))[0], line["learning_rate"]


def assert_next_step(reader, want: dict, tolerance: float = 1e-6) -> float:
    """Every weight within ``tolerance`` of the largest |value| of Megatron's; the largest difference seen."""
    worst = 0.0
    for name, t in want.items():
        err, scale = float((reader.full("param", name) - t).abs().max()), float(t.abs().max())
        assert err <= tolerance * scale, f"{name}: max |difference| {err:.3g} > {tolerance:g} x {scale:.3g}"
        worst = max(worst, err / scale)
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("run, kind", [("dense", "legacy"), ("dense", "dp_reshardable"), ("moe", "legacy"),
                                       ("moe", "dp_reshardable"), ("one_bucket", "fully_reshardable"),
                                       ("one_bucket", "legacy"), ("bf16", "legacy"), ("bf16", "dp_reshardable")])
def test_megatron_cores_distributed_optimizer_states_convert_exactly(tmp_path, one_process, megatron_runs, run, kind,
                                                                     capsys):
    """Its fp32 masters and Adam's moments, flattened in its buckets (several, or one), come out as it holds them
    (max |difference| 0), its step and scheduler position with them; a bf16 run's buffer (bf16 weights, fp32 grads)
    too, its fp32 masters becoming our weights."""
    r = megatron_runs[run]
    if run == "bf16" and kind == "legacy":
        saved = torch.load(r["folder"] / kind / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt", weights_only=True)
        assert list(saved[0]) == [(torch.bfloat16, torch.float32)]
    assert convert.main(["from-megatron", str(r["folder"] / kind), str(tmp_path / "ours")]) == 0
    out = capsys.readouterr().out
    assert "Adam's moments at step 2, the fp32 master weights" in out and "Megatron's next" in out, out
    reader, common, _ = open_checkpoint(str(tmp_path / "ours"))
    assert common["adam_step"] == 2.0 and common["step"] == 2
    assert common["train_state"]["consumed_samples"] == common["train_state"]["schedule_samples"] == 2 * GBS
    for ours_kind, want in r["states"].items():
        for name, t in want.items():
            assert torch.equal(reader.full(ours_kind, name), t), (ours_kind, name)


@pytest.mark.slow
@pytest.mark.parametrize("run, kind", [("dense", "dp_reshardable"), ("moe", "legacy"),
                                       ("one_bucket", "fully_reshardable")])
def test_a_run_resumed_here_takes_megatrons_next_step(tmp_path, one_process, megatron_runs, run, kind):
    """pretrain_gpt.py --load of the conversion, no schedule flags: its first step runs at Megatron's next learning
    rate (exactly) and gives Megatron's next weights (within 1e-6 of the largest)."""
    r = megatron_runs[run]
    assert convert.main(["from-megatron", str(r["folder"] / kind), str(tmp_path / "ours")]) == 0
    reader, lr = resume(tmp_path / "ours", tmp_path / "run")
    assert lr == r["lr"] and 0 < lr < LR
    print(f"{run} {kind}: learning rate {lr!r}, weights within {assert_next_step(reader, r['next']):.2g} of the "
          f"largest")


@pytest.mark.slow
def test_a_misplaced_fully_reshardable_save_is_refused_in_one_line(tmp_path, one_process, megatron_runs, capsys):
    """Megatron Core 0.16.1's own fully_reshardable save of a buffer with several buckets places the states at the
    wrong offsets (its warning says so): the converter sees the masters are not the weights and refuses, naming the
    way out; --no-optim converts the weights."""
    folder = megatron_runs["misplaced"]["folder"] / "fully_reshardable"
    assert convert.main(["from-megatron", str(folder), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "dp_reshardable" in err and "--no-optim" in err, err
    assert not (tmp_path / "ours").exists()
    assert convert.main(["from-megatron", str(folder), str(tmp_path / "ours"), "--no-optim"]) == 0


def load_into_megatron(meg, fmt: str, theirs, chain) -> dict:
    """Megatron-LM's load of our export ``meg`` (iteration 2) into Megatron Core's model and distributed optimizer:
    legacy, the rank file's model and groups, then ``load_parameter_state`` of distrib_optim.pt; torch_dist,
    ``dist_checkpointing.load`` of the request built from the checkpoint's content metadata. The scheduler's saved
    state (it sets the groups' learning rate and weight decay, as Megatron-LM's load does)."""
    from megatron.core import dist_checkpointing

    folder = meg / "iter_0000002"
    if fmt == "legacy":
        saved = safe_load(str(folder / "mp_rank_00" / FILE))
        theirs.load_state_dict(saved["model"], strict=True)
        chain.load_state_dict(saved["optimizer"])
        chain.load_parameter_state(str(folder / "mp_rank_00" / "distrib_optim.pt"))
        return saved["opt_param_scheduler"]
    common = safe_load(str(folder / "common.pt"))
    meta = common["content_metadata"]
    # torch's AdamW has no step before its first (its sharded_state_dict asks one); on a GPU, FusedAdam's groups hold it
    chain.chained_optimizers[0]._init_optimizer_states_with_dummy_values()
    model = theirs.sharded_state_dict(metadata=meta)
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = dist_checkpointing.load({"model": model, "optimizer": chain.sharded_state_dict(
            model, is_loading=True, metadata=meta)}, str(folder))
    theirs.load_state_dict(loaded["model"], strict=True)
    chain.load_state_dict(loaded["optimizer"])
    return common["opt_param_scheduler"]


@pytest.mark.slow
@pytest.mark.parametrize("run, fmt, overlap, bf16", [("dense", "legacy", True, False), ("moe", "legacy", False, False),
                                                     ("dense", "torch_dist", True, False),
                                                     ("moe", "torch_dist", False, False), ("moe", "legacy", True, True),
                                                     ("dense", "torch_dist", False, True)])
def test_our_export_loads_into_megatron_cores_distributed_optimizer(tmp_path, one_process, megatron_runs, run, fmt,
                                                                    overlap, bf16):
    """Megatron Core's run -> ours -> to-megatron --use-distributed-optimizer (legacy for its bucket layout, torch_dist
    fully_reshardable for any): its distributed optimizer loads our moments and masters exactly, its scheduler our
    position, and its next step is the one it would have taken (within 1e-6 of the largest weight); for a bf16 run
    (--bf16: its buffer's key), the same masters and moments."""
    r = megatron_runs[run]
    assert convert.main(["from-megatron", str(r["folder"] / "legacy"), str(tmp_path / "ours")]) == 0
    buckets = ["--overlap-grad-reduce", "--ddp-bucket-size", str(BUCKET)] if overlap else []
    assert convert.main(["to-megatron", str(tmp_path / "ours"), str(tmp_path / "meg"), "--format", fmt,
                         "--use-distributed-optimizer", *(buckets if fmt == "legacy" else []),
                         *(["--bf16"] if bf16 else [])]) == 0
    with megatron_core() as mcore:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        config, _, theirs = build_pair(mcore, *LLAMA, *SHAPES[run])
        if bf16:
            theirs.bfloat16()
            theirs.config.bf16, theirs.config.params_dtype = True, torch.bfloat16
        with distributed_optimizer(theirs, overlap, bf16) as (model, chain, inner):
            saved = load_into_megatron(tmp_path / "meg", fmt, theirs, chain)
            scheduler = OptimizerParamScheduler(chain, 0.0, LR, MIN_LR, GBS, 16 * GBS, "cosine", WD, WD, 16 * GBS,
                                                "constant")
            scheduler.load_state_dict(saved)
            assert inner.param_groups[0]["lr"] == pytest.approx(r["lr"], rel=1e-12)
            for kind, want in core_states(theirs, inner).items():
                for name, t in want.items():
                    assert torch.equal(t, r["states"][kind][name]), (kind, name)
            if bf16:
                return
            core_train_step(model, inner, *mock_batch(config, 2 * GBS), mcore)
            after = ours_of(dict(theirs.named_parameters()))
    for name, t in r["next"].items():
        assert float((after[name] - t).abs().max()) <= 1e-6 * float(t.abs().max()), name


def _dp2_rank(rank: int, world_size: int, folder: str, export: str) -> dict:
    """One of two gloo ranks, Megatron Core at data-parallel size 2 (its distributed optimizer: each rank owns half of
    every bucket): trains the dense run's 2 steps (both ranks the same batch: the same gradients as at dp 1), saves
    them as Megatron-LM does (legacy: rank 0's gathered distrib_optim.pt; torch_dist dp_reshardable: each rank its
    shards), then loads ``export`` (our dp 1 export) into a fresh optimizer; its shards against our whole states."""
    import importlib.metadata
    import multiprocessing
    import queue
    from pathlib import Path

    import megatron
    from megatron import parallel_state

    core_folder = str(Path(importlib.metadata.distribution("megatron-core").locate_file("megatron")))
    megatron.__path__.append(core_folder)
    patches = pytest.MonkeyPatch()
    try:
        from megatron.core import parallel_state as core_state
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron.core.models.gpt import GPTModel as CoreGPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.tensor_parallel import random as core_random
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.transformer_config import TransformerConfig

        patches.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
        patches.setattr(core_random.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())
        patches.setattr(moe_utils, "te_general_gemm", None, raising=False)
        # its torch_dist writer forks a process per file and collects their results through a manager: a pool rank
        # is a daemon (which may not start processes), and this process is the only reader of the results
        patches.setattr(filesystem_async, "_results_queue", queue.Queue())
        patches.setitem(multiprocessing.current_process()._config, "daemon", False)
        parallel_state.initialize()
        core_state.initialize_model_parallel(1, 1)
        mcore = {"GPTModel": CoreGPTModel, "block_spec": get_gpt_decoder_block_spec, "config": TransformerConfig,
                 "scaler": moe_utils.MoEAuxLossAutoScaler}
        root = Path(folder)
        config, _, theirs = build_pair(mcore, *LLAMA)
        with distributed_optimizer(theirs, True) as (model, chain, inner):
            scheduler = OptimizerParamScheduler(chain, 0.0, LR, MIN_LR, GBS, 16 * GBS, "cosine", WD, WD, 16 * GBS,
                                                "constant")
            for _ in range(2):
                core_train_step(model, inner, *tokens_and_labels())
                scheduler.step(increment=GBS)
            args = _args(config, "dense", True, data_parallel_size=2)
            if rank == 0:  # Megatron-LM's legacy save: dp rank 0 writes the rank file; all gather the states
                _save(root, "legacy", theirs, chain, scheduler, args)
            else:
                chain.save_parameter_state(str(root / "unused.pt"))
            _save(root, "dp_reshardable", theirs, chain, scheduler, args)
        config, _, theirs = build_pair(mcore, *LLAMA)
        with distributed_optimizer(theirs, True) as (model, chain, inner):
            load_into_megatron(Path(export), "legacy", theirs, chain)
            shards = {}
            for name, p in theirs.named_parameters():
                if p in inner.model_param_group_index_map:  # this rank owns a piece of it
                    piece = inner._get_model_param_range_map(p)["param"]
                    held = inner._get_main_param_and_optimizer_states(p)
                    shards[name] = ((piece.start, piece.end), {k: held[k].detach().clone() for k in KINDS})
        core_state.destroy_model_parallel()
        return shards
    finally:
        patches.undo()
        megatron.__path__.remove(core_folder)


@pytest.mark.slow
def test_at_data_parallel_size_2_its_states_convert_and_ours_load(tmp_path, one_process, megatron_runs):
    """Megatron Core at dp 2 (two gloo ranks, each owning half of every bucket): its legacy save (gathered) and its
    dp_reshardable save (each rank its shards) convert to the dp 1 run's states exactly (the same batches give the
    same gradients); our export, written for dp 1, loads at dp 2: each rank's shard of the masters and moments is
    ours, every element owned once."""
    from tests.distributed.harness import run_distributed

    r = megatron_runs["dense"]
    assert convert.main(["from-megatron", str(r["folder"] / "legacy"), str(tmp_path / "ours")]) == 0
    assert convert.main(["to-megatron", str(tmp_path / "ours"), str(tmp_path / "meg"), "--use-distributed-optimizer",
                         "--overlap-grad-reduce", "--ddp-bucket-size", str(BUCKET)]) == 0
    shards = run_distributed(_dp2_rank, 2, str(tmp_path / "dp2"), str(tmp_path / "meg"), timeout=300)
    whole = r["core_states"]
    owned = dict.fromkeys(whole["param"], 0)
    for held in shards:
        assert 0 < len(held) < len(owned) + 2  # a rank owns pieces, not everything
        for name, ((start, end), tensors) in held.items():
            owned[name] += end - start
            for kind in KINDS:
                assert torch.equal(tensors[kind], whole[kind][name].reshape(-1)[start:end]), (name, kind)
    assert owned == {name: t.numel() for name, t in whole["param"].items()}
    for kind in ("legacy", "dp_reshardable"):
        out = tmp_path / f"from_dp2_{kind}"
        assert convert.main(["from-megatron", str(tmp_path / "dp2" / kind), str(out)]) == 0
        reader, common, _ = open_checkpoint(str(out))
        assert common["adam_step"] == 2.0
        for ours_kind, want in r["states"].items():
            for name, t in want.items():
                assert torch.equal(reader.full(ours_kind, name), t), (kind, ours_kind, name)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["dense", "moe"])
def test_its_fp32_optimizer_continues_here_too(tmp_path, one_process, shape):
    """Without the distributed optimizer (its FP32Optimizer, one per rank file), under its scheduler: the conversion's
    first resumed step runs at its next learning rate and gives its next weights within 1e-6 of the largest, dense and
    MoE (test_megatron_optimizer_states.py checks the states and the reverse)."""
    from tests.unit.megatron_core_reference import core_optimizer

    def step(theirs, optimizer, tokens, labels, mcore) -> None:
        mcore["scaler"].set_loss_scale(torch.tensor(1.0))
        optimizer.zero_grad()
        batch, seq = tokens.shape
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
        theirs(tokens, torch.arange(seq).expand(batch, seq), causal, labels=labels).mean().backward()
        assert optimizer.step()[0]

    with megatron_core() as mcore:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        config, _, theirs = build_pair(mcore, *LLAMA, *SHAPES[shape])
        optimizer = core_optimizer(theirs, LR, WD)
        for group in optimizer.param_groups:
            group["max_lr"], group["min_lr"] = LR, MIN_LR
        scheduler = OptimizerParamScheduler(optimizer, 0.0, LR, MIN_LR, GBS, 16 * GBS, "cosine", WD, WD, 16 * GBS,
                                            "constant")
        for _ in range(2):
            step(theirs, optimizer, *tokens_and_labels(), mcore)
            scheduler.step(increment=GBS)
        folder = tmp_path / "meg" / "iter_0000002" / "mp_rank_00"
        folder.mkdir(parents=True)
        args = _args(config, shape, False, use_distributed_optimizer=False)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 2, "model": theirs.state_dict(),
                    "optimizer": optimizer.state_dict(), "opt_param_scheduler": scheduler.state_dict()},
                   folder / FILE)
        (tmp_path / "meg" / TRACKER).write_text("2")
        lr = optimizer.param_groups[0]["lr"]
        step(theirs, optimizer, *mock_batch(config, 2 * GBS), mcore)
        want = ours_of(dict(theirs.named_parameters()))
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")]) == 0
    reader, resumed_lr = resume(tmp_path / "ours", tmp_path / "run")
    assert resumed_lr == lr and 0 < lr < LR
    print(f"{shape}: learning rate {lr!r}, weights within {assert_next_step(reader, want):.2g} of the largest")
