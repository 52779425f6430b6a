"""Megatron-LM's distributed optimizer, learning-rate schedule and progress through ``from-megatron`` /
``to-megatron``, and ``tools/checkpoint_info.py`` on Megatron folders.

Against NVIDIA's Megatron Core 0.16.1 on the CPU (``megatron_core_reference``, skipped when absent):

- the bucket layout (``megatron_distrib_optim.buffer_layout``) is its ``_ParamAndGradBuffer``'s, for several bucket
  sizes, dp sizes and a shared embedding;
- its ``DistributedOptimizer`` (over its ``DistributedDataParallel``, one gloo process, several buckets), trained and
  saved by its own code (legacy ``distrib_optim.pt`` by ``save_parameter_state``, torch_dist ``dp_reshardable`` and
  ``fully_reshardable`` by ``dist_checkpointing.save``), converts with its Adam moments exactly, and a run resumed
  here takes its next step (weights within 1e-6 of the largest) at its next learning rate, dense and MoE;
- the reverse: ``to-megatron --use-distributed-optimizer`` loads into its ``DistributedOptimizer`` (legacy
  ``load_parameter_state``; torch_dist through ``dist_checkpointing.load``) with our moments, and its next step is
  ours;
- the learning rate of the first step resumed from a checkpoint without scheduler state (it was 0.0);
- ``checkpoint_info.py`` on a legacy and a torch_dist Megatron folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import types

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint
from megatron.checkpoint.megatron_distrib_optim import buffer_layout
from megatron.checkpoint.megatron_legacy import FILE, TRACKER, safe_load
from megatron.checkpoint.megatron_schedule import from_args, megatron_schedule, schedule_flags
from megatron.config import parse_config, validate
from megatron.optimizer.lr_schedule import build_param_schedule
from tests.functional.launch import program_module, run_here
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


def _core_scheduler(args, gbs):
    """Megatron Core's OptimizerParamScheduler as Megatron-LM's get_optimizer_param_scheduler builds it from
    ``args`` (megatron/training/training.py), over a stand-in optimizer with one group."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    a = vars(args)
    if a.get("train_iters"):
        decay, wd_steps = (a.get("lr_decay_iters") or a["train_iters"]) * gbs, a["train_iters"] * gbs
        warmup = a["lr_warmup_fraction"] * decay if a.get("lr_warmup_fraction") is not None else \
            a["lr_warmup_iters"] * gbs
        wsd = a["lr_wsd_decay_iters"] * gbs if a.get("lr_wsd_decay_iters") is not None else None
    else:
        decay, wd_steps = a.get("lr_decay_samples") or a["train_samples"], a["train_samples"]
        warmup = a["lr_warmup_fraction"] * decay if a.get("lr_warmup_fraction") is not None else \
            a["lr_warmup_samples"]
        wsd = a.get("lr_wsd_decay_samples")
    optimizer = types.SimpleNamespace(param_groups=[{"wd_mult": 1.0}])
    return OptimizerParamScheduler(optimizer, a["lr_warmup_init"], a["lr"], a["min_lr"], warmup, decay,
                                   a["lr_decay_style"], a["start_weight_decay"], a["end_weight_decay"], wd_steps,
                                   a["weight_decay_incr_style"], wsd_decay_steps=wsd,
                                   lr_wsd_decay_style=a.get("lr_wsd_decay_style"))


_SCHEDULES = {
    "iters, cosine, warm-up fraction": dict(train_iters=50, lr_decay_iters=40, lr_warmup_fraction=0.13,
                                            lr_warmup_iters=0, lr_decay_style="cosine", global_batch_size=6),
    "iters, linear, warm-up iters, wd ramp": dict(train_iters=30, lr_decay_iters=None, lr_warmup_fraction=None,
                                                  lr_warmup_iters=4, lr_decay_style="linear", global_batch_size=4,
                                                  weight_decay_incr_style="cosine", start_weight_decay=0.01,
                                                  end_weight_decay=0.1),
    "samples, WSD": dict(train_iters=None, train_samples=400, lr_decay_samples=300, lr_warmup_samples=30,
                         lr_warmup_fraction=None, lr_decay_style="WSD", lr_wsd_decay_samples=100,
                         lr_wsd_decay_style="cosine", global_batch_size=8),
}


