"""megatron.tokenizer and tools/train_tokenizer.py on tiny corpora trained in the test (no downloads)."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import pickle
import random
from functools import lru_cache
from pathlib import Path

import pytest
import sentencepiece as spm
import tokenizers

from megatron.tokenizer import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
    pad_vocab_size,
)

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("train_tokenizer", REPO / "tools" / "train_tokenizer.py")
train_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_tokenizer)

WORDS = ("the a of and to in is was for on with as by at from it this that people city river house tree "
         "quick brown fox jumps over lazy dog cat runs walks fast slow red blue green old new small large "
         "café naïve résumé Zürich 東京 日本語 день мир 😀 🚀 don't it's we'll 2024 3.14 100").split()

STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces and trailing  ",
    "line one\nline two\n\nafter a blank line\n",
    "\ttabs\tand\r\nwindows newlines",
    "café naïve résumé Zürich",
    "日本語のテキストと東京",
    "день добрый, мир",
    "emoji 😀🚀 skin tone 👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "numbers 12345 and 3.14159, it's we'll they're",
    "ＦＵＬＬＷＩＤＴＨ and zero\u200bwidth",
    "{\"json\": [1, 2, 3]}  # code\n    indented()",
    "",
]


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + rng.choice(".!?")
            for _ in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A .jsonl + .txt corpus, and the bpe / sentencepiece (bpe and unigram) tokenizers trained on it."""
    root = tmp_path_factory.mktemp("tok")
    sentences = _sentences(400)
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i in range(0, 300, 3):
            f.write(json.dumps({"text": " ".join(sentences[i:i + 2]) + "\n" + sentences[i + 2], "id": i}) + "\n")
    (root / "corpus.txt").write_text("\n\n".join(sentences[300:]) + "\n", encoding="utf-8")
    out = {"root": root}
    for name, extra in (("bpe", ["--type", "bpe", "--vocab-size", "600"]),
                        ("sp", ["--type", "sentencepiece", "--vocab-size", "500"]),
                        ("unigram", ["--type", "sentencepiece", "--model-type", "unigram", "--vocab-size", "500"])):
        out[name] = root / name
        argv = ["--input", str(root / "corpus.*"), "--output-dir", str(out[name]), *extra]
        assert train_tokenizer.main(argv) == 0
    return out


@lru_cache
def _load(kind: str, folder: str) -> Tokenizer:
    path = Path(folder)
    if kind == "gpt2":
        return build_tokenizer("GPT2BPETokenizer", vocab_file=path / "vocab.json", merge_file=path / "merges.txt")
    if kind == "hf":
        return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path / "tokenizer.json")
    return build_tokenizer("SentencePieceTokenizer", tokenizer_model=path / "tokenizer.model")


@pytest.fixture(params=["gpt2", "hf", "sp", "unigram"])
def any_tokenizer(request: pytest.FixtureRequest, trained: dict[str, Path]) -> Tokenizer:
    folder = trained["bpe"] if request.param in ("gpt2", "hf") else trained[request.param]
    return _load(request.param if request.param in ("gpt2", "hf") else "sp", str(folder))


