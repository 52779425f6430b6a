"""A small GPT checkpoint with a real tokenizer, written without training: a byte-level BPE trained on
a few hundred sentences and a 2-layer model initialised with a wide spread (so its next-token
distributions are peaked and greedy choices are far from ties)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from megatron import parallel_state
from megatron.checkpoint.convert import write_params
from megatron.config import parse_config
from megatron.model.gpt import GPTModel
from megatron.model.init import init_parameters

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the model reads every token of the corpus and learns which word comes next while the optimizer "
         "moves its weights a little at each step until the loss falls and the text it writes makes sense "
         "again tomorrow we will train a larger one on more data with eight ranks").split()
MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
               "--max-seq-len", "96", "--max-position-embeddings", "96", "--device", "cpu",
               "--initializer-range", "0.2", "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0"]
PROMPTS = ["the model reads", "a", "every token of the corpus and learns which word comes", "again tomorrow we"]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _write_checkpoint(folder, *flags: str) -> str:
    """A run folder holding step_0 of a tp-1 checkpoint of MODEL_FLAGS (+ ``flags``) whose config names its
    tokenizer (one trained on a small random corpus)."""
    rng = random.Random(0)
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))})
                              + "\n" for _ in range(400)))
    assert _tool("train_tokenizer").main(["--input", str(corpus), "--type", "bpe", "--vocab-size", "300",
                                          "--output-dir", str(folder / "tok")]) == 0
    vocab = json.loads((folder / "tok" / "vocab.json").read_text())
    config = parse_config([*MODEL_FLAGS, "--vocab-size", str(len(vocab)), "--tokenizer-type", "GPT2BPETokenizer",
                           "--vocab-file", str(folder / "tok" / "vocab.json"),
                           "--merge-file", str(folder / "tok" / "merges.txt"), *flags])
    parallel_state.initialize()
    model = GPTModel(config.model, config.padded_vocab_size)
    with torch.no_grad():
        init_parameters(model, 1234, config.model)
    run = folder / "run"
    write_params(str(run), config, {n: p.detach() for n, p in model.named_parameters()})
    return str(run)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    """A run folder holding step_0 of a tp-1 checkpoint whose config names its tokenizer."""
    return _write_checkpoint(tmp_path_factory.mktemp("gen"))


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory) -> str:
    """The same with a mixture of 4 experts (top-2) in place of the second layer's MLP."""
    return _write_checkpoint(tmp_path_factory.mktemp("gen-moe"), "--num-experts", "4", "--moe-layer-freq", "[0,1]")


@pytest.fixture(scope="session")
def mla_checkpoint(tmp_path_factory) -> str:
    """The same with DeepSeek-V3's multi-latent attention (query LoRA, latent norms, YaRN) in every layer."""
    return _write_checkpoint(tmp_path_factory.mktemp("gen-mla"), *MLA_FLAGS)


MLA_FLAGS = ["--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
             "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
             "--v-head-dim", "12", "--qk-layernorm", "--rotary-scaling-factor", "4", "--mscale", "0.9",
             "--mscale-all-dim", "0.9", "--original-max-position-embeddings", "8"]


def _engine(path: str):
    from megatron.inference import InferenceEngine, initialize, load_model, tokenizer_for

    initialize()
    model, config = load_model(path)
    return InferenceEngine(model, config, tokenizer_for(config))


@pytest.fixture(scope="module")
def engine(checkpoint):
    """The inference engine on ``checkpoint`` (one per test module)."""
    return _engine(checkpoint)


@pytest.fixture(scope="module")
def mla_engine(mla_checkpoint):
    """The inference engine on ``mla_checkpoint``."""
    return _engine(mla_checkpoint)


def greedy_tokens(model, vocab: int, ids: list[int], n: int) -> list[int]:
    """The ``n`` tokens ``model`` (an inference-loaded GPT, one process) continues ``ids`` with, greedily, by full
    forwards (no KV cache: the reference the code under test is checked against)."""
    import torch

    with torch.no_grad():
        for _ in range(n):
            ids = ids + [int(model(torch.tensor([ids]))[0, -1, :vocab].argmax())]
    return ids[-n:]


def last_word_guesses(model, tokenizer, vocab: int, lines: list[str], count: int) -> list[str]:
    """Up to ``count`` of ``lines``, each cut after a word (from the third on) and completed by the word the model
    predicts next greedily, when that word is one token with its leading space: cloze texts it gets right."""
    guessed = []
    for words in (line.split() for line in lines):
        for n in range(3, len(words)):
            context = " ".join(words[:n])
            best = greedy_tokens(model, vocab, tokenizer.tokenize(context), 1)[0]
            word = tokenizer.detokenize([best])
            if word.startswith(" ") and word[1:].isalpha() and tokenizer.tokenize(word) == [best]:
                guessed.append(context + word)
                break
        if len(guessed) == count:
            break
    return guessed