@pytest.mark.parametrize("name", list(_SCHEDULES))
def test_the_schedule_rebuilt_from_megatrons_args_is_its_schedulers(name):
    """Without scheduler state, from-megatron rebuilds the schedule from the args (get_optimizer_param_scheduler's
    rules); the flags it gives the converted run build the same schedule here: at every position of interest the
    learning rate and weight decay are Megatron Core's OptimizerParamScheduler's, exactly."""
    values = dict(lr=3e-3, min_lr=3e-5, lr_warmup_init=1e-4, weight_decay=0.1, start_weight_decay=0.1,
                  end_weight_decay=0.1, weight_decay_incr_style="constant", adam_beta1=0.9, adam_beta2=0.95,
                  adam_eps=1e-8, clip_grad=1.0)
    values.update(_SCHEDULES[name])
    args = argparse.Namespace(**values)
    gbs = args.global_batch_size
    with megatron_core():
        theirs = _core_scheduler(args, gbs)
        state = from_args(args, gbs)
        assert {k: state[k] for k in theirs.state_dict() if k != "num_steps"} == \
               {k: v for k, v in theirs.state_dict().items() if k != "num_steps"}
        flags = schedule_flags({**state, "init_lr": args.lr_warmup_init}, args, gbs)
        config = parse_config(["--mock-data", "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
                               "--vocab-size", "64", "--max-seq-len", "8", *flags])
        validate(config)
        ours = build_param_schedule(config)
        for n in sorted({0, 1, gbs, 3 * gbs, int(state["lr_warmup_steps"]), int(state["lr_warmup_steps"]) + 1,
                         int(state["lr_decay_steps"]) // 2, int(state["lr_decay_steps"]) - 1,
                         int(state["lr_decay_steps"]), int(state["wd_incr_steps"]) + gbs}):
            theirs.num_steps = n
            assert ours.lr(n) == theirs.get_lr({}), (n, ours.lr(n), theirs.get_lr({}))
            assert ours.weight_decay(n) == theirs.get_wd(), n


def test_a_saved_scheduler_state_is_carried_and_its_position_used():
    args = argparse.Namespace(lr=1e-3, min_lr=0.0, train_iters=8, global_batch_size=4, consumed_train_samples=24)
    head = {"opt_param_scheduler": {"max_lr": 2e-3, "lr_warmup_steps": 8, "num_steps": 20, "lr_decay_style": "linear",
                                    "lr_decay_steps": 32, "min_lr": 1e-4, "start_wd": 0.0, "end_wd": 0.0,
                                    "wd_incr_style": "constant", "wd_incr_steps": 32}}
    consumed, schedule, notes = megatron_schedule(args, head, 6)
    assert consumed == 24 and schedule.position == 20 and notes == []
    assert schedule.lr() == pytest.approx(1e-4 + (2e-3 - 1e-4) * (1 - 12 / 24))
    assert "--train-iters" in schedule.flags and schedule.flags[schedule.flags.index("--lr") + 1] == "0.002"


def test_a_checkpoint_without_consumed_samples_counts_the_iterations():
    args = argparse.Namespace(global_batch_size=4)
    consumed, schedule, notes = megatron_schedule(args, {}, 6)
    assert consumed == 24 and schedule is None
    assert any("no consumed_train_samples" in n for n in notes)
    assert any("no learning-rate scheduler" in n for n in notes)


