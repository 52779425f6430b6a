"""The Mamba-2 mixer (megatron/hybrid/mamba.py, docs/hybrid.md): equal to transformers' ``NemotronHMamba2Mixer``
holding the same numbers (its projection rows and convolution channels reordered by group), output and input gradient;
within packed documents each document's output is the mixer's on that document alone."""

from __future__ import annotations

import types

import pytest
import torch

from megatron.attention.plan import AttentionPlan
from megatron.hybrid.mamba import D_CONV, Mamba2Mixer

H_, HEADS, P, G, N = 16, 4, 8, 2, 6
CFG = types.SimpleNamespace(hidden_size=H_, mamba_num_heads=HEADS, mamba_head_dim=P, mamba_num_groups=G,
                            mamba_state_dim=N, layernorm_epsilon=1e-5)


def _mixer(seed: int = 0) -> Mamba2Mixer:
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(CFG)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0.0, 0.3)
        mixer.A_log.uniform_(0.0, 1.0)
    return mixer


def _transformers_twin(mixer: Mamba2Mixer):
    """transformers' mixer with ``mixer``'s numbers: the projection's rows and the convolution's channels put
    component-major (all gates, all inputs, all B, all C, all steps)."""
    nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    from transformers import NemotronHConfig

    config = NemotronHConfig(hidden_size=H_, mamba_num_heads=HEADS, mamba_head_dim=P, n_groups=G, ssm_state_size=N,
                             conv_kernel=D_CONV, use_conv_bias=True, layer_norm_epsilon=1e-5, num_hidden_layers=1,
                             hybrid_override_pattern="M", time_step_min=0.0, mamba_hidden_act="silu", use_bias=False,
                             chunk_size=16)
    twin, per = nemotron_h.NemotronHMamba2Mixer(config, 0), HEADS // G
    cuts = [per * P, per * P, N, N, per]  # z, x, B, C, dt of a group
    with torch.no_grad():
        rows = mixer.in_proj.weight.view(G, sum(cuts), H_).split(cuts, dim=1)
        twin.in_proj.weight.copy_(torch.cat([part.reshape(-1, H_) for part in rows]))
        channels = [per * P, N, N]  # x, B, C of a group
        weight = mixer.conv1d_weight.view(G, sum(channels), D_CONV).split(channels, dim=1)
        bias = mixer.conv1d_bias.view(G, sum(channels)).split(channels, dim=1)
        twin.conv1d.weight.copy_(torch.cat([w.reshape(-1, D_CONV) for w in weight])[:, None])
        twin.conv1d.bias.copy_(torch.cat([c.reshape(-1) for c in bias]))
        for name in ("dt_bias", "A_log", "D"):
            getattr(twin, name).copy_(getattr(mixer, name))
        twin.norm.weight.copy_(mixer.norm_weight)
        twin.out_proj.weight.copy_(mixer.out_proj.weight)
    return twin


def test_the_mixer_equals_transformers():
    mixer = _mixer()
    twin = _transformers_twin(mixer)
    x = torch.randn(2, 37, H_, generator=torch.Generator().manual_seed(1))
    ours_in, theirs_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = mixer(ours_in.transpose(0, 1)).transpose(0, 1)
    theirs = twin(theirs_in)
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1, 1, ours.numel()).view_as(ours)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-5)


def test_packed_documents_do_not_see_each_other():
    mixer = _mixer()
    x = torch.randn(30, 1, H_, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0] * 9 + [1] * 2 + [2] * 19])
    packed = mixer(x, plan=AttentionPlan(document_ids=ids))
    for start, end in ((0, 9), (9, 11), (11, 30)):
        torch.testing.assert_close(packed[start:end], mixer(x[start:end]), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(packed[11:], mixer(x)[11:])
