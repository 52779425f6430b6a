"""Megatron-LM's other tokenizer types: GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer, NullTokenizer.

Every file is made by the test: a SentencePiece model trained on a tiny corpus, a tiktoken vocabulary written by
hand in Megatron-LM's JSON format. The expected ids are Megatron-LM's (megatron/core/tokenizers at the mirrored
commit): no BOS added on encode, eod the EOS id; tiktoken ids shifted by the reserved special ids; NullTokenizer
``vocab_size = N`` and ``eod = N - 1``.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import pickle
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from megatron.config import ConfigError, parse_config, validate
from megatron.data.indexed_dataset import IndexedDataset
from megatron.tokenizer import (
    TOKENIZER_TYPES,
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    TikTokenizer,
    TokenizerError,
    build_tokenizer,
    configured_tokenizer,
)
from megatron.tokenizer.tik import PATTERNS, SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the cat sat on the mat while a dog ran in the garden with the other cats café 東京 😀".split()
STRINGS = ["Hello world", "the cat sat on the mat.", " leading space", "two  spaces\tand tab\n\nnew lines\r\n",
           "café naïve 東京 день 😀🚀 👨‍👩‍👧", "numbers 12345 and 3.14, it's we'll", "CamelCase HTTPServer x2y", ""]
MERGES = [b"th", b"the", b" t", b" the", b"at", b"cat", b" c", b" cat", b"in", b" in", b"he", b"an", b" s",
          b" sat", b"ca", b" m", b" mat", b"ma"]


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece BPE model with Llama 2's ids: <unk> 0, <s> 1, </s> 2, no pad; byte fallback."""
    folder = tmp_path_factory.mktemp("sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_sentences(300)), model_prefix=str(folder / "tok"),
                                   model_type="bpe", vocab_size=400, byte_fallback=True, hard_vocab_limit=False,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   minloglevel=2)
    return folder / "tok.model"