def test_the_bucket_layout_is_megatron_cores():
    """buffer_layout against Megatron Core's own _ParamAndGradBuffer (distributed optimizer on): each parameter's
    place in the buckets' unpadded parts laid end to end and each bucket's numel_unpadded, with bucket sizes from one
    parameter to all, dp sizes 1, 3 and 8 (the end padding) and a shared embedding in a bucket of its own."""
    with megatron_core():
        import torch.distributed as dist
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
        from megatron.core.process_groups_config import ProcessGroupCollection

        class Group:  # a data-parallel group of dp ranks, seen from rank 0: the buffer asks only its size and rank
            def __init__(self, size):
                self.n = size

            def size(self):
                return self.n

            def rank(self):
                return 0

        groups = ProcessGroupCollection()
        groups.tp = groups.dp_cp = dist.group.WORLD
        for dp in (1, 3, 8):
            for size in (None, 100, 700, 5000):
                g = torch.Generator().manual_seed(dp * 7 + (size or 0))
                params = [torch.nn.Parameter(torch.zeros(int(torch.randint(1, 300, (1,), generator=g))))
                          for _ in range(9)]
                shared = 0 if size != 700 else 4  # the first stage's embedding (registered first), or any
                params[shared].shared_embedding = True
                names = {p: f"p{i}" for i, p in enumerate(params)}
                config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                       bucket_size=size)
                buffer = _ParamAndGradBuffer(config, torch.float32, torch.float32, params, Group(dp), size, names,
                                             1.0 / dp, list(range(len(params))), False, groups)
                ours = buffer_layout([(names[p], p.numel()) for p in params], size, frozenset({f"p{shared}"}), dp)
                assert ours.buckets == [b.numel_unpadded for b in buffer.buckets], (dp, size)
                assert len(ours.buckets) > (1 if size in (100, 700) else 0)
                before = [sum(b.numel_unpadded for b in buffer.buckets[:i]) for i in range(len(buffer.buckets))]
                for p, (start, end, b) in buffer.param_index_map.items():
                    bucket = buffer.buckets[b]
                    assert ours.slots[names[p]] == (before[b] + start - bucket.offset, end - start), (dp, size)


# ---- Megatron Core's DistributedOptimizer, trained and saved by its own code ----

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
def distributed_optimizer(theirs, overlap: bool):
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
                                                       clip_grad=0.0, use_distributed_optimizer=True), [model])
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


def core_states(theirs, inner) -> dict[str, dict[str, torch.Tensor]]:
    """{kind (ours: param, exp_avg, exp_avg_sq): {our name: tensor}} of the distributed optimizer (dp 1: whole)."""
    params = dict(theirs.named_parameters())
    return {kind: ours_of({n: inner._get_main_param_and_optimizer_states(p)[kind].detach().view(p.shape)
                           for n, p in params.items()}) for kind in ("param", "exp_avg", "exp_avg_sq")}


def _args(config, shape: str, overlap: bool, **changes):
    args = megatron_args(config)
    args.__dict__.update(SCHEDULE, iteration=2, consumed_train_samples=2 * GBS, use_distributed_optimizer=True,
                         overlap_grad_reduce=overlap, ddp_bucket_size=BUCKET if overlap else None,
                         data_parallel_size=1, hidden_dropout=0.0, attention_dropout=0.0,  # as its model here
                         **(MOE_ARGS if shape == "moe" else {}), **changes)
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
        iteration.mkdir(parents=True)
        model = theirs.sharded_state_dict(metadata=meta)
        optimizer = chain.sharded_state_dict(model, metadata=meta)
        dist_checkpointing.save({**entries, "model": model, "optimizer": optimizer}, str(iteration),
                                content_metadata=meta)
    (folder / kind / TRACKER).write_text("2")


