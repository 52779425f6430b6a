"""Tokenize a corpus into Megatron-LM's mmap indexed format.

    python tools/preprocess_data.py --input corpus/*.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 4

writes ``data/corpus_text_document.bin`` / ``.idx`` (one pair per ``--json-keys`` key). With
``--split-sentences`` (Megatron-LM's flag) each sentence of a document is its own sequence in the
``.idx`` (the document boundaries are still recorded) and the pair is ``data/corpus_text_sentence``;
sentences are found by the rule in ``megatron/data/sentences.py`` (no nltk download).
``--tokenizer-type NullTokenizer --vocab-size N`` reads text that is already token ids (``"11 325 97"``).

Input: JSONL files (one JSON object per line; ``.gz`` too), a folder or glob of them, or
plain ``.txt`` files (one document per file, or per blank-line-separated block with
``--txt-mode paragraph``). Memory stays flat: lines are streamed in, tokenized by worker
processes in batches with a bounded number in flight, and streamed out in input order.
Output is written under temporary names and renamed when complete. Bad lines (invalid JSON,
a missing or non-string key, undecodable bytes) are counted and reported; ``--fail-on-error``
stops at the first. An input that gives no tokens, or a tokenizer that produces an id outside its
own vocabulary, stops with one line and exit 2, leaving no output files.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.indexed_dataset import IndexedDatasetWriter, best_dtype  # noqa: E402
from megatron.data.sentences import split_sentences  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES, TokenizerError, build_tokenizer  # noqa: E402

INPUT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".txt", ".txt.gz")


class PreprocessError(Exception):
    pass


def expand_inputs(patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = sorted(p for p in glob.glob(os.path.join(pattern, "**", "*"), recursive=True)
                           if p.endswith(INPUT_SUFFIXES) and os.path.isfile(p))
        else:
            found = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not found or not all(os.path.isfile(p) for p in found):
            raise PreprocessError(f"--input '{pattern}' matches no file; give JSONL/.txt files, a folder or a glob.")
        files.extend(found)
    return files


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_records(files: list[str], txt_mode: str) -> Iterator[tuple[str, int, bytes]]:
    """Yield (where, kind, raw) per document candidate: kind 0 = a JSON line, 1 = plain text."""
    for path in files:
        is_txt = path.endswith((".txt", ".txt.gz"))
        with _open(path) as f:
            if is_txt and txt_mode == "file":
                yield path, 1, f.read()
                continue
            block: list[bytes] = []
            for number, line in enumerate(f, 1):
                if not is_txt:
                    if line.strip():
                        yield f"{path}:{number}", 0, line
                elif line.strip():
                    block.append(line)
                elif block:
                    yield f"{path}:{number}", 1, b"".join(block)
                    block = []
            if block:
                yield f"{path}:end", 1, b"".join(block)


class Encoder:
    """Turns raw records into token arrays per key. One instance per worker process."""

    tokenizer = None

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def initialize(self) -> None:
        a = self.args
        if a.workers > 1:  # the processes are the parallelism: no tokenizer thread pools on top
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        Encoder.tokenizer = tokenizer_of(a)

    def encode(self, batch: list[tuple[str, int, bytes]]) -> tuple[list[list[list[np.ndarray]]], int, list[str],
                                                                    str | None]:
        """-> (per key, per good document of the batch, its sequences' token arrays; bytes read; error messages;
        a fatal error: the first id outside the tokenizer's vocabulary, or None)."""
        keys, tokenizer, errors = self.args.json_keys, Encoder.tokenizer, []
        texts: list[list[str]] = [[] for _ in keys]
        wheres: list[str] = []
        size = 0
        for where, kind, raw in batch:
            size += len(raw)
            fields, error = _fields(where, kind, raw, keys)
            if error is not None:
                errors.append(error)
                continue
            wheres.append(where)
            for column, field in zip(texts, fields):
                column.append(field)
        out = []
        for key, column in zip(keys, texts):
            try:
                sequences = self._sequences(column)
            except TokenizerError as err:  # text the tokenizer cannot read (NullTokenizer: not integer ids)
                return [], size, errors, f"{wheres[0]} to {wheres[-1]} (key '{key}'): {err}"
            arrays, bad = _to_arrays(sequences, tokenizer.vocab_size)
            if bad is not None:
                return [], size, errors, (f"{wheres[bad[0]]} (key '{key}'): the tokenizer produced id {bad[1]} but "
                                          f"its vocabulary has {tokenizer.vocab_size} ids; the tokenizer files "
                                          f"are inconsistent: check them, or use the files the model was made with.")
            out.append(arrays)
        return out, size, errors, None

    def _sequences(self, column: list[str]) -> list[list[list[int]]]:
        """Per document, the token ids of its sequences: the whole text, or with --split-sentences each sentence
        that gives tokens (as Megatron-LM). --append-eod ends the document's last sequence."""
        a, tokenizer = self.args, Encoder.tokenizer
        if not a.split_sentences:
            encoded = tokenizer.tokenize_batch(column) if column else []
            return [[ids + [tokenizer.eod]] if a.append_eod else [ids] for ids in encoded]
        per_doc = [split_sentences(text, a.keep_newlines) for text in column]
        flat = [s for sentences in per_doc for s in sentences]
        encoded = iter(tokenizer.tokenize_batch(flat) if flat else [])
        docs = []
        for sentences in per_doc:
            seqs = [ids for ids in (next(encoded) for _ in sentences) if ids]
            if seqs and a.append_eod:
                seqs[-1] = seqs[-1] + [tokenizer.eod]
            docs.append(seqs)
        return docs


def tokenizer_of(args: argparse.Namespace):
    """The tokenizer the flags name (Megatron-LM's --tokenizer-type and its files and arguments); --vocab-size
    and the --tiktoken-* flags are NullTokenizer's and TikTokenizer's, ignored by the other types."""
    extra = {}
    if args.tokenizer_type in ("NullTokenizer", "TikTokenizer"):
        extra = {"vocab_size": args.vocab_size, "tiktoken_pattern": args.tiktoken_pattern,
                 "tiktoken_num_special_tokens": args.tiktoken_num_special_tokens}
    return build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                           args.eod_token, **extra)


