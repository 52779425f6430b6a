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


def test_a_tiny_hybrid_trains_and_generates_as_a_full_recompute(tmp_path):
    """Megatron-LM's flags (``--is-hybrid-model --hybrid-override-pattern``), 12 steps on packed mock documents: the
    loss falls; the checkpoint generates greedily with the state cache (two prompts, left-padded) the tokens a full
    recompute of every prefix chooses; the parameters and FLOPs estimates count its layers."""
    import re

    from megatron.config import parse_config, validate
    from megatron.memory.model_states import parameter_split
    from megatron.parallelize_gpt import build_model
    from tests.functional.launch import run_here
    from tests.unit.test_gated_deltanet import assert_generates_as_a_full_recompute

    flags = ["--mock-data", "--device", "cpu", "--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4",
             "--vocab-size", "128", "--seq-length", "32", "--max-position-embeddings", "32", "--normalization",
             "RMSNorm", "--squared-relu", "--disable-bias-linear", "--position-embedding-type", "none",
             "--is-hybrid-model", "--hybrid-override-pattern", "M-M*-E", "--mamba-head-dim", "8", "--mamba-num-groups",
             "2", "--mamba-state-dim", "8", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
             "32"]
    config = parse_config(flags)
    validate(config)
    assert config.model.moe_layer_freq == "[0,0,0,0,0,1]"
    assert sum(parameter_split(config)) == sum(p.numel() for p in build_model(config).parameters())
    run = run_here(*flags, "--global-batch-size", "8", "--micro-batch-size", "4", "--train-iters", "12", "--lr", "3e-3",
                   "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "12", "--eval-iters", "1",
                   "--log-interval", "1", "--num-workers", "0", "--mock-document-length", "10",
                   "--reset-attention-mask", "--reset-position-ids", "--save", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-2000:]
    losses = [float(v) for v in re.findall(r" - global step \d+, .*?loss: ([\d.]+)", run.stderr)]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.2  # measured: 4.87 -> 4.57
    assert_generates_as_a_full_recompute(tmp_path / "run")


HYBRID = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size",
          "64", "--max-seq-len", "16", "--is-hybrid-model", "--mamba-head-dim", "8", "--mamba-num-groups", "2"]


@pytest.mark.parametrize("flags,message", [
    (["--hybrid-override-pattern", "M-X*"], "holds 'X'"),
    (["--hybrid-override-pattern", "M-*"], "gives 3 layers but num_layers is 4"),
    (["--hybrid-override-pattern", "M-E*"], "give --num-experts with them"),
    ([], "is_hybrid_model needs hybrid_override_pattern"),
    (["--hybrid-override-pattern", "M-M*", "--cp", "2", "--max-seq-len", "8"], "chunks hold 2 tokens"),
    (["--hybrid-override-pattern", "M-M*", "--mamba-num-groups", "3"], "must be a multiple of mamba_num_groups"),
    (["--hybrid-override-pattern", "M-M*", "--hybrid-attention-ratio", "0.5"], "--hybrid-attention-ratio"),
])
def test_hybrid_settings_refused_in_one_sentence(flags, message):
    from megatron.config import ConfigError, parse_config, validate

    with pytest.raises(ConfigError) as raised:
        config = parse_config([*HYBRID, *flags])
        validate(config, world_size=2 if "--cp" in flags else 1)
    assert message in str(raised.value)


def test_the_exports_not_written_yet_are_refused():
    from megatron.checkpoint.hf.common import ConversionError
    from megatron.checkpoint.hf.models import converter_for_model
    from megatron.checkpoint.megatron_lm.args import to_args
    from megatron.config import parse_config, validate

    config = parse_config([*HYBRID, "--hybrid-override-pattern", "M-E*", "--num-experts", "2", "--squared-relu",
                           "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "none"])
    validate(config)
    with pytest.raises(ConversionError, match="moe_router_score_function softmax has no Hugging Face Nemotron-H"):
        converter_for_model(config.model)  # Nemotron 3's router is a sigmoid
    with pytest.raises(ConversionError, match="MambaModel is not written yet"):
        to_args(config.model, tp=1, pp=1, seq_length=16, iteration=1, consumed_train_samples=0)


def test_megatron_lm_s_newer_name_of_the_pattern_is_taken():
    from megatron.config import parse_config

    assert parse_config(["--mock-data", "--hybrid-layer-pattern", "M-M*"]).model.hybrid_override_pattern == "M-M*"
