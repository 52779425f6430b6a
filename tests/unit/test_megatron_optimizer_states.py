"""Megatron-LM's optimizer states through ``tools/convert_checkpoint.py from-megatron`` / ``to-megatron``.

- ours (AdamW moments, masters, step) -> Megatron (legacy tp 2 x pp 2, torch_dist) -> ours is bitwise, GPT-2 and
  Llama shapes and (legacy) a mixture of experts;
- against NVIDIA's Megatron Core (``megatron_core_reference``, skipped when absent): its own fp32 optimizer
  (``FP32Optimizer`` over torch's AdamW with ``_get_param_groups``' groups), trained, saved as Megatron-LM saves it
  (legacy ``optimizer`` entry; torch_dist through ``dist_checkpointing.save`` of ``optimizer.sharded_state_dict``),
  converts with ``from-megatron``, and ``pretrain_gpt.py --load`` takes the same next step as Megatron Core does from
  that state (a fresh AdamW would not); our run's next checkpoint, exported with ``to-megatron``, loads into Megatron
  Core's optimizer (``load_state_dict``, ``dist_checkpointing.load``) and its next step is ours;
- what cannot be converted is one line (a damaged distributed-optimizer file, a parameter order that does not match
  the saved groups), nothing written (the distributed optimizer's states: test_megatron_distrib_optim.py).
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint, read_tensors, tensor_layout, write_checkpoint
from megatron.checkpoint.megatron_lm.core_names import from_megatron_core_state
from megatron.checkpoint.megatron_lm.legacy import FILE, TRACKER, safe_load
from megatron.checkpoint.megatron_lm.optim import core_order, parameters
from megatron.config import parse_config, validate
from megatron.data.mock_dataset import MockGPTDataset
from tests.functional.launch import run_here
from tests.unit.megatron_core_reference import (
    CORE_WARNINGS,
    LLAMA,
    MOE,
    SEQ,
    TINY,
    VOCAB,
    assert_close_to_scale,
    build_pair,
    core_optimizer,
    core_step,
    megatron_core,
    tokens_and_labels,
)
from tests.unit.test_megatron_checkpoints import SHAPES, convert, megatron_args

pytestmark = CORE_WARNINGS

LR, WD, GBS = 1e-3, 0.1, 4
KINDS = ("param", "exp_avg", "exp_avg_sq")


def trained_checkpoint(run, flags, step=12, consumed=96, adam_step=5.0):
    """A checkpoint of ours with random weights and AdamW states (the second moments positive; the vocabulary's
    padding rows zero in every kind, as a conversion leaves them)."""
    config = parse_config([*TINY, *flags])
    validate(config)
    g = torch.Generator().manual_seed(3)
    tensors = {kind: {name: torch.randn(shape, generator=g).abs() if kind == "exp_avg_sq" else
                      torch.randn(shape, generator=g) for name, (shape, _) in tensor_layout(config).items()}
               for kind in KINDS}
    for by_name in tensors.values():
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name in by_name:
                by_name[name][config.model.vocab_size:] = 0
    write_checkpoint(str(run), config, [(kind, name) for kind in KINDS for name in tensors["param"]],
                     lambda kind, name: tensors[kind][name], step=step, adam_step=adam_step,
                     train_state={"consumed_samples": consumed, "skipped_steps": 0, "schedule_samples": consumed})
    return config, tensors


@pytest.mark.parametrize("shape, fmt", [("gpt2", "legacy"), ("llama", "legacy"), ("llama_moe", "legacy"),
                                        ("gpt2", "torch_dist"), ("llama", "torch_dist"), ("llama_moe", "torch_dist")])
def test_ours_to_megatron_and_back_keeps_the_optimizer_states_bitwise(tmp_path, one_process, shape, fmt):
    config, tensors = trained_checkpoint(tmp_path / "run", SHAPES[shape])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--format", fmt,
                         "--tp", "2", "--pp", "2"]) == 0
    folder = tmp_path / "meg" / "iter_0000012"
    if fmt == "legacy":  # each rank's optimizer: Megatron Core's fp32 optimizer's dict, in its parameter order
        rank = safe_load(str(folder / "mp_rank_01_001" / FILE))
        optimizer, names = rank["optimizer"], core_order(parameters(rank["model"]))
        assert sum(len(g["params"]) for g in optimizer["param_groups"]) == len(names)
        assert {float(s["step"]) for s in optimizer["state"].values()} == {5.0}
        assert rank["opt_param_scheduler"]["num_steps"] == 96
    else:
        common = safe_load(str(folder / "common.pt"))
        assert float(common["optimizer"]["state"]["common_step"]) == 5.0
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "back")]) == 0
    reader, common, _ = open_checkpoint(str(tmp_path / "back"))
    assert common["step"] == 12 and common["adam_step"] == 5.0 and common["train_state"]["schedule_samples"] == 96
    for kind in KINDS:
        back = read_tensors(reader, kind)
        assert back.keys() == tensors[kind].keys()
        for name, t in tensors[kind].items():
            assert torch.equal(back[name], t), (kind, name)


def test_to_megatron_no_optim_leaves_the_states_out(tmp_path, one_process, capsys):
    trained_checkpoint(tmp_path / "run", SHAPES["llama"])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--no-optim"]) == 0
    assert "--no-load-optim" in capsys.readouterr().out
    assert "optimizer" not in safe_load(str(tmp_path / "meg" / "iter_0000012" / "mp_rank_00" / FILE))


def test_megatron_cores_parameter_order_is_the_one_written():
    """``core_order`` (what to-megatron numbers the states by) is Megatron Core's own for the GPT-2 shape (learned
    positions, biases, LayerNorm's bias; the Llama shape and its mixture of experts are checked end to end below:
    Megatron Core's optimizer loads the export by index)."""
    with megatron_core() as mcore:
        _, _, theirs = build_pair(mcore)
        names = [n for n, _ in theirs.named_parameters()]
        assert any(n.endswith(".bias") for n in names) and core_order(reversed(names)) == names


