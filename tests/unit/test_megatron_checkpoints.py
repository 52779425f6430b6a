"""Megatron-LM checkpoints in and out (``tools/convert_checkpoint.py from-megatron`` / ``to-megatron``).

- ours -> Megatron legacy cut for tp 2 x pp 2 -> ours is bitwise (GPT-2 shape, Llama shape, Llama-shaped MoE), the
  step and consumed samples kept, and the rank files hold Megatron Core's layout (QKV rows per query group, SwiGLU's
  ``[gate_r; up_r]`` per tp rank, row-parallel columns, layers numbered per stage, the tied head's copy on the last
  stage, the vocabulary padded for Megatron's tp); the same from the legacy (non-Core) GPT model's names; the
  torch_dist format (DCP) likewise, a mixture of experts included (its experts stacked, one key per layer);
- against NVIDIA's Megatron Core (``tests/unit/megatron_core_reference.py``, skipped when absent): its ``GPTModel``
  loads a ``to-megatron`` export and gives our logits (GPT-2 and Llama shapes; torch_dist through its own
  ``dist_checkpointing.load``); its own state dict, saved in the legacy layout as Megatron-LM's ``save_checkpoint``
  writes it (``args`` Namespace with Megatron's enums, numpy RNG state) and by its own
  ``dist_checkpointing.save`` (torch_dist), converts with ``from-megatron``, gives its logits here and continues
  training in ``pretrain_gpt.py --load``;
- what cannot be read safely (a pickled payload in a rank file or in DCP's ``.metadata``) or converted is one line
  and exit status 2, the payload never run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import pickle
import random
import types

import numpy as np
import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint, read_tensors, tensor_layout, write_params
from megatron.checkpoint.megatron_lm.legacy import FILE, TRACKER, safe_load
from megatron.config import parse_config, validate
from megatron.model.gpt import GPTModel
from tests.functional.launch import program_module, run_here
from tests.unit.megatron_core_reference import (
    CORE_WARNINGS,
    LLAMA,
    MOE,
    SEQ,
    TINY,
    VOCAB,
    assert_close_to_scale,
    build_pair,
    core_forward,
    megatron_core,
    tokens_and_labels,
)

pytestmark = CORE_WARNINGS

convert = program_module("tools/convert_checkpoint.py")
# vocab 250: ours pads to 256 (tp 1), Megatron's tp 2 to 256 too; 4 heads in 2 groups, SwiGLU width 24 (tp 2 cuts)
SHAPES = {"gpt2": ["--vocab-size", "250"], "llama": [*LLAMA, "--vocab-size", "250"],
          "llama_moe": [*LLAMA, *MOE, "--vocab-size", "250"],
          "qwen3": [*LLAMA, "--qk-layernorm", "--vocab-size", "250"]}


def our_checkpoint(run, flags, step=12, consumed=96):
    """A checkpoint of ours with random weights (the vocabulary's padding rows zero, as a conversion leaves them)."""
    config = parse_config([*TINY, *flags])
    validate(config)
    g = torch.Generator().manual_seed(3)
    params = {name: torch.randn(shape, generator=g) for name, (shape, _) in tensor_layout(config).items()}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in params:
            params[name][config.model.vocab_size:] = 0
    write_params(str(run), config, params, step=step, train_state={"consumed_samples": consumed, "skipped_steps": 0})
    return config, params


def assert_round_trip(tmp_path, config, params):
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "back")]) == 0
    reader, common, back_config = open_checkpoint(str(tmp_path / "back"))
    assert common["step"] == 12 and common["train_state"]["consumed_samples"] == 96
    assert back_config.model == config.model
    back = read_tensors(reader)
    assert back.keys() == params.keys()
    for name, t in params.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize("shape", ["gpt2", "llama", "llama_moe", "qwen3"])
