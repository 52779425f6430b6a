"""Hugging Face Mixtral (``MixtralForCausalLM``) export and import of our mixture-of-experts GPT: transformers scores
the export of a trained MoE run's validation tokens at the run's validation loss, and greedily generates what
tools/generate.py generates from the checkpoint; tools/evaluate.py gives the checkpoint transformers' loss;
HF -> ours -> HF is bitwise (the Hub's form, and transformers 5's fused form read back the same); and every MoE
setting Mixtral has not is refused in one line, both ways."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from megatron.checkpoint.convert import open_checkpoint, tensor_layout, write_params
from megatron.checkpoint.hf import mixtral as X
from megatron.checkpoint.hf.common import ConversionError
from megatron.config import parse_config, validate
from megatron.data.loader import build_batch
from tests.functional.launch import TINY, losses, parity_layouts, program_module, run_here, run_tool_here

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402  (installed with transformers)

convert = program_module("tools/convert_checkpoint.py")
VOCAB, SEQ, E, F_EXPERT = 250, 32, 4, 48  # vocab 250 pads to 256: the padding rows are exercised
# A Llama-shaped MoE: 4 query heads in 2 key/value groups, 4 SwiGLU experts of width 48, top-2, no biases.
MIXTRAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
           "--num-query-groups", "2", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
           "--disable-bias-linear", "--rotary-base", "500000", "--layernorm-epsilon", "1e-6", "--vocab-size",
           str(VOCAB), "--max-seq-len", str(SEQ), "--max-position-embeddings", str(SEQ), "--num-experts", str(E),
           "--moe-router-topk", "2", "--ffn-hidden-size", str(F_EXPERT), "--moe-aux-loss-coeff", "0.01"]


def one_line_error(text: str) -> str:
    err = text.strip()
    assert err.startswith("convert_checkpoint.py: error: ") and "\n" not in err, err
    return err


# ---------------------------------------------------------------- a trained run, scored by transformers

# TINY's data and optimizer, 2 steps of one micro-batch, the one evaluation at the end (of the weights the save at
# the end holds).
RUN = [*TINY, *MIXTRAL, "--max-steps", "2", "--global-batch-size", "8", "--micro-batch-size", "8", "--eval-freq",
       "1000", "--tokenizer-type", "NullTokenizer"]
# The runs whose export transformers scores: name -> (processes, flags added to RUN). One process trains here, in
# this process; a run of several joins the shared launch of its world size (its name in SHARED). The run is trained
# with expert parallelism (each of the 2 ranks holds 2 of the 4 experts): its checkpoint names every expert globally.
RUNS = {"ep2": (2, ["--expert-model-parallel-size", "2", "--micro-batch-size", "4"])}
SHARED = parity_layouts({f"mixtral-hf-{name}": (nproc, [*RUN, *flags])
                         for name, (nproc, flags) in RUNS.items() if nproc > 1})


@pytest.fixture(scope="module", params=list(RUNS))
def moe_run(request, tmp_path_factory):
    """A trained Llama-shaped MoE run's folder (its step-2 checkpoint and metrics.jsonl)."""
    nproc, flags = RUNS[request.param]
    if nproc > 1:
        return request.getfixturevalue("parity").outcome(f"mixtral-hf-{request.param}").check()
    out = tmp_path_factory.mktemp(f"mixtral-{request.param}") / "run"
    done = run_here(*RUN, *flags, "--save", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def exported(moe_run, tmp_path_factory):
    """(the run's folder, its Hugging Face export, the MixtralForCausalLM loaded from it)."""
    hf_dir = tmp_path_factory.mktemp("mixtral-hf") / "hf"
    done = run_tool_here("tools/convert_checkpoint.py", "to-hf", str(moe_run), str(hf_dir))
    assert done.returncode == 0, done.stderr
    model, info = transformers.MixtralForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    return moe_run, hf_dir, model.eval()


@pytest.mark.slow  # trains
@pytest.mark.shared_runs(*SHARED)
def test_transformers_scores_the_runs_validation_tokens_at_its_validation_loss(exported):
    run_dir, hf_dir, model = exported
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"], cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (
        ["MixtralForCausalLM"], "mixtral", E, 2)
    assert (cfg["intermediate_size"], cfg["router_aux_loss_coef"], cfg["output_router_logits"]) == (F_EXPERT, 0.01,
                                                                                                   False)
    _, common, config = open_checkpoint(str(run_dir))
    assert common["step"] == 2
    # the validation samples of the run: eval_iters global batches from the start of the valid split
    _, valid, _ = program_module("pretrain_gpt.py").datasets_provider(config)
    samples = [valid[i] for i in range(config.eval_iters * config.batch_size.global_batch_size)]
    batch = build_batch(samples, valid.eod_id, config.dataset.eod_mask_loss)
    with torch.no_grad():
        logits = model(batch["tokens"]).logits
    token_losses = F.cross_entropy(logits.flatten(0, 1).double(), batch["labels"].flatten(), reduction="none")
    theirs = float((token_losses * batch["loss_mask"].flatten()).sum() / batch["loss_mask"].sum())
    ours = losses(run_dir, "valid")
    assert len(ours) == 1 and abs(theirs - ours[0]) < 1e-4, (theirs, ours)