def mock_batch(config, first: int):
    """The global batch of samples ``first .. first + GBS`` of the mock data a run of ``config`` trains on."""
    data = MockGPTDataset(10_000, SEQ, VOCAB, config.seed)
    samples = torch.from_numpy(np.stack([data[i] for i in range(first, first + GBS)]))
    return samples[:, :-1], samples[:, 1:]


def ours_of(core_params: dict) -> dict[str, torch.Tensor]:
    return from_megatron_core_state({n: t.detach().clone() for n, t in core_params.items()}, swiglu=True)


@pytest.fixture(scope="module")
def core_run(tmp_path_factory):
    """A Llama-shaped Megatron Core model trained 2 steps by its own fp32 optimizer, saved at iteration 6 (24
    samples) in both formats with its optimizer and scheduler, and as a bf16 run saves it; (folder, Megatron Core's
    weights after its next step on the mock batch our run trains step 7 on, those after a fresh AdamW's step
    instead, the saved weights and {kind: Adam's saved states}, under our names)."""
    folder = tmp_path_factory.mktemp("megatron_core_optim")
    with megatron_core() as mcore:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        config, _, theirs = build_pair(mcore, *LLAMA)
        optimizer = core_optimizer(theirs, LR, WD)
        for _ in range(2):
            core_step(theirs, optimizer, *tokens_and_labels(), LR, WD)
        args = megatron_args(config)
        args.hidden_dropout = args.attention_dropout = 0.0  # as Megatron Core's model here: the same steps
        scheduler = {"max_lr": LR, "lr_warmup_steps": 0, "num_steps": 24, "lr_decay_style": "constant",
                     "lr_decay_steps": 32, "min_lr": 0.0, "start_wd": WD, "end_wd": WD, "wd_incr_style": "constant",
                     "wd_incr_steps": 32}
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 6, "model": theirs.state_dict(),
                 "optimizer": optimizer.state_dict(), "opt_param_scheduler": scheduler}
        (folder / "legacy" / "iter_0000006" / "mp_rank_00").mkdir(parents=True)
        torch.save(state, folder / "legacy" / "iter_0000006" / "mp_rank_00" / FILE)
        (folder / "legacy" / TRACKER).write_text("6")
        with pytest.MonkeyPatch.context() as patches:
            patches.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
            patches.setattr(filesystem_async, "_process_memory", lambda: 0)
            (folder / "torch_dist" / "iter_0000006").mkdir(parents=True)
            model = theirs.sharded_state_dict()
            dist_checkpointing.save({"model": model, "optimizer": optimizer.sharded_state_dict(model),
                                     "opt_param_scheduler": scheduler, "args": args, "iteration": 6,
                                     "checkpoint_version": 3.0}, str(folder / "torch_dist" / "iter_0000006"))
        (folder / "torch_dist" / TRACKER).write_text("6")
        saved = {n: p.detach().clone() for n, p in theirs.named_parameters()}
        states = {kind: ours_of({n: optimizer.optimizer.state[p][kind] for n, p in theirs.named_parameters()})
                  for kind in ("exp_avg", "exp_avg_sq")}
        # a bf16 run's legacy file, as Float16OptimizerWithFloat16Params saves it with Apex's / TE's FusedAdam (the
        # step in the groups): bf16 model weights, the fp32 masters per group in Megatron's own group order
        torch_sd = copy.deepcopy(optimizer.state_dict())
        for group in torch_sd["param_groups"]:
            group["step"] = 2
        for per_param in torch_sd["state"].values():
            del per_param["step"]
        masters = [[p.detach().clone() for p in group["params"]] for group in optimizer.param_groups]
        bf16 = {**state, "model": {n: t.bfloat16() if isinstance(t, torch.Tensor) else t for n, t in
                                   state["model"].items()},
                "optimizer": {"optimizer": torch_sd, "grad_scaler": {}, "fp32_from_fp16_params": masters}}
        (folder / "bf16" / "iter_0000006" / "mp_rank_00").mkdir(parents=True)
        torch.save(bf16, folder / "bf16" / "iter_0000006" / "mp_rank_00" / FILE)
        (folder / "bf16" / TRACKER).write_text("6")
        batch = mock_batch(config, 24)
        core_step(theirs, optimizer, *batch, LR, WD)
        with_states = ours_of(dict(theirs.named_parameters()))
        with torch.no_grad():
            for n, p in theirs.named_parameters():
                p.copy_(saved[n])
        core_step(theirs, core_optimizer(theirs, LR, WD), *batch, LR, WD)
        fresh = ours_of(dict(theirs.named_parameters()))
    return folder, with_states, fresh, ours_of(saved), states


