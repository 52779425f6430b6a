"""Megatron-LM checkpoints of DeepSeek-V3's shape (``tools/convert_checkpoint.py from-megatron`` / ``to-megatron``):
multi-latent attention (a query down-projection with its norm, or one query projection; the latent norms; YaRN),
DeepSeek-V3's router (sigmoid, expert bias, group-limited, scaled), a shared expert, a dense first layer, and
multi-token prediction (two modules whose layers are MoE; GPT-2's shape with one: tied head, learned positions).

- ours -> Megatron (legacy cut for tp 2 x pp 2, torch_dist) -> ours is bitwise: the weights, the AdamW states, the
  routers' expert bias (our train state, Megatron Core's ``mlp.router.expert_bias`` buffer) and the model's
  configuration (MLA, YaRN, router and MTP settings through the saved ``args``); the rank files hold Megatron Core's
  layout (the local spec's column-parallel down-projections and ``eh_proj`` cut by rows, the latent norms whole,
  the last stage holding the prediction modules and the embedding they read); torch_dist keeps the local MLA
  spec's names (it has no keys map) and reads Transformer Engine's;
- against NVIDIA's Megatron Core 0.16.1 (``megatron_core_reference``; skipped when absent), its ``GPTModel`` built
  with the local spec (and ``get_gpt_mtp_block_spec``) from the export's ``args`` by Megatron-LM's own rule (every
  ``args`` field that is a field of its ``TransformerConfig`` / ``MLATransformerConfig``): it loads the legacy
  export (strict ``load_state_dict``) and torch_dist (its ``dist_checkpointing.load``) and gives our logits within
  1e-5 of their scale; with MTP (its forward then wants labels), our per-token losses, each depth's MTP loss and,
  after the same objective's backward, every parameter's gradient; its own weights and expert biases, saved as
  Megatron-LM saves them (legacy, and torch_dist by its ``dist_checkpointing.save``), convert with
  ``from-megatron`` and give its losses here; ``core_order`` is its parameter order (the legacy optimizer's).

The weights are moved between the two models only by the converters (``to-megatron`` / ``from-megatron``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from megatron import moe
from megatron.checkpoint.convert import open_checkpoint, read_tensors, tensor_layout, write_checkpoint
from megatron.checkpoint.megatron_lm.legacy import FILE, safe_load
from megatron.checkpoint.megatron_lm.optim import core_order
from megatron.config import parse_config, validate
from megatron.model.gpt import GPTModel
from tests.unit.megatron_core_reference import (
    CORE_WARNINGS,
    TINY,
    assert_close_to_scale,
    core_forward,
    megatron_core,
    save_as_megatron,
    tokens_and_labels,
)
from tests.unit.test_megatron_checkpoints import convert
from tests.unit.test_mla import DEEPSEEK_MOE, MLA, YARN, _local_core_attention

pytestmark = CORE_WARNINGS

KINDS = ("param", "exp_avg", "exp_avg_sq")
# DeepSeek-V3's router as its configurations set it (sigmoid with pre-softmax, the sequence aux loss), layer 0 dense
ROUTER = [*DEEPSEEK_MOE, "--moe-router-pre-softmax", "--moe-router-load-balancing-type", "seq_aux_loss",
          "--moe-aux-loss-coeff", "0.01", "--moe-router-bias-update-rate", "0.002"]
SHAPES = {"q_lora": [*MLA, "--q-lora-rank", "10", *YARN, *ROUTER],
          "q_proj": [*MLA, "--rope-type", "rope", *ROUTER],
          "mtp": [*MLA, "--q-lora-rank", "10", *YARN, *ROUTER, "--mtp-num-layers", "2",
                  "--mtp-loss-scaling-factor", "0.3"],
          # GPT-2's shape with a prediction module: tied head, learned positions (shifted for the module), LayerNorm
          # with biases (the modules' norms too), dense
          "gpt2_mtp": ["--mtp-num-layers", "1"]}


def biases(config) -> dict[str, list[float]]:
    """An expert bias per MoE layer, as our train state keeps it (distinct values: they change the choices)."""
    m = config.model
    return {str(i): [0.2 * (i + 1), -0.1, 0.05 * i, -0.15] for i in range(m.num_layers + (m.mtp_num_layers or 0))
            if m.num_experts and json.loads(m.moe_layer_freq)[min(i, m.num_layers - 1)]}  # MTP: as the last layer


def assert_biases(got: dict, want: dict) -> None:
    """Equal up to fp32 (Megatron Core keeps the bias in fp32; our train state in JSON numbers)."""
    assert got.keys() == want.keys()
    for layer, values in want.items():
        assert got[layer] == pytest.approx(values, rel=1e-6), layer


def our_checkpoint(run, flags, step=12, consumed=96, adam_step=5.0, scale=1.0):
    """A checkpoint of ours: random weights and AdamW states, the expert biases in the train state. ``scale`` < 1:
    weights of that size, the norms' around 1 (a well-conditioned network, for comparing computations)."""
    config = parse_config([*TINY, *flags])
    validate(config)
    g = torch.Generator().manual_seed(3)
    tensors = {kind: {name: torch.randn(shape, generator=g).abs() if kind == "exp_avg_sq" else
                      torch.randn(shape, generator=g) for name, (shape, _) in tensor_layout(config).items()}
               for kind in KINDS}
    if scale != 1.0:
        tensors["param"] = {name: t * scale + (1.0 if name.endswith("norm.weight") else 0.0)
                            for name, t in tensors["param"].items()}
    for by_name in tensors.values():
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name in by_name:
                by_name[name][config.model.vocab_size:] = 0
    write_checkpoint(str(run), config, [(kind, name) for kind in KINDS for name in tensors["param"]],
                     lambda kind, name: tensors[kind][name], step=step, adam_step=adam_step,
                     train_state={"consumed_samples": consumed, "skipped_steps": 0, "schedule_samples": consumed,
                                  "moe_expert_bias": biases(config)})
    return config, tensors


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_ours_to_megatron_and_back_is_bitwise(tmp_path, one_process, shape, fmt):
    config, tensors = our_checkpoint(tmp_path / "run", [*SHAPES[shape], "--vocab-size", "250"])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--format", fmt,
                         "--tp", "2", "--pp", "2"]) == 0
    folder = tmp_path / "meg" / "iter_0000012"
    if fmt == "legacy":
        ranks = {(t, p): safe_load(str(folder / f"mp_rank_{t:02d}_{p:03d}" / FILE))["model"]
                 for t in range(2) for p in range(2)}
        check_legacy_layout(shape, ranks, tensors["param"], config)
    else:
        from megatron.checkpoint.megatron_lm.dcp_reader import SafeReader

        check_torch_dist_keys(shape, SafeReader(str(folder)).read_metadata().state_dict_metadata.keys())
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "back")]) == 0
    reader, common, back_config = open_checkpoint(str(tmp_path / "back"))
    assert back_config.model == config.model
    assert common["step"] == 12 and common["adam_step"] == 5.0
    assert_biases(common["train_state"].get("moe_expert_bias", {}), biases(config))
    for kind in KINDS:
        back = read_tensors(reader, kind)
        assert back.keys() == tensors[kind].keys()
        for name, t in tensors[kind].items():
            assert torch.equal(back[name], t), (kind, name)


