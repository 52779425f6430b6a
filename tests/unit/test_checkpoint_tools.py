"""Checkpoint tools: Hugging Face GPT-2 export/import (logits equal, bitwise round trip), the offline
writer read back by the real loader, resharding, checkpoint_info, and one-line errors (exit 2)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron import parallel_state
from megatron.checkpoint import (
    KINDS,
    CheckpointReader,
    load_checkpoint,
    resolve_checkpoint,
    resumed_config,
    save_checkpoint,
)
from megatron.checkpoint.convert import open_checkpoint, tensor_layout, write_params
from megatron.checkpoint.hf.gpt2 import ConversionError, from_hf_state_dict, hf_config, name_map, to_hf_state_dict
from megatron.config import Config, parse_config, validate
from megatron.data.loader import build_batch
from megatron.distributed.parallelize import parallelize, plan_sharding
from megatron.optimizer import build_optimizer
from megatron.parallelize_gpt import build_model
from megatron.tensor_parallel import tensor_parallel_seed
from megatron.training import train_step
from tests.functional.launch import run_tool_here
from tests.transformers_said import transformers_said

ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ = 250, 32  # vocab 250 pads to 256: the padding rows are exercised
TINY = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", str(VOCAB),
        "--max-seq-len", str(SEQ), "--max-position-embeddings", str(SEQ), "--hidden-dropout", "0",
        "--attention-dropout", "0")
WTE = "embedding.word_embeddings.weight"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert = _tool("convert_checkpoint")
info = _tool("checkpoint_info")


def make_config(*argv: str) -> Config:
    config = parse_config(["--mock-data", "--device", "cpu", *TINY, *argv])
    validate(config, world_size=1, cuda_available=False)
    return config


def our_model(config: Config) -> torch.nn.Module:
    parallel_state.initialize()
    tensor_parallel_seed(config.seed, 0, torch.device("cpu"))
    return build_model(config)


@torch.no_grad()
def load_weights(model: torch.nn.Module, path) -> torch.nn.Module:
    reader = CheckpointReader(resolve_checkpoint(str(path)))
    for name, p in model.named_parameters():
        p.copy_(reader.full("param", name))
    return model.eval()


def random_params(config: Config, seed: int = 0, std: float = 0.1) -> dict[str, torch.Tensor]:
    """Every parameter drawn at random (LayerNorm weights around 1, biases non-zero), so that any wrong
    permutation or transpose changes the logits; the padding rows of the word embedding zero."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, (shape, _) in tensor_layout(config).items():
        t = torch.randn(shape, generator=g) * std
        if "layernorm.weight" in name:
            t += 1.0
        if name == WTE:
            t[config.model.vocab_size:] = 0.0
        params[name] = t
    return params


def tokens(batch: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir, ids: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        return model(ids).logits


def build_buffer_and_optimizer(model, config: Config):
    """(buffer, optimizer) over ``model`` as the Trainer builds them (one process: the model is not wrapped)."""
    plan = plan_sharding(config, parallel_state.get())
    _, buffer, _ = parallelize(model, plan)
    return buffer, build_optimizer(buffer, plan, config)


def trained_checkpoint(out: Path, config: Config, steps: int = 2) -> Path:
    """A checkpoint written by training's own save_checkpoint after ``steps`` AdamW steps."""
    model = our_model(config)
    buffer, optimizer = build_buffer_and_optimizer(model, config)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        batch = build_batch([rng.integers(0, VOCAB - 1, size=SEQ + 1) for _ in range(4)], VOCAB - 1)
        _, result = train_step(pretrain_gpt.forward_step, batch, model, buffer, optimizer, 1e-2, 4)
        assert result.applied
    save_checkpoint(str(out), steps, model, optimizer, parallel_state.get(), config,
                    {"consumed_samples": 4 * steps, "skipped_steps": 0})
    return out


# ---------------------------------------------------------------- the mapping itself


def test_name_map_covers_every_parameter_and_hf_names():
    config = make_config()
    assert set(name_map(config.model.num_layers)) == set(tensor_layout(config))
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{
        k: v for k, v in hf_config(config.model).items() if k not in ("architectures", "model_type")}))
    expected = {k for k in hf.state_dict() if k != "lm_head.weight"}
    assert set(name_map(config.model.num_layers).values()) == expected