def resume(tmp_path, converted, steps: int = 7):
    out = tmp_path / "run"
    result = run_here("--mock-data", "--device", "cpu", "--load", str(converted), "--save", str(out),
                      "--global-batch-size", str(GBS), "--micro-batch-size", str(GBS), "--max-steps", str(steps),
                      "--save-interval", "1", "--num-workers", "0", "--eval-freq", "100", "--logging-freq", "1",
                      "--max-seq-len", str(SEQ), "--lr", str(LR), "--min-lr", "0", "--lr-decay-style", "constant",
                      "--lr-warmup-iters", "0", "--weight-decay", str(WD), "--clip-grad", "0", "--no-eod-mask-loss")
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def assert_params_close(reader, want: dict, what: str) -> None:
    for name, t in want.items():
        assert_close_to_scale(reader.full("param", name), t, f"{what}: {name}")


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_megatron_cores_optimizer_continues_here_as_in_megatron(tmp_path, core_run, capsys, fmt):
    folder, with_states, fresh, _, _ = core_run
    assert convert.main(["from-megatron", str(folder / fmt), str(tmp_path / "ours")]) == 0
    assert "optimizer states are converted: Adam's moments at step 2" in capsys.readouterr().out
    _, common, _ = open_checkpoint(str(tmp_path / "ours"))
    assert common["adam_step"] == 2.0 and common["train_state"]["schedule_samples"] == 24
    out = resume(tmp_path, tmp_path / "ours", steps=7)
    reader, common, _ = open_checkpoint(str(out / "step_7"))
    assert common["adam_step"] == 3.0
    assert_params_close(reader, with_states, "after Megatron Core's next step")
    far = [n for n, t in fresh.items() if (reader.full("param", n) - t).abs().max() > 1e-5 * t.abs().max()]
    assert far, "a fresh AdamW's step gives the same weights: the test would not see lost moments"