def test_ours_to_megatron_torch_dist_and_back_is_bitwise(tmp_path, one_process, shape):
    config, params = our_checkpoint(tmp_path / "run", SHAPES[shape])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--format", "torch_dist",
                         "--tp", "2", "--pp", "2"]) == 0
    folder = tmp_path / "meg" / "iter_0000012"
    assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert (folder / ".metadata").is_file() and list(folder.glob("__*_*.distcp"))
    args = safe_load(str(folder / "common.pt"))["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.padded_vocab_size) == (2, 2, 256)
    assert_round_trip(tmp_path, config, params)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_ours_to_megatron_tp2_pp2_and_back_is_bitwise(tmp_path, one_process, shape):
    config, params = our_checkpoint(tmp_path / "run", SHAPES[shape])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--tp", "2", "--pp", "2"]) == 0
    assert (tmp_path / "meg" / TRACKER).read_text().strip() == "12"
    ranks = {(t, p): safe_load(str(tmp_path / "meg" / "iter_0000012" / f"mp_rank_{t:02d}_{p:03d}" / FILE))
             for t in range(2) for p in range(2)}
    args = ranks[(0, 0)]["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.padded_vocab_size) == (2, 2, 256)
    assert args.iteration == 12 and args.consumed_train_samples == 96
    # Megatron Core's layout on the ranks: stage 1 holds layer 1 as its layer 0
    qkv = params["layers.1.self_attention.query_key_value.weight"]
    assert torch.equal(ranks[(1, 1)]["model"]["decoder.layers.0.self_attention.linear_qkv.weight"], qkv.chunk(2)[1])
    proj = params["layers.0.self_attention.dense.weight"]
    assert torch.equal(ranks[(1, 0)]["model"]["decoder.layers.0.self_attention.linear_proj.weight"],
                       proj.chunk(2, dim=1)[1])
    if shape == "llama":
        fc1 = params["layers.0.mlp.dense_h_to_4h.weight"]  # ours: rows gate_0, up_0, gate_1, up_1, ...
        gate, up = fc1[0::2], fc1[1::2]
        assert torch.equal(ranks[(1, 0)]["model"]["decoder.layers.0.mlp.linear_fc1.weight"],
                           torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    if shape == "gpt2":  # tied: the last stage holds Megatron's copy of the word embedding
        assert torch.equal(ranks[(0, 1)]["model"]["output_layer.weight"],
                           ranks[(0, 0)]["model"]["embedding.word_embeddings.weight"])
    assert_round_trip(tmp_path, config, params)


_LEGACY_NAMES = {"input_layernorm": "input_norm", "self_attention.linear_qkv": "self_attention.query_key_value",
                 "self_attention.linear_proj": "self_attention.dense", "pre_mlp_layernorm": "post_attention_norm",
                 "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h"}


def as_legacy_model(core: dict, tied_copy: bool) -> dict:
    """A rank's Megatron Core state dict as Megatron-LM's legacy GPT model nests and names it."""
    lm, head = {}, {}
    for name, t in core.items():
        module, param = name.rsplit(".", 1)
        if module.startswith("embedding."):
            lm.setdefault("embedding", {}).setdefault(module.split(".")[1], {})[param] = t
        elif module.startswith("decoder.layers."):
            _, _, i, rest = module.split(".", 3)
            lm.setdefault("encoder", {})[f"layers.{i}.{_LEGACY_NAMES[rest]}.{param}"] = t
        elif module == "decoder.final_layernorm":
            lm.setdefault("encoder", {})[f"final_norm.{param}"] = t
        elif tied_copy:
            head["word_embeddings_for_head"] = {param: t}
        else:
            lm["output_layer"] = {param: t}
    return {"language_model": lm, **head}


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_a_legacy_gpt_model_checkpoint_tp2_pp2_converts_bitwise(tmp_path, one_process, shape):
    config, params = our_checkpoint(tmp_path / "run", SHAPES[shape])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--tp", "2", "--pp", "2"]) == 0
    for file in (tmp_path / "meg" / "iter_0000012").glob(f"mp_rank_*/{FILE}"):
        saved = safe_load(str(file))
        saved["model"] = as_legacy_model(saved["model"], tied_copy=shape == "gpt2")
        torch.save(saved, file)
    assert_round_trip(tmp_path, config, params)


def test_megatron_core_loads_the_export_with_our_logits(tmp_path):
    """GPT-2 (the tanh GELU), its exact GELU (--no-bias-gelu-fusion, and without linear biases, as Megatron-LM runs
    them), Llama, Qwen3 and a squared-ReLU MLP (Nemotron's): Megatron Core loads the legacy export and gives our
    logits."""
    for shape, flags in (("gpt2", []), ("gpt2-exact-gelu", ["--no-bias-gelu-fusion"]),
                         ("gpt2-no-bias", ["--disable-bias-linear"]), ("llama", LLAMA),
                         ("qwen3", [*LLAMA, "--qk-layernorm"]),
                         ("squared-relu", [*LLAMA, "--no-swiglu", "--squared-relu"])):
        with megatron_core() as mcore:
            config, ours, theirs = build_pair(mcore, *flags)
            run, meg = tmp_path / shape / "run", tmp_path / shape / "meg"
            write_params(str(run), config, {n: p.detach() for n, p in ours.named_parameters()}, step=3)
            assert convert.main(["to-megatron", str(run), str(meg)]) == 0
            saved = safe_load(str(meg / "iter_0000003" / "mp_rank_00" / FILE))
            with torch.no_grad():
                for p in theirs.parameters():
                    p.zero_()
            theirs.load_state_dict(saved["model"], strict=True)
            tokens, _ = tokens_and_labels()
            with torch.no_grad():
                assert_close_to_scale(core_forward(theirs.eval(), tokens), ours.eval()(tokens), f"{shape} logits")


def test_megatron_cores_dist_checkpointing_loads_the_torch_dist_export_with_our_logits(tmp_path):
    """Llama shape, and Llama-shaped MoE (a MoE layer, then a dense one; a shared expert): Megatron Core's
    ``dist_checkpointing.load`` reads the export into its GPTModel with our logits."""
    with megatron_core() as mcore:
        from megatron.core import dist_checkpointing

        for shape, flags in (("llama", LLAMA), ("moe", [*LLAMA, *MOE, "--moe-shared-expert-intermediate-size", "16"])):
            config, ours, theirs = build_pair(mcore, *flags)
            run, meg = tmp_path / shape / "run", tmp_path / shape / "meg"
            write_params(str(run), config, {n: p.detach() for n, p in ours.named_parameters()}, step=3)
            assert convert.main(["to-megatron", str(run), str(meg), "--format", "torch_dist"]) == 0
            with torch.no_grad():
                for p in theirs.parameters():
                    p.zero_()
            with torch.serialization.safe_globals([argparse.Namespace]):  # common.pt: torch.load is weights-only
                loaded = dist_checkpointing.load({"model": theirs.sharded_state_dict()}, str(meg / "iter_0000003"))
            theirs.load_state_dict(loaded["model"], strict=True)
            tokens, _ = tokens_and_labels()
            with torch.no_grad():
                assert_close_to_scale(core_forward(theirs.eval(), tokens), ours.eval()(tokens), f"{shape} logits")


def test_megatron_cores_own_moe_torch_dist_checkpoint_gives_its_logits_here(tmp_path, one_process):
    """A Llama-shaped MoE GPTModel of Megatron Core saved by its own ``dist_checkpointing.save`` (experts stacked,
    one key per layer) converts with ``from-megatron`` and gives its logits here."""
    folder = tmp_path / "meg" / "iter_0000004"
    with megatron_core() as mcore:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        config, _, theirs = build_pair(mcore, *LLAMA, *MOE, "--moe-shared-expert-intermediate-size", "16")
        args = megatron_args(config)
        args.num_experts, args.moe_router_topk, args.moe_layer_freq = 4, 2, [1, 0]
        args.moe_shared_expert_intermediate_size, args.moe_router_load_balancing_type = 16, "aux_loss"
        args.moe_aux_loss_coeff, args.moe_token_dispatcher_type = 0.1, "allgather"
        with pytest.MonkeyPatch.context() as patches:
            patches.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
            patches.setattr(filesystem_async, "_process_memory", lambda: 0)
            folder.mkdir(parents=True)
            dist_checkpointing.save({"model": theirs.sharded_state_dict(), "args": args, "iteration": 4,
                                     "checkpoint_version": 3.0}, str(folder))
        (tmp_path / "meg" / TRACKER).write_text("4")
        tokens, _ = tokens_and_labels()
        with torch.no_grad():
            logits = core_forward(theirs.eval(), tokens)
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")]) == 0
    reader, _, config = open_checkpoint(str(tmp_path / "ours"))
    assert config.model.num_experts == 4
    model = GPTModel(config.model, config.padded_vocab_size).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.full("param", name))
        assert_close_to_scale(model(tokens), logits, "logits")


def megatron_args(config) -> argparse.Namespace:
    """The model's part of the ``args`` Megatron-LM saves (its names; the tokenizer's size only in the padding)."""
    m = config.model
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size, group_query_attention=True, num_query_groups=m.num_query_groups,
        kv_channels=m.hidden_size // m.num_attention_heads, max_position_embeddings=SEQ, seq_length=SEQ,
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, rotary_base=m.rotary_base, rotary_percent=1.0, norm_epsilon=1e-5,
        vocab_size=None, padded_vocab_size=VOCAB, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, expert_model_parallel_size=1, consumed_train_samples=24, iteration=6,
        params_dtype=torch.float32, qk_layernorm=False, moe_grouped_gemm=False, use_mcore_models=True)


@pytest.fixture(scope="module")
def core_checkpoint(tmp_path_factory):
    """A Llama-shaped Megatron Core GPTModel's own weights (its initialisation, perturbed) saved as Megatron-LM's
    ``save_checkpoint`` does (iteration 6, 24 consumed samples); (its folder, tokens, its logits)."""
    folder = tmp_path_factory.mktemp("megatron_core")
    with megatron_core() as mcore:
        config, _, theirs = build_pair(mcore, *LLAMA)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in theirs.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        tokens, _ = tokens_and_labels()
        with torch.no_grad():
            logits = core_forward(theirs.eval(), tokens)
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.zeros(8), "rng_tracker_states": {}}
        from megatron.core.enums import ModelType
        from megatron.core.rerun_state_machine import RerunMode
        from megatron.core.transformer.enums import AttnBackend

        args = megatron_args(config)  # with what Megatron-LM keeps besides plain data (megatron.core.safe_globals)
        args.attention_backend, args.save = AttnBackend.auto, pathlib.PosixPath("/ckpts/gpt")
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 6, "model_type": ModelType.encoder_or_decoder,
                 "rerun_state_machine": {"mode": RerunMode.DISABLED, "extra": types.SimpleNamespace(a=1)},
                 "model": theirs.state_dict(), "rng_state": [rng], "num_floating_point_operations_so_far": 0}
        (folder / "legacy" / "iter_0000006" / "mp_rank_00").mkdir(parents=True)
        torch.save(state, folder / "legacy" / "iter_0000006" / "mp_rank_00" / FILE)
        (folder / "legacy" / TRACKER).write_text("6")
        # torch_dist, written by Megatron Core's dist_checkpointing (its writer processes: two CUDA-only calls)
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        with pytest.MonkeyPatch.context() as patches:
            patches.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
            patches.setattr(filesystem_async, "_process_memory", lambda: 0)
            (folder / "torch_dist" / "iter_0000006").mkdir(parents=True)
            dist_checkpointing.save({"model": theirs.sharded_state_dict(), "args": state["args"], "iteration": 6,
                                     "checkpoint_version": 3.0}, str(folder / "torch_dist" / "iter_0000006"))
        (folder / "torch_dist" / TRACKER).write_text("6")
    return folder, tokens, logits


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_megatron_cores_own_checkpoint_gives_its_logits_here(tmp_path, one_process, core_checkpoint, fmt):
    folder, tokens, logits = core_checkpoint
    assert convert.main(["from-megatron", str(folder / fmt), str(tmp_path / "ours")]) == 0
    reader, common, config = open_checkpoint(str(tmp_path / "ours"))
    assert common["step"] == 6 and common["train_state"]["consumed_samples"] == 24
    model = GPTModel(config.model, config.padded_vocab_size).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.full("param", name))
        assert_close_to_scale(model(tokens), logits, "logits")