def test_qkv_rows_by_head_become_q_k_v_columns():
    config = make_config()
    params = random_params(config)
    hf = to_hf_state_dict(params, config.model)
    heads, h = config.model.num_attention_heads, config.model.hidden_size
    hd = h // heads
    ours = params["layers.0.self_attention.query_key_value.weight"]  # [heads x (q, k, v) x hd, h]
    c_attn = hf["transformer.h.0.attn.c_attn.weight"]  # [h, q | k | v]
    for head in range(heads):
        for j, _ in enumerate("qkv"):
            rows = ours[(head * 3 + j) * hd:(head * 3 + j + 1) * hd]
            cols = c_attn[:, j * h + head * hd:j * h + (head + 1) * hd]
            assert torch.equal(rows, cols.t())
    assert hf["transformer.wte.weight"].shape == (VOCAB, h)  # padding rows dropped
    back = from_hf_state_dict(hf, config.model, config.padded_vocab_size)
    assert back.keys() == params.keys() and all(torch.equal(back[k], params[k]) for k in params)


def test_an_untied_head_and_another_activation_are_refused():
    config = make_config()
    hf = to_hf_state_dict(random_params(config), config.model)
    with pytest.raises(ConversionError, match="does not tie"):
        from_hf_state_dict({**hf, "lm_head.weight": torch.zeros_like(hf["transformer.wte.weight"])}, config.model,
                           config.padded_vocab_size)
    with pytest.raises(ConversionError, match="missing 1"):
        from_hf_state_dict({k: v for k, v in hf.items() if k != "transformer.ln_f.bias"}, config.model, 256)


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("flags, activation", [((), "gelu_new"), (("--no-bias-gelu-fusion",), "gelu")],
                         ids=["gelu-tanh", "gelu-exact"])
def test_export_of_written_weights_gives_hf_the_same_logits(tmp_path, flags, activation):
    """GPT-2's tanh-approximated GELU by default; Megatron Core's exact GELU with --no-bias-gelu-fusion, which
    transformers computes as ``gelu`` (the two differ by ~1e-3 in these logits: each case fails with the other)."""
    config = make_config(*flags)
    write_params(str(tmp_path / "ckpt"), config, random_params(config))
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    hf_config_json = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config_json["activation_function"] == activation and hf_config_json["vocab_size"] == VOCAB
    ids = tokens()
    model = load_weights(our_model(config), tmp_path / "ckpt")
    with torch.no_grad():
        ours = model(ids)
    theirs = hf_logits(tmp_path / "hf", ids)
    assert ours.shape == (3, SEQ, 256) and theirs.shape == (3, SEQ, VOCAB)
    assert ours.abs().max() > 1.0  # not a near-zero comparison
    torch.testing.assert_close(ours[..., :VOCAB], theirs, rtol=0, atol=1e-4)


def test_the_exports_generation_config_makes_transformers_generate_without_a_length_warning(tmp_path):
    """generation_config.json holds no length: with max_length there, transformers logs "Both `max_new_tokens` ...
    and `max_length` ... seem to have been set" at every generate(max_new_tokens=N); with max_new_tokens there, a
    caller's max_length (lm-eval's hf backend's) is overridden and it warns too."""
    transformers = pytest.importorskip("transformers")
    config = make_config()
    write_params(str(tmp_path / "ckpt"), config, random_params(config))
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--no-tokenizer"]) == 0
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert not {"max_length", "max_new_tokens"} & set(generation)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    prompt = tokens(batch=1)[:, :5]
    with transformers_said() as said:
        three = model.generate(prompt, max_new_tokens=3, do_sample=False)
        upto = model.generate(prompt, max_length=SEQ, do_sample=False)
    assert not [m for m in said if "max_length" in m or "max_new_tokens" in m], said
    assert three.shape == (1, 8) and upto.shape == (1, SEQ)  # each caller's own length


def test_export_of_a_trained_checkpoint_gives_hf_the_same_logits(tmp_path):
    config = make_config()
    trained_checkpoint(tmp_path / "run", config)
    assert convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0  # the run folder: latest
    ids = tokens(seed=1)
    with torch.no_grad():
        ours = load_weights(our_model(config), tmp_path / "run")(ids)
    torch.testing.assert_close(ours[..., :VOCAB], hf_logits(tmp_path / "hf", ids), rtol=0, atol=1e-4)


# ---------------------------------------------------------------- import


