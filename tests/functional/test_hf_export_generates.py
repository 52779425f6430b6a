"""A Hugging Face export generates out of the box: ``to-hf`` writes the run's tokenizer (AutoTokenizer loads
it with no custom code and gives our ids) and the end-of-document id as bos/eos, so
``transformers.pipeline("text-generation", model=DIR)`` generates from a prompt alone, greedily the
tokens our engine generates; ``from-hf`` brings the tokenizer back, so ``tools/generate.py`` needs no
tokenizer flags; every file written has the mode the umask gives.

Every tokenizer is made here: a GPT-2 BPE trained by tools/train_tokenizer.py and SentencePiece models
trained on a few KB of text, a tiktoken vocabulary written by hand."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import random
import stat
import sys

import pytest
import torch

from megatron import parallel_state
from megatron.checkpoint.convert import write_params
from megatron.checkpoint.hf.common import SAMPLE_TEXT, export_tokenizer
from megatron.config import parse_config
from megatron.inference import InferenceEngine, Request, SamplingParams, initialize, load_model, tokenizer_for
from megatron.model.gpt import GPTModel
from megatron.model.init import init_parameters
from megatron.tokenizer import build_tokenizer
from tests.functional.launch import ROOT
from tests.transformers_said import transformers_said

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

WORDS = ("the model reads every token of the corpus and learns which word comes next while the optimizer moves "
         "its weights a little at each step until the loss falls café 東京").split()
POSITIONS = 48
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
         "--max-seq-len", str(POSITIONS), "--max-position-embeddings", str(POSITIONS), "--device", "cpu",
         "--initializer-range", "0.2", "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
PROMPT = "the model reads every token"
TEXTS = [PROMPT, SAMPLE_TEXT, " leading space", "two  spaces\tand tab\n\nnew lines\r\n", "x", ""]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert = _tool("convert_checkpoint")


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 25))) for _ in range(n)]


def _checkpoint(run_dir, *flags: str) -> None:
    """A step-0 checkpoint of a randomly initialised model (wide init: peaked, tie-free greedy choices)."""
    config = parse_config([*MODEL, *flags])
    parallel_state.initialize()
    model = GPTModel(config.model, config.padded_vocab_size)
    with torch.no_grad():
        init_parameters(model, 1234, config.model)
    write_params(str(run_dir), config, {n: p.detach() for n, p in model.named_parameters()})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The project folder of the runs: tok/ (GPT-2 BPE: vocab.json, merges.txt, tokenizer.json), sp.model
    (SentencePiece BPE, Llama style), and gpt/ (a GPT-2-shaped run whose config names tok/ relative to
    the project folder, where it was launched)."""
    folder = tmp_path_factory.mktemp("project")
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in _sentences(300)))
    assert _tool("train_tokenizer").main(["--input", str(folder / "corpus.jsonl"), "--vocab-size", "300",
                                          "--output-dir", str(folder / "tok")]) == 0
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_sentences(300, 1)), model_prefix=str(folder / "sp"),
                                   model_type="bpe", vocab_size=300, byte_fallback=True, hard_vocab_limit=False,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   minloglevel=2)
    cwd = os.getcwd()
    os.chdir(folder)  # the run is launched from the project folder, naming its files relative to it
    try:
        _checkpoint("gpt", "--vocab-size", "300", "--tokenizer-type", "GPT2BPETokenizer",
                    "--vocab-file", "tok/vocab.json", "--merge-file", "tok/merges.txt")
    finally:
        os.chdir(cwd)
    return folder