@pytest.mark.slow  # trains
@pytest.mark.shared_runs(*SHARED)
def test_generate_and_evaluate_on_the_checkpoint_agree_with_transformers(exported, tmp_path):
    run_dir, _, model = exported
    prompt = [5, 17, 42, 8, 99, 3]
    done = run_tool_here("tools/generate.py", "--load", str(run_dir), "--prompt", " ".join(map(str, prompt)),
                         "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos", "--output-format", "jsonl")
    assert done.returncode == 0, done.stderr[-2000:]
    ours = json.loads(done.stdout.strip().splitlines()[-1])["tokens"]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs
    ids = torch.randint(0, VOCAB - 1, (SEQ + 1,), generator=torch.Generator().manual_seed(4)).tolist()
    (tmp_path / "ids.txt").write_text(" ".join(map(str, ids)))
    done = run_tool_here("tools/evaluate.py", "--task", "perplexity", "--input", str(tmp_path / "ids.txt"),
                         "--load", str(run_dir), "--overlapping-eval", str(SEQ))  # one window: the ids' own loss
    assert done.returncode == 0, done.stderr[-2000:]
    loss = json.loads(done.stdout.strip().splitlines()[-1])["strided"]["loss"]
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0]
    assert loss == pytest.approx(float(F.cross_entropy(logits.double(), torch.tensor(ids[1:]))), abs=1e-5)


# ---------------------------------------------------------------- HF -> ours -> HF


def hf_model(tie: bool, seed: int = 0):
    """A tiny random ``MixtralForCausalLM`` (every weight perturbed, so norms are not 1)."""
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=F_EXPERT, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ, rms_norm_eps=1e-6, rope_theta=500000.0, num_local_experts=E,
        num_experts_per_tok=2, router_aux_loss_coef=0.02, tie_word_embeddings=tie, bos_token_id=None,
        eos_token_id=None)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # a tied head is the same Parameter: perturbed once
            p.add_(torch.randn_like(p) * 0.1)
    return model


# What config.json must keep through the round trip (the model's shape and routing).
KEPT = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "hidden_act",
        "tie_word_embeddings", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "sliding_window",
        "router_jitter_noise", "output_router_logits", "model_type", "architectures")


@pytest.mark.parametrize("tie, tp", [(False, 1), (True, 2)], ids=["untied-tp1", "tied-tp2"])
def test_hf_to_our_checkpoint_to_hf_is_bitwise(tmp_path, tie, tp):
    src = tmp_path / "hf_in"
    hf_model(tie).save_pretrained(str(src))
    done = run_tool_here("tools/convert_checkpoint.py", "from-hf", str(src), str(tmp_path / "ours"), "--tp", str(tp))
    assert done.returncode == 0, done.stderr
    reader, common, config = open_checkpoint(str(tmp_path / "ours"))
    m = config.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_aux_loss_coeff, m.num_query_groups) == (
        E, 2, F_EXPERT, 0.02, 2)
    assert len({p["rank"] for p in reader.metadata["pieces"]}) == tp  # the experts cut over the tp ranks
    done = run_tool_here("tools/convert_checkpoint.py", "to-hf", str(tmp_path / "ours"), str(tmp_path / "hf_out"))
    assert done.returncode == 0, done.stderr
    before = load_file(str(src / "model.safetensors"))
    after = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    if tie:
        before.pop("lm_head.weight", None)  # tied: written or not depending on the transformers version
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in after and before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    a, b = (transformers.MixtralConfig.from_pretrained(str(d)).to_dict() for d in (src, tmp_path / "hf_out"))
    assert {k: a[k] for k in KEPT} == {k: b[k] for k in KEPT}
    assert (a["head_dim"] or 16, b["head_dim"] or 16) == (16, 16)


