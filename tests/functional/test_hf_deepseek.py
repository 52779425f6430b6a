"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``) export and import of our multi-latent-attention GPT:
transformers computes the export's logits and loss as our model does (YaRN, the latent norms at our epsilon,
DeepSeek-V3's router with the expert bias, group-limited routing, a shared expert padded to whole units, dense
first layers), its multi-token prediction drafter reads our MTP layers; it scores a trained DeepSeek-shaped run's
validation tokens at the run's validation loss; HF -> ours -> HF is bitwise; a ``rope_interleave: false`` folder
imports to our logits; and what either side cannot represent is refused in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from megatron import moe, parallel_state
from megatron.checkpoint.convert import open_checkpoint, read_tensors, write_params
from megatron.checkpoint.hf import deepseek_v3 as hf_deepseek
from megatron.checkpoint.hf.common import ConversionError
from megatron.config import parse_config, validate
from megatron.data.loader import build_batch
from megatron.parallelize_gpt import build_model
from megatron.tensor_parallel import tensor_parallel_seed
from tests.functional import test_deepseek_layouts  # noqa: F401  (registers the shared run deepseek-5)
from tests.functional.launch import losses, program_module, run_tool_here

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402  (installed with transformers)

convert = program_module("tools/convert_checkpoint.py")
VOCAB, SEQ, E = 250, 32, 8  # vocab 250 pads to 256: the padding rows are exercised
LLAMA = ["--mock-data", "--device", "cpu", "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--vocab-size", str(VOCAB), "--max-seq-len", str(SEQ), "--max-position-embeddings", str(SEQ),
         "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0"]
MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
       "--v-head-dim", "12", "--qk-layernorm"]
MOE = ["--num-experts", str(E), "--moe-ffn-hidden-size", "32", "--moe-router-score-function", "sigmoid"]
# DeepSeek-V3's shape, scaled down: the query LoRA, YaRN (its concentration and softmax scale both away from 1), one
# dense layer, 8 experts in 4 groups (2 chosen, top 4), a shared expert of 1.5 units (padded), the expert bias,
# scaled probabilities, an untied head, the default epsilon 1e-5 (the latent rows scaled) and one MTP layer.
DEEPSEEK = [*LLAMA, *MLA, *MOE, "--q-lora-rank", "24", "--rotary-scaling-factor", "4", "--mscale", "0.9",
            "--mscale-all-dim", "0.7", "--original-max-position-embeddings", "8", "--moe-layer-freq", "([0]*1+[1]*2)",
            "--moe-shared-expert-intermediate-size", "48", "--moe-router-topk", "4", "--moe-router-enable-expert-bias",
            "--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
            "--untie-embeddings-and-output-weights", "--mtp-num-layers", "1"]
# The other choices: plain rope, one query projection, every layer MoE with top-1 (not normalised), no groups, no
# shared expert (width 0 there), no expert bias (zeros there), a tied head, epsilon 1e-6 (no scaling), pre-softmax.
PLAIN = [*LLAMA, *MLA, *MOE, "--rope-type", "rope", "--moe-router-topk", "1", "--moe-router-pre-softmax",
         "--layernorm-epsilon", "1e-6"]


def one_line_error(text: str) -> str:
    err = text.strip()
    assert err.startswith("convert_checkpoint.py: error: ") and "\n" not in err, err
    return err


def make_config(flags: list[str]):
    config = parse_config(flags)
    validate(config, world_size=1, cuda_available=False)
    return config