# ------------------------------------------------------------------------------------------ the tool
def test_tool_writes_the_files_and_reports_them(trained: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        assert (trained["bpe"] / name).is_file()
    assert (trained["bpe"] / "merges.txt").read_text(encoding="utf-8").startswith("#version: 0.2\n")
    assert sorted(p.name for p in trained["sp"].iterdir()) == ["tokenizer.model"]
    out = trained["root"] / "again"
    assert train_tokenizer.main(["--input", str(trained["root"] / "corpus.jsonl"), "--output-dir", str(out),
                                 "--vocab-size", "400", "--max-documents", "10"]) == 0
    stdout = capsys.readouterr().out
    assert f"wrote {out / 'vocab.json'}" in stdout and f"wrote {out / 'tokenizer.json'}" in stdout
    size = len(json.loads((out / "vocab.json").read_text(encoding="utf-8")))
    assert "from 10 documents" in stdout and f"vocab size {size}" in stdout


def test_tool_reads_gzipped_jsonl_with_several_keys(tmp_path: Path) -> None:
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        for s in _sentences(50):
            f.write(json.dumps({"title": s[:10], "body": s}) + "\n")
    assert train_tokenizer.main(["--input", str(tmp_path / "a.jsonl.gz"), "--json-keys", "title", "body",
                                 "--output-dir", str(tmp_path / "o"), "--vocab-size", "300"]) == 0
    assert (tmp_path / "o" / "tokenizer.json").is_file()


@pytest.mark.parametrize("case", ["missing", "glob", "folder", "key", "not-json", "suffix", "empty", "vocab"])
def test_tool_input_errors_exit_2_with_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "some text"}) + "\n", encoding="utf-8")
    argv = {
        "missing": ["--input", str(tmp_path / "nope.jsonl")],
        "glob": ["--input", str(tmp_path / "nope*.jsonl")],
        "folder": ["--input", str(tmp_path)],
        "key": ["--input", str(good), "--json-keys", "content"],
        "not-json": ["--input", str(tmp_path / "bad.jsonl")],
        "suffix": ["--input", str(tmp_path / "data.csv")],
        "empty": ["--input", str(tmp_path / "empty.txt")],
        "vocab": ["--input", str(good), "--vocab-size", "100"],
    }[case]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "fine"}) + "\n{broken\n", encoding="utf-8")
    (tmp_path / "data.csv").write_text("a,b\n", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    assert train_tokenizer.main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("train_tokenizer.py: error:") and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_tool_trainer_failure_exits_1(trained: dict[str, Path], tmp_path: Path, capsys) -> None:
    argv = ["--input", str(trained["root"] / "corpus.txt"), "--type", "sentencepiece", "--vocab-size", "50",
            "--output-dir", str(tmp_path)]
    assert train_tokenizer.main(argv) == 1
    assert "sentencepiece training failed" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ byte-level BPE
def test_gpt2_files_and_tokenizer_json_give_identical_ids(trained: dict[str, Path]) -> None:
    gpt2, hf = _load("gpt2", str(trained["bpe"])), _load("hf", str(trained["bpe"]))
    assert isinstance(gpt2, GPT2BPETokenizer) and isinstance(hf, HuggingFaceTokenizer)
    for s in STRINGS:
        assert gpt2.tokenize(s) == hf.tokenize(s), s
    assert gpt2.vocab_size == hf.vocab_size and gpt2.eod == hf.eod


def test_byte_level_round_trip(trained: dict[str, Path]) -> None:
    for kind in ("gpt2", "hf"):
        tok = _load(kind, str(trained["bpe"]))
        for s in STRINGS:
            assert tok.detokenize(tok.tokenize(s)) == s
        ids = tok.tokenize("café 😀")
        assert len(ids) > 2 and max(ids) < tok.vocab_size  # multi-byte characters, all ids in range


def test_bpe_eod_is_the_last_id_and_vocab_size_is_the_librarys(trained: dict[str, Path]) -> None:
    vocab = json.loads((trained["bpe"] / "vocab.json").read_text(encoding="utf-8"))
    gpt2, hf = _load("gpt2", str(trained["bpe"])), _load("hf", str(trained["bpe"]))
    library = tokenizers.Tokenizer.from_file(str(trained["bpe"] / "tokenizer.json"))
    assert gpt2.vocab_size == len(vocab) == library.get_vocab_size(with_added_tokens=True) <= 600
    assert gpt2.eod == vocab["<|endoftext|>"] == len(vocab) - 1 == library.token_to_id("<|endoftext|>")
    assert gpt2.detokenize([gpt2.eod]) == hf.detokenize([hf.eod]) == "<|endoftext|>"
    assert len(gpt2.tokenize("the people")) < len("the people")  # merges were learned


def test_literal_endoftext_text(trained: dict[str, Path]) -> None:
    # GPT2BPETokenizer follows OpenAI's encoder and Megatron-LM: the literal text is ordinary text;
    # a tokenizer.json's added tokens are matched in text, as the library does.
    gpt2, hf = _load("gpt2", str(trained["bpe"])), _load("hf", str(trained["bpe"]))
    assert gpt2.eod not in gpt2.tokenize("a<|endoftext|>b")
    assert hf.tokenize("a<|endoftext|>b") == [*hf.tokenize("a"), hf.eod, *hf.tokenize("b")]


def _openai_gpt2_encode(text: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> list[int]:
    """OpenAI's gpt-2/src/encoder.py, inlined as the reference."""
    regex = pytest.importorskip("regex")
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_encoder = dict(zip(bs, map(chr, cs)))
    ranks = {pair: i for i, pair in enumerate(merges)}
    pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    ids = []
    for token in regex.findall(pat, text):
        word = tuple(byte_encoder[b] for b in token.encode("utf-8"))
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:])}
            best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        ids.extend(vocab[piece] for piece in word)
    return ids


