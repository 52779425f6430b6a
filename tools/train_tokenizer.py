#!/usr/bin/env python
"""Train a tokenizer offline on local text, with the `tokenizers` or `sentencepiece` library.

Inputs (``--input``: paths or globs, optionally gzipped):

- ``.jsonl`` / ``.json``: one JSON object per line, one document per line; the string under each
  ``--json-keys`` key is trained on (a missing key or a non-string value is an error).
- ``.txt``: plain text; each file is one document.

The corpus is streamed: files are read line by line and handed to the trainers' iterator APIs, never joined
into one string (SentencePiece itself keeps the sentences it trains on in memory; cap them with
``--max-documents`` or ``--input-sentence-size``).

``--type bpe``: GPT-2 style byte-level BPE. Writes ``vocab.json`` + ``merges.txt`` (GPT-2's format, for
``--tokenizer-type GPT2BPETokenizer``) and ``tokenizer.json`` (for ``HuggingFaceTokenizer``). The single
special token ``<|endoftext|>`` takes the LAST id (vocab size - 1), as in GPT-2 where it is 50256; every
other id is a byte or a merge.

``--type sentencepiece``: writes ``tokenizer.model`` (for ``SentencePieceTokenizer``) with unk=0, bos=1,
eos=2 (the end-of-document id), no pad, byte fallback on (no unknown characters), identity normalization and
whitespace kept as is (Llama-style).

The vocabulary size is an upper bound: a small corpus can give fewer tokens. Exit codes: 0 on success,
2 for bad arguments or inputs (missing, unreadable, malformed, empty), 1 when the trainer fails.

Example::

    python tools/train_tokenizer.py --input 'data/*.jsonl' --type bpe --vocab-size 50257 --output-dir tok/
"""

from __future__ import annotations

import argparse
import glob
import gzip
import io
import json
import os
import sys
from collections.abc import Iterator
from typing import IO

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

EOD_TOKEN = "<|endoftext|>"
TXT_CHUNK_CHARS = 1 << 20  # .txt files reach the BPE trainer in chunks of about 1M characters.
MAX_SENTENCE_BYTES = 4192  # SentencePiece skips longer sentences, so longer lines are cut at a space.


