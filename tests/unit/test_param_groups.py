"""Megatron-LM's parameter groups: weight decay on the query/key norms (--apply-wd-to-qk-layernorm) and a learning
rate of its own for the word embedding and output layer (--decoupled-lr, --decoupled-min-lr). The rules and the
schedule against Megatron Core 0.16.1's (``_get_param_groups``, ``OptimizerParamScheduler.get_lr``); the step
against AdamW applied parameter by parameter."""

from __future__ import annotations

import pytest
import torch

from megatron.config import ConfigError, parse_config, validate
from megatron.optimizer import build_param_schedule, decoupled_schedule
from megatron.optimizer.param_groups import group_of
from megatron.parallelize_gpt import parallelize_gpt
from tests.unit.megatron_core_reference import CORE_WARNINGS, LLAMA, build_pair, megatron_core

pytestmark = CORE_WARNINGS
TINY = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--vocab-size", "128", "--max-seq-len", "8", "--max-position-embeddings", "8", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--max-steps", "100", "--global-batch-size", "4", "--micro-batch-size", "4"]
DECOUPLED = ["--decoupled-lr", "5e-3", "--decoupled-min-lr", "1e-4", "--lr", "1e-3", "--min-lr", "1e-5",
             "--weight-decay", "0.1"]


def config_of(*flags: str):
    config = parse_config([*TINY, *flags])
    validate(config)
    return config


@pytest.mark.parametrize("qk_wd", [False, True], ids=["norms-without-decay", "wd-on-qk-norms"])
def test_the_groups_are_megatron_cores(qk_wd):
    """Every parameter of Megatron Core's GPT (QK-norm, untied head) lands in the group Megatron Core puts it in:
    its weight decay on or off and its peak learning rate, decoupled or not."""
    wd_flags = ["--apply-wd-to-qk-layernorm"] if qk_wd else []
    ours = config_of(*LLAMA, "--qk-layernorm", *DECOUPLED, *wd_flags).optimizer
    with megatron_core() as mcore:
        from megatron.core.optimizer import OptimizerConfig, _get_param_groups

        _, _, theirs = build_pair(mcore, *LLAMA, "--qk-layernorm")
        core = OptimizerConfig(lr=1e-3, min_lr=1e-5, decoupled_lr=5e-3, decoupled_min_lr=1e-4, weight_decay=0.1,
                               apply_wd_to_qk_layernorm=qk_wd)
        groups = _get_param_groups([theirs], core, None)
        core_group = {id(p): (g["wd_mult"] != 0.0, g["max_lr"] == 5e-3) for g in groups for p in g["params"]}
        named = list(theirs.named_parameters())
    assert any(core_group[id(p)][1] for _, p in named)  # the embedding and the head
    assert any(core_group[id(p)][0] for n, p in named if "k_layernorm" in n) == qk_wd
    for name, param in named:
        assert group_of(name, param.shape, ours) == core_group[id(param)], name


def test_the_decoupled_schedule_is_megatron_cores():
    config = config_of(*DECOUPLED, "--lr-warmup-iters", "10", "--lr-decay-style", "cosine", "--lr-warmup-init",
                       "1e-6")
    ours = decoupled_schedule(config, build_param_schedule(config))
    plain = build_param_schedule(config)
    with megatron_core() as mcore:  # noqa: F841 (imports megatron.core)
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        class Holder:
            param_groups = [{"max_lr": 5e-3, "min_lr": 1e-4}]

        theirs = OptimizerParamScheduler(Holder(), init_lr=1e-6, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=10 * 4,
                                         lr_decay_steps=100 * 4, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                         wd_incr_steps=100 * 4, wd_incr_style="constant")
        for samples in (0, 8, 40, 44, 200, 396, 400, 480):
            theirs.num_steps = samples
            assert ours.lr(samples) == pytest.approx(theirs.get_lr(Holder.param_groups[0]), rel=1e-12), samples
            assert plain.lr(samples) == pytest.approx(theirs.get_lr({}), rel=1e-12), samples


def test_one_step_moves_each_group_at_its_rate():
    """One AdamW step at lr 1e-3 with decoupled_lr 5e-3 and QK-norm decay: each parameter moves as torch's AdamW
    moves it alone, at its group's learning rate and weight decay."""
    torch.manual_seed(0)
    config = config_of(*LLAMA, "--qk-layernorm", *DECOUPLED, "--apply-wd-to-qk-layernorm")
    parallel = parallelize_gpt(config, torch.device("cpu"))
    model, optimizer = parallel.model, parallel.optimizer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    optimizer.zero_grad()
    for name, p in model.named_parameters():
        p.main_grad.copy_(grads[name])
    optimizer.decoupled_lr = 5e-3
    assert optimizer.step(1e-3, 0.1).applied
    decoupled = decayed = 0
    for name, p in model.named_parameters():
        decays, own_lr = group_of(name, p.shape, config.optimizer)
        decoupled, decayed = decoupled + own_lr, decayed + (decays and p.dim() == 1)
        ref = before[name].clone().requires_grad_(True)
        ref.grad = grads[name].clone()
        reference = torch.optim.AdamW([ref], lr=5e-3 if own_lr else 1e-3, betas=(0.9, 0.999), eps=1e-8,
                                      weight_decay=0.1 if decays else 0.0)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))  # the global norm's clip
        ref.grad.mul_(min(1.0, 1.0 / (float(norm) + 1e-6)))
        reference.step()
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-6, atol=1e-7, msg=name)
    assert decoupled == 2 and decayed == 4  # embedding + head; q and k norms of two layers


@pytest.mark.parametrize("flags, message", [
    (["--decoupled-min-lr", "1e-4"], "decoupled_min_lr (0.0001) is the floor of decoupled_lr's schedule, which is "
                                     "unset"),
    (["--decoupled-lr", "-1"], "decoupled_lr and decoupled_min_lr must be >= 0"),
    (["--decoupled-lr", "1e-4", "--lr-warmup-init", "1e-3", "--lr", "2e-3"], "must be at most decoupled_lr"),
], ids=["floor-without-peak", "negative", "warmup-above-peak"])
def test_bad_decoupled_settings_are_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_of(*flags)


def test_megatrons_deprecated_spelling_turns_qk_norm_decay_on():
    assert not config_of().optimizer.apply_wd_to_qk_layernorm
    assert config_of("--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm").optimizer.apply_wd_to_qk_layernorm
    with pytest.raises(ConfigError, match="must be one of apply_wd_to_qk_layernorm"):  # Megatron's one choice
        config_of("--no-weight-decay-cond-type", "other")