@pytest.fixture
def hf_dir(tmp_path):
    """A randomly initialised Hugging Face GPT-2 (every weight perturbed), saved with save_pretrained."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                  bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / "hf_in"
    model.save_pretrained(str(path))
    return path


def test_hf_to_ours_to_hf_is_bitwise(tmp_path, hf_dir):
    from safetensors.torch import load_file

    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "ours")]) == 0
    reader, common, config = open_checkpoint(str(tmp_path / "ours"))
    assert common["step"] == 0 and common["adam_step"] == 0.0
    assert common["train_state"] == {"consumed_samples": 0, "skipped_steps": 0}
    m = config.model
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.vocab_size, m.max_position_embeddings,
            m.ffn_hidden_size, m.layernorm_epsilon) == (64, 2, 4, VOCAB, SEQ, 256, 1e-5)
    assert reader.global_shape(WTE) == (256, 64)
    assert torch.count_nonzero(reader.full("param", WTE)[VOCAB:]) == 0  # zero padding rows
    assert convert.main(["to-hf", str(tmp_path / "ours"), str(tmp_path / "hf_out")]) == 0
    before = load_file(str(hf_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    before.pop("lm_head.weight", None)  # tied: written or not depending on the transformers version
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    transformers = pytest.importorskip("transformers")
    a = transformers.GPT2LMHeadModel.from_pretrained(str(hf_dir)).state_dict()
    b = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf_out")).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_imported_checkpoint_loads_through_load_checkpoint_with_hf_logits(tmp_path, hf_dir):
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "ours"), "--max-seq-len", str(SEQ)]) == 0
    config = make_config()
    model = our_model(config)
    _, optimizer = build_buffer_and_optimizer(model, config)
    loaded = load_checkpoint(str(tmp_path / "ours"), model, optimizer, parallel_state.get(), config)
    assert loaded["step"] == 0 and loaded["consumed_samples"] == 0 and not loaded["same_layout"]
    ids = tokens(seed=2)
    with torch.no_grad():
        ours = model.eval()(ids)
    torch.testing.assert_close(ours[..., :VOCAB], hf_logits(hf_dir, ids), rtol=0, atol=1e-4)
    assert ours[..., VOCAB:].abs().max() == 0  # zero padding rows: zero logits


def test_a_run_loading_an_import_takes_only_the_model_from_it(tmp_path, hf_dir):
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "ours"), "--max-steps", "77"]) == 0
    assert open_checkpoint(str(tmp_path / "ours"))[2].max_steps == 77  # common.json: the whole resolved config
    config = resumed_config(["--load", str(tmp_path / "ours"), "--mock-data", "--device", "cpu", "--max-seq-len", "16"])
    m = config.model
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.vocab_size, m.max_position_embeddings) == (
        64, 2, 4, VOCAB, SEQ)
    # the schedule and batch sizes are the loading run's own, not the conversion's
    assert config.max_steps == Config().max_steps and config.optimizer.lr.decay_steps is None
    assert config.batch_size.micro_batch_size is None


def test_from_hf_flags_and_refusals(tmp_path, hf_dir):
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "tp2"), "--tp", "2", "--vocab-size", "300"]) == 0
    reader, _, config = open_checkpoint(str(tmp_path / "tp2"))
    assert config.distributed.mp_degree == 2 and config.model.vocab_size == 300
    assert reader.global_shape(WTE) == (512, 64)  # 300 padded to a multiple of 128 x 2
    assert torch.count_nonzero(reader.full("param", WTE)[VOCAB:]) == 0
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "tp2")]) == 2  # step_0 exists: needs --force
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "x"), "--hidden-size", "128"]) == 2
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "activation_function": "gelu"}))  # exact GELU
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "exact")]) == 0
    assert not open_checkpoint(str(tmp_path / "exact"))[2].model.bias_gelu_fusion
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "y")]) == 2


def test_a_converter_never_writes_into_a_runs_folder(tmp_path, hf_dir, capsys):
    """A run folder's relaunch resumes what its 'latest' names: an import written there would replace its run."""
    run = trained_checkpoint(tmp_path / "run", make_config(), steps=2)
    (run / "metrics.jsonl").write_text('{"split": "train", "step": 1, "loss": 5.0}\n')
    assert convert.main(["from-hf", str(hf_dir), str(run)]) == 2
    assert f"{run} holds a run (" in capsys.readouterr().err and (run / "latest").read_text() == "step_2"
    assert not (run / "step_0").exists()  # reshard writes through the same write_checkpoint


