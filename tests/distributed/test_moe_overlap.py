"""The expert-parallel exchange overlapped with computation (megatron/moe/overlap.py): ``--moe-shared-expert-overlap``
(the shared expert's forward during the dispatch all-to-all) and ``--delay-wgrad-compute`` (the experts' weight
gradients during the dispatch's adjoint) give the plain alltoall dispatcher's output, input gradient and every
parameter's gradient at ep 2, for GELU and SwiGLU experts, with and without biases, a capacity with padding, the
activation recomputed (``moe_act``) and the whole layer checkpointed. The plain dispatcher is itself checked against
one process (tests/functional/test_moe_layouts.py)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed

H, E = 16, 4
VARIANTS = {
    "gelu": [],
    "swiglu-no-bias": ["--swiglu", "--disable-bias-linear"],
    "capacity-padded": ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
    "moe_act-recomputed": ["--swiglu"],  # each expert's activation recomputed in the backward (recompute_activation)
    "layer-checkpointed": ["--swiglu"],
}


def _layer(flags: list[str]):
    from megatron import parallel_state
    from megatron.config import parse_config, validate
    from megatron.model.transformer import MLP
    from megatron.moe.dispatch import Groups
    from megatron.moe.experts import Experts
    from megatron.moe.layer import MoELayer

    config = parse_config(["--mock-data", "--num-layers", "1", "--hidden-size", str(H), "--num-attention-heads", "2",
                           "--vocab-size", "64", "--max-seq-len", "8", "--ffn-hidden-size", "24", "--num-experts",
                           str(E), "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "20",
                           "--moe-shared-expert-gate", "--moe-aux-loss-coeff", "0.1", *flags])
    validate(config)
    parallel_state.initialize()
    torch.manual_seed(0)
    layer = MoELayer(config.model, MLP)
    group = dist.new_group([0, 1])
    layer.groups = Groups(ep=group, ep_etp=group)
    layer.experts = Experts(config.model, dist.get_rank(), 2)
    with torch.no_grad():  # the same router and shared expert on both ranks, each rank its own experts
        for i, (name, p) in enumerate(layer.named_parameters()):
            seed = i + 100 * ("experts." in name) * dist.get_rank()
            p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed))
    return layer.train()


def _run(layer, x: torch.Tensor, shared_overlap: bool, delay_wgrad: bool, checkpointed: bool):
    from megatron.tensor_parallel import checkpoint

    layer.shared_overlap, layer.delay_wgrad = shared_overlap, delay_wgrad
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = checkpoint(layer, x) if checkpointed else layer(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _check(rank: int, world_size: int, variant: str) -> tuple[int, int]:
    from megatron.moe import overlap

    calls = {"delayed": 0}
    plain = overlap._weight_grads

    def counted(*args):
        calls["delayed"] += 1
        return plain(*args)

    overlap._weight_grads = counted
    try:
        return _compare(rank, variant), calls["delayed"]
    finally:
        overlap._weight_grads = plain


def _compare(rank: int, variant: str) -> int:
    layer = _layer(VARIANTS[variant])
    shared, where = layer._shared, []

    def recorded(x):  # whether the shared expert ran inside the exchange (megatron/moe/overlap.py's forward)
        where.append(any(f.filename.endswith("moe/overlap.py") for f in inspect.stack()))
        return shared(x)

    layer._shared = recorded
    for expert in layer.experts.values():  # as megatron.recompute sets it for recompute_modules moe_act
        expert.recompute_activation = variant == "moe_act-recomputed"
    x = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(10 + rank))  # each rank its own tokens
    checkpointed = variant == "layer-checkpointed"
    want = _run(layer, x, False, False, checkpointed)
    compared = 0
    for shared_overlap, delay_wgrad in ((True, False), (False, True), (True, True)):
        where.clear()
        got = _run(layer, x, shared_overlap, delay_wgrad, checkpointed)
        assert where[0] == shared_overlap  # the forward's (a checkpointed layer's recompute may stop before it)
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)
        assert got[2].keys() == want[2].keys()
        for name, grad in want[2].items():
            assert (got[2][name] is None) == (grad is None), name
            if grad is not None:
                torch.testing.assert_close(got[2][name], grad, rtol=1e-6, atol=1e-7, msg=name)
                compared += int(".experts." in f".{name}")
    return compared


@pytest.mark.parametrize("variant", VARIANTS)
def test_overlapped_exchange_equals_the_plain_dispatcher(variant):
    results = run_distributed(_check, 2, variant)
    assert all(compared > 0 for compared, _ in results)  # the experts' weight gradients were among those compared
    assert all(delayed == 2 for _, delayed in results)  # the two runs with --delay-wgrad-compute took that path