def test_from_megatron_finetune_starts_a_new_run_from_the_weights(tmp_path, one_process, core_checkpoint):
    folder, _, _ = core_checkpoint
    assert convert.main(["from-megatron", str(folder / "legacy"), str(tmp_path / "ours"), "--finetune"]) == 0
    _, common, _ = open_checkpoint(str(tmp_path / "ours"))
    assert common["step"] == 0 and common["train_state"]["consumed_samples"] == 0


def test_megatron_cores_own_checkpoint_continues_training(tmp_path, core_checkpoint):
    folder, _, _ = core_checkpoint
    assert convert.main(["from-megatron", str(folder / "legacy"), str(tmp_path / "ours")]) == 0
    out = tmp_path / "run"
    result = run_here("--mock-data", "--device", "cpu", "--load", str(tmp_path / "ours"), "--save", str(out),
                      "--global-batch-size", "4", "--micro-batch-size", "4", "--max-steps", "8", "--num-workers", "0",
                      "--eval-freq", "100", "--logging-freq", "1", "--max-seq-len", str(SEQ))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resuming at step 6" in result.stdout + result.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in train] == [7, 8] and all(np.isfinite(r["loss"]) for r in train)
    assert train[-1]["consumed_samples"] == 24 + 2 * 4


def test_a_file_holding_other_objects_is_refused_in_one_line(tmp_path, capsys):
    meg = tmp_path / "meg"
    (meg / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    torch.save({"args": argparse.Namespace(num_layers=1), "model": {}, "iteration": 1,
                "payload": _Payload()}, meg / "iter_0000001" / "mp_rank_00" / FILE)
    (meg / TRACKER).write_text("1")
    assert convert.main(["from-megatron", str(meg), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds builtins.print, which" in err, err
    assert not (tmp_path / "ours").exists()  # and nothing was printed by the payload
    assert "unpickled!" not in capsys.readouterr().out


class _Payload:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_a_torch_dist_metadata_file_holding_code_is_refused_in_one_line(tmp_path, one_process, capsys):
    """DCP's own reader would ``pickle.load`` the ``.metadata`` file (running the payload): ours never does."""
    our_checkpoint(tmp_path / "run", SHAPES["gpt2"])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), "--format", "torch_dist"]) == 0
    capsys.readouterr()
    (tmp_path / "meg" / "iter_0000012" / ".metadata").write_bytes(pickle.dumps(_Payload()))
    assert convert.main(["from-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "holds builtins.print, which" in err, err
    assert "unpickled!" not in captured.out and not (tmp_path / "ours").exists()


@pytest.mark.parametrize("flags, message", [
    (["--tp", "4"], "must divide num_attention_heads (4) and the key/value groups (2)"),  # would split a group
    (["--pp", "3"], "--pp 3 does not divide num_layers 2"),
])
def test_an_export_megatron_cannot_hold_is_one_line(tmp_path, one_process, capsys, flags, message):
    our_checkpoint(tmp_path / "run", SHAPES["llama"])
    assert convert.main(["to-megatron", str(tmp_path / "run"), str(tmp_path / "meg"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not list(tmp_path.glob("meg/iter_*"))


@pytest.mark.parametrize("change, message", [
    ({"use_rope_scaling": True}, "Llama 3's rope scaling"),
    ({"moe_single_grouped_weight": True, "num_experts": 4}, "one weight for all of a layer's experts"),
    ({"pipeline_model_parallel_size": 2}, "mp_rank_00_000"),
])
def test_what_cannot_be_converted_is_one_line(tmp_path, one_process, capsys, change, message):
    config = parse_config([*TINY, *LLAMA])
    validate(config)
    meg = tmp_path / "meg"
    (meg / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    args = vars(megatron_args(config)) | change
    torch.save({"args": argparse.Namespace(**args), "model": {}, "iteration": 2},
               meg / "iter_0000002" / "mp_rank_00" / FILE)
    (meg / TRACKER).write_text("2")
    assert convert.main(["from-megatron", str(meg), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