def check_legacy_layout(shape: str, ranks: dict, params: dict, config) -> None:
    """Megatron Core's local-spec layout on the tp 2 x pp 2 ranks ({(t, p): model}); stage 1 holds layer 1 as its
    layer 0, the prediction modules, and (with them) the embedding they read: Megatron Core's MTP stage."""
    last = ranks[(1, 1)]
    if shape != "gpt2_mtp":
        kv_down = params["layers.1.self_attention.linear_kv_down_proj.weight"]  # [kv_lora_rank; dr] cut as one
        assert torch.equal(last["decoder.layers.0.self_attention.linear_kv_down_proj.weight"], kv_down.chunk(2)[1])
        assert torch.equal(last["decoder.layers.0.self_attention.kv_layernorm.weight"],
                           params["layers.1.self_attention.kv_layernorm.weight"])
        assert last["decoder.layers.0.mlp.router.expert_bias"].tolist() == pytest.approx(biases(config)["1"])
    if shape in ("mtp", "gpt2_mtp"):
        k = config.model.mtp_num_layers - 1
        eh_proj = params[f"mtp.layers.{k}.eh_proj.weight"]  # [h, 2h], rows cut
        assert torch.equal(last[f"mtp.layers.{k}.eh_proj.weight"], eh_proj.chunk(2)[1])
        for name in [n for n in ranks[(1, 0)] if n.startswith("embedding.")]:
            assert torch.equal(last[name], ranks[(1, 0)][name]), name
    if shape == "mtp":
        assert last["mtp.layers.1.transformer_layer.mlp.router.expert_bias"].tolist() == pytest.approx(
            biases(config)["3"])
    if shape == "gpt2_mtp":  # the tied head's copy too, and the learned positions the module embeds with
        assert {"output_layer.weight", "embedding.position_embeddings.weight"} <= last.keys()