def _megatron_run(folder, shape: str, overlap: bool, kinds: tuple[str, ...]) -> dict:
    """Megatron Core's model (``shape``) and distributed optimizer trained 2 steps of its scheduler (warm-up 1
    iteration, cosine), saved in each of ``kinds``, then its next step on the mock batch our run trains step 3 on:
    {"states": its saved states, "lr": its next learning rate, "next": its weights after that step (ours)}."""
    with megatron_core() as mcore:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        config, _, theirs = build_pair(mcore, *LLAMA, *SHAPES[shape])
        with distributed_optimizer(theirs, overlap) as (model, chain, inner):
            scheduler = OptimizerParamScheduler(chain, 0.0, LR, MIN_LR, GBS, 16 * GBS, "cosine", WD, WD, 16 * GBS,
                                                "constant")
            for _ in range(2):
                core_train_step(model, inner, *tokens_and_labels(), mcore)
                scheduler.step(increment=GBS)
            states = core_states(theirs, inner)
            for kind in kinds:
                _save(folder, kind, theirs, chain, scheduler, _args(config, shape, overlap))
            lr = inner.param_groups[0]["lr"]
            core_train_step(model, inner, *mock_batch(config, 2 * GBS), mcore)
            return {"config": config, "states": states, "lr": lr, "next": ours_of(dict(theirs.named_parameters()))}


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
                                        ("misplaced", "dense", True, ("fully_reshardable",))):
        runs[name] = {**_megatron_run(root / name, shape, overlap, kinds), "folder": root / name}
    return runs


@pytest.fixture
def one_process():
    from megatron import parallel_state

    parallel_state.initialize()
    yield
    parallel_state.destroy()


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
                                       ("one_bucket", "legacy")])
def test_megatron_cores_distributed_optimizer_states_convert_exactly(tmp_path, one_process, megatron_runs, run, kind,
                                                                     capsys):
    """Its fp32 masters and Adam's moments, flattened in its buckets (several, or one), come out as it holds them
    (max |difference| 0), its step and scheduler position with them."""
    r = megatron_runs[run]
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
    assert_next_step(reader, r["next"])


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
@pytest.mark.parametrize("run, fmt, overlap", [("dense", "legacy", True), ("moe", "legacy", False),
                                               ("dense", "torch_dist", True), ("moe", "torch_dist", False)])
def test_our_export_loads_into_megatron_cores_distributed_optimizer(tmp_path, one_process, megatron_runs, run, fmt,
                                                                    overlap):
    """Megatron Core's run -> ours -> to-megatron --use-distributed-optimizer (legacy for its bucket layout, torch_dist
    fully_reshardable for any): its distributed optimizer loads our moments and masters exactly, its scheduler our
    position, and its next step is the one it would have taken (within 1e-6 of the largest weight)."""
    r = megatron_runs[run]
    assert convert.main(["from-megatron", str(r["folder"] / "legacy"), str(tmp_path / "ours")]) == 0
    buckets = ["--overlap-grad-reduce", "--ddp-bucket-size", str(BUCKET)] if overlap else []
    assert convert.main(["to-megatron", str(tmp_path / "ours"), str(tmp_path / "meg"), "--format", fmt,
                         "--use-distributed-optimizer", *(buckets if fmt == "legacy" else [])]) == 0
    with megatron_core() as mcore:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        config, _, theirs = build_pair(mcore, *LLAMA, *SHAPES[run])
        with distributed_optimizer(theirs, overlap) as (model, chain, inner):
            saved = load_into_megatron(tmp_path / "meg", fmt, theirs, chain)
            scheduler = OptimizerParamScheduler(chain, 0.0, LR, MIN_LR, GBS, 16 * GBS, "cosine", WD, WD, 16 * GBS,
                                                "constant")
            scheduler.load_state_dict(saved)
            assert inner.param_groups[0]["lr"] == pytest.approx(r["lr"], rel=1e-12)
            for kind, want in core_states(theirs, inner).items():
                for name, t in want.items():
                    assert torch.equal(t, r["states"][kind][name]), (kind, name)
            core_train_step(model, inner, *mock_batch(config, 2 * GBS), mcore)
            after = ours_of(dict(theirs.named_parameters()))
    for name, t in r["next"].items():
        assert float((after[name] - t).abs().max()) <= 1e-6 * float(t.abs().max()), name