def test_gpt2_matches_openai_reference_encoder(trained: dict[str, Path]) -> None:
    vocab = json.loads((trained["bpe"] / "vocab.json").read_text(encoding="utf-8"))
    lines = (trained["bpe"] / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]
    merges = [tuple(line.split(" ")) for line in lines if line]
    gpt2 = _load("gpt2", str(trained["bpe"]))
    for s in [*STRINGS, *_sentences(30, seed=1), "a<|endoftext|>b"]:
        assert gpt2.tokenize(s) == _openai_gpt2_encode(s, vocab, merges), s


# ------------------------------------------------------------------------------------------ SentencePiece
@pytest.mark.parametrize("name", ["sp", "unigram"])
def test_sentencepiece(trained: dict[str, Path], name: str) -> None:
    tok = _load("sp", str(trained[name]))
    library = spm.SentencePieceProcessor(model_file=str(trained[name] / "tokenizer.model"))
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == library.get_piece_size() <= 500
    assert tok.eod == library.eos_id() == library.piece_to_id("</s>") == 2
    for s in STRINGS:
        assert tok.tokenize(s) == library.encode(s, out_type=int)
    for s in ["Hello world", "The quick brown fox, 2024.", "café 😀 東京", "two  spaces\tand tab"]:
        assert tok.detokenize(tok.tokenize(s)) == s  # identity normalization, whitespace kept, byte fallback
    assert tok.detokenize([tok.eod]) == ""


# ------------------------------------------------------------------------------------------ all types
def test_tokenize_batch_equals_tokenize(any_tokenizer: Tokenizer) -> None:
    assert any_tokenizer.tokenize_batch(STRINGS) == [any_tokenizer.tokenize(s) for s in STRINGS]
    assert any_tokenizer.tokenize_batch([]) == []


def test_pickle_round_trip(any_tokenizer: Tokenizer) -> None:
    blob = pickle.dumps(any_tokenizer)
    assert len(blob) < 1000  # the file paths, not the vocabulary
    clone = pickle.loads(blob)
    assert type(clone) is type(any_tokenizer) and clone.name == any_tokenizer.name
    assert (clone.vocab_size, clone.eod) == (any_tokenizer.vocab_size, any_tokenizer.eod)
    assert clone.tokenize_batch(STRINGS) == any_tokenizer.tokenize_batch(STRINGS)


def test_detokenize_accepts_arrays(any_tokenizer: Tokenizer) -> None:
    np = pytest.importorskip("numpy")
    ids = any_tokenizer.tokenize("Hello world, the quick brown fox")
    text = any_tokenizer.detokenize(ids)
    assert any_tokenizer.detokenize(np.array(ids, dtype=np.int64)) == text
    assert any_tokenizer.detokenize(tuple(ids)) == text


def test_names(trained: dict[str, Path]) -> None:
    assert _load("gpt2", str(trained["bpe"])).name == "GPT2BPETokenizer"
    assert _load("hf", str(trained["bpe"])).name == "HuggingFaceTokenizer"
    assert _load("sp", str(trained["sp"])).name == "SentencePieceTokenizer"