ADAMW_KINDS = KINDS[:3]  # the fp32 master and AdamW's moments (KINDS' last, momentum_buffer, is Muon's)


# ---------------------------------------------------------------- reshard


def test_reshard_to_tp2_keeps_every_tensor_and_kind(tmp_path):
    config = make_config()
    trained_checkpoint(tmp_path / "run", config)
    assert convert.main(["reshard", str(tmp_path / "run"), str(tmp_path / "tp2"), "--tp", "2"]) == 0
    assert (tmp_path / "tp2" / "latest").read_text() == "step_2"
    source, target = CheckpointReader(resolve_checkpoint(str(tmp_path / "run"))), CheckpointReader(
        resolve_checkpoint(str(tmp_path / "tp2")))
    assert source.names == target.names
    for kind in ADAMW_KINDS:
        for name in source.names:
            assert torch.equal(source.full(kind, name), target.full(kind, name)), (kind, name)
    layout = tensor_layout(config)
    for piece in target.metadata["pieces"]:
        dim = layout[piece["name"]][1]
        if dim is None:  # replicated: whole, in rank 0's file
            assert piece["rank"] == 0 and piece["tp_size"] == 1 and piece["partition_dim"] is None
        else:  # a tensor-parallel slice, in its own rank's file
            assert piece["rank"] == piece["tp_rank"] and piece["tp_size"] == 2 and piece["partition_dim"] == dim
    assert target.metadata["layout"]["tp"] == 2
    common = target.common()
    assert common["step"] == 2 and common["adam_step"] == 2.0 and common["train_state"]["consumed_samples"] == 8
    # the resharded checkpoint resumes training: masters, AdamW states and step as saved
    model = our_model(config)
    _, optimizer = build_buffer_and_optimizer(model, config)
    assert load_checkpoint(str(tmp_path / "tp2"), model, optimizer, parallel_state.get(), config)["step"] == 2
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), source.full("param", name))


def test_reshard_repads_the_vocabulary_for_the_new_tp(tmp_path):
    config = make_config("--vocab-size", "300")  # tp 1: 384 rows; tp 2: 512; tp 4: 512
    trained_checkpoint(tmp_path / "run", config, steps=1)
    assert convert.main(["reshard", str(tmp_path / "run"), str(tmp_path / "tp2"), "--tp", "2"]) == 0
    source = CheckpointReader(resolve_checkpoint(str(tmp_path / "run")))
    target = CheckpointReader(resolve_checkpoint(str(tmp_path / "tp2")))
    assert source.global_shape(WTE) == (384, 64) and target.global_shape(WTE) == (512, 64)
    for kind in ADAMW_KINDS:
        assert torch.equal(target.full(kind, WTE)[:384], source.full(kind, WTE))
        assert torch.count_nonzero(target.full(kind, WTE)[384:]) == 0
    assert open_checkpoint(str(tmp_path / "tp2"))[2].padded_vocab_size == 512
    # and back to tp 1: the original shape and values
    assert convert.main(["reshard", str(tmp_path / "tp2"), str(tmp_path / "tp1"), "--tp", "1"]) == 0
    back = CheckpointReader(resolve_checkpoint(str(tmp_path / "tp1")))
    for kind in ADAMW_KINDS:
        for name in source.names:
            assert torch.equal(back.full(kind, name), source.full(kind, name))


def test_reshard_refuses_to_overwrite_its_source_and_bad_sizes(tmp_path):
    config = make_config()
    write_params(str(tmp_path / "run"), config, random_params(config))
    assert convert.main(["reshard", str(tmp_path / "run"), str(tmp_path / "run"), "--tp", "2", "--force"]) == 2
    assert convert.main(["reshard", str(tmp_path / "run"), str(tmp_path / "tp3"), "--tp", "3"]) == 2
    assert not (tmp_path / "tp3" / "step_0").exists()
    assert convert.main(["reshard", str(tmp_path / "run"), str(tmp_path / "tp2"), "--tp", "2"]) == 0
    assert convert.main(["reshard", str(tmp_path / "run"), str(tmp_path / "tp2"), "--tp", "2"]) == 2
    assert convert.main(["reshard", str(tmp_path / "run"), str(tmp_path / "tp2"), "--tp", "2", "--force"]) == 0


