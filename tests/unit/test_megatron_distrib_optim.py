"""Megatron-LM's distributed optimizer, learning-rate schedule and progress through ``from-megatron`` /
``to-megatron`` without running Megatron Core's optimizer (that: test_megatron_distrib_optim_core.py), and
``tools/checkpoint_info.py`` on Megatron folders:

- the bucket layout (``megatron_distrib_optim.buffer_layout``) is Megatron Core 0.16.1's ``_ParamAndGradBuffer``'s,
  for several bucket sizes, dp sizes and a shared embedding;
- the schedule rebuilt from Megatron's args is its ``OptimizerParamScheduler``'s, and the flags that carry it build
  the same schedule here; a saved scheduler state is carried, its position used;
- the learning rate of the first step resumed from a checkpoint without scheduler state or consumed samples (it was
  0.0);
- ours -> to-megatron --use-distributed-optimizer -> ours is bitwise; a layout that is not the args' is one line;
- ``checkpoint_info.py`` on a legacy and a torch_dist Megatron folder.
"""

from __future__ import annotations

import argparse
import json
import types

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint
from megatron.checkpoint.megatron_lm.distrib_optim import buffer_layout
from megatron.checkpoint.megatron_lm.legacy import FILE, safe_load
from megatron.checkpoint.megatron_lm.schedule import from_args, megatron_schedule, schedule_flags
from megatron.config import parse_config, validate
from megatron.optimizer.lr_schedule import build_param_schedule
from tests.functional.launch import program_module, run_here
from tests.unit.megatron_core_reference import CORE_WARNINGS, SEQ, megatron_core
from tests.unit.test_megatron_checkpoints import convert

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
    saved["args"].moe_latent_size = 4
    torch.save(saved, folder / "iter_0000012" / "mp_rank_01" / FILE)
    torch.save(saved, folder / "iter_0000012" / "mp_rank_00" / FILE)
    capsys.readouterr()
    assert info.main([str(folder)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "converts: no, from-megatron refuses it: the checkpoint's model uses experts on a latent projection "
        "(--moe-latent-size), which this GPT does not build.")


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


def test_the_distributed_optimizers_flags_without_it_are_refused_in_one_line(exports, capsys):
    for flags, said in ((["--bf16"], "--bf16 without --use-distributed-optimizer"),
                        (["--overlap-grad-reduce"], "add --use-distributed-optimizer or drop them"),
                        (["--use-distributed-optimizer", "--dp", "0"], "must be at least 1")):
        capsys.readouterr()
        assert convert.main(["to-megatron", str(exports / "run"), str(exports / "meg"), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err, err
        assert not (exports / "meg").exists()