def test_our_export_continues_in_megatron_cores_optimizer_as_here(tmp_path, core_run):
    """Our step 7 (converted from Megatron Core, trained here) -> to-megatron -> Megatron Core's optimizer loads it
    and its step 8 is ours, through the legacy files and through dist_checkpointing.load."""
    folder, *_ = core_run
    assert convert.main(["from-megatron", str(folder / "torch_dist"), str(tmp_path / "ours")]) == 0
    out = resume(tmp_path, tmp_path / "ours", steps=8)
    ours_8, _, _ = open_checkpoint(str(out / "step_8"))
    for fmt in ("legacy", "torch_dist"):
        meg = tmp_path / f"meg_{fmt}"
        assert convert.main(["to-megatron", str(out / "step_7"), str(meg), "--format", fmt]) == 0
        with megatron_core() as mcore:
            config, _, theirs = build_pair(mcore, *LLAMA)
            optimizer = core_optimizer(theirs, LR, WD)
            if fmt == "legacy":
                saved = safe_load(str(meg / "iter_0000007" / "mp_rank_00" / FILE))
                theirs.load_state_dict(saved["model"], strict=True)
                optimizer.load_state_dict(saved["optimizer"])
            else:
                from megatron.core import dist_checkpointing

                model = theirs.sharded_state_dict()
                with torch.serialization.safe_globals([argparse.Namespace]):
                    loaded = dist_checkpointing.load(
                        {"model": model, "optimizer": optimizer.sharded_state_dict(model, is_loading=True)},
                        str(meg / "iter_0000007"))
                theirs.load_state_dict(loaded["model"], strict=True)
                optimizer.load_state_dict(loaded["optimizer"])
            assert {float(s["step"]) for s in optimizer.optimizer.state.values()} == {3.0}  # 2 there, 1 here
            core_step(theirs, optimizer, *mock_batch(config, 28), LR, WD)
            assert_params_close(ours_8, ours_of(dict(theirs.named_parameters())), f"{fmt}: Megatron Core's step 8")