def our_model(config, seed: int = 0):
    """Our model of ``config``, every weight perturbed (norms off 1) and the expert biases random; (model, its
    checkpoint's train state)."""
    parallel_state.initialize()
    tensor_parallel_seed(config.seed, 0, torch.device("cpu"))
    model = build_model(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                p[VOCAB:] = 0.0
        for layer in moe.moe_layers(model):
            if layer.router.expert_bias is not None:
                layer.router.expert_bias.copy_(torch.randn(E, generator=g) * 0.1)
    biases = moe.expert_biases(model)
    return model, {"consumed_samples": 0, "skipped_steps": 0, **({"moe_expert_bias": biases} if biases else {})}


def load_ours(run_dir):
    """Our model of a checkpoint (tp 1 in this process), its expert biases set."""
    reader, common, config = open_checkpoint(str(run_dir))
    parallel_state.initialize()
    model = build_model(config).eval()
    missing, unexpected = model.load_state_dict(read_tensors(reader), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    moe.set_expert_biases(model, common["train_state"].get("moe_expert_bias") or {})
    return model


@pytest.mark.parametrize("flags", [DEEPSEEK, PLAIN], ids=["deepseek-v3-shape", "plain-rope-tied-top1"])
def test_transformers_computes_the_exports_logits_loss_and_mtp(tmp_path, flags):
    config = make_config(flags)
    model, train_state = our_model(config)
    write_params(str(tmp_path / "ckpt"), config, {n: p.detach() for n, p in model.named_parameters()},
                 train_state=train_state)
    done = run_tool_here("tools/convert_checkpoint.py", "to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    m, n = config.model, config.model.num_layers
    mtp_keys = {key for key in info["unexpected_keys"] if key.startswith(f"model.layers.{n}.")}
    assert not info["missing_keys"] and not info["mismatched_keys"] and info["unexpected_keys"] == mtp_keys, info
    assert bool(mtp_keys) == bool(m.mtp_num_layers)  # transformers' main model leaves the MTP layer aside
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, out = model(ids), hf.eval()(ids, labels=ids)
        our_loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    assert ours.abs().max() > 1.0  # not a near-zero comparison
    torch.testing.assert_close(ours[..., :VOCAB], out.logits, rtol=0, atol=1e-5)
    assert abs(float(our_loss) - float(out.loss)) < 1e-5
    if not m.mtp_num_layers:
        return
    # transformers' drafter (its MtpModel, the layers DeepSeek's checkpoints hold past num_hidden_layers) on the
    # model's normed last hidden state and the tokens one on: our MTP layer's logits
    from transformers.modeling_layers import MtpModel

    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}.*"]  # transformers lists DeepSeek-V3's 61 only
    drafter = MtpModel.from_pretrained(hf).eval()
    s, positions = SEQ - 1, torch.arange(1, SEQ).expand(2, -1)
    with torch.no_grad():
        hidden = model.hidden_states(ids[:, :s])
        mtp = model.mtp.layers[0](hidden, model.embedding(ids[:, 1:], positions), model.rotary(positions - 1), None)
        ours = model.parallel_logits(mtp).transpose(0, 1)[..., :VOCAB]
        theirs = drafter._project_to_logits(drafter.forward_layer(0, hf.model(ids[:, :s]).last_hidden_state,
                                                                 positions, None, input_ids=ids[:, 1:]))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def hf_model(seed: int = 0, **overrides):
    """A tiny random ``DeepseekV3ForCausalLM`` (every weight and expert bias perturbed): YaRN, the query LoRA, one dense
    layer, 8 experts in 4 groups (2 chosen), top 4, 2 shared units."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=E,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=SEQ, rms_norm_eps=1e-6, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 8, "mscale": 0.9, "mscale_all_dim": 0.7},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**settings, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def test_hf_to_ours_to_hf_is_bitwise_and_keeps_the_logits(tmp_path):
    src, model = tmp_path / "hf_in", hf_model()
    model.save_pretrained(str(src))
    done = run_tool_here("tools/convert_checkpoint.py", "from-hf", str(src), str(tmp_path / "ours"), "--tp", "2")
    assert done.returncode == 0, done.stderr
    _, common, config = open_checkpoint(str(tmp_path / "ours"))
    m = config.model
    assert (m.multi_latent_attention, m.q_lora_rank, m.moe_layer_freq, m.moe_shared_expert_intermediate_size,
            m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_enable_expert_bias, m.rope_type,
            m.rotary_scaling_factor, m.mtp_num_layers) == (True, 24, "([0]*1+[1]*2)", 48, 4, 2, True, "yarn", 4.0, None)
    bias = model.model.layers[2].mlp.gate.e_score_correction_bias
    assert common["train_state"]["moe_expert_bias"]["2"] == bias.tolist()  # the expert bias in the train state
    # transformers 5's in-memory (fused) experts read as the saved form
    model_cfg = parse_config(hf_deepseek.model_flags(model.config.to_dict())).model
    fused = hf_deepseek.from_hf_state_dict(model.state_dict(), model_cfg, 256)
    hub = hf_deepseek.from_hf_state_dict(load_file(str(src / "model.safetensors")), model_cfg, 256)
    assert fused.keys() == hub.keys() and all(torch.equal(fused[k], hub[k]) for k in hub)
    assert run_tool_here("tools/convert_checkpoint.py", "to-hf", str(tmp_path / "ours"),
                         str(tmp_path / "hf_out")).returncode == 0
    before, after = (load_file(str(d / "model.safetensors")) for d in (src, tmp_path / "hf_out"))
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    a, b = (transformers.DeepseekV3Config.from_pretrained(str(d)).to_dict() for d in (src, tmp_path / "hf_out"))
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "n_shared_experts",
                "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
                "first_k_dense_replace", "norm_topk_prob", "rms_norm_eps", "tie_word_embeddings", "rope_interleave"):
        assert a[key] == b[key], key
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "hf_out")).eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)  # the same rotary and softmax scales too


@pytest.mark.parametrize("overrides", [
    {"rope_interleave": False},
    {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "rms_norm_eps": 1e-5,
     "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
], ids=["rotate-half-rope", "one-query-projection-plain-rope-eps-1e-5"])
def test_our_import_computes_transformers_logits(tmp_path, overrides):
    model = hf_model(seed=3, **overrides)
    model.save_pretrained(str(tmp_path / "hf"))
    done = run_tool_here("tools/convert_checkpoint.py", "from-hf", str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert done.returncode == 0, done.stderr
    ours = load_ours(tmp_path / "ours")
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[..., :VOCAB], model(ids).logits, rtol=0, atol=1e-5)


def test_mtp_layers_go_back_and_forth(tmp_path):
    """Ours (with MTP) -> HF -> ours is bitwise; a folder whose config names MTP layers its weights lack (transformers'
    own save drops them) imports without them, saying so."""
    config = make_config(DEEPSEEK + ["--layernorm-epsilon", "1e-6"])  # the latent rows unscaled: bitwise
    model, train_state = our_model(config, seed=5)
    params = {n: p.detach() for n, p in model.named_parameters()}
    write_params(str(tmp_path / "ckpt"), config, params, train_state=train_state)
    for command, source, target in (("to-hf", "ckpt", "hf"), ("from-hf", "hf", "back")):
        done = run_tool_here("tools/convert_checkpoint.py", command, str(tmp_path / source), str(tmp_path / target))
        assert done.returncode == 0, done.stderr
    reader, common, back = open_checkpoint(str(tmp_path / "back"))
    assert back.model.mtp_num_layers == 1 and back.model.moe_shared_expert_intermediate_size == 64  # padded
    tensors = read_tensors(reader)
    assert sorted(tensors) == sorted(params)
    shared = "mtp.layers.0.transformer_layer.mlp.shared_expert."
    for name in params:
        want = params[name]
        if name.startswith(("layers.1.mlp.shared_expert.", "layers.2.mlp.shared_expert.", shared)):
            down = name.endswith("dense_4h_to_h.weight")  # 48 units and 16 zero ones (gate/up rows interleaved)
            got, pad = (tensors[name][:, :48], tensors[name][:, 48:]) if down else (tensors[name][:96],
                                                                                    tensors[name][96:])
            assert not pad.any(), name
        else:
            got = tensors[name][:want.shape[0]] if name.startswith(("embedding.", "output_layer")) else tensors[name]
        assert torch.equal(got, want), name
    assert common["train_state"]["moe_expert_bias"] == train_state["moe_expert_bias"]
    resaved = tmp_path / "resaved"  # transformers' save_pretrained leaves the MTP layer out
    transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "hf")).save_pretrained(str(resaved))
    done = run_tool_here("tools/convert_checkpoint.py", "from-hf", str(resaved), str(tmp_path / "no_mtp"))
    assert done.returncode == 0 and "imported without them" in done.stdout, done.stderr
    assert open_checkpoint(str(tmp_path / "no_mtp"))[2].model.mtp_num_layers is None


@pytest.mark.parametrize("change, message", [
    ({"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False},
     "moe_router_score_function softmax has no Hugging Face DeepSeek-V3 (DeepseekV3ForCausalLM) equivalent (its "
     "router is a sigmoid), so this checkpoint cannot be exported."),
    ({"moe_router_topk": 2}, "group-limited routing with moe_router_topk 2 and moe_router_group_topk 2"),
    ({"moe_layer_freq": "[1,0,1]"}, "moe_layer_freq [1,0,1] has no"),
    ({"qk_layernorm": False}, "multi-latent attention without qk_layernorm has no"),
    ({"moe_expert_capacity_factor": 1.0}, "moe_expert_capacity_factor 1.0 has no"),
    ({"rope_type": "rope"}, "rope_type rope with rotary_scaling_factor 4.0 and mscale_all_dim 0.7 has no"),
])
def test_to_hf_refuses_what_deepseek_v3_has_not(change, message):
    model_cfg = dataclasses.replace(make_config(DEEPSEEK).model, **change)
    with pytest.raises(ConversionError) as err:
        convert.converter_for_model(model_cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-in")
    hf_model().save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "fp8"}}, "sets quantization_config (DeepSeek's FP8 weights)"),
    ({"num_experts_per_tok": 6}, "scores a group by its top 2 experts, this GPT's by its top num_experts_per_tok"),
    ({"norm_topk_prob": False}, "sets norm_topk_prob False with num_experts_per_tok 4"),
    ({"attention_bias": True}, "sets attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 16,
                          "original_max_position_embeddings": 8}}, "sets YaRN's {'beta_fast': 16}"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0}}, "sets rope type 'llama3'"),
])
def test_from_hf_refuses_what_our_gpt_cannot_represent(tmp_path, hf_dir, change, message):
    src = tmp_path / "hf"
    src.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    (src / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    done = run_tool_here("tools/convert_checkpoint.py", "from-hf", str(src), str(tmp_path / "out"))
    assert done.returncode == 2 and message in one_line_error(done.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # reads a trained run (the DeepSeek layouts' shared reference)
@pytest.mark.shared_runs("deepseek-5")
def test_transformers_scores_a_trained_runs_validation_tokens_at_its_validation_loss(parity, tmp_path):
    """tests/functional/test_deepseek_layouts.py's deepseek-5 run (MLA with YaRN, DeepSeek-V3's router with a trained
    expert bias, a shared expert of 1.5 units, one MTP layer, epsilon 1e-5): its step-5 checkpoint's export scores
    the run's validation samples at its validation loss; tools/evaluate.py gives the checkpoint transformers' loss
    and tools/generate.py transformers' greedy tokens (both routing with the checkpoint's expert biases)."""
    run_dir = parity.outcome("deepseek-5").check()
    done = run_tool_here("tools/convert_checkpoint.py", "to-hf", str(run_dir), str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    _, common, config = open_checkpoint(str(run_dir))
    assert common["step"] == 5 and any(any(b) for b in common["train_state"]["moe_expert_bias"].values())
    _, valid, _ = program_module("pretrain_gpt.py").datasets_provider(config)
    samples = [valid[i] for i in range(config.eval_iters * config.batch_size.global_batch_size)]
    batch = build_batch(samples, valid.eod_id, config.dataset.eod_mask_loss)
    with torch.no_grad():
        logits = model(batch["tokens"]).logits
    token_losses = F.cross_entropy(logits.flatten(0, 1).double(), batch["labels"].flatten(), reduction="none")
    theirs = float((token_losses * batch["loss_mask"].flatten()).sum() / batch["loss_mask"].sum())
    ours = losses(run_dir, "valid")
    assert len(ours) == 1 and abs(theirs - ours[0]) < 1e-5, (theirs, ours)
    # tools/evaluate.py routes with the checkpoint's expert biases too (without them: 1e-3 off here)
    ids = torch.randint(0, VOCAB - 1, (SEQ + 1,), generator=torch.Generator().manual_seed(4)).tolist()
    (tmp_path / "ids.txt").write_text(" ".join(map(str, ids)))
    done = run_tool_here("tools/evaluate.py", "--task", "perplexity", "--input", str(tmp_path / "ids.txt"), "--load",
                         str(run_dir), "--overlapping-eval", str(SEQ), "--tokenizer-type", "NullTokenizer")
    assert done.returncode == 0, done.stderr[-2000:]
    loss = json.loads(done.stdout.strip().splitlines()[-1])["strided"]["loss"]
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0]
    assert loss == pytest.approx(float(F.cross_entropy(logits.double(), torch.tensor(ids[1:]))), abs=1e-5)
    # generation: the checkpoint's expert biases in the loaded routers, transformers' greedy tokens
    from megatron.inference.loader import load_model

    parallel_state.initialize()
    loaded, _ = load_model(str(run_dir))
    assert {str(layer.layer_number): layer.router.expert_bias.tolist() for layer in moe.moe_layers(loaded)} == \
        common["train_state"]["moe_expert_bias"]
    prompt = [5, 17, 42, 8, 99, 3]
    done = run_tool_here("tools/generate.py", "--load", str(run_dir), "--prompt", " ".join(map(str, prompt)),
                         "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos", "--output-format", "jsonl",
                         "--tokenizer-type", "NullTokenizer")
    assert done.returncode == 0, done.stderr[-2000:]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert json.loads(done.stdout.strip().splitlines()[-1])["tokens"] == theirs
