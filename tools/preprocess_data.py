"""Tokenize a corpus into Megatron-LM's mmap indexed format.

    python tools/preprocess_data.py --input corpus/*.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 4

writes ``data/corpus_text_document.bin`` / ``.idx`` (one pair per ``--json-keys`` key). With
``--split-sentences`` (Megatron-LM's flag) each sentence of a document is its own sequence in the
``.idx`` (the document boundaries are still recorded) and the pair is ``data/corpus_text_sentence``;
sentences are found by the rule in ``megatron/data/sentences.py`` (no nltk download).
``--tokenizer-type NullTokenizer --vocab-size N`` reads text that is already token ids (``"11 325 97"``).

Input: JSONL files (one JSON object per line), a folder or glob of them, or plain ``.txt`` files
(one document per file, or per blank-line-separated block with ``--txt-mode paragraph``); each may be
compressed (``.gz``, ``.bz2``, ``.xz``; ``.zst`` with the zstandard package) and may start with a UTF-8
byte order mark. Memory stays flat: lines are streamed in, tokenized by worker processes in batches with a
bounded number in flight, and streamed out in input order; the tokenizer sees at most ``CHUNK_CHARS``
characters at a time (a longer document is tokenized in pieces, cut before a space between two words).
Output is written under temporary names and renamed when complete, by one writer at a time: a second
``preprocess_data.py`` with the same ``--output-prefix`` is refused while the first holds
``{prefix}.lock``. Records that cannot be encoded (invalid JSON, a missing or non-string key,
undecodable bytes, a lone surrogate, text the tokenizer fails on) are skipped, counted by kind in the
summary line and the first few named; ``--fail-on-error`` stops at the first. A corrupt or truncated
input file, an input that gives no tokens, or a tokenizer that produces an id outside its own vocabulary
stops with one line and exit 2, leaving no output files.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron import file_lock  # noqa: E402
from megatron.data.corpus_files import COMPRESSIONS, CorpusError, expand_inputs, read_records  # noqa: E402
from megatron.data.indexed_dataset import IndexedDatasetWriter, best_dtype  # noqa: E402
from megatron.data.sentences import split_sentences  # noqa: E402
from megatron.progress import Progress  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES, TokenizerError, build_tokenizer  # noqa: E402

CHUNK_CHARS = 1 << 20  # the most characters the tokenizer is given at once


class PreprocessError(Exception):
    pass


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

    def encode(self, batch: list[tuple[str, int, bytes]]) -> tuple[list[list[list[np.ndarray]]], int,
                                                                    list[tuple[str, str]], str | None]:
        """-> (per key, per good document of the batch, its sequences' token arrays; bytes read; the bad records,
        each (kind, message); a fatal error: the first id outside the tokenizer's vocabulary, or None)."""
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
        out, failed = [], {}
        for key, column in zip(keys, texts):
            try:
                docs = self._sequences(column)
            except TokenizerError as err:  # text the tokenizer cannot read (NullTokenizer: not integer ids)
                return [], size, errors, f"{wheres[0]} to {wheres[-1]} (key '{key}'): {err}"
            except _OutOfVocabulary as bad:
                return [], size, errors, (f"{wheres[bad.doc]} (key '{key}'): the tokenizer produced id {bad.id} but "
                                          f"its vocabulary has {tokenizer.vocab_size} ids; the tokenizer files "
                                          f"are inconsistent: check them, or use the files the model was made with.")
            for d, doc in enumerate(docs):
                if isinstance(doc, str) and d not in failed:  # this key's text of the record: a tokenizer failure
                    failed[d] = ("the tokenizer failed", f"{wheres[d]} (key '{key}'): the tokenizer failed ({doc})")
            out.append(docs)
        if failed:  # the record is left out under every key
            errors.extend(failed[d] for d in sorted(failed))
            out = [[doc for d, doc in enumerate(docs) if d not in failed] for docs in out]
        return out, size, errors, None

    def _sequences(self, column: list[str]) -> list[list[np.ndarray] | str]:
        """Per document, the token arrays of its sequences (the whole text, or with --split-sentences each sentence
        that gives tokens, as Megatron-LM), or why the tokenizer failed on it. --append-eod ends the document's last
        sequence."""
        a, eod = self.args, Encoder.tokenizer.eod
        if not a.split_sentences:
            docs = [ids if isinstance(ids, str) else [ids] for ids in self._arrays(column)]
        else:
            per_doc = [split_sentences(text, a.keep_newlines) for text in column]
            encoded = iter(self._arrays([s for sentences in per_doc for s in sentences]))
            docs = []
            for sentences in per_doc:
                seqs = [next(encoded) for _ in sentences]
                failure = next((ids for ids in seqs if isinstance(ids, str)), None)
                docs.append(failure if failure is not None else [ids for ids in seqs if len(ids)])
        if a.append_eod:
            for doc in docs:
                if not isinstance(doc, str) and doc:
                    doc[-1] = np.append(doc[-1], np.asarray(eod, dtype=doc[-1].dtype))
        return docs

    def _arrays(self, texts: list[str]) -> list[np.ndarray | str]:
        """Each text's token ids as an array of the output's dtype, or why the tokenizer failed on it. The tokenizer
        is given at most CHUNK_CHARS characters at once (texts in groups, a longer text in pieces), so its working
        memory does not grow with a document's length. _OutOfVocabulary for an id outside the vocabulary."""
        out: list = [None] * len(texts)
        group: list[int] = []
        size = 0
        for i, text in enumerate(texts):
            if len(text) > CHUNK_CHARS:
                out[i] = self._long(i, text)
                continue
            group.append(i)
            size += len(text)
            if size >= CHUNK_CHARS:
                self._tokenize(texts, group, out)
                group, size = [], 0
        self._tokenize(texts, group, out)
        return out

    def _long(self, i: int, text: str) -> np.ndarray | str:
        parts = []
        for piece in pieces(text, CHUNK_CHARS):
            result: list = [None]
            self._tokenize([piece], [0], result, doc=i)
            if isinstance(result[0], str):
                return result[0]
            parts.append(result[0])
        return np.concatenate(parts) if parts else np.zeros(0, best_dtype(Encoder.tokenizer.vocab_size))

    def _tokenize(self, texts: list[str], group: list[int], out: list, doc: int | None = None) -> None:
        """Tokenize ``texts[i]`` for i in ``group`` into ``out[i]``; when the batch call fails (not a TokenizerError),
        each text alone, the failing ones getting their error's message."""
        if not group:
            return
        tokenizer = Encoder.tokenizer
        try:
            results = tokenizer.tokenize_batch([texts[i] for i in group])
        except TokenizerError:
            raise
        except Exception:
            results = []
            for i in group:
                try:
                    results.append(tokenizer.tokenize(texts[i]))
                except TokenizerError:
                    raise
                except Exception as err:
                    results.append(" ".join(f"{type(err).__name__}: {err}".split())[:200])
        for i, ids in zip(group, results):
            out[i] = ids if isinstance(ids, str) else _array(ids, tokenizer.vocab_size, i if doc is None else doc)


class _OutOfVocabulary(Exception):
    def __init__(self, doc: int, id: int):
        super().__init__(doc, id)
        self.doc, self.id = doc, id


def _array(ids: list[int], vocab_size: int, doc: int) -> np.ndarray:
    """``ids`` as an array of the output's dtype; _OutOfVocabulary(doc, id) for an id >= vocab_size."""
    try:
        arr = np.asarray(ids, dtype=best_dtype(vocab_size))
    except OverflowError:  # an id too large for the dtype, hence for the vocabulary
        raise _OutOfVocabulary(doc, max(ids)) from None
    if len(arr) and int(arr.max()) >= vocab_size:
        raise _OutOfVocabulary(doc, int(arr.max()))
    return arr


def pieces(text: str, limit: int) -> Iterator[str]:
    """``text`` in pieces of at most ``limit`` characters, each cut just before a space between two words
    ("word| next"), where byte-level BPE (GPT-2, tiktoken), SentencePiece's default normalization and
    pre-tokenized ids split anyway: the pieces' tokens are the whole text's. A stretch of ``limit`` characters
    without such a space is cut at the limit (its tokens at the cut may differ from the whole text's)."""
    start, n = 0, len(text)
    while n - start > limit:
        end = start + limit
        cut = text.rfind(" ", start + 1, end)
        while cut > start and (text[cut - 1].isspace() or text[cut + 1].isspace()):
            cut = text.rfind(" ", start + 1, cut)
        if cut <= start:
            cut = end
        yield text[start:cut]
        start = cut
    yield text[start:]


def tokenizer_of(args: argparse.Namespace):
    """The tokenizer the flags name (Megatron-LM's --tokenizer-type and its files and arguments); --vocab-size
    and the --tiktoken-* flags are NullTokenizer's and TikTokenizer's, ignored by the other types."""
    extra = {}
    if args.tokenizer_type in ("NullTokenizer", "TikTokenizer"):
        extra = {"vocab_size": args.vocab_size, "tiktoken_pattern": args.tiktoken_pattern,
                 "tiktoken_num_special_tokens": args.tiktoken_num_special_tokens}
    return build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                           args.eod_token, **extra)


