"""Our MoE router against Megatron Core 0.16.1's ``TopKRouter`` on the CPU (``megatron_core_reference``), router
alone, the same weights and inputs: probabilities, routing maps, the logged balancing losses and the gradients of
the router's weight and input, within 1e-5 of the largest magnitude.

- Sinkhorn routing, top-1 (sigmoid probabilities) and top-2 (softmax), in training (the choice Sinkhorn's balanced
  assignment's top k, checked to differ from the scores' own top k on these tokens) and in evaluation.
- ``global_aux_loss`` over three micro-batches of a step (its counts averaged over them) and again after the
  step's reset; with ``aux_loss`` and with ``seq_aux_loss`` in a list of types with a coefficient each.
- ``moe_input_jitter_eps`` and ``moe_router_force_load_balancing`` (the same draws from the default generator).
"""

from __future__ import annotations

import pytest
import torch

from megatron.config import parse_config, validate
from megatron.moe.router import TopKRouter
from tests.unit.megatron_core_reference import CORE_WARNINGS, TINY, assert_close_to_scale, megatron_core

pytestmark = CORE_WARNINGS
SEQ, BATCH, HIDDEN, EXPERTS = 8, 4, 16, 4


@pytest.fixture(scope="module")
def mcore():
    with megatron_core() as env:
        from megatron.core.transformer.moe.router import TopKRouter as CoreRouter

        env["Router"] = CoreRouter
        yield env


def router_pair(mcore, *flags: str):
    """(our TopKRouter, Megatron Core's, the same fp32 weight) of ``TINY`` with 4 experts and ``flags``."""
    config = parse_config([*TINY, "--num-experts", str(EXPERTS), "--disable-bias-linear", *flags])
    validate(config)
    m = config.model
    ours = TopKRouter(m)
    core_config = mcore["config"](
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk, add_bias_linear=False,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_router_pre_softmax=m.moe_router_pre_softmax, moe_input_jitter_eps=m.moe_input_jitter_eps,
        moe_router_force_load_balancing=m.moe_router_force_load_balancing, moe_router_dtype="fp32",
        moe_token_dispatcher_type="allgather", use_cpu_initialization=True)
    theirs = mcore["Router"](core_config, pg_collection=_pg_collection())
    theirs.set_layer_number(1)
    weight = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(1)) * 0.5
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    return ours.train(), theirs.train()


def _pg_collection():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()