def _fields(where: str, kind: int, raw: bytes, keys: list[str]) -> tuple[list[str] | None, str | None]:
    """(the text of each key, None), or (None, why the record is bad)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"{where}: undecodable UTF-8 ({err.reason} at byte {err.start})"
    if kind == 1:
        return [text] * len(keys), None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"{where}: invalid JSON ({err.msg})"
    missing = [k for k in keys if not isinstance(doc, dict) or not isinstance(doc.get(k), str)]
    if missing:
        return None, f"{where}: no string value for key '{missing[0]}'"
    return [doc[k] for k in keys], None


def _to_arrays(docs: list[list[list[int]]], vocab_size: int) -> tuple[list[list[np.ndarray]], tuple[int, int] | None]:
    """Each document's sequences as arrays of the format's dtype, and (document, id) of the first id >= vocab_size
    (else None)."""
    dtype, arrays = best_dtype(vocab_size), []
    for d, sequences in enumerate(docs):
        doc = []
        for ids in sequences:
            try:
                arr = np.asarray(ids, dtype=dtype)
            except OverflowError:  # an id too large for the dtype, hence for the vocabulary
                return arrays, (d, max(ids))
            if len(arr) and int(arr.max()) >= vocab_size:
                return arrays, (d, int(arr.max()))
            doc.append(arr)
        arrays.append(doc)
    return arrays, None


def _batches(records: Iterator, batch_size: int) -> Iterator[list]:
    batch = []
    for record in records:
        batch.append(record)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def _results(encoder: Encoder, batches: Iterator[list], workers: int) -> Iterator[tuple]:
    """Encoded batches in input order, with at most 2 x workers batches in flight."""
    if workers <= 1:
        encoder.initialize()
        for batch in batches:
            yield encoder.encode(batch)
        return
    with multiprocessing.get_context("fork").Pool(workers, initializer=encoder.initialize) as pool:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(encoder.encode, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class Progress:
    def __init__(self, interval: int):
        self.interval, self.start, self.next = interval, time.time(), interval
        self.docs = self.bytes = self.bad = 0

    def update(self, docs: int, size: int, final: bool = False) -> None:
        self.docs += docs
        self.bytes += size
        if self.docs >= self.next or final:
            elapsed = max(time.time() - self.start, 1e-9)
            print(f"processed {self.docs} documents ({self.docs / elapsed:.0f} docs/s, "
                  f"{self.bytes / elapsed / 2**20:.2f} MB/s)", file=sys.stderr, flush=True)
            self.next = self.docs + self.interval


def preprocess(args: argparse.Namespace) -> dict:
    files = expand_inputs(args.input)
    encoder = Encoder(args)
    probe = tokenizer_of(args)
    dtype = best_dtype(probe.vocab_size)
    level = "sentence" if args.split_sentences else "document"  # Megatron-LM's names
    prefixes = [f"{args.output_prefix}_{key}_{level}" for key in args.json_keys]
    writers = [IndexedDatasetWriter(p, dtype) for p in prefixes]
    progress, bad = Progress(args.log_interval), []
    try:
        records = read_records(files, args.txt_mode)
        for encoded, size, errors, fatal in _results(encoder, _batches(records, args.batch_size), args.workers):
            if fatal is not None:
                raise PreprocessError(fatal)
            if errors and args.fail_on_error:
                raise PreprocessError(f"bad input at {errors[0]} (--fail-on-error is set).")
            bad.extend(errors[: max(0, 5 - len(bad))])
            progress.bad += len(errors)
            for writer, docs in zip(writers, encoded):
                for sequences in docs:
                    for sequence in sequences:
                        writer.add_item(sequence)
                    writer.end_document()
            progress.update(len(encoded[0]), size)
        _check_not_empty(writers, args.json_keys, progress.bad, bad)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    for writer in writers:
        writer.finalize()
    progress.update(0, 0, final=True)
    if progress.bad:
        print(f"skipped {progress.bad} bad record(s); the first: " + "; ".join(bad), file=sys.stderr)
    for prefix in prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx", file=sys.stderr)
    return {"documents": progress.docs, "bad": progress.bad, "bytes": progress.bytes, "prefixes": prefixes}


def _check_not_empty(writers: list[IndexedDatasetWriter], keys: list[str], num_bad: int, bad: list[str]) -> None:
    """An output without documents or tokens is an error (nothing is written): a dataset must hold tokens."""
    for writer, key in zip(writers, keys):
        if writer.num_documents and writer.num_tokens:
            continue
        found = f"{writer.num_documents} documents, {writer.num_tokens} tokens"
        why = f"; all {num_bad} record(s) were bad, the first: {bad[0]}" if num_bad and not writer.num_documents else ""
        raise PreprocessError(f"the input gives key '{key}' no tokens ({found}){why}; nothing was written: give "
                              f"input that holds text.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="preprocess_data.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="JSONL/.txt files, folders or globs.")
    p.add_argument("--output-prefix", required=True,
                   help="Output path prefix; _{key}_document.bin/.idx is added (_{key}_sentence.bin/.idx with "
                        "--split-sentences).")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="Keys of the JSON objects to tokenize.")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--vocab-file", help="GPT-2 BPE vocab.json.")
    p.add_argument("--merge-file", help="GPT-2 BPE merges.txt.")
    p.add_argument("--tokenizer-model", help="SentencePiece .model, Hugging Face tokenizer.json (or its folder), or "
                                             "TikTokenizer's vocabulary JSON.")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer: ids 0..N-1 of the pre-tokenized text, N-1 the "
                                                  "end-of-document id (required); TikTokenizer: default 131072.")
    p.add_argument("--tiktoken-pattern", choices=["v1", "v2"], help="TikTokenizer: the pre-tokenization pattern "
                                                                    "(default v2).")
    p.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids reserved for special tokens below the BPE ranks.")
    p.add_argument("--eod-token", help="End-of-document token of a Hugging Face tokenizer, when not a usual name.")
    p.add_argument("--append-eod", action="store_true", help="End every document with the end-of-document token.")
    p.add_argument("--workers", type=int, default=1, help="Tokenizer worker processes.")
    p.add_argument("--batch-size", type=int, default=256, help="Documents per worker task.")
    p.add_argument("--log-interval", type=int, default=10000, help="Report progress every this many documents.")
    p.add_argument("--txt-mode", choices=["file", "paragraph"], default="file",
                   help=".txt input: one document per file, or per blank-line-separated block.")
    p.add_argument("--fail-on-error", action="store_true", help="Stop at the first bad record.")
    p.add_argument("--split-sentences", action="store_true",
                   help="One sequence per sentence (document boundaries kept), as Megatron-LM; a rule, not nltk.")
    p.add_argument("--keep-newlines", action="store_true",
                   help="With --split-sentences: keep the newlines that follow each sentence.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1 or args.batch_size < 1 or args.log_interval < 1:
        print("preprocess_data.py: error: --workers, --batch-size and --log-interval must be at least 1.",
              file=sys.stderr)
        return 2
    try:
        preprocess(args)
    except (PreprocessError, TokenizerError) as err:
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