# ------------------------------------------------------------------------------------------ HF specifics
def _word_level_json(tmp_path: Path, tokens: list[str]) -> Path:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_folder_eod_lookup_and_override(trained: dict[str, Path], tmp_path: Path) -> None:
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=trained["bpe"]).eod == \
        _load("gpt2", str(trained["bpe"])).eod
    path = _word_level_json(tmp_path, ["[UNK]", "hello", "<eos>", "</s>", "<|im_end|>"])
    assert HuggingFaceTokenizer(path).eod == 3  # "</s>" comes before "<eos>" in the lookup order
    assert HuggingFaceTokenizer(path, eod_token="<|im_end|>").eod == 4
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path, eod_token="<eos>").eod == 2
    assert HuggingFaceTokenizer(path).vocab_size == 5


def test_hf_no_special_tokens_added(tmp_path: Path) -> None:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2, "hi": 3},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A </s>",
                                                                  special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.enable_truncation(1)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HuggingFaceTokenizer(tmp_path / "tokenizer.json")
    assert hf.tokenize("hi hi") == [3, 3] and hf.tokenize_batch(["hi hi"]) == [[3, 3]]


# ------------------------------------------------------------------------------------------ errors
def _error(call, *flags: str) -> str:
    with pytest.raises(TokenizerError) as info:
        call()
    message = str(info.value)
    for flag in flags:
        assert flag in message, message
    assert isinstance(info.value, ValueError) and "\n" not in message
    return message


def test_missing_arguments(trained: dict[str, Path]) -> None:
    bpe = trained["bpe"]
    _error(lambda: build_tokenizer("GPT2BPETokenizer", merge_file=bpe / "merges.txt"), "--vocab-file")
    _error(lambda: build_tokenizer("GPT2BPETokenizer", vocab_file=bpe / "vocab.json"), "--merge-file")
    _error(lambda: build_tokenizer("SentencePieceTokenizer"), "--tokenizer-model")
    _error(lambda: build_tokenizer("HuggingFaceTokenizer", vocab_file=bpe / "vocab.json"), "--tokenizer-model")
    _error(lambda: build_tokenizer("BertWordPieceLowerCase"), "--tokenizer-type", "BertWordPieceLowerCase")
    _error(lambda: GPT2BPETokenizer(None, bpe / "merges.txt"), "--vocab-file")


def test_missing_files(trained: dict[str, Path], tmp_path: Path) -> None:
    bpe, nope = trained["bpe"], tmp_path / "nope"
    _error(lambda: build_tokenizer("GPT2BPETokenizer", nope / "vocab.json", bpe / "merges.txt"),
           "--vocab-file", str(nope / "vocab.json"))
    _error(lambda: build_tokenizer("GPT2BPETokenizer", bpe / "vocab.json", nope / "merges.txt"),
           "--merge-file", str(nope / "merges.txt"))
    _error(lambda: build_tokenizer("SentencePieceTokenizer", tokenizer_model=nope / "t.model"),
           "--tokenizer-model", str(nope / "t.model"))
    _error(lambda: build_tokenizer("HuggingFaceTokenizer", tokenizer_model=nope / "tokenizer.json"),
           "--tokenizer-model", str(nope / "tokenizer.json"))
    _error(lambda: build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path),
           "--tokenizer-model", str(tmp_path))  # a folder without tokenizer.json
    _error(lambda: build_tokenizer("SentencePieceTokenizer", tokenizer_model=tmp_path), "--tokenizer-model")


def test_unreadable_files(trained: dict[str, Path], tmp_path: Path) -> None:
    garbage = tmp_path / "garbage"
    garbage.write_text("not a tokenizer {", encoding="utf-8")
    _error(lambda: HuggingFaceTokenizer(garbage), "--tokenizer-model", str(garbage))
    _error(lambda: SentencePieceTokenizer(garbage), "--tokenizer-model", str(garbage))
    _error(lambda: GPT2BPETokenizer(garbage, trained["bpe"] / "merges.txt"), "--vocab-file", str(garbage))