def _resume_lr(converted, out, *flags: str) -> tuple[float, object]:
    """The learning rate of the first step of our run resuming ``converted`` (step 13), and its config."""
    result = run_here("--mock-data", "--device", "cpu", "--load", str(converted), "--save", str(out), "--max-steps",
                      "13", "--num-workers", "0", "--eval-freq", "100", "--logging-freq", "1", "--no-save-at-end",
                      "--max-seq-len", str(SEQ), *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = [json.loads(t) for t in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in t]
    return line["learning_rate"], open_checkpoint(str(converted))[2]


def test_a_checkpoint_without_scheduler_state_resumes_at_its_learning_rate_not_zero(tmp_path, one_process, capsys):
    """Regression: from-megatron of a checkpoint at iteration 12 without scheduler state whose args lack
    consumed_train_samples placed the schedule at 0 samples, and the first resumed step ran at learning rate 0.0 (the
    warm-up's start). Now the samples are the iterations times the args' global batch (96) and the schedule is
    Megatron's, rebuilt from its args: the first step here runs at the learning rate Megatron's next step would; with
    args that say no schedule nor batch, the iterations times the given --global-batch-size place this run's own."""
    from tests.unit.test_megatron_optimizer_states import trained_checkpoint

    config, _ = trained_checkpoint(tmp_path / "run", ["--vocab-size", "250", "--max-steps", "20", "--lr", "1e-3",
                                                      "--lr-warmup-iters", "2", "--global-batch-size", "8"])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--no-optim"]) == 0
    rank_file = tmp_path / "meg" / "iter_0000012" / "mp_rank_00" / FILE
    saved = safe_load(str(rank_file))
    assert "opt_param_scheduler" not in saved and saved["args"].train_iters == 20
    del saved["args"].consumed_train_samples
    torch.save(saved, rank_file)
    capsys.readouterr()
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")]) == 0
    out = capsys.readouterr().out
    assert "96 consumed samples (iteration 12 x global batch 8)" in out and "rebuilt from its args" in out, out
    lr, _ = _resume_lr(tmp_path / "ours", tmp_path / "resumed")
    assert lr == build_param_schedule(config).lr(96) and lr > 0

    for name in ("lr", "train_iters", "global_batch_size"):  # args that give no schedule: the flags' own
        delattr(saved["args"], name)
    torch.save(saved, rank_file)
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours2"), "--global-batch-size",
                         "8"]) == 0
    assert "96 assumed (iteration 12 x the global batch 8" in capsys.readouterr().out
    lr, resumed = _resume_lr(tmp_path / "ours2", tmp_path / "resumed2", "--global-batch-size", "8", "--lr", "1e-3")
    assert lr > 0 and open_checkpoint(str(tmp_path / "ours2"))[1]["train_state"]["schedule_samples"] == 96


info = program_module("tools/checkpoint_info.py")