def check_torch_dist_keys(shape: str, keys) -> None:
    """The sharded keys Megatron Core's local spec gives: MLA's layers keep their own names (no keys map), one by one
    (a dense layer, then a MoE one); a prediction module's layer renamed as a decoder layer is."""
    if shape == "gpt2_mtp":
        assert {"decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                "mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_bias",
                "mtp.layers.0.enorm.bias", "mtp.layers.0.eh_proj.weight"} <= keys
        return
    assert {"decoder.layers.0.input_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm.weight",
            "decoder.layers.1.self_attention.kv_layernorm.weight", "decoder.layers.1.mlp.router.expert_bias"} <= keys
    assert not [k for k in keys if "layer_norm_weight" in k]


def test_torch_dist_reads_transformer_engines_mla_names(tmp_path, one_process):
    """Transformer Engine's MLA spec fuses the latent norms into the up-projections (``layer_norm_weight``) and a
    dense layer's MLP norm into ``linear_fc1``: such a checkpoint reads as the local spec's."""
    from megatron.checkpoint.megatron_lm.dist import read_torch_dist, write_torch_dist

    config, tensors = our_checkpoint(tmp_path / "run", SHAPES["q_lora"])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--format", "torch_dist",
                         "--no-optim"]) == 0
    args, _, whole, _ = read_torch_dist(str(tmp_path / "meg" / "iter_0000012"))
    renames = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
               "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
               "decoder.layers.0.pre_mlp_layernorm.": "decoder.layers.0.mlp.linear_fc1.layer_norm_"}
    te = {}
    for name, t in whole.items():
        for local, fused in renames.items():
            name = name.replace(local, fused)
        te[name] = t
    assert "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight" in te
    write_torch_dist(str(tmp_path / "te"), 12, te, args, 2)
    assert convert.main(["from-megatron", str(tmp_path / "te"), str(tmp_path / "back")]) == 0
    back = read_tensors(open_checkpoint(str(tmp_path / "back"))[0], "param")
    for name, t in tensors["param"].items():
        assert torch.equal(back[name], t), name


def test_a_tp_that_cuts_a_latent_rank_is_one_line(tmp_path, one_process, capsys):
    """Megatron Core's local spec cuts the down-projections' rows over tp: a --tp that does not divide them."""
    our_checkpoint(tmp_path / "run", SHAPES["q_lora"])  # q_lora_rank 10, 4 heads
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--tp", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "linear_q_down_proj.weight" in err and "--tp" in err, err
    assert not list(tmp_path.glob("meg/iter_*"))