def _fields(where: str, kind: int, raw: bytes, keys: list[str]) -> tuple[list[str] | None, tuple[str, str] | None]:
    """(the text of each key, None), or (None, (the kind of bad record, why))."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, ("undecodable UTF-8", f"{where}: undecodable UTF-8 ({err.reason} at byte {err.start})")
    if kind == 1:
        return [text] * len(keys), None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        return None, ("invalid JSON", f"{where}: invalid JSON ({err.msg})")
    except RecursionError:
        return None, ("invalid JSON", f"{where}: invalid JSON (nested too deeply)")
    missing = [k for k in keys if not isinstance(doc, dict) or not isinstance(doc.get(k), str)]
    if missing:
        return None, ("no string value for a key", f"{where}: no string value for key '{missing[0]}'")
    fields = [doc[k] for k in keys]
    if "\\u" in text:  # only a \uXXXX escape can make a lone surrogate: a str that is not text
        for key, field in zip(keys, fields):
            try:
                field.encode("utf-8")
            except UnicodeEncodeError as err:
                return None, ("a lone surrogate", f"{where}: key '{key}' holds a lone surrogate "
                                                  f"(\\u{ord(field[err.start]):04x}), which is not text")
    return fields, None


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
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=encoder.initialize)
    finished = False
    try:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(encoder.encode, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        finished = True
    finally:
        # done: the workers take the end sentinel and exit on their own. Pool.terminate (what ``with Pool()`` does)
        # holds the task queue's lock and signals the workers: one that did not die of it (forked mid-call) hung
        # the join for good. Terminated only when the run stops early (an error, Ctrl-C).
        if finished:
            pool.close()
        else:
            pool.terminate()
        pool.join()


class Counts:
    """What was read and written, shown by megatron/progress.py (a bar on a terminal, a line every
    --progress-interval seconds in a file): input bytes against the input files' size (unknown for compressed
    input), and documents."""

    def __init__(self, files: list[str], interval: float):
        total = None if any(f.endswith(tuple(COMPRESSIONS)) for f in files) else sum(_size(f) for f in files)
        self.bar = Progress("preprocess", total=total or None, unit="B", interval=interval)
        self.docs = self.bytes = self.bad = 0

    def update(self, docs: int, size: int) -> None:
        self.docs += docs
        self.bytes += size
        self.bar.set_postfix(f"{self.docs} docs")
        self.bar.update(size)

    def close(self) -> None:
        if self.bar.total:  # the files' size counts what was not a record too (blank lines, a BOM)
            self.bar.set_total(self.bytes)
        self.bar.close()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def preprocess(args: argparse.Namespace) -> dict:
    files = expand_inputs(args.input)
    encoder = Encoder(args)
    probe = tokenizer_of(args)
    dtype = best_dtype(probe.vocab_size)
    level = "sentence" if args.split_sentences else "document"  # Megatron-LM's names
    prefixes = [f"{args.output_prefix}_{key}_{level}" for key in args.json_keys]
    lock = _hold_prefix(args.output_prefix)
    try:
        return _write(args, files, encoder, [IndexedDatasetWriter(p, dtype) for p in prefixes], prefixes)
    finally:
        if lock is not None:
            file_lock.drop(lock, args.output_prefix + ".lock")


def _hold_prefix(prefix: str):
    """The lock on ``{prefix}.lock`` while this process writes the prefix's files: a second writer of the same
    prefix would take over its temporary files. PreprocessError when another one holds it; None (and a warning)
    where the file system has no locks."""
    path = prefix + ".lock"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return file_lock.hold(path)
    except file_lock.Busy as busy:
        raise PreprocessError(f"another preprocess_data.py is writing --output-prefix {prefix} ({busy.holder}, "
                              f"holding {path}): wait for it to end, or give another --output-prefix.") from None
    except file_lock.Unsupported as err:
        print(f"preprocess_data.py: warning: cannot lock {path} ({err}): a second writer of the same "
              f"--output-prefix would not be detected.", file=sys.stderr)
        return None
    except OSError as err:
        raise PreprocessError(f"cannot write {path} ({err.strerror or err}); give a writable --output-prefix.") \
            from None


def _write(args: argparse.Namespace, files: list[str], encoder: Encoder, writers: list[IndexedDatasetWriter],
           prefixes: list[str]) -> dict:
    progress, bad, kinds = Counts(files, args.progress_interval), [], collections.Counter()
    try:
        records = read_records(files, args.txt_mode)
        for encoded, size, errors, fatal in _results(encoder, _batches(records, args.batch_size), args.workers):
            if fatal is not None:
                raise PreprocessError(fatal)
            if errors and args.fail_on_error:
                raise PreprocessError(f"bad input at {errors[0][1]} (--fail-on-error is set).")
            bad.extend(message for _, message in errors[: max(0, 5 - len(bad))])
            kinds.update(kind for kind, _ in errors)
            progress.bad += len(errors)
            for writer, docs in zip(writers, encoded):
                for sequences in docs:
                    for sequence in sequences:
                        writer.add_item(sequence)
                    writer.end_document()
            progress.update(len(encoded[0]) if encoded else 0, size)
        _check_not_empty(writers, args.json_keys, progress.bad, bad)
    except BaseException:
        progress.bar.close(final=False)
        for writer in writers:
            writer.abort()
        raise
    for writer in writers:
        writer.finalize()
    progress.close()
    if progress.bad:
        counts = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
        print(f"skipped {progress.bad} bad record(s) of {progress.docs + progress.bad} ({counts}); the first: "
              + "; ".join(bad), file=sys.stderr)
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
    p.add_argument("--progress-interval", type=float, default=10.0,
                   help="Seconds between progress lines when stderr is a file or pipe (on a terminal: a bar).")
    p.add_argument("--log-interval", type=int, default=10000,
                   help="Megatron-LM's flag, accepted: progress is reported by time (--progress-interval).")
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
    if args.workers < 1 or args.batch_size < 1 or args.log_interval < 1 or not args.progress_interval > 0:
        print("preprocess_data.py: error: --workers, --batch-size and --log-interval must be at least 1, "
              "--progress-interval above 0.", file=sys.stderr)
        return 2
    try:
        preprocess(args)
    except (PreprocessError, CorpusError, TokenizerError) as err:
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