class InputError(Exception):
    """A problem with the inputs, reported as one line with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    p = argparse.ArgumentParser(prog="train_tokenizer.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="Files or globs (quote them): .jsonl/.json (one document per line) or .txt, optionally .gz.")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="Keys of the JSON objects whose strings are trained on.")
    p.add_argument("--type", choices=("bpe", "sentencepiece"), default="bpe",
                   help="bpe: byte-level BPE (vocab.json, merges.txt, tokenizer.json); "
                        "sentencepiece: tokenizer.model.")
    p.add_argument("--vocab-size", type=int, default=32000, help="Vocabulary size, special tokens included.")
    p.add_argument("--output-dir", required=True, help="Folder the tokenizer files are written to.")
    p.add_argument("--min-frequency", type=int, default=2, help="bpe: least count of a pair to merge it.")
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe", help="sentencepiece: the model.")
    p.add_argument("--character-coverage", type=float, default=0.9995,
                   help="sentencepiece: share of characters kept as pieces; the rest are byte-fallback bytes.")
    p.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="sentencepiece: encode characters outside the vocabulary as UTF-8 bytes instead of <unk>.")
    p.add_argument("--input-sentence-size", type=int, default=0,
                   help="sentencepiece: train on a random sample of this many lines (0: all of them).")
    p.add_argument("--max-documents", type=int, default=None, help="Read at most this many documents.")
    return p


# ----------------------------------------------------------------------------------------------- inputs
def expand_inputs(patterns: list[str]) -> list[str]:
    """The input files, in order, without repeats: globs expanded (sorted), plain paths checked."""
    files: list[str] = []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            matches = [m for m in sorted(glob.glob(pattern, recursive=True)) if os.path.isfile(m)]
            if not matches:
                raise InputError(f"--input {pattern} matches no files")
        elif os.path.isdir(pattern):
            raise InputError(f"--input {pattern} is a folder; pass files or a glob such as {pattern}/*.jsonl")
        elif not os.path.isfile(pattern):
            raise InputError(f"--input {pattern} does not exist")
        else:
            matches = [pattern]
        for match in matches:
            _input_kind(match)
            if match not in files:
                files.append(match)
    return files


def _input_kind(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith((".jsonl", ".json")):
        return "json"
    if name.endswith(".txt"):
        return "text"
    raise InputError(f"--input {path}: unsupported file type (expected .jsonl, .json or .txt, optionally .gz)")


def _open(path: str) -> IO[str]:
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


class Corpus:
    """Streams the inputs as text pieces; a problem ends the stream and is kept in ``error``.

    Trainers call the iterators from native code, so an exception raised inside them would come back wrapped
    (or with a traceback); instead the stream stops and the caller checks ``error`` after training.
    """

    def __init__(self, files: list[str], json_keys: list[str], max_documents: int | None) -> None:
        self.files = files
        self.json_keys = json_keys
        self.max_documents = max_documents
        self.documents = 0
        self.error: str | None = None

    def pieces(self) -> Iterator[str]:
        """The documents: a .jsonl line's strings, or a .txt file in chunks cut at newlines."""
        self.documents = 0
        self.error = None
        try:
            yield from self._pieces()
        except InputError as exc:
            self.error = str(exc)
        except (OSError, UnicodeDecodeError, EOFError) as exc:
            self.error = f"could not read the input: {exc}"

    def lines(self, max_bytes: int = MAX_SENTENCE_BYTES) -> Iterator[str]:
        """The non-blank lines of the documents, each cut to at most ``max_bytes`` UTF-8 bytes."""
        for piece in self.pieces():
            for line in piece.splitlines():
                if line.strip():
                    yield from _cut(line, max_bytes)

    def _pieces(self) -> Iterator[str]:
        for path in self.files:
            if self.max_documents is not None and self.documents >= self.max_documents:
                return
            with _open(path) as f:
                if _input_kind(path) == "text":
                    self.documents += 1
                    yield from _chunks(f)
                    continue
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    if self.max_documents is not None and self.documents >= self.max_documents:
                        return
                    self.documents += 1
                    yield from self._json_texts(line, path, lineno)

    def _json_texts(self, line: str, path: str, lineno: int) -> Iterator[str]:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{path}:{lineno}: expected a JSON object per line")
        for key in self.json_keys:
            if key not in obj:
                raise InputError(f"{path}:{lineno}: no key {key!r} (set --json-keys)")
            if not isinstance(obj[key], str):
                raise InputError(f"{path}:{lineno}: {key!r} is not a string")
            if obj[key]:
                yield obj[key]


def _chunks(f: IO[str]) -> Iterator[str]:
    """A text file in pieces of about TXT_CHUNK_CHARS characters, cut after a newline (else before a space)."""
    rest = ""
    while block := f.read(TXT_CHUNK_CHARS):
        text = rest + block
        cut = text.rfind("\n") + 1 or max(text.rfind(" "), 0) or len(text)  # " word" stays whole
        rest = text[cut:]
        yield text[:cut]
    if rest:
        yield rest


def _cut(line: str, max_bytes: int) -> Iterator[str]:
    """``line`` in pieces of at most ``max_bytes`` UTF-8 bytes, cut at the last space where there is one."""
    while len(line.encode("utf-8")) > max_bytes:
        head = line.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
        space = head.rfind(" ")
        cut = space if space > 0 else len(head)
        yield line[:cut]
        line = line[cut:].removeprefix(" ")
    if line.strip():
        yield line