def test_megatron_lms_own_deepseek_args_give_the_model(tmp_path):
    """The ``args`` a Megatron-LM DeepSeek-V3 run saves (its names and defaults: an MLA model's ``kv_channels`` and
    query groups, which shape nothing; no ``original_max_position_embeddings``; the flex dispatcher, a runtime
    choice) give our model: MLA, YaRN, the router, the dense first layer and MTP as the run had them; what would
    change the network unseen (YaRN's ramp, a partial rotary, experts on a latent projection) is one line."""
    from megatron.checkpoint.hf.common import ConversionError
    from megatron.checkpoint.megatron_lm.args import model_flags

    args = argparse.Namespace(
        num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4, kv_channels=8,
        group_query_attention=False, num_query_groups=4, max_position_embeddings=8, seq_length=8,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False,
        normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=True, vocab_size=None, padded_vocab_size=128,
        multi_latent_attention=True, q_lora_rank=10, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4,
        v_head_dim=5, qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.9, mscale_all_dim=0.7,
        num_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=8,
        moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_pre_softmax=True,
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3, moe_router_num_groups=2,
        moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-4, moe_token_dispatcher_type="flex", moe_router_dtype="fp32", moe_grouped_gemm=False,
        mtp_num_layers=1, mtp_loss_scaling_factor=0.1, hidden_dropout=0.0, attention_dropout=0.0)
    config = parse_config(["--mock-data", *model_flags(args)])
    validate(config)
    m = config.model
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
            m.v_head_dim, m.qk_layernorm) == (True, 10, 12, 6, 4, 5, True)
    assert (m.rope_type, m.rotary_scaling_factor, m.mscale, m.mscale_all_dim, m.original_max_position_embeddings) == (
        "yarn", 4.0, 0.9, 0.7, 4096)
    assert (m.moe_layer_freq, m.moe_router_score_function, m.moe_router_enable_expert_bias, m.moe_router_num_groups,
            m.moe_router_group_topk, m.moe_router_topk_scaling_factor) == ("[0,1]", "sigmoid", True, 2, 1, 2.5)
    assert (m.mtp_num_layers, m.mtp_loss_scaling_factor, m.kv_channels, m.group_query_attention) == (1, 0.1, None,
                                                                                                    False)
    for change, message in (({"beta_fast": 16}, "beta_fast 16"),
                            ({"rope_type": "rope", "rotary_percent": 0.5}, "rotates 0.5 of its rotary channels"),
                            ({"moe_latent_size": 4}, "experts on a latent projection")):
        with pytest.raises(ConversionError) as refused:
            model_flags(argparse.Namespace(**{**vars(args), **change}))
        assert message in str(refused.value) and "\n" not in str(refused.value)


# ----------------------------------------------------------------------------- against Megatron Core

@pytest.fixture(scope="module")
def mcore():
    """Megatron Core on the CPU; its MLA module told Transformer Engine is absent (test_mla.py's fixture)."""
    with megatron_core() as env:
        from megatron.core.transformer import multi_latent_attention

        patches = pytest.MonkeyPatch()
        patches.setattr(multi_latent_attention, "HAVE_TE", False)
        try:
            yield env
        finally:
            patches.undo()