def test_the_fused_form_of_transformers_5_imports_like_the_hubs_and_rows_interleave(tmp_path):
    model = hf_model(tie=False, seed=1)
    model.save_pretrained(str(tmp_path / "hf"))
    model_cfg = parse_config(X.model_flags(model.config.to_dict())).model
    hub = X.from_hf_state_dict(load_file(str(tmp_path / "hf" / "model.safetensors")), model_cfg, 256)
    fused = X.from_hf_state_dict(model.state_dict(), model_cfg, 256)  # mlp.experts.gate_up_proj [E, 2f, h], ...
    assert hub.keys() == fused.keys() == set(X.name_map(model_cfg))
    assert all(torch.equal(hub[k], fused[k]) for k in hub)
    experts = model.model.layers[1].mlp.experts
    h_to_4h = hub["layers.1.mlp.experts.2.dense_h_to_4h.weight"]  # rows 2j: gate_j, 2j + 1: up_j
    assert torch.equal(h_to_4h[0::2], experts.gate_up_proj[2, :F_EXPERT])
    assert torch.equal(h_to_4h[1::2], experts.gate_up_proj[2, F_EXPERT:])
    assert torch.equal(hub["layers.1.mlp.experts.2.dense_4h_to_h.weight"], experts.down_proj[2])
    assert torch.equal(hub["layers.0.mlp.router.weight"], model.model.layers[0].mlp.gate.weight)


# ---------------------------------------------------------------- refusals


def base_config():
    config = parse_config(["--mock-data", "--device", "cpu", *MIXTRAL])
    validate(config, world_size=1, cuda_available=False)
    return config


@pytest.mark.parametrize("fields, setting", [
    ({"moe_shared_expert_intermediate_size": 32}, "a shared expert (moe_shared_expert_intermediate_size 32)"),
    ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function sigmoid"),
    ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax"),
    ({"moe_layer_freq": "2"}, "moe_layer_freq 2 (dense layers [1])"),
    ({"moe_layer_freq": "[1,0]"}, "moe_layer_freq [1,0] (dense layers [1])"),
    ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias"),
    ({"moe_expert_capacity_factor": 1.0}, "moe_expert_capacity_factor 1.0"),
    ({"disable_bias_linear": False}, "linear biases (disable_bias_linear off)"),
    ({"normalization": "LayerNorm"}, "normalization LayerNorm"),
])
def test_a_moe_model_without_a_mixtral_equivalent_is_refused_naming_the_setting(fields, setting):
    model_cfg = dataclasses.replace(base_config().model, **fields)
    with pytest.raises(ConversionError) as err:
        X.check_model(model_cfg)  # what to-hf runs for a MoE model without a shared expert
    message = str(err.value)
    assert message.startswith(f"{setting} has no Hugging Face Mixtral") and "\n" not in message, message
    assert ". " not in message  # one sentence


def test_export_of_a_pre_softmax_checkpoint_is_one_line_and_writes_nothing(tmp_path):
    config = parse_config(["--mock-data", "--device", "cpu", *MIXTRAL, "--moe-router-pre-softmax"])
    validate(config, world_size=1, cuda_available=False)
    write_params(str(tmp_path / "ckpt"), config,
                 {name: torch.zeros(shape) for name, (shape, _) in tensor_layout(config).items()})
    done = run_tool_here("tools/convert_checkpoint.py", "to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert done.returncode == 2
    assert "moe_router_pre_softmax has no Hugging Face Mixtral (MixtralForCausalLM) equivalent (Mixtral renormalises" \
        in one_line_error(done.stderr)
    assert not (tmp_path / "hf").exists()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral-in") / "hf"
    hf_model(tie=False).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("change, message", [
    ({"sliding_window": 16}, "sliding_window 16; Mixtral's sliding window is not mapped here"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1; this GPT's router has no input jitter"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok (5) must be from 1 to num_local_experts (4)"),
    ({"num_local_experts": 8}, "missing 24 (first 'model.layers.0.block_sparse_moe.experts.4.w1.weight')"),
    ({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]},
     "'gemma3_text' model (Gemma3ForCausalLM)"),
])
def test_unsupported_mixtral_configs_are_refused_in_one_line(tmp_path, hf_dir, change, message):
    folder = tmp_path / "hf"
    folder.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    (folder / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    done = run_tool_here("tools/convert_checkpoint.py", "from-hf", str(folder), str(tmp_path / "out"))
    assert done.returncode == 2 and message in one_line_error(done.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--moe-router-topk", "1"], "moe_router_topk is 2 in config.json; it cannot be changed (got 1)"),
    (["--moe-layer-freq", "2"], "moe_layer_freq is 1 in config.json; it cannot be changed (got 2)"),
    (["--moe-router-pre-softmax"], "moe_router_pre_softmax is False in config.json; it cannot be changed"),
])
def test_an_import_refuses_flags_that_change_the_experts(tmp_path, hf_dir, flags, message):
    done = run_tool_here("tools/convert_checkpoint.py", "from-hf", str(hf_dir), str(tmp_path / "out"), *flags)
    assert done.returncode == 2 and message in one_line_error(done.stderr)
    assert not (tmp_path / "out").exists()
