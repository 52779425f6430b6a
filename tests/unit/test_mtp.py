"""Multi-token prediction (megatron.model.mtp): the loader's shifted fields, the objective the training step
backpropagates (the language model's token mean plus the scaled token means of every depth over the global batch),
the logged per-depth losses, and that evaluation and logits use the main head alone. Layout parity (tp, sp, pp, ep,
ZeRO-3, resume) is tests/functional/test_deepseek_layouts.py; Megatron Core's MTP on the same weights is the
independent reference for the math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from megatron.config import Config, ConfigError, parse_config, validate
from megatron.data.future_tokens import future_fields
from megatron.data.loader import build_batch
from megatron.model import mtp
from megatron.model.mtp import MTPInputs
from megatron.parallelize_gpt import build_model

VOCAB, SEQ, EOD = 96, 12, 95
SHAPE = ("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", str(VOCAB),
         "--max-seq-len", str(SEQ), "--max-position-embeddings", str(SEQ), "--hidden-dropout", "0",
         "--attention-dropout", "0")
VARIANTS = {  # learned positions (the shifted position ids matter) and DeepSeek's kind (rope, RMSNorm, experts)
    "gpt2": ("--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.5"),
    "rope-moe": ("--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.5", "--position-embedding-type", "rope",
                 "--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
                 "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1]"),
}


def make_config(*argv: str) -> Config:
    config = parse_config(["--mock-data", "--device", "cpu", *SHAPE, *argv])
    validate(config, world_size=1, cuda_available=False)
    return config


def make_batch(depth: int, reset: bool = False) -> dict:
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, EOD, SEQ + 1) for _ in range(3)]
    samples[1][[3, 7]] = EOD  # loss tokens masked at end-of-document: the depths count different tokens
    return build_batch(samples, EOD, mtp_depth=depth, reset_attention_mask=reset)


def test_the_loader_shifts_each_field_and_masks_past_the_end_and_across_documents():
    tokens = torch.arange(10, 16).view(1, 6)
    fields = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(1, 6),
              "position_ids": torch.arange(6).view(1, 6)}
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    out = future_fields(fields, 2, docs)
    assert out["mtp_tokens"][0, :, 0].tolist() == [11, 12, 13, 14, 15, 0]
    assert out["mtp_tokens"][0, :, 1].tolist() == [12, 13, 14, 15, 0, 0]
    assert out["mtp_labels"][0, :, 1].tolist() == [13, 14, 15, 16, 0, 0]
    assert out["mtp_position_ids"][0, :, 0].tolist() == [1, 2, 3, 4, 5, 0]
    assert out["mtp_loss_mask"][0, :, 0].tolist() == [1, 1, 0, 1, 1, 0]  # position 2's target is in document 1
    assert out["mtp_loss_mask"][0, :, 1].tolist() == [1, 0, 0, 1, 0, 0]
    assert future_fields(fields, 1)["mtp_loss_mask"][0, :, 0].tolist() == [1, 1, 1, 1, 1, 0]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_step_backpropagates_the_main_mean_plus_the_scaled_depth_means(variant):
    """The training step's gradient (``before_step``'s scales, the losses attached to the main ones) is that of
    ``main / N + factor / D x sum_k loss_k / N_k``, each depth's token mean over its own loss tokens, written out
    here with the modules called one by one; the logged ``mtp_loss`` is each depth's mean."""
    config = make_config(*VARIANTS[variant])
    model, batch = build_model(config), make_batch(2)
    mask = batch["loss_mask"]
    mtp.before_step(model, batch, None, loss_scale=1.0)
    losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], mtp=MTPInputs.from_batch(batch))
    ((losses * mask).sum() / mask.sum()).backward()
    got, logged = _grads(model), mtp.after_step(model)["mtp_loss"]

    model.zero_grad()
    x, rotary, plan = model._decode(batch["tokens"], batch["position_ids"], None, None)
    objective = (model.loss(x, batch["labels"]) * mask).sum() / mask.sum()
    inputs, means = MTPInputs.from_batch(batch), []
    for k, layer in enumerate(model.mtp.layers):
        x = layer(x, model.embedding(inputs.tokens[..., k], inputs.position_ids[..., k]), rotary, plan)
        depth_mask = inputs.loss_mask[..., k]
        means.append((model.loss(x, inputs.labels[..., k]) * depth_mask).sum() / depth_mask.sum())
        objective = objective + 0.5 / 2 * means[-1]
    objective.backward()
    want = _grads(model)
    assert set(got) == set(want) and any(n.startswith("mtp.layers.1.") for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert logged == pytest.approx([float(m.detach()) for m in means], rel=1e-6)
    assert inputs.loss_mask[..., 0].sum() != inputs.loss_mask[..., 1].sum()  # the depths' own counts were used


def test_evaluation_and_logits_use_the_main_head_alone():
    config = make_config(*VARIANTS["gpt2"])
    model, batch = build_model(config).eval(), make_batch(2)
    plain = build_model(make_config()).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    with torch.no_grad():
        args = (batch["tokens"], batch["position_ids"])
        assert torch.equal(model(*args, labels=batch["labels"], mtp=MTPInputs.from_batch(batch)),
                           plain(*args, labels=batch["labels"]))
        assert torch.equal(model(*args), plain(*args))


def test_its_norms_start_at_one_and_its_layer_follows_the_last_decoder_layer():
    model = build_model(make_config(*VARIANTS["rope-moe"]))
    for name, module in model.named_modules():
        if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
    from megatron.moe import MoELayer

    assert all(isinstance(layer.transformer_layer.mlp, MoELayer) for layer in model.mtp.layers)
    assert [layer.transformer_layer.layer_number for layer in model.mtp.layers] == [2, 3]


@pytest.mark.parametrize("flags, message", [
    (("--mtp-num-layers", "0"), "mtp_num_layers must be at least 1"),
    (("--mtp-num-layers", str(SEQ)), "below the sequence length"),
    (("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "-1"), "mtp_loss_scaling_factor must be"),
])
def test_bad_settings_are_one_line(flags, message):
    with pytest.raises(ConfigError, match=message):
        make_config(*flags)