def _greedy(run_dir, prompt: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, our engine's greedy continuation, the end-of-document id included if it ended there)."""
    initialize()
    model, config = load_model(str(run_dir))
    tokenizer = tokenizer_for(config)
    engine = InferenceEngine(model, config, tokenizer)
    ids = tokenizer.tokenize(prompt)
    (completion,) = engine.generate([Request(ids, SamplingParams(max_tokens=max_tokens, temperature=0))])
    return ids, completion.tokens + ([tokenizer.eod] if completion.finish_reason == "stop" else [])


def _modes(folder) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _check_generates(run_dir, hf_dir, eod: int) -> None:
    """The pipeline, with the folder, a prompt and a length, generates without a length warning; greedily, our
    engine's tokens."""
    config = json.loads((hf_dir / "config.json").read_text())
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == eod
    assert generation["eos_token_id"] == generation["pad_token_id"] == eod
    assert not {"max_length", "max_new_tokens"} & set(generation)  # the caller's length, as Hugging Face's files
    pipe = transformers.pipeline("text-generation", model=str(hf_dir))
    assert pipe.tokenizer.eos_token_id == eod
    with transformers_said() as said:
        (out,) = pipe(PROMPT, max_new_tokens=POSITIONS // 2)
        (greedy,) = pipe(PROMPT, do_sample=False, max_new_tokens=POSITIONS // 2, return_tensors=True)
        (short,) = pipe(PROMPT, do_sample=False, max_new_tokens=3, return_tensors=True)
    assert not [m for m in said if "max_length" in m or "max_new_tokens" in m], said  # no length warning
    assert out["generated_text"].startswith(PROMPT) and len(out["generated_text"]) > len(PROMPT)
    prompt, continuation = _greedy(run_dir, PROMPT, POSITIONS // 2)
    assert len(continuation) > 5
    assert greedy["generated_token_ids"] == prompt + continuation
    assert short["generated_token_ids"] == prompt + continuation[:3]


def _check_same_ids(hf_dir, ours) -> None:
    auto = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    for text in TEXTS:
        assert auto(text)["input_ids"] == ours.tokenize(text), text
    assert auto.eos_token_id == ours.eod


def test_a_gpt2_export_generates_as_our_engine_with_the_runs_tokenizer(files, tmp_path, monkeypatch, umask_022,
                                                                        capsys):
    monkeypatch.chdir(tmp_path)  # not where the run was launched: its relative paths are found from the checkpoint
    assert convert.main(["to-hf", str(files / "gpt"), "hf"]) == 0
    assert "transformers.pipeline('text-generation', model='hf')" in capsys.readouterr().out
    hf = tmp_path / "hf"
    assert {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"} <= set(_modes(hf))
    assert set(_modes(hf).values()) == {0o644}  # model.safetensors included (safetensors writes 0600)
    ours = build_tokenizer("GPT2BPETokenizer", files / "tok" / "vocab.json", files / "tok" / "merges.txt")
    _check_same_ids(hf, ours)
    _check_generates(files / "gpt", hf, ours.eod)  # our engine too finds the run's tokenizer from another folder


def test_the_import_names_the_tokenizer_so_generate_needs_no_flags(files, tmp_path, monkeypatch, umask_022, capsys):
    assert convert.main(["to-hf", str(files / "gpt"), str(tmp_path / "hf")]) == 0
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    saved = (tmp_path / "imported" / "step_0" / "config.yaml").read_text()
    assert "tokenizer_type: HuggingFaceTokenizer" in saved and str(tmp_path / "imported" / "tokenizer") in saved
    assert set(_modes(tmp_path / "imported" / "tokenizer").values()) == {0o644}
    capsys.readouterr()
    generate = _tool("generate")
    assert generate.main(["--load", str(tmp_path / "imported"), "--prompt", PROMPT, "--temperature", "0",
                          "--max-new-tokens", "8", "--ignore-eos", "--output-format", "jsonl"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    _, expected = _greedy(files / "gpt", PROMPT, 8)
    assert record["tokens"] == expected[:8]
    # and out again: the same tokenizer
    assert convert.main(["to-hf", str(tmp_path / "imported"), str(tmp_path / "hf2")]) == 0
    _check_same_ids(tmp_path / "hf2", build_tokenizer("GPT2BPETokenizer", files / "tok" / "vocab.json",
                                                      files / "tok" / "merges.txt"))


def test_a_llama_export_with_a_sentencepiece_tokenizer_generates_as_our_engine(files, tmp_path):
    _checkpoint(tmp_path / "llama", *LLAMA, "--vocab-size", "300", "--tokenizer-type", "Llama2Tokenizer",
                "--tokenizer-model", str(files / "sp.model"))
    assert convert.main(["to-hf", str(tmp_path / "llama"), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == (files / "sp.model").read_bytes()
    ours = build_tokenizer("Llama2Tokenizer", tokenizer_model=files / "sp.model")
    _check_same_ids(tmp_path / "hf", ours)
    _check_generates(tmp_path / "llama", tmp_path / "hf", ours.eod)


def _export(tmp_path, vocab_size: int, **section) -> object:
    """export_tokenizer of a ``tokenizer:`` section, its files written to tmp_path/hf."""
    config = parse_config([])
    for name, value in section.items():
        setattr(config.tokenizer, name, value)
    (tmp_path / "step_0").mkdir(parents=True, exist_ok=True)
    out = export_tokenizer(config.tokenizer, vocab_size, str(tmp_path / "step_0"), 64)
    (tmp_path / "hf").mkdir(exist_ok=True)
    for name, data in out.files.items():
        (tmp_path / "hf" / name).write_bytes(data)
    return out


def test_tokenizer_json_sentencepiece_unigram_and_tiktoken_export_with_our_ids(files, tmp_path):
    # a tokenizer.json whose post-processor adds a BOS: left out (the model never saw it)
    import tokenizers
    from tokenizers.processors import TemplateProcessing

    tok = tokenizers.Tokenizer.from_file(str(files / "tok" / "tokenizer.json"))
    tok.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 299)])
    tok.save(str(tmp_path / "with_bos.json"))
    out = _export(tmp_path / "a", 300, tokenizer_type="HuggingFaceTokenizer",
                  tokenizer_model=str(tmp_path / "with_bos.json"))
    assert not out.warnings and any("post-processor" in note for note in out.notes)
    _check_same_ids(tmp_path / "a" / "hf",
                    build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path / "with_bos.json"))

    # SentencePiece unigram with its default normalization (NFKC, extra whitespace removed)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_sentences(300, 2)), model_prefix=str(tmp_path / "uni"),
                                   model_type="unigram", vocab_size=150, hard_vocab_limit=False, minloglevel=2)
    out = _export(tmp_path / "b", 150, tokenizer_type="SentencePieceTokenizer",
                  tokenizer_model=str(tmp_path / "uni.model"))
    assert not out.warnings and out.token_ids == {"bos_token_id": 2, "eos_token_id": 2}
    _check_same_ids(tmp_path / "b" / "hf",
                    build_tokenizer("SentencePieceTokenizer", tokenizer_model=tmp_path / "uni.model"))

    # tiktoken (Megatron-LM's vocabulary JSON): 10 reserved special ids, then the bytes and a few merges
    pytest.importorskip("tiktoken")
    merged = [b"th", b"the", b" t", b" the", b"he", b"in", b" in", b"od", b"mod", b"model", b" model", b"er"]
    tokens = [bytes([b]) for b in range(256)] + merged
    (tmp_path / "tik.json").write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                                    "token_str": t.decode("utf-8", "replace")}
                                                   for i, t in enumerate(tokens)]))
    settings = dict(tokenizer_type="TikTokenizer", tokenizer_model=str(tmp_path / "tik.json"),
                    tiktoken_num_special_tokens=10)
    for pattern in ("v1", "v2"):
        out = _export(tmp_path / pattern, 10 + len(tokens), tiktoken_pattern=pattern, **settings)
        assert not out.warnings and out.token_ids["eos_token_id"] == 2
        _check_same_ids(tmp_path / pattern / "hf", build_tokenizer(
            "TikTokenizer", tokenizer_model=tmp_path / "tik.json", tiktoken_pattern=pattern,
            vocab_size=10 + len(tokens), tiktoken_num_special_tokens=10))


def test_a_null_tokenizer_exports_the_ids_only(tmp_path, capsys):
    _checkpoint(tmp_path / "run", "--vocab-size", "300", "--tokenizer-type", "NullTokenizer")
    assert convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert "NullTokenizer: the run read token ids" in capsys.readouterr().out
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == 299


def test_a_tokenizer_file_found_nowhere_is_one_line_and_can_be_given_or_skipped(files, tmp_path, capsys):
    _checkpoint(tmp_path / "run", "--vocab-size", "300", "--tokenizer-type", "GPT2BPETokenizer",
                "--vocab-file", "gone/vocab.json", "--merge-file", str(files / "tok" / "merges.txt"))
    assert convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_checkpoint.py: error: the tokenizer's --vocab-file gone/vocab.json is not found")
    assert "\n" not in err and "--no-tokenizer" in err
    assert not (tmp_path / "hf").exists()  # nothing written
    assert convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf"), "--no-tokenizer"]) == 0
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] is None
    assert convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf2"), "--vocab-file",
                         str(files / "tok" / "vocab.json")]) == 0
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["eos_token_id"] == 299


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