def core_model(mcore, args: argparse.Namespace):
    """Megatron Core's ``GPTModel`` (local spec) of a checkpoint's ``args``, as Megatron-LM builds it
    (``core_transformer_config_from_args``: every ``args`` field that is a field of its ``TransformerConfig``, or
    ``MLATransformerConfig`` with multi-latent attention, then its renames); on the CPU in fp32 without fusions or
    dropout (GELU the fused bias-GELU's tanh form), the allgather dispatcher; MLA's local attention core given the
    value width (``test_mla._local_core_attention``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    mla = bool(args.multi_latent_attention)
    config_class = MLATransformerConfig if mla else TransformerConfig
    fields = {f.name for f in dataclasses.fields(config_class)}
    kwargs = {name: value for name, value in vars(args).items() if name in fields}
    kwargs.update(num_moe_experts=args.num_experts, layernorm_epsilon=args.norm_epsilon,
                  gated_linear_unit=args.swiglu,
                  activation_func=F.silu if args.swiglu else (lambda x: F.gelu(x, approximate="tanh")),
                  num_query_groups=args.num_query_groups if args.group_query_attention else None,
                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                  use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
                  masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
                  apply_rope_fusion=False, moe_token_dispatcher_type="allgather", moe_router_dtype="fp32",
                  hidden_dropout=0.0, attention_dropout=0.0, **({"kv_channels": args.v_head_dim} if mla else {}))
    config = config_class(**kwargs)
    spec = mcore["block_spec"](config, use_transformer_engine=False, normalization=args.normalization)
    for layer_spec in spec.layer_specs if mla else ():
        layer_spec.submodules.self_attention.submodules.core_attention = _local_core_attention()
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if args.mtp_num_layers else None
    return mcore["GPTModel"](config, spec, vocab_size=args.padded_vocab_size, max_sequence_length=args.seq_length,
                             position_embedding_type=args.position_embedding_type,
                             share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                             mtp_block_spec=mtp)


def our_model(reader, config, common) -> GPTModel:
    """Our GPT holding a checkpoint's weights and its routers' expert biases (what a run loading it restores)."""
    model = GPTModel(config.model, config.padded_vocab_size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.full("param", name))
    moe.set_expert_biases(model, common["train_state"].get("moe_expert_bias") or {})
    return model


def exported_pair(mcore, tmp_path, shape: str, fmt: str):
    """(our config, our GPT, Megatron Core's GPTModel) of one checkpoint of ours: Megatron Core's built from the
    ``to-megatron`` export's ``args`` and loaded from it (legacy: its strict ``load_state_dict``; torch_dist: its
    ``dist_checkpointing.load``), ours from the checkpoint."""
    from megatron.core import dist_checkpointing

    run, meg = tmp_path / "run", tmp_path / fmt
    if not run.exists():
        our_checkpoint(run, SHAPES[shape], step=3, scale=0.3)
    reader, common, config = open_checkpoint(str(run))
    assert convert.main(["to-megatron", str(run), str(meg), "--format", fmt, "--no-optim"]) == 0
    if fmt == "legacy":
        saved = safe_load(str(meg / "iter_0000003" / "mp_rank_00" / FILE))
        theirs = core_model(mcore, saved["args"])
        theirs.load_state_dict(saved["model"], strict=True)
    else:
        theirs = core_model(mcore, safe_load(str(meg / "iter_0000003" / "common.pt"))["args"])
        with torch.serialization.safe_globals([argparse.Namespace]):
            loaded = dist_checkpointing.load({"model": theirs.sharded_state_dict()}, str(meg / "iter_0000003"))
        theirs.load_state_dict(loaded["model"], strict=True)
    for i, values in biases(config).items():
        layer = (theirs.decoder.layers[int(i)] if int(i) < config.model.num_layers else
                 theirs.mtp.layers[int(i) - config.model.num_layers].transformer_layer)
        assert layer.mlp.router.expert_bias.tolist() == pytest.approx(values), i
    return config, our_model(reader, config, common), theirs


@pytest.mark.parametrize("shape", ["q_lora", "q_proj"])
def test_megatron_core_loads_the_export_with_our_logits(tmp_path, mcore, shape):
    tokens, _ = tokens_and_labels()
    for fmt in ("legacy", "torch_dist"):
        _, ours, theirs = exported_pair(mcore, tmp_path, shape, fmt)
        with torch.no_grad():
            assert_close_to_scale(core_forward(theirs.eval(), tokens), ours.eval()(tokens), f"{fmt} logits")


def training_forward(mcore, config, ours, theirs):
    """Both models' training forward on the same batch, each side's aux-loss and MTP-loss scale 1: (our per-token
    language-model losses, Megatron Core's, our per-depth MTP token means, Megatron Core's record of them)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron.data.future_tokens import future_fields
    from megatron.model.mtp import MTPInputs

    tokens, labels = tokens_and_labels()
    fields = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(tokens.shape),
              "position_ids": torch.arange(tokens.shape[1]).expand_as(tokens)}
    inputs = MTPInputs.from_batch(future_fields(fields, config.model.mtp_num_layers))
    moe.set_aux_loss_scale(1.0)
    mcore["scaler"].set_loss_scale(torch.tensor(1.0))
    moe.before_step(ours, micro_batches=1, dp_group=None, loss_scale=1.0)
    mcore["tracker"].get_moe_layer_wise_logging_tracker().clear()  # sized by the first model to record: 4 layers
    MTPLossLoggingHelper.tracker.clear()
    try:
        want = core_forward(theirs.train(), tokens, labels)
        depths = MTPLossLoggingHelper.tracker["values"].clone()
    finally:
        MTPLossLoggingHelper.tracker.clear()
    got = ours.train()(tokens, labels=labels, mtp=inputs)
    sums, counts = ours.mtp.records[-1]
    return got, want, (sums / counts).float(), depths


