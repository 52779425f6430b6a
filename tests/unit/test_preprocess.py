"""tools/preprocess_data.py: outputs, bad records, workers, input forms."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset
from megatron.progress import format_count
from megatron.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the model reads tokens and predicts the next one while the optimizer updates weights "
         "data flows through layers of attention and feed forward blocks").split()


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # worker processes find the tool's functions by module name
    spec.loader.exec_module(module)
    return module


def _texts(n: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(300)))
    assert _tool("train_tokenizer").main(["--input", str(corpus), "--type", "bpe", "--vocab-size", "300",
                                          "--output-dir", str(folder)]) == 0
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def _run(tokenizer_files, inputs, prefix, *extra) -> int:
    vocab, merges = tokenizer_files
    return _tool("preprocess_data").main(["--input", *map(str, inputs), "--output-prefix", str(prefix),
                                          "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                          "--merge-file", merges, *extra])


def test_documents_bad_records_and_progress(tmp_path, tokenizer_files, capsys):
    texts = _texts(20, seed=1)
    lines = [json.dumps({"text": t}).encode() for t in texts]
    lines[3] = b'{"text": "unterminated'
    lines[7] = json.dumps({"body": "no text key"}).encode()
    lines[11] = json.dumps({"text": 42}).encode()
    lines[15] = b'{"text": "bad \xff bytes"}'
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n\n")
    assert _run(tokenizer_files, [tmp_path / "in.jsonl"], tmp_path / "out" / "c", "--append-eod",
                "--log-interval", "5") == 0
    err = capsys.readouterr().err
    assert "skipped 4 bad record(s)" in err
    size = (tmp_path / "in.jsonl").stat().st_size - 1  # the records' bytes: all but the blank line
    progress = [line for line in err.splitlines() if line.startswith("preprocess: ")]
    assert len(progress) == 1 and progress[0].endswith(", 16 docs")  # stderr is no terminal: one closing line
    assert progress[0].startswith(f"preprocess: {format_count(size, 'B')} in ")
    assert "in.jsonl:4: invalid JSON" in err and "in.jsonl:8: no string value for key 'text'" in err
    ds = IndexedDataset(str(tmp_path / "out" / "c_text_document"))
    tok = build_tokenizer("GPT2BPETokenizer", *tokenizer_files)
    good = [t for i, t in enumerate(texts) if i not in (3, 7, 11, 15)]
    assert [d.tolist() for d in ds] == [tok.tokenize(t) + [tok.eod] for t in good]
    assert sorted(os.listdir(tmp_path / "out")) == ["c_text_document.bin", "c_text_document.idx"]


def test_fail_on_error_stops_and_leaves_no_files(tmp_path, tokenizer_files, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "fine"}\nnot json\n')
    assert _run(tokenizer_files, [tmp_path / "in.jsonl"], tmp_path / "out" / "c", "--fail-on-error") == 2
    assert "in.jsonl:2: invalid JSON" in capsys.readouterr().err
    assert os.listdir(tmp_path / "out") == []


def test_two_workers_write_the_same_bytes_as_one(tmp_path, tokenizer_files):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(500, seed=2)))
    for workers in ("1", "2"):
        assert _run(tokenizer_files, [tmp_path / "in.jsonl"], tmp_path / f"w{workers}" / "c", "--workers", workers,
                    "--batch-size", "16", "--append-eod") == 0
    for suffix in (".bin", ".idx"):
        one = (tmp_path / "w1" / f"c_text_document{suffix}").read_bytes()
        assert one == (tmp_path / "w2" / f"c_text_document{suffix}").read_bytes()


def test_several_keys_folder_glob_gzip_and_txt(tmp_path, tokenizer_files):
    tok = build_tokenizer("GPT2BPETokenizer", *tokenizer_files)
    docs = [{"title": f"title {i}", "text": t} for i, t in enumerate(_texts(6, seed=3))]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[:3]))
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(d) + "\n" for d in docs[3:]))
    assert _run(tokenizer_files, [tmp_path / "in"], tmp_path / "o" / "k", "--json-keys", "text", "title") == 0
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / "o" / f"k_{key}_document"))
        assert [d.tolist() for d in ds] == [tok.tokenize(d[key]) for d in docs]
    assert _run(tokenizer_files, [str(tmp_path / "in" / "*.jsonl")], tmp_path / "g" / "k") == 0
    assert len(IndexedDataset(str(tmp_path / "g" / "k_text_document"))) == 3

    (tmp_path / "t.txt").write_text("first block line\nsame block\n\nsecond block\n\n\nthird\n")
    assert _run(tokenizer_files, [tmp_path / "t.txt"], tmp_path / "tf" / "x") == 0
    assert len(IndexedDataset(str(tmp_path / "tf" / "x_text_document"))) == 1
    assert _run(tokenizer_files, [tmp_path / "t.txt"], tmp_path / "tp" / "x", "--txt-mode", "paragraph") == 0
    ds = IndexedDataset(str(tmp_path / "tp" / "x_text_document"))
    assert [tok.detokenize(d) for d in ds] == ["first block line\nsame block\n", "second block\n", "third\n"]


def test_missing_input_is_one_line_error(tmp_path, tokenizer_files, capsys):
    assert _run(tokenizer_files, [tmp_path / "nope.jsonl"], tmp_path / "o" / "x") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.jsonl" in err[0]


NO_TOKENS = "the input gives key 'text' no tokens"


@pytest.mark.parametrize("content, expected", [
    ("", f"{NO_TOKENS} (0 documents, 0 tokens); nothing was written"),
    ('{"text": ""}\n{"text": ""}\n', f"{NO_TOKENS} (2 documents, 0 tokens); nothing was written"),
    ("not json\n", f"{NO_TOKENS} (0 documents, 0 tokens); all 1 record(s) were bad, the first: "),
])
def test_an_input_without_tokens_is_one_line_and_writes_nothing(tmp_path, tokenizer_files, capsys, content, expected):
    (tmp_path / "in.jsonl").write_text(content)
    assert _run(tokenizer_files, [tmp_path / "in.jsonl"], tmp_path / "out" / "c") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"preprocess_data.py: error: {expected}")
    assert os.listdir(tmp_path / "out") == []


def test_an_id_outside_the_tokenizers_vocabulary_is_one_line(tmp_path, tokenizer_files, capsys, monkeypatch):
    """A tokenizer whose vocab_size undercounts its ids (inconsistent files) must not write a dataset the
    model would index out of range."""
    tool = _tool("preprocess_data")
    real = tool.build_tokenizer

    def undercounting(*args):
        tok = real(*args)
        monkeypatch.setattr(type(tok), "vocab_size", property(lambda self: 100))
        return tok

    monkeypatch.setattr(tool, "build_tokenizer", undercounting)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(5, seed=4)))
    vocab, merges = tokenizer_files
    assert tool.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out" / "c"),
                      "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"preprocess_data.py: error: {tmp_path}/in.jsonl:1 (key 'text'): "
                                               f"the tokenizer produced id ")
    assert "but its vocabulary has 100 ids" in err[0]
    assert os.listdir(tmp_path / "out") == []


SENTENCES = [["The model reads tokens.", "Mr. Smith predicts the next one!", "Does it learn?", "Yes."],
             ["Data flows through layers, e.g. attention.", "The optimizer updates weights."],
             ["One.", "Two blocks of attention and feed forward.", "Three \"layers.\"", "(Four.)", "5 tokens."]]


def test_split_sentences_gives_a_sequence_per_sentence_and_keeps_documents(tmp_path, tokenizer_files):
    """Megatron-LM's --split-sentences: each sentence is a sequence of the .idx, the document boundaries are kept,
    --append-eod ends each document's last sentence, and the pair is named ..._sentence."""
    tok = build_tokenizer("GPT2BPETokenizer", *tokenizer_files)
    docs = [" ".join(sentences) for sentences in SENTENCES]
    docs[1] = docs[1].replace(" The", "\n\nThe")  # a paragraph break between sentences
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert _run(tokenizer_files, [tmp_path / "in.jsonl"], tmp_path / "out" / "c", "--split-sentences",
                "--append-eod", "--workers", "2", "--batch-size", "2") == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["c_text_sentence.bin", "c_text_sentence.idx"]
    ds = IndexedDataset(str(tmp_path / "out" / "c_text_sentence"))
    flat = [s for sentences in SENTENCES for s in sentences]
    last = np.cumsum([len(s) for s in SENTENCES]) - 1
    assert [d.tolist() for d in ds] == [tok.tokenize(s) + [tok.eod] * (i in last) for i, s in enumerate(flat)]
    assert ds.num_documents == 3 and ds.document_indices.tolist() == [0, 4, 6, 11]
    assert _run(tokenizer_files, [tmp_path / "in.jsonl"], tmp_path / "nl" / "c", "--split-sentences",
                "--keep-newlines") == 0
    kept = IndexedDataset(str(tmp_path / "nl" / "c_text_sentence"))
    assert tok.detokenize(kept[4]) == "Data flows through layers, e.g. attention.\n\n"
    assert _run(tokenizer_files, [tmp_path / "in.jsonl"], tmp_path / "doc" / "c") == 0
    assert len(IndexedDataset(str(tmp_path / "doc" / "c_text_document"))) == 3  # without the flag: a document each

    from megatron.data.blended_dataset import build_datasets

    train, _, _ = build_datasets(str(tmp_path / "out" / "c_text_sentence"), "1", (30, 0, 0), 8, 1, tok.eod,
                                 str(tmp_path / "cache"))
    stream = np.concatenate([ds[int(j)] for j in train.doc_idx])  # the sentences are Megatron Core's documents
    assert sorted(set(train.doc_idx.tolist())) == list(range(11))
    for i in range(len(train)):
        j = int(train.shuffle_idx[i])
        assert train[i].tolist() == stream[j * 8: j * 8 + 9].tolist()