def _tiktoken_vocab(path: Path, tokens: list[bytes]) -> Path:
    """Megatron-LM's tiktoken vocabulary: [{rank, token_bytes (base64), token_str}], the 256 bytes first."""
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode("ascii"),
                "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(tokens)]
    path.write_text(json.dumps(entries), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tik_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiktoken_vocab(tmp_path_factory.mktemp("tik") / "vocab.json", [bytes([b]) for b in range(256)] + MERGES)


NUM_SPECIAL = 10
VOCAB = NUM_SPECIAL + 256 + len(MERGES)


def _tik(path: Path, pattern: str = "v2", vocab_size: int = VOCAB, num_special: int = NUM_SPECIAL) -> TikTokenizer:
    pytest.importorskip("tiktoken")
    return build_tokenizer("TikTokenizer", tokenizer_model=path, tiktoken_pattern=pattern, vocab_size=vocab_size,
                           tiktoken_num_special_tokens=num_special)


def _reference_tiktoken(text: str, pattern: str, ranks: dict[bytes, int], offset: int) -> list[int]:
    """tiktoken's byte-pair encoding, written out: per regex piece, merge the adjacent pair of lowest rank."""
    regex = pytest.importorskip("regex")
    ids = []
    for piece in regex.findall(PATTERNS[pattern], text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while len(parts) > 1:
            pairs = [(ranks.get(a + b, float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] + offset for p in parts]
    return ids


# ------------------------------------------------------------------------------------------ SentencePiece
@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_sentencepiece_types(sp_model: Path, kind: str) -> None:
    tok = build_tokenizer(kind, tokenizer_model=sp_model)
    library = spm.SentencePieceProcessor(model_file=str(sp_model))
    assert type(tok).__name__ == tok.name == kind
    assert isinstance(tok, GPTSentencePieceTokenizer if kind.startswith("GPT") else Llama2Tokenizer)
    assert (tok.eod, tok.bos, tok.vocab_size) == (library.eos_id(), library.bos_id(), library.get_piece_size())
    assert (tok.eod, tok.bos) == (2, 1)
    for s in STRINGS:
        ids = tok.tokenize(s)
        assert ids == library.encode(s, out_type=int)  # no BOS, no EOS: Megatron-LM's SentencePiece library
        assert tok.detokenize(ids) == s
    assert tok.tokenize_batch(STRINGS) == [tok.tokenize(s) for s in STRINGS]
    assert tok.tokenize("the cat")[0] != tok.bos
    assert tok.tokenize("</s>") != [tok.eod]  # control pieces in text are ordinary text
    clone = pickle.loads(pickle.dumps(tok))
    assert type(clone) is type(tok) and clone.tokenize("the cat sat") == tok.tokenize("the cat sat")


def test_sentencepiece_types_name_their_type_in_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="Llama2Tokenizer needs --tokenizer-model"):
        build_tokenizer("Llama2Tokenizer")
    with pytest.raises(TokenizerError, match=f"--tokenizer-model {tmp_path / 'no.model'} does not exist"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=tmp_path / "no.model")


# ------------------------------------------------------------------------------------------ TikTokenizer
def test_tiktoken_ids_are_ranks_after_the_special_ids(tik_vocab: Path) -> None:
    tok = _tik(tik_vocab)
    assert (tok.name, tok.vocab_size, tok.eod, tok.bos) == ("TikTokenizer", VOCAB, 2, 1)
    the = 256 + MERGES.index(b"the") + NUM_SPECIAL
    assert tok.tokenize("the") == [the] and tok.tokenize("a") == [ord("a") + NUM_SPECIAL]
    assert tok.tokenize(" the cat") == [256 + MERGES.index(b" the") + NUM_SPECIAL,
                                        256 + MERGES.index(b" cat") + NUM_SPECIAL]
    # Megatron-LM encodes with allowed_special="all": text spelling a special token is that token.
    assert tok.tokenize("a</s>") == [ord("a") + NUM_SPECIAL, tok.eod]
    assert tok.tokenize("<s><SPECIAL_9><pad>") == [1, 9, SPECIAL_TOKENS.index("<pad>")]
    assert tok.tokenize("<SPECIAL_10>") != [10]  # only num_special_tokens ids are reserved
    assert tok.detokenize([tok.bos, the, tok.eod]) == "<s>the</s>"


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktoken_matches_a_written_out_bpe_and_round_trips(tik_vocab: Path, pattern: str) -> None:
    tok = _tik(tik_vocab, pattern)
    ranks = {t: i for i, t in enumerate([bytes([b]) for b in range(256)] + MERGES)}
    for s in [*STRINGS, *_sentences(20, seed=1)]:
        ids = tok.tokenize(s)
        assert ids == _reference_tiktoken(s, pattern, ranks, NUM_SPECIAL), s
        assert tok.detokenize(ids) == s and all(NUM_SPECIAL <= i < VOCAB for i in ids)
    assert tok.tokenize_batch(STRINGS) == [tok.tokenize(s) for s in STRINGS]
    clone = pickle.loads(pickle.dumps(tok))
    assert (clone.pattern, clone.vocab_size, clone.tokenize("the cat")) == (pattern, VOCAB, tok.tokenize("the cat"))


def test_tiktoken_patterns_differ_as_megatrons() -> None:
    regex = pytest.importorskip("regex")
    text = "CamelCase 2024\n\nx"
    assert regex.findall(PATTERNS["v1"], text) == ["CamelCase", " ", "2", "0", "2", "4", "\n\n", "x"]
    assert regex.findall(PATTERNS["v2"], text) == ["Camel", "Case", " ", "2", "0", "2", "4", "\n\n", "x"]


def test_tiktoken_vocab_size_cuts_the_file(tik_vocab: Path) -> None:
    tok = _tik(tik_vocab, vocab_size=NUM_SPECIAL + 256)  # the merges fall outside: bytes only
    assert tok.vocab_size == NUM_SPECIAL + 256
    assert tok.tokenize("the") == [b + NUM_SPECIAL for b in b"the"]
    with pytest.raises(TokenizerError, match=f"give --vocab-size {VOCAB} or less"):
        _tik(tik_vocab, vocab_size=VOCAB + 1)
    with pytest.raises(TokenizerError, match=f"holds {VOCAB - NUM_SPECIAL} tokens"):
        build_tokenizer("TikTokenizer", tokenizer_model=tik_vocab)  # Megatron-LM's default: 131072


def test_tiktoken_defaults_and_file_errors(tik_vocab: Path, tmp_path: Path) -> None:
    tok = _tik(tik_vocab, pattern=None, vocab_size=VOCAB + 990, num_special=1000)  # Megatron-LM's defaults
    assert tok.pattern == "v2" and tok.tokenize("the") == [256 + MERGES.index(b"the") + 1000]
    assert tok.tokenize("<SPECIAL_999>") == [999]
    cases = {
        "not-json": ("{", "as a tiktoken vocabulary"),
        "not-list": (json.dumps({"a": 1}), "expected a JSON list"),
        "bad-rank": (None, "entry 3 is not {rank: 3"),
        "not-a-byte": (None, "entry 65 must be the single byte 65"),
    }
    good = json.loads(tik_vocab.read_text(encoding="utf-8"))
    for name, (text, message) in cases.items():
        entries = [dict(e) for e in good]
        if name == "bad-rank":
            entries[3]["rank"] = 4
        if name == "not-a-byte":
            entries[65]["token_bytes"] = base64.b64encode(b"B").decode()
        path = tmp_path / f"{name}.json"
        path.write_text(text if text is not None else json.dumps(entries), encoding="utf-8")
        with pytest.raises(TokenizerError, match=message) as info:
            _tik(path)
        assert str(path) in str(info.value)
    with pytest.raises(TokenizerError, match=r"7 <= --tiktoken-num-special-tokens \(3\)"):
        _tik(tik_vocab, num_special=3)
    with pytest.raises(TokenizerError, match="--tiktoken-pattern must be v1 or v2"):
        _tik(tik_vocab, pattern="v3")
    with pytest.raises(TokenizerError, match="TikTokenizer needs --tokenizer-model"):
        build_tokenizer("TikTokenizer")


def test_tiktoken_missing_package_is_a_tokenizer_error(tik_vocab: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken raises ImportError
    with pytest.raises(TokenizerError, match="pip install tiktoken"):
        TikTokenizer(tik_vocab, vocab_size=VOCAB, num_special_tokens=NUM_SPECIAL)


def test_tiktoken_from_the_config_takes_vocab_size_and_its_flags(tik_vocab: Path) -> None:
    pytest.importorskip("tiktoken")
    config = parse_config(["--mock-data", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(tik_vocab),
                           "--tiktoken-pattern", "v1", "--tiktoken-num-special-tokens", str(NUM_SPECIAL),
                           "--vocab-size", str(VOCAB)])
    tok = configured_tokenizer(config.tokenizer, config.model.vocab_size)
    assert isinstance(tok, TikTokenizer) and (tok.pattern, tok.vocab_size, tok.num_special_tokens) == \
        ("v1", VOCAB, NUM_SPECIAL)
    validate(config, tokenizer_vocab_size=tok.vocab_size)
    assert config.model.vocab_size == VOCAB and config.padded_vocab_size == 384


# ------------------------------------------------------------------------------------------ NullTokenizer
def test_null_tokenizer_is_megatrons() -> None:
    tok = build_tokenizer("NullTokenizer", vocab_size=50257)
    assert (tok.name, tok.vocab_size, tok.eod, tok.bos) == ("NullTokenizer", 50257, 50256, None)
    assert tok.tokenize("11 325 97") == [11, 325, 97] and tok.detokenize([11, 325, 97]) == "11 325 97"
    assert tok.tokenize(" 1\t2\n3 \n") == [1, 2, 3] and tok.tokenize("") == []
    assert tok.detokenize(np.array([0, 50256])) == "0 50256"
    assert tok.tokenize_batch(["1 2", "3"]) == [[1, 2], [3]]
    clone = pickle.loads(pickle.dumps(tok))
    assert type(clone) is NullTokenizer and (clone.vocab_size, clone.eod) == (50257, 50256)


def test_null_tokenizer_errors() -> None:
    tok = NullTokenizer(100)
    with pytest.raises(TokenizerError, match="'cat'"):
        tok.tokenize("1 2 cat 3")
    with pytest.raises(TokenizerError, match="token id 100 is outside --vocab-size 100"):
        tok.tokenize("1 100")
    with pytest.raises(TokenizerError, match="token id -1"):
        tok.tokenize("-1")
    with pytest.raises(TokenizerError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(TokenizerError, match="at least 2"):
        NullTokenizer(1)


def test_null_tokenizer_vocab_size_is_the_models() -> None:
    """--tokenizer-type NullTokenizer --vocab-size 50257: the model's vocabulary is 50257 (padded 50304), and
    it covers the end-of-document id 50256."""
    config = parse_config(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257"])
    tok = configured_tokenizer(config.tokenizer, config.model.vocab_size)
    validate(config, tokenizer_vocab_size=tok.vocab_size)
    assert config.model.vocab_size == 50257 and config.padded_vocab_size == 50304 and tok.eod < 50257
    config = parse_config(["--mock-data", "--tokenizer-type", "NullTokenizer"])
    with pytest.raises(ConfigError, match="NullTokenizer needs --vocab-size"):
        validate(config, tokenizer_vocab_size=None)
    with pytest.raises(TokenizerError, match="NullTokenizer needs --vocab-size"):
        configured_tokenizer(config.tokenizer, config.model.vocab_size)


def test_every_type_is_built_by_name(sp_model: Path, tik_vocab: Path) -> None:
    pytest.importorskip("tiktoken")
    assert set(TOKENIZER_TYPES) >= {"GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "NullTokenizer"}
    built = {kind: build_tokenizer(kind, tokenizer_model=tik_vocab if kind == "TikTokenizer" else sp_model,
                                   vocab_size=VOCAB, tiktoken_num_special_tokens=NUM_SPECIAL)
             for kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "NullTokenizer")}
    assert all(tok.name == kind for kind, tok in built.items())


def test_token_id_looks_a_spelling_up_in_the_vocabulary(sp_model: Path, tik_vocab: Path) -> None:
    """What --fim-data's tokens are resolved with: a vocabulary entry by its spelling, None when there is none."""
    sp = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    assert (sp.token_id("</s>"), sp.token_id("<unk>"), sp.token_id("<fim_prefix>")) == (sp.eod, 0, None)
    assert sp.token_id(sp.spelling(300)) == 300
    tik = _tik(tik_vocab)
    assert (tik.token_id("</s>"), tik.token_id("<SPECIAL_9>"), tik.token_id("the")) == (2, 9, tik.tokenize("the")[0])
    assert tik.token_id("the cat") is None and tik.token_id("<fim_prefix>") is None
    assert NullTokenizer(100).token_id("5") is None  # no spellings: ids written as numbers


# ------------------------------------------------------------------------------------------ preprocessing
def _preprocess(*argv: str) -> int:
    spec = importlib.util.spec_from_file_location("preprocess_data", ROOT / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = module  # worker processes find the tool's functions by module name
    spec.loader.exec_module(module)
    return module.main(list(argv))


def test_preprocess_null_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    docs = [[5, 7, 9], [1], [300, 2, 2, 4]]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n" for d in docs))
    assert _preprocess("--input", str(tmp_path / "ids.jsonl"), "--output-prefix", str(tmp_path / "n"),
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "301", "--append-eod") == 0
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [d + [300] for d in docs] and ds.dtype == np.uint16
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "1 2 x"}) + "\n")
    assert _preprocess("--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "b"),
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "301") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("preprocess_data.py: error: ") and "bad.jsonl:1" in err and "'x'" in err
    assert not list(tmp_path.glob("b_*"))


@pytest.mark.parametrize("kind", ["TikTokenizer", "Llama2Tokenizer"])
def test_preprocess_tiktoken_and_llama2(tmp_path: Path, sp_model: Path, tik_vocab: Path, kind: str) -> None:
    if kind == "TikTokenizer":
        pytest.importorskip("tiktoken")
        flags = ["--tokenizer-model", str(tik_vocab), "--vocab-size", str(VOCAB), "--tiktoken-pattern", "v1",
                 "--tiktoken-num-special-tokens", str(NUM_SPECIAL)]
        tok = _tik(tik_vocab, "v1")
    else:
        flags = ["--tokenizer-model", str(sp_model)]
        tok = build_tokenizer(kind, tokenizer_model=sp_model)
    texts = _sentences(30, seed=2)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert _preprocess("--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "c"),
                       "--tokenizer-type", kind, *flags, "--append-eod", "--workers", "2") == 0
    ds = IndexedDataset(str(tmp_path / "c_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(t) + [tok.eod] for t in texts]