@pytest.mark.parametrize("shape, fmt", [("mtp", "legacy"), ("mtp", "torch_dist"), ("gpt2_mtp", "legacy"),
                                        ("gpt2_mtp", "torch_dist")])
def test_megatron_cores_multi_token_prediction_equals_ours(tmp_path, mcore, shape, fmt):
    """With two prediction modules (their layers MoE, as the decoder's last), and GPT-2's shape with one: Megatron
    Core, given the export, gives our language model's per-token losses, each depth's loss (its
    ``MTPLossLoggingHelper`` record: the token mean) and, after a backward of the same objective (the mean LM loss,
    the depths' scaled means, the routers' sequence aux loss, each side's loss scale 1), every parameter's
    gradient."""
    from megatron.checkpoint.megatron_lm.core_names import from_megatron_core

    config, ours, theirs = exported_pair(mcore, tmp_path, shape, fmt)
    got, want, depths, core_depths = training_forward(mcore, config, ours, theirs)
    assert_close_to_scale(got.detach(), want.detach(), "the language model's losses")
    assert_close_to_scale(depths, core_depths, "each depth's loss")
    want.mean().backward()
    got.mean().backward()
    swiglu = bool(config.model.swiglu)
    theirs_grads = dict(from_megatron_core(n, p.grad, swiglu) for n, p in theirs.named_parameters())
    ours_grads = {n: p.grad for n, p in ours.named_parameters()}
    last = config.model.mtp_num_layers - 1
    assert theirs_grads.keys() == ours_grads.keys() and any(n.startswith(f"mtp.layers.{last}.") for n in ours_grads)
    for name, grad in ours_grads.items():
        assert_close_to_scale(theirs_grads[name], grad, f"the gradient of {name}")


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_megatron_cores_own_checkpoint_gives_its_losses_here(tmp_path, mcore, fmt):
    """Megatron Core's own GPTModel of the DeepSeek-V3 shape with two prediction modules (its initialisation,
    perturbed; expert biases set), saved as Megatron-LM saves it (legacy: its state dict; torch_dist: its
    ``dist_checkpointing.save``), converts with ``from-megatron`` and gives its losses here: the language model's
    per token (with MTP, Megatron Core's forward wants labels and returns no logits) and each depth's."""

    from megatron.checkpoint.megatron_lm.args import to_args

    config = parse_config([*TINY, *SHAPES["mtp"]])
    validate(config)
    args = to_args(config.model, tp=1, pp=1, seq_length=8, iteration=6, consumed_train_samples=24)
    theirs = core_model(mcore, args)
    g = torch.Generator().manual_seed(5)
    bias = {"1": [0.3, -0.2, 0.1, -0.05], "2": [-0.1, 0.2, 0.0, 0.1], "3": [0.05, 0.0, -0.2, 0.3]}
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
        for layer in (theirs.decoder.layers[1], *(m.transformer_layer for m in theirs.mtp.layers)):
            layer.mlp.router.expert_bias.copy_(torch.tensor(bias[str(layer.layer_number - 1)]))
    save_as_megatron(theirs, args, tmp_path / "meg", 6, fmt)
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")]) == 0
    reader, common, back = open_checkpoint(str(tmp_path / "ours"))
    assert back.model == config.model
    assert_biases(common["train_state"]["moe_expert_bias"], bias)
    with torch.no_grad():
        got, want, depths, core_depths = training_forward(mcore, back, our_model(reader, back, common), theirs)
    assert_close_to_scale(got, want, "the language model's losses")
    assert_close_to_scale(depths, core_depths, "each depth's loss")


def test_core_order_is_megatron_cores_parameter_order(mcore):
    """What to-megatron numbers the legacy optimizer's states by: Megatron Core's ``named_parameters`` order, here
    with multi-latent attention's projections and norms, the router, experts and shared expert."""
    config = parse_config([*TINY, *SHAPES["mtp"]])
    validate(config)
    from megatron.checkpoint.megatron_lm.args import to_args

    theirs = core_model(mcore, to_args(config.model, tp=1, pp=1, seq_length=8, iteration=0,
                                       consumed_train_samples=0))
    names = [n for n, _ in theirs.named_parameters()]
    assert core_order(reversed(names)) == names