def test_a_damaged_distributed_optimizer_file_is_refused_in_one_line(tmp_path, one_process, core_run, capsys):
    """A distrib_optim.pt that is not Megatron Core's distributed-optimizer state (megatron_distrib_optim converts
    one that is): one line naming the way out, nothing written; --no-optim converts the weights."""
    folder, *_ = core_run
    meg = tmp_path / "meg"
    (meg / "iter_0000006" / "mp_rank_00").mkdir(parents=True)
    saved = safe_load(str(folder / "legacy" / "iter_0000006" / "mp_rank_00" / FILE))
    saved["optimizer"] = {"optimizer": {"param_groups": saved["optimizer"]["param_groups"]}}  # its state_dict()
    torch.save(saved, meg / "iter_0000006" / "mp_rank_00" / FILE)
    torch.save({}, meg / "iter_0000006" / "mp_rank_00" / "distrib_optim.pt")
    (meg / TRACKER).write_text("6")
    assert convert.main(["from-megatron", str(meg), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "distributed-optimizer state" in err and "--no-optim" in err, err
    assert not (tmp_path / "ours").exists()
    assert convert.main(["from-megatron", str(meg), str(tmp_path / "ours"), "--no-optim"]) == 0
    assert "not converted" in capsys.readouterr().out
    _, common, _ = open_checkpoint(str(tmp_path / "ours"))
    assert common["adam_step"] == 0.0 and common["step"] == 6


def test_a_parameter_order_that_does_not_match_is_refused_in_one_line(tmp_path, one_process, core_run, capsys):
    folder, *_ = core_run
    meg = tmp_path / "meg"
    (meg / "iter_0000006" / "mp_rank_00").mkdir(parents=True)
    saved = safe_load(str(folder / "legacy" / "iter_0000006" / "mp_rank_00" / FILE))
    groups = saved["optimizer"]["param_groups"]
    groups[1]["params"].append(groups[0]["params"].pop())  # a parameter in the other group: another order
    torch.save(saved, meg / "iter_0000006" / "mp_rank_00" / FILE)
    (meg / TRACKER).write_text("6")
    assert convert.main(["from-megatron", str(meg), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot be matched to the weights" in err, err
    assert not (tmp_path / "ours").exists()



@pytest.mark.parametrize("fmt", ["legacy", "torch_dist", "bf16"])
def test_megatron_cores_states_convert_bitwise(tmp_path, one_process, core_run, fmt):
    """Adam's moments and step as Megatron Core's optimizer holds them; a bf16 run's fp32 masters (not its rounded
    bf16 weights) become our weights, its step read from the groups (Apex's / Transformer Engine's FusedAdam)."""
    folder, _, _, weights, states = core_run
    assert convert.main(["from-megatron", str(folder / fmt), str(tmp_path / "ours")]) == 0
    reader, common, _ = open_checkpoint(str(tmp_path / "ours"))
    assert common["adam_step"] == 2.0
    for kind, want in [("param", weights), *states.items()]:
        for name, t in want.items():
            assert torch.equal(reader.full(kind, name), t), (kind, name)


def test_the_distributed_optimizers_bucket_layout_in_torch_dist_is_refused_in_one_line(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "meg" / "iter_0000006"
    folder.mkdir(parents=True)
    dcp.save({"embedding.word_embeddings.weight": torch.zeros(4, 2),
              "optimizer.distributed.dp_group_idx_0.param": torch.zeros(8)},
             storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    torch.save({"args": argparse.Namespace(num_layers=1), "iteration": 6}, folder / "common.pt")
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / "meg" / TRACKER).write_text("6")
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--dist-ckpt-optim-fully-reshardable" in err and "--no-optim" in err, err
    assert not (tmp_path / "ours").exists()


def test_torch_dists_stacked_layers_hold_the_experts_layer_then_expert():
    """Megatron Core's homogeneous layers (``moe_layer_freq`` 1) stack a MoE layer's experts as ``[layer, expert,
    ...]`` under ``decoder.layers.mlp.experts.experts.*``; reading unstacks both."""
    from megatron.checkpoint.megatron_lm.dist import _stacked, _unstacked

    g = torch.Generator().manual_seed(0)
    whole = {f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight": torch.randn(6, 4, generator=g)
             for i in range(2) for e in range(3)}
    whole.update({f"decoder.layers.{i}.input_layernorm.weight": torch.randn(4, generator=g) for i in range(2)})
    state = _stacked(whole, 2)
    stacked = state["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert stacked.shape == (2, 3, 6, 4)
    assert torch.equal(stacked[1, 2], whole["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"])
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in state
    back = _unstacked(state)
    assert back.keys() == whole.keys() and all(torch.equal(back[n], t) for n, t in whole.items())


def test_megatron_cores_moe_optimizer_converts_both_ways_bitwise(tmp_path, one_process):
    """A mixture of experts (a shared expert; a dense layer after the MoE one): Megatron Core's optimizer (one, the
    experts in its groups with the rest at expert parallelism 1), its states saved as Megatron-LM saves them
    (legacy; torch_dist: ``sharded_state_dict`` with Megatron-LM's metadata) convert bitwise; the conversion's
    export loads back into a new optimizer (its ``load_state_dict``; ``dist_checkpointing.load``) with the same
    states."""
    flags = [*LLAMA, *MOE, "--moe-shared-expert-intermediate-size", "16"]
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}  # Megatron-LM's, non-distributed
    with megatron_core() as mcore:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        config, _, theirs = build_pair(mcore, *flags)
        chain = core_optimizer(theirs, LR, WD)
        members = getattr(chain, "chained_optimizers", [chain])
        assert len(members) == 1  # expert parallelism 1: the experts' allreduce is True, no second optimizer
        g = torch.Generator().manual_seed(7)
        for member in members:
            member.init_state_fn(member.optimizer)
            for state in member.optimizer.state.values():
                state["step"] = torch.tensor(4.0)
                for kind in ("exp_avg", "exp_avg_sq"):
                    state[kind].copy_(torch.rand(state[kind].shape, generator=g))
        params = dict(theirs.named_parameters())
        owner = {id(p): m.optimizer for m in members for grp in m.optimizer.param_groups for p in grp["params"]}
        want = {kind: ours_of({n: owner[id(p)].state[p][kind] for n, p in params.items()})
                for kind in ("exp_avg", "exp_avg_sq")}
        args = megatron_args(config)
        args.num_experts, args.moe_router_topk, args.moe_layer_freq = 4, 2, [1, 0]
        args.moe_shared_expert_intermediate_size, args.moe_router_load_balancing_type = 16, "aux_loss"
        args.moe_aux_loss_coeff, args.moe_token_dispatcher_type = 0.1, "allgather"
        (tmp_path / "legacy" / "iter_0000006" / "mp_rank_00").mkdir(parents=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 6, "model": theirs.state_dict(),
                    "optimizer": chain.state_dict()}, tmp_path / "legacy" / "iter_0000006" / "mp_rank_00" / FILE)
        with pytest.MonkeyPatch.context() as patches:
            patches.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
            patches.setattr(filesystem_async, "_process_memory", lambda: 0)
            (tmp_path / "torch_dist" / "iter_0000006").mkdir(parents=True)
            model = theirs.sharded_state_dict(metadata=meta)
            dist_checkpointing.save({"model": model, "optimizer": chain.sharded_state_dict(model, metadata=meta),
                                     "args": args, "iteration": 6, "checkpoint_version": 3.0},
                                    str(tmp_path / "torch_dist" / "iter_0000006"), content_metadata=meta)
        for fmt in ("legacy", "torch_dist"):
            (tmp_path / fmt / TRACKER).write_text("6")
            assert convert.main(["from-megatron", str(tmp_path / fmt), str(tmp_path / f"ours_{fmt}")]) == 0
            reader, common, _ = open_checkpoint(str(tmp_path / f"ours_{fmt}"))
            assert common["adam_step"] == 4.0
            for kind, by_name in want.items():
                for name, t in by_name.items():
                    assert torch.equal(reader.full(kind, name), t), (fmt, kind, name)
            out = tmp_path / f"meg_{fmt}"
            assert convert.main(["to-megatron", str(tmp_path / f"ours_{fmt}"), str(out), "--format", fmt]) == 0
            back = core_optimizer(theirs, LR, WD)
            if fmt == "legacy":
                back.load_state_dict(safe_load(str(out / "iter_0000006" / "mp_rank_00" / FILE))["optimizer"])
            else:
                with torch.serialization.safe_globals([argparse.Namespace]):
                    request = back.sharded_state_dict(theirs.sharded_state_dict(metadata=meta), is_loading=True,
                                                      metadata=meta)
                    loaded = dist_checkpointing.load({"optimizer": request}, str(out / "iter_0000006"))
                back.load_state_dict(loaded["optimizer"])
            for old, new in zip(members, getattr(back, "chained_optimizers", [back])):
                for p in (p for grp in old.optimizer.param_groups for p in grp["params"]):
                    for kind in ("exp_avg", "exp_avg_sq", "step"):
                        assert torch.equal(new.optimizer.state[p][kind], old.optimizer.state[p][kind]), (fmt, kind)