def inputs(seed: int) -> torch.Tensor:
    """[s, b, h], some tokens alike so that the scores' top k crowds a few experts (Sinkhorn then moves some)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    x[: SEQ // 2] += 1.5 * torch.randn(HIDDEN, generator=g)
    return x


def run_both(ours, theirs, x: torch.Tensor, mcore, seed: int = 0):
    """Both routers on ``x`` (each its own leaf copy), the same objective ``sum(probs * w)`` plus (ours) the
    auxiliary loss at gradient scale 1 (theirs: attached by its scaler, scale 1); the default generator seeded alike
    before each. Returns (ours: probs, map, balance, input grad), (theirs: probs, map, input grad)."""
    mcore["scaler"].set_loss_scale(torch.tensor(1.0))
    w = torch.randn(SEQ * BATCH, EXPERTS, generator=torch.Generator().manual_seed(7))
    mine, core = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(seed)
    probs, kept, _, aux, balance = ours(mine.view(-1, HIDDEN), BATCH, with_losses=ours.training)
    ((probs * w).sum() + (aux if aux is not None else 0.0)).backward()
    torch.manual_seed(seed)
    core_probs, core_map = theirs(core)
    (core_probs * w).sum().backward()
    return (probs, kept, balance, mine.grad), (core_probs, core_map, core.grad)


def assert_same(ours, theirs, what: str):
    (probs, kept, _, grad), (core_probs, core_map, core_grad) = ours, theirs
    assert torch.equal(kept, core_map), what
    assert_close_to_scale(core_probs.detach(), probs.detach(), f"{what}: the probabilities")
    assert_close_to_scale(core_grad, grad, f"{what}: the input's gradient")


@pytest.mark.parametrize("topk", [1, 2])
def test_sinkhorn_routing_equals_megatron_cores_in_training_and_evaluation(mcore, topk):
    ours, theirs = router_pair(mcore, "--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0",
                               "--moe-router-topk", str(topk))
    x = inputs(0)
    got, want = run_both(ours, theirs, x, mcore)
    assert_same(got, want, "training")
    assert_close_to_scale(theirs.weight.grad, ours.weight.grad, "the router weight's gradient")
    plain_top = torch.topk(x.view(-1, HIDDEN) @ ours.weight.detach().T, topk, dim=1).indices
    plain = torch.zeros_like(got[1]).scatter(1, plain_top, True)
    assert not torch.equal(plain, got[1])  # the balanced assignment changed some tokens' choice
    ours.eval(), theirs.eval()
    got, want = run_both(ours, theirs, x, mcore)
    assert_same(got, want, "evaluation")
    assert torch.equal(got[1], plain)  # evaluation: the scores' own top k


@pytest.mark.parametrize("flags, names", [
    (["--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.1"],
     ["global_load_balancing_loss"]),
    (["--moe-router-load-balancing-type", "aux_loss", "global_aux_loss", "--moe-aux-loss-coeff", "0.1", "0.3"],
     ["load_balancing_loss", "global_load_balancing_loss"]),
    (["--moe-router-load-balancing-type", "seq_aux_loss,global_aux_loss", "--moe-aux-loss-coeff", "0.2,0.05"],
     ["seq_load_balancing_loss", "global_load_balancing_loss"]),
], ids=["global", "aux_and_global", "seq_aux_and_global"])
def test_global_aux_loss_over_a_steps_micro_batches_equals_megatron_cores(mcore, flags, names):
    ours, theirs = router_pair(mcore, *flags)
    for step in range(2):
        ours.reset_global(), theirs.reset_global_aux_loss_tracker()
        for micro_batch in range(3):
            mcore["tracker"].clear_aux_losses_tracker()
            ours.weight.grad, theirs.weight.grad = None, None
            got, want = run_both(ours, theirs, inputs(10 * step + micro_batch), mcore)
            what = f"step {step}, micro-batch {micro_batch}"
            assert_same(got, want, what)
            assert_close_to_scale(theirs.weight.grad, ours.weight.grad, f"{what}: the router weight's gradient")
            tracked = mcore["tracker"].get_moe_layer_wise_logging_tracker()
            logged = sum(float(tracked[name]["values"][0]) for name in names)
            assert abs(float(got[2]) - logged) <= 1e-5 * logged, (what, float(got[2]), logged)
    assert ours.global_steps == 3 and float(theirs.ga_steps) == 3.0
    with_losses = ours.weight.grad.clone()  # the losses' part of the gradient is far above the tolerance
    ours.weight.grad = None
    ours(inputs(12).view(-1, HIDDEN), BATCH, with_losses=False)[0].mul(
        torch.randn(SEQ * BATCH, EXPERTS, generator=torch.Generator().manual_seed(7))).sum().backward()
    assert float((with_losses - ours.weight.grad).abs().max()) > 1e-3 * float(with_losses.abs().max())
    assert torch.equal(ours.global_counts, theirs.global_tokens_per_expert)


def test_the_global_loss_s_gradient_is_the_running_mean_s_not_a_recompute_s(mcore):
    """A recompute in the backward (a checkpointed layer) runs the router again: the gradient stays the forward's."""
    ours, _ = router_pair(mcore, "--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "1")
    x = inputs(3).view(-1, HIDDEN)
    ours(inputs(4).view(-1, HIDDEN), BATCH)[3].backward()  # an earlier micro-batch of the step
    ours.weight.grad = None
    ours(x, BATCH)[3].backward()
    plain = ours.weight.grad.clone()
    ours.reset_global()
    ours(inputs(4).view(-1, HIDDEN), BATCH)[3].backward()
    ours.weight.grad = None
    aux = torch.utils.checkpoint.checkpoint(lambda t: ours(t, BATCH)[3], x, use_reentrant=False)
    aux.backward()
    assert ours.global_steps == 2  # the recompute added nothing
    torch.testing.assert_close(ours.weight.grad, plain, rtol=0, atol=0)


@pytest.mark.parametrize("flags", [["--moe-input-jitter-eps", "0.2"], ["--moe-router-force-load-balancing"]],
                         ids=["input_jitter", "force_load_balancing"])
def test_jitter_and_forced_balancing_equal_megatron_cores(mcore, flags):
    ours, theirs = router_pair(mcore, "--moe-aux-loss-coeff", "0.1", *flags)
    got, want = run_both(ours, theirs, inputs(5), mcore, seed=11)
    assert_same(got, want, flags[0])
    assert_close_to_scale(theirs.weight.grad, ours.weight.grad, "the router weight's gradient")
    again, _ = run_both(ours, theirs, inputs(5), mcore, seed=12)
    assert not torch.equal(again[0], got[0])  # other draws, other probabilities
