"""The raw corpus files ``tools/preprocess_data.py`` reads: which files an ``--input`` names, and their
records, streamed.

JSONL files (one JSON object per line) and plain ``.txt`` files (one document per file, or per
blank-line-separated block), each possibly compressed (``.gz``, ``.bz2``, ``.xz``; ``.zst`` with the
zstandard package). A UTF-8 byte order mark at the start of a file is not part of its first record. A file
that cannot be read to its end (a corrupt or truncated compressed stream) is a one-line CorpusError.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import lzma
import os
import zlib
from collections.abc import Iterator


class CorpusError(Exception):
    """An input that cannot be read: one line saying which and what to do."""


COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}
INPUT_SUFFIXES = tuple(kind + packed for kind in (".jsonl", ".json", ".txt") for packed in ("", *COMPRESSIONS))
BOM = b"\xef\xbb\xbf"


def expand_inputs(patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = sorted(p for p in glob.glob(os.path.join(pattern, "**", "*"), recursive=True)
                           if p.endswith(INPUT_SUFFIXES) and os.path.isfile(p))
        else:
            found = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not found or not all(os.path.isfile(p) for p in found):
            raise CorpusError(f"--input '{pattern}' matches no file; give JSONL/.txt files, a folder or a glob.")
        files.extend(found)
    return files


def _compression(path: str) -> str | None:
    return next((name for suffix, name in COMPRESSIONS.items() if path.endswith(suffix)), None)


def _open(path: str):
    packed = _compression(path)
    if packed == "zstd":
        try:
            import zstandard
        except ImportError:
            raise CorpusError(f"{path} is zstd-compressed: reading it needs the zstandard package (pip install "
                                  f"zstandard), or decompress it first (zstd -d).") from None
        return zstandard.open(path, "rb")
    opener = {"gzip": gzip.open, "bzip2": bz2.open, "xz": lzma.open}.get(packed, open)
    return opener(path, "rb")


def _corrupt_errors() -> tuple[type[BaseException], ...]:
    """What a damaged compressed stream raises while it is read (gzip: BadGzipFile, an OSError, or EOFError)."""
    errors: tuple = (OSError, EOFError, zlib.error, lzma.LZMAError)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


def read_records(files: list[str], txt_mode: str) -> Iterator[tuple[str, int, bytes]]:
    """Yield (where, kind, raw) per document candidate: kind 0 = a JSON line, 1 = plain text. A file that
    cannot be read to its end (a corrupt or truncated compressed stream) is a one-line CorpusError."""
    for path in files:
        try:
            yield from _records_of(path, txt_mode)
        except _corrupt_errors() as err:
            packed = _compression(path)
            detail = " ".join(str(err).split()) or type(err).__name__
            if packed is None:
                raise CorpusError(f"cannot read {path} ({detail}); fix it or leave it out of --input.") from None
            raise CorpusError(f"cannot read {path}: its {packed} data is corrupt or truncated ({detail}); "
                                  f"fetch or compress it again, or leave it out of --input.") from None


def _records_of(path: str, txt_mode: str) -> Iterator[tuple[str, int, bytes]]:
    is_txt = path.endswith(tuple(".txt" + packed for packed in ("", *COMPRESSIONS)))
    with _open(path) as f:
        if is_txt and txt_mode == "file":
            data = f.read()
            yield path, 1, data[len(BOM):] if data.startswith(BOM) else data
            return
        block: list[bytes] = []
        for number, line in enumerate(f, 1):
            if number == 1 and line.startswith(BOM):  # a UTF-8 byte order mark: not part of the first record
                line = line[len(BOM):]
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