# --------------------------------------------------------------------------------------------- trainers
def train_bpe(corpus: Corpus, vocab_size: int, min_frequency: int, output_dir: str) -> list[str]:
    """Byte-level BPE with ``<|endoftext|>`` as the last id; returns the files written."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, min_frequency=min_frequency, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=sys.stderr.isatty())
    tok.train_from_iterator(corpus.pieces(), trainer=trainer)
    if corpus.error is not None:
        raise InputError(corpus.error)

    # The trainer's ids are 0..n-1 (bytes, then merges); <|endoftext|> is appended as n, as GPT-2 has it.
    vocab_file, merge_file = tok.model.save(output_dir)
    vocab = tok.get_vocab()
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise RuntimeError("the BPE trainer's ids are not 0..n-1")
    vocab[EOD_TOKEN] = len(vocab)
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(dict(sorted(vocab.items(), key=lambda kv: kv[1])), f, ensure_ascii=False)

    # tokenizer.json: the same BPE, read back from the files just written, with GPT-2's pipeline.
    final = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    final.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    final.decoder = decoders.ByteLevel()
    final.post_processor = processors.ByteLevel(trim_offsets=False)
    final.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    tokenizer_json = os.path.join(output_dir, "tokenizer.json")
    final.save(tokenizer_json)
    return [vocab_file, merge_file, tokenizer_json]


def train_sentencepiece(corpus: Corpus, args: argparse.Namespace) -> list[str]:
    """A SentencePiece model with eos enabled; returns the files written."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=corpus.lines(), model_writer=model, model_type=args.model_type,
        vocab_size=args.vocab_size, character_coverage=args.character_coverage, byte_fallback=args.byte_fallback,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, hard_vocab_limit=False,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        max_sentence_length=MAX_SENTENCE_BYTES, input_sentence_size=args.input_sentence_size,
        shuffle_input_sentence=True, num_threads=min(os.cpu_count() or 1, 16), minloglevel=1)
    if corpus.error is not None:
        raise InputError(corpus.error)
    path = os.path.join(args.output_dir, "tokenizer.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return [path]


# ------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the exit code (0 success, 2 bad arguments or inputs, 1 trainer failure)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage and the error.
        return exc.code if isinstance(exc.code, int) else 2
    prog = parser.prog

    def fail(message: str, code: int) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return code

    least = 257 if args.type == "bpe" else 1
    if args.vocab_size < least:
        return fail(f"--vocab-size must be at least {least} for --type {args.type}, got {args.vocab_size}", 2)
    if args.max_documents is not None and args.max_documents < 1:
        return fail(f"--max-documents must be at least 1, got {args.max_documents}", 2)
    if args.min_frequency < 0 or args.input_sentence_size < 0:
        return fail("--min-frequency and --input-sentence-size cannot be negative", 2)
    if not 0.0 < args.character_coverage <= 1.0:
        return fail(f"--character-coverage must be in (0, 1], got {args.character_coverage}", 2)
    try:
        files = expand_inputs(args.input)
        os.makedirs(args.output_dir, exist_ok=True)
        corpus = Corpus(files, args.json_keys, args.max_documents)
        if not any(True for _ in corpus.pieces()) and corpus.error is None:
            raise InputError(f"no text in --input {' '.join(args.input)}")
        if corpus.error is not None:
            raise InputError(corpus.error)
        if args.type == "bpe":
            written = train_bpe(corpus, args.vocab_size, args.min_frequency, args.output_dir)
        else:
            written = train_sentencepiece(corpus, args)
    except InputError as exc:
        return fail(str(exc), 2)
    except OSError as exc:
        return fail(str(exc), 2)
    except (RuntimeError, ValueError) as exc:  # the trainer's own complaints (e.g. vocabulary too small)
        return fail(f"{args.type} training failed: {str(exc).strip().splitlines()[0]}", 1)

    from megatron.tokenizer import GPT2BPETokenizer, SentencePieceTokenizer

    if args.type == "bpe":
        loaded = GPT2BPETokenizer(written[0], written[1])
        eod = f"{EOD_TOKEN} = {loaded.eod}"
    else:
        loaded = SentencePieceTokenizer(written[0])
        eod = f"eos = {loaded.eod}"
    for path in written:
        print(f"wrote {path}")
    note = "" if loaded.vocab_size == args.vocab_size else f" (asked for {args.vocab_size}; the corpus gave fewer)"
    print(f"{args.type} tokenizer from {corpus.documents} documents in {len(files)} file(s): "
          f"vocab size {loaded.vocab_size}{note}, {eod}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