def test_missing_eod_tokens(trained: dict[str, Path], tmp_path: Path) -> None:
    path = _word_level_json(tmp_path, ["[UNK]", "hello", "world"])
    message = _error(lambda: build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path),
                     "--tokenizer-model", str(path))
    assert "eod_token" in message
    _error(lambda: HuggingFaceTokenizer(path, eod_token="<|im_end|>"), "--tokenizer-model", "<|im_end|>")

    vocab = json.loads((trained["bpe"] / "vocab.json").read_text(encoding="utf-8"))
    del vocab["<|endoftext|>"]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    _error(lambda: GPT2BPETokenizer(tmp_path / "vocab.json", trained["bpe"] / "merges.txt"),
           "--vocab-file", "<|endoftext|>")

    spm.SentencePieceTrainer.train(sentence_iterator=iter(_sentences(100)), model_prefix=str(tmp_path / "noeos"),
                                   vocab_size=100, eos_id=-1, hard_vocab_limit=False, minloglevel=2)
    _error(lambda: SentencePieceTokenizer(tmp_path / "noeos.model"), "--tokenizer-model", "EOS")


# ------------------------------------------------------------------------------------------ padding
@pytest.mark.parametrize(("size", "tp", "expected"), [
    (50257, 1, 50304), (50257, 8, 51200), (50304, 1, 50304), (51200, 8, 51200), (32000, 1, 32000),
    (32001, 2, 32256), (1, 1, 128), (129, 1, 256), (128256, 4, 128512),
])
def test_pad_vocab_size(size: int, tp: int, expected: int) -> None:
    assert pad_vocab_size(size, tp) == expected
    assert pad_vocab_size(size, tensor_parallel_size=tp, multiple=128) == expected


def test_pad_vocab_size_other_multiple_and_bad_values() -> None:
    assert pad_vocab_size(50257, multiple=64) == 50304 and pad_vocab_size(100, 2, multiple=1) == 100
    for bad in ((0, 1), (50257, 0), (-5, 1)):
        with pytest.raises(ValueError):
            pad_vocab_size(*bad)


def test_tool_text_chunks_and_long_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_tokenizer, "TXT_CHUNK_CHARS", 10)
    for text in ["abc def\nghi jkl mno pqr\n\nstu", "x" * 35, "a b c d e f g h i j k", " xxxxxxxxxxxxxxx yy", ""]:
        parts = list(train_tokenizer._chunks(io.StringIO(text)))
        assert "".join(parts) == text and all(parts)
    pieces = list(train_tokenizer._cut("aaa bbb ccc " + "d" * 12 + " é é é", 8))
    assert all(len(p.encode("utf-8")) <= 8 for p in pieces) and "".join(pieces).replace(" ", "") == \
        ("aaabbbccc" + "d" * 12 + "ééé")


def test_vocab_and_merge_files_without_a_type_are_gpt2_bpe(trained: dict[str, Path]) -> None:
    """Megatron-LM's 175B example passes --vocab-file and --merge-file and no --tokenizer-type."""
    from megatron.config import parse_config, validate
    from megatron.tokenizer import configured_tokenizer

    files = ["--vocab-file", str(trained["bpe"] / "vocab.json"), "--merge-file", str(trained["bpe"] / "merges.txt")]
    config = parse_config(["--input-dir", "corpus_text_document", *files])
    tokenizer = configured_tokenizer(config.tokenizer)
    assert isinstance(tokenizer, GPT2BPETokenizer)
    validate(config, tokenizer_vocab_size=tokenizer.vocab_size)
    assert config.tokenizer.tokenizer_type == "GPT2BPETokenizer" and config.model.vocab_size == tokenizer.vocab_size
    only_vocab = parse_config(["--mock-data", files[0], files[1]])  # one file alone is not a tokenizer
    assert configured_tokenizer(only_vocab.tokenizer) is None