def test_a_long_conversion_reports_its_tensors_and_a_short_one_is_quiet(tmp_path, monkeypatch, capsys):
    """megatron/progress.py in the converters: nothing for a conversion shorter than the report interval, lines
    of tensors read / written (stderr is no terminal here) when each tensor takes longer (an interval of 0)."""
    import functools

    from megatron import progress
    from megatron.checkpoint import convert as conversion

    config = make_config()
    write_params(str(tmp_path / "run"), config, random_params(config))
    capsys.readouterr()
    assert convert.main(["reshard", str(tmp_path / "run"), str(tmp_path / "quiet"), "--tp", "2"]) == 0
    assert "tensors" not in capsys.readouterr().err
    monkeypatch.setattr(conversion, "Progress", functools.partial(progress.Progress, interval=0, bar="lines"))
    assert convert.main(["reshard", str(tmp_path / "run"), str(tmp_path / "tp2"), "--tp", "2"]) == 0
    assert convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf"), "--no-tokenizer"]) == 0
    err = capsys.readouterr().err.splitlines()
    layout = tensor_layout(config)
    written = sum(2 if dim is not None else 1 for _, dim in layout.values())  # the tp slices, the rest whole
    writing = [line for line in err if line.startswith("writing tensors: ")]
    assert len(writing) == written + 1 and writing[0].startswith(f"writing tensors: 1/{written} tensors (")
    assert writing[-2].startswith(f"writing tensors: {written}/{written} tensors (100%)")
    assert writing[-1].startswith(f"writing tensors: {written} tensors in 0:")
    reading = [line for line in err if line.startswith("reading param tensors: ")]
    assert reading[-1].startswith(f"reading param tensors: {len(layout)} tensors in 0:")


# ---------------------------------------------------------------- checkpoint_info and errors


def test_checkpoint_info_prints_the_step_sizes_and_shapes(tmp_path, capsys):
    config = make_config()
    trained_checkpoint(tmp_path / "run", config)
    assert info.main([str(tmp_path / "run"), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "step: 2 " in out and "consumed samples 8" in out
    assert "saved under: world_size 1, tp 1, pp 1" in out
    assert "2 layers, hidden 64, 4 heads" in out and "precision fp32" in out
    n = sum(int(np.prod(shape)) for shape, _ in tensor_layout(config).values())
    assert f"tensors: 28, parameters: {n:,}" in out
    for kind in ADAMW_KINDS:
        assert f"  {kind}: {n:,} elements, " in out
    assert "momentum_buffer" not in out  # Muon's, not AdamW's
    assert "embedding.word_embeddings.weight: [256, 64] split along dim 0" in out
    assert "layers.1.mlp.dense_4h_to_h.weight: [64, 256] split along dim 1" in out


def _cli(tool: str, *args: str) -> subprocess.CompletedProcess:
    """checkpoint_info as its own process (a script's exit status, from ``sys.exit(main())``); the converter's
    two commands in this process (``run_tool_here``: the same ``main``, without an interpreter of their own)."""
    if tool != "checkpoint_info":
        return run_tool_here(f"tools/{tool}.py", *args)
    return subprocess.run([sys.executable, str(ROOT / "tools" / f"{tool}.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow  # starts each tool
@pytest.mark.parametrize("tool, args", [
    ("convert_checkpoint", ("to-hf", "{missing}", "{out}")),
    ("convert_checkpoint", ("reshard", "{missing}", "{out}", "--tp", "2")),
    ("checkpoint_info", ("{missing}",)),
], ids=["to-hf", "reshard", "info"])
def test_a_missing_checkpoint_is_exit_2_with_one_line(tmp_path, tool, args):
    args = [a.format(missing=tmp_path / "nowhere", out=tmp_path / "out") for a in args]
    result = _cli(tool, *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "error: no checkpoint at" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_damaged_checkpoint_is_exit_2(tmp_path, capsys):
    config = make_config()
    write_params(str(tmp_path / "run"), config, random_params(config))
    rank_file = tmp_path / "run" / "step_0" / "rank0.bin"
    rank_file.write_bytes(rank_file.read_bytes()[:1000])
    assert convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    assert info.main([str(tmp_path / "run")]) == 2
    assert "incomplete or damaged" in capsys.readouterr().err
    (tmp_path / "run" / "step_0" / "metadata.json").write_text("{")
    assert info.main([str(tmp_path / "run")]) == 2
    assert convert.main(["from-hf", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