@pytest.fixture
def exports(tmp_path, one_process):
    """A checkpoint of ours (step 12, AdamW at step 5, tp 2 split on export) written by to-megatron for a run with
    --use-distributed-optimizer: legacy (several buckets: --overlap-grad-reduce --ddp-bucket-size 300) and torch_dist
    (fully_reshardable)."""
    from tests.unit.test_megatron_optimizer_states import trained_checkpoint

    trained_checkpoint(tmp_path / "run", ["--vocab-size", "250", "--max-steps", "20", "--lr", "1e-3",
                                          "--lr-warmup-iters", "2", "--global-batch-size", "8"])
    for fmt, flags in (("legacy", ["--overlap-grad-reduce", "--ddp-bucket-size", "300"]), ("torch_dist", [])):
        assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / fmt), "--format", fmt, "--tp", "2",
                             "--use-distributed-optimizer", *flags]) == 0
    return tmp_path


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_checkpoint_info_says_what_a_megatron_folder_holds_and_what_converts(exports, fmt, capsys):
    capsys.readouterr()
    for path in (exports / fmt, exports / fmt / "iter_0000012"):  # the save folder, or its iteration folder
        assert info.main([str(path)]) == 0
        lines = capsys.readouterr().out.splitlines()
        text = "\n".join(lines)
        assert lines[0] == f"Megatron-LM checkpoint: {exports / fmt / 'iter_0000012'}"
        assert f"format: {fmt}" in text and "iteration: 12 (consumed samples 96)" in text
        assert "tensor-parallel 2 x pipeline 1 x expert-parallel 1" in text
        assert "model (args): 2 layers, hidden 16, 4 heads, ffn 24, vocab 250 (padded 256)" in text
        optimizer = next(line for line in lines if line.startswith("optimizer:"))
        assert "distributed optimizer" in optimizer and "Adam's step 5" in optimizer
        assert ("distrib_optim.pt" if fmt == "legacy" else "fully_reshardable") in optimizer
        assert "scheduler: from its opt_param_scheduler: cosine from max_lr 0.001" in text and "at 96 samples" in text
        assert lines[-1].startswith("converts: the model")
    assert info.main([str(exports / fmt), "--verify"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "converts: yes (from-megatron): 28 tensors, Adam's moments at step 5"


def test_a_bucket_layout_that_is_not_the_args_is_refused_in_one_line(exports, capsys):
    """A legacy folder whose args say another bucket size than its distrib_optim.pt was laid out with: the converter
    refuses it in one line (never guesses), nothing written; checkpoint_info --verify says so in its words;
    --no-optim converts the weights. A model the converter refuses: checkpoint_info says why."""
    folder = exports / "legacy"
    for rank in ("mp_rank_00", "mp_rank_01"):
        saved = safe_load(str(folder / "iter_0000012" / rank / FILE))
        saved["args"].ddp_bucket_size = 100
        torch.save(saved, folder / "iter_0000012" / rank / FILE)
    capsys.readouterr()
    assert convert.main(["from-megatron", str(folder), str(exports / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bucket layout" in err and "--no-optim" in err, err
    assert not (exports / "ours").exists()
    assert info.main([str(folder), "--verify"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("converts: the weights only (from-megatron --no-optim)") and "bucket layout" in last
    assert convert.main(["from-megatron", str(folder), str(exports / "ours"), "--no-optim"]) == 0
    saved["args"].squared_relu = True
    torch.save(saved, folder / "iter_0000012" / "mp_rank_01" / FILE)
    torch.save(saved, folder / "iter_0000012" / "mp_rank_00" / FILE)
    capsys.readouterr()
    assert info.main([str(folder)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "converts: no, from-megatron refuses it: the checkpoint's model uses the squared-ReLU MLP (--squared-relu), "
        "which this GPT does not build.")


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_ours_to_the_distributed_optimizers_layout_and_back_is_bitwise(exports, fmt):
    """Our masters and AdamW moments -> to-megatron --use-distributed-optimizer (tp 2; legacy in several buckets) ->
    from-megatron: every tensor bitwise, the step and the schedule's position kept."""
    from tests.unit.test_megatron_optimizer_states import KINDS

    original, _, _ = open_checkpoint(str(exports / "run"))
    assert convert.main(["from-megatron", str(exports / fmt), str(exports / "back")]) == 0
    reader, common, _ = open_checkpoint(str(exports / "back"))
    assert common["adam_step"] == 5.0 and common["train_state"]["schedule_samples"] == 96
    for kind in KINDS:
        for name in original.names:
            assert torch.equal(reader.full(kind, name), original.full(kind, name)), (kind, name)