@pytest.mark.parametrize("text, sentences", [
    ("Hello there. How are you? Fine! Thanks.", ["Hello there.", "How are you?", "Fine!", "Thanks."]),
    ("Mr. Smith met Dr. Jones, e.g. The Boss. Then J. R. Tolkien wrote.",
     ["Mr. Smith met Dr. Jones, e.g. The Boss.", "Then J. R. Tolkien wrote."]),
    ('He said "Stop." Then he left... And 1990. 2000 came. (Really.) Yes.',
     ['He said "Stop."', "Then he left...", "And 1990.", "2000 came.", "(Really.)", "Yes."]),
    ("The U.S. Army is big. See Fig. 3 and no. 4. it is 3.5 km. Done", [
        "The U.S. Army is big.", "See Fig. 3 and no. 4. it is 3.5 km.", "Done"]),
    ("  \n ", []),
])
def test_the_sentence_rule(text, sentences):
    from megatron.data.sentences import split_sentences

    assert split_sentences(text) == sentences
    assert split_sentences("A first one.\nThe second.\n\n", keep_newlines=True) == ["A first one.\n", "The second.\n\n"]


# ------------------------------------------- records it cannot encode, long documents, damaged input, two writers


def _main(tool, tokenizer_files, inputs, prefix, *extra) -> int:
    vocab, merges = tokenizer_files
    return tool.main(["--input", *map(str, inputs), "--output-prefix", str(prefix), "--tokenizer-type",
                      "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, *extra])


def test_records_it_cannot_encode_are_skipped_and_counted_by_kind(tmp_path, tokenizer_files, capsys, monkeypatch):
    """Every kind of record that cannot become tokens is left out (under every key) and counted, never the end
    of the run; a BOM before the first record is not part of it."""
    tool = _tool("preprocess_data")
    real = tool.tokenizer_of

    def failing_on_boom(args):  # a tokenizer that fails on one text (as a library might on odd input)
        tok = real(args)
        tokenize = tok.tokenize

        def batch(texts):
            return [tok.tokenize(t) for t in texts]

        def one(text):
            if "BOOM" in text:
                raise ValueError("cannot tokenize this")
            return tokenize(text)
        tok.tokenize_batch, tok.tokenize = batch, one
        return tok

    monkeypatch.setattr(tool, "tokenizer_of", failing_on_boom)
    texts = _texts(9, seed=5)
    docs = [{"text": t, "title": f"title {i}"} for i, t in enumerate(texts)]
    lines = [json.dumps(d).encode() for d in docs]
    bad = {1: b'{"text": "lone \\ud800 surrogate", "title": "x"}', 3: b'{"text": ' + b"[" * 100000 + b"]" * 100000
           + b"}", 5: json.dumps({"text": "fine", "title": "BOOM"}).encode(), 7: b'{"text": "\xff", "title": "x"}'}
    for i, line in bad.items():
        lines[i] = line
    (tmp_path / "in.jsonl").write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n")  # a BOM before record 1
    assert _main(tool, tokenizer_files, [tmp_path / "in.jsonl"], tmp_path / "out" / "c", "--json-keys", "text",
                 "title") == 0
    summary = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("skipped"))
    assert summary.startswith("skipped 4 bad record(s) of 9 (")
    for kind in ("1 a lone surrogate", "1 invalid JSON", "1 the tokenizer failed", "1 undecodable UTF-8"):
        assert kind in summary
    assert "in.jsonl:2: key 'text' holds a lone surrogate (\\ud800), which is not text" in summary
    assert "in.jsonl:4: invalid JSON (nested too deeply)" in summary
    assert "in.jsonl:6 (key 'title'): the tokenizer failed (ValueError: cannot tokenize this)" in summary
    tok = build_tokenizer("GPT2BPETokenizer", *tokenizer_files)
    good = [d for i, d in enumerate(docs) if i not in bad]
    for key in ("text", "title"):  # the record the tokenizer failed on under 'title' is out of 'text' too
        assert [d.tolist() for d in IndexedDataset(str(tmp_path / "out" / f"c_{key}_document"))] == \
            [tok.tokenize(d[key]) for d in good]


def test_a_bom_is_not_part_of_the_first_record(tmp_path, tokenizer_files):
    tok = build_tokenizer("GPT2BPETokenizer", *tokenizer_files)
    (tmp_path / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "the model"}).encode() + b"\n")
    (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbfthe model")
    for name in ("b.jsonl", "b.txt"):
        assert _run(tokenizer_files, [tmp_path / name], tmp_path / "out" / name) == 0
        assert [d.tolist() for d in IndexedDataset(str(tmp_path / "out" / f"{name}_text_document"))] == \
            [tok.tokenize("the model")]


def test_a_long_document_reaches_the_tokenizer_in_bounded_pieces_with_the_same_tokens(tmp_path, tokenizer_files,
                                                                                     monkeypatch):
    """A document longer than CHUNK_CHARS is tokenized in pieces cut before a space between two words: the
    tokenizer never holds more than CHUNK_CHARS characters (its memory, ~150 bytes per character for Hugging
    Face's, is what made a 50 MB document take 7.3 GB), and the tokens are the whole text's."""
    tool = _tool("preprocess_data")
    monkeypatch.setattr(tool, "CHUNK_CHARS", 300)
    seen, real = [], tool.tokenizer_of

    def spying(args):
        tok = real(args)
        batch = tok.tokenize_batch

        def spy(texts):
            seen.append(sum(map(len, texts)))
            return batch(texts)
        tok.tokenize_batch = spy
        return tok

    monkeypatch.setattr(tool, "tokenizer_of", spying)
    long = " ".join(_texts(60, seed=6)).replace(". ", ".  \n ")  # ~6,000 characters, runs of whitespace too
    docs = [long, "a short one.", long[:250]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    for extra, sub in (([], "d"), (["--split-sentences"], "s")):
        seen.clear()
        assert _main(tool, tokenizer_files, [tmp_path / "in.jsonl"], tmp_path / sub / "c", "--append-eod",
                     *extra) == 0
        assert len(docs[0]) > 10 * 300 and max(seen) <= 300
    tok = build_tokenizer("GPT2BPETokenizer", *tokenizer_files)
    assert [d.tolist() for d in IndexedDataset(str(tmp_path / "d" / "c_text_document"))] == \
        [tok.tokenize(t) + [tok.eod] for t in docs]
    text = "x" * 700 + " tail"  # no space between words for 700 characters: cut at the limit
    assert [len(p) for p in tool.pieces(text, 300)] == [300, 300, 105] and "".join(tool.pieces(text, 300)) == text
    assert list(tool.pieces("aaa bbb  ccc ddd", 9)) == ["aaa", " bbb  ccc", " ddd"]  # never in a run of spaces


@pytest.mark.parametrize("name, damage", [("in.jsonl.gz", "truncate"), ("in.jsonl.gz", "flip"),
                                          ("in.jsonl.bz2", "truncate"), ("in.jsonl.xz", "flip"),
                                          ("in.txt.gz", "not-compressed")])
def test_a_corrupt_compressed_input_is_one_line(tmp_path, tokenizer_files, capsys, name, damage):
    import bz2
    import lzma

    compress = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[Path(name).suffix]
    data = compress("".join(json.dumps({"text": t}) + "\n" for t in _texts(400, seed=7)).encode())
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / name).write_bytes(data)
    assert _run(tokenizer_files, [tmp_path / "good" / name], tmp_path / "ok" / "c") == 0  # read when whole
    capsys.readouterr()
    damaged = {"truncate": data[: len(data) // 2], "flip": data[:40] + bytes([data[40] ^ 0xFF]) + data[41:],
               "not-compressed": b"plain text, not gzip\n"}[damage]
    (tmp_path / name).write_bytes(damaged)
    assert _run(tokenizer_files, [tmp_path / name], tmp_path / "out" / "c") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("processed")]
    packed = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz"}[Path(name).suffix]
    assert len(err) == 1 and err[0].startswith(f"preprocess_data.py: error: cannot read {tmp_path / name}: its "
                                               f"{packed} data is corrupt or truncated (")
    assert err[0].endswith("; fetch or compress it again, or leave it out of --input.")
    assert os.listdir(tmp_path / "out") == []  # no output, not even a partial one


def test_a_second_writer_of_one_prefix_is_refused(tmp_path, tokenizer_files, capsys):
    """Two preprocess_data.py writing one --output-prefix at once would take each other's temporary files (one
    then said it wrote an .idx that did not exist): the second is refused while the first holds the lock."""
    from megatron import file_lock

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(5, seed=8)))
    (tmp_path / "out").mkdir()
    held = file_lock.hold(str(tmp_path / "out" / "c.lock"))  # the first writer (a lock is per open file)
    try:
        assert _run(tokenizer_files, [tmp_path / "in.jsonl"], tmp_path / "out" / "c") == 2
    finally:
        file_lock.drop(held, str(tmp_path / "out" / "c.lock"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"preprocess_data.py: error: another preprocess_data.py is writing "
                                               f"--output-prefix {tmp_path}/out/c (pid {os.getpid()} on ")
    assert err[0].endswith("wait for it to end, or give another --output-prefix.")
    assert os.listdir(tmp_path / "out") == []
    assert _run(tokenizer_files, [tmp_path / "in.jsonl"], tmp_path / "out" / "c") == 0  # once it has ended
    assert sorted(os.listdir(tmp_path / "out")) == ["c_text_document.bin", "c_text_document.idx"]  # no lock left


def test_a_zst_input_without_zstandard_says_what_to_install(tmp_path, tokenizer_files, capsys):
    if importlib.util.find_spec("zstandard") is not None:
        pytest.skip("zstandard is installed: .zst inputs are read")
    (tmp_path / "in.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    assert _run(tokenizer_files, [tmp_path / "in.jsonl.zst"], tmp_path / "out" / "c") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"preprocess_data.py: error: {tmp_path}/in.jsonl.zst is zstd-compressed: reading it needs the "
                   f"zstandard package (pip install zstandard), or decompress it first (zstd -d)."]
    assert os.listdir(tmp_path / "out") == []
