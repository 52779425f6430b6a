"""The on-disk checkpoint format: rank files of raw fp32 pieces, ``metadata.json`` and a reader.

A step folder holds:

- ``rank{r}.bin``: the pieces rank r wrote, raw little-endian fp32, back to back. Reading a piece
  is a seek and a read of its bytes: no pickle, no memory map that would keep pages resident.
- ``rank{r}.rng.json``: that rank's RNG streams (restored only under the same layout).
- ``metadata.json``: the layout saved under and every piece: ``kind`` (param = fp32 master
  weight, exp_avg, exp_avg_sq), global ``name`` and ``global_shape``, the tensor-parallel slice it
  belongs to (``partition_dim``, ``tp_rank`` of ``tp_size``, ``local_shape``), its flat range
  ``[lo, hi)`` in that slice, where it is (``rank``, byte ``offset``) and ``crc32``: the zlib CRC-32
  of each ``checksum.chunk_bytes`` (4 MiB) chunk of its bytes. ``files`` holds the CRC-32 of
  ``common.json``, ``config.yaml`` and every ``rank{r}.rng.json``.
- ``common.json`` (step, consumed samples, AdamW step, loss scaler, configuration) and
  ``config.yaml``.

Nothing in a step folder is code: every file is raw numbers or JSON/YAML text, read without any
unpickling (``small_files``). Formats 2 and 3 kept ``common.pt`` and ``rank{r}.rng.pt`` as pickles;
they are read by PyTorch's restricted unpickler with an explicit allow-list, and refused when they
name anything else.

Every byte read is checked against its checksum: a piece read in part is checked over the chunks
it touches (at most two chunks more than asked are read), so a mismatch is never loaded. Format 2
(before checksums) is still read, unverified.
"""

from __future__ import annotations

import json
import os
import re
import zlib

import numpy as np
import torch

from megatron.checkpoint import small_files
from megatron.checkpoint.piece_checks import KINDS, overlap, wrong_field  # noqa: F401 - KINDS: format.KINDS

FORMAT_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)  # 2: no checksums (read unverified); 2 and 3: pickled small files
CRC_CHUNK_BYTES = 4 << 20  # one CRC-32 per 4 MiB of a piece: a partial read checks at most 8 MiB more
# KINDS (param: the fp32 master weight, exp_avg, exp_avg_sq) comes from piece_checks, which checks them
PIECE_FIELDS = ("offset", "rank", "kind", "name", "lo", "hi", "global_shape", "partition_dim", "tp_rank", "tp_size",
                "local_shape")
VOCAB_PADDED = ("word_embeddings.weight", "output_layer.weight")  # rows: the vocabulary padded for tp
SMALL_FILE = re.compile(r"common\.(json|pt)|config\.yaml|rank\d+\.rng\.(json|pt)")  # what 'files' may name


def is_vocab_padded(name: str) -> bool:
    """Whether the tensor ``name`` has one row per padded-vocabulary id (its padding rows depend on tp)."""
    return name.endswith(VOCAB_PADDED)


_STEP_DIR = re.compile(r"step_(\d+)(\.old)?")


class CheckpointError(RuntimeError):
    """A checkpoint or output folder that cannot be used: missing, truncated, corrupt, from another
    model, or in the way. Its message is one line saying what is wrong and what to do."""


def write_bytes(path: str, data: bytes) -> int:
    """Write ``data`` durably and atomically (temporary name, fsync, rename); returns its CRC-32."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return zlib.crc32(data)


def write_text(path: str, text: str) -> int:
    """Write ``text`` durably and atomically; returns the CRC-32 of its bytes."""
    return write_bytes(path, text.encode())


def fsync_dir(path: str) -> None:
    """Make the folder's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def chunk_crcs(data, chunk: int = CRC_CHUNK_BYTES) -> list[int]:
    """The CRC-32 of each ``chunk`` bytes of ``data`` (a bytes-like object)."""
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[i:i + chunk]) for i in range(0, len(view), chunk)]


class RankFileWriter:
    """Appends fp32 pieces to ``rank{r}.bin``; ``add`` returns the piece's location and checksums."""

    def __init__(self, step_dir: str, rank: int, chunk_bytes: int = CRC_CHUNK_BYTES):
        self.rank, self.chunk_bytes = rank, chunk_bytes
        self._file = open(os.path.join(step_dir, f"rank{rank}.bin"), "wb")
        self._offset = 0

    def add(self, tensor: torch.Tensor) -> dict:
        data = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
        raw = memoryview(data.numpy()).cast("B")
        self._file.write(raw)
        where = {"rank": self.rank, "offset": self._offset, "crc32": chunk_crcs(raw, self.chunk_bytes)}
        self._offset += len(raw)
        return where

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def earlier_checkpoint(step_dir: str) -> str:
    """What to do about a damaged ``step_dir``: load the newest complete step folder below it."""
    parent, name = os.path.split(os.path.normpath(step_dir))
    match = _STEP_DIR.fullmatch(name)
    steps = []
    if match and os.path.isdir(parent or "."):
        steps = sorted(int(m.group(1)) for d in os.listdir(parent or ".") if (m := re.fullmatch(r"step_(\d+)", d))
                       and int(m.group(1)) < int(match.group(1))
                       and os.path.isfile(os.path.join(parent, d, "metadata.json")))
    if steps:
        return f"load an earlier checkpoint instead (--load {os.path.join(parent, f'step_{steps[-1]}')})"
    return "load an earlier step_N folder instead, if there is one"


def find_checkpoint(path: str) -> str | None:
    """The step folder to load from ``path`` (a step folder, or a run folder: the step its ``latest``
    names), or None when ``path`` holds no checkpoint at all: it does not exist, or is a folder with no
    ``latest`` and no step folders (a run that never saved). A damaged checkpoint (a ``latest`` naming
    a missing or incomplete folder, step folders without ``latest``) raises CheckpointError."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint folder; give a run folder or a step_N folder.")
    if _STEP_DIR.fullmatch(os.path.basename(os.path.normpath(path))):
        raise CheckpointError(f"{path} holds no metadata.json: its save is incomplete or damaged; "
                              f"{earlier_checkpoint(path)}.")
    latest = os.path.join(path, "latest")
    if os.path.lexists(latest):
        return _follow_latest(path, latest)
    try:
        entries = os.listdir(path)
    except OSError as err:
        raise CheckpointError(f"cannot read the folder {path} ({err.strerror or err}); fix its permissions.") from err
    steps = sorted((d for d in entries if _STEP_DIR.fullmatch(d)), key=lambda d: int(d[5:].split(".")[0]))
    if steps:
        raise CheckpointError(f"{path} holds step folders but no 'latest' file; load one of them directly "
                              f"(--load {os.path.join(path, steps[-1])}).")
    return None


def _follow_latest(path: str, latest: str) -> str:
    try:
        with open(latest, errors="replace") as f:
            name = f.read(256).strip()  # a step folder's name: never read more (a link to /dev/zero)
    except OSError as err:
        raise CheckpointError(f"cannot read {latest} ({err.strerror or err}); remove it or load a step folder "
                              f"directly.") from err
    if not re.fullmatch(r"step_\d+", name):
        raise CheckpointError(f"{latest} holds {name[:40]!r}, not a step folder name; it is damaged: load a step "
                              f"folder directly (--load {path}/step_N).")
    step_dir = os.path.join(path, name)
    if os.path.isfile(os.path.join(step_dir, "metadata.json")):
        return step_dir
    if os.path.isfile(os.path.join(step_dir + ".old", "metadata.json")):  # killed while re-saving that step
        return step_dir + ".old"
    raise CheckpointError(f"{latest} names {step_dir}, which holds no checkpoint (metadata.json is missing); "
                          f"{earlier_checkpoint(step_dir)}.")


def resolve_checkpoint(path: str) -> str:
    """A step folder from ``path``: a run's output folder (its ``latest``) or a step folder."""
    step_dir = find_checkpoint(path)
    if step_dir is None:
        raise CheckpointError(f"no checkpoint at {path}: expected a step folder with metadata.json or a run folder "
                              f"with a 'latest' file.")
    return step_dir


def same_folder(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def file_inside(folder: str, relative: object, where: str, *, is_folder: bool = False) -> str:
    """The real path of the file ``relative`` that an index in ``folder`` (named ``where`` in messages) names, or
    that ``folder`` holds; CheckpointError unless it is a regular file inside ``folder`` (a folder, with
    ``is_folder``): a relative path without ``..`` that resolves, symlinks followed, under the folder. A checkpoint
    someone else wrote reads only its own files."""
    if not isinstance(relative, str) or not relative:
        raise CheckpointError(f"{where} names a data file by {relative!r}, not a file name: the index is damaged.")
    if os.path.isabs(relative) or ".." in relative.replace("\\", "/").split("/"):
        raise CheckpointError(f"{where} names the data file {relative!r}, outside the checkpoint's folder; a "
                              f"checkpoint reads only its own files (refusing it).")
    root, real = os.path.realpath(folder), os.path.realpath(os.path.join(folder, relative))
    if os.path.commonpath([root, real]) != root:
        raise CheckpointError(f"{where} names {relative!r}, a link to {real}, outside the checkpoint's folder; a "
                              f"checkpoint reads only its own files (refusing it).")
    if not (os.path.isdir(real) if is_folder else os.path.isfile(real)):
        raise CheckpointError(f"{where} names the data file {relative!r}, which is missing from {folder}: the "
                              f"checkpoint is incomplete.")
    return real


def verify_file(step_dir: str, name: str, metadata: dict | None = None) -> None:
    """CheckpointError if ``step_dir/name`` does not match the CRC-32 that ``metadata.json`` records
    for it (nothing to check when none is recorded: format 2, or a file the format does not list)."""
    if metadata is None:
        try:
            with open(os.path.join(step_dir, "metadata.json")) as f:
                metadata = json.load(f)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read {step_dir}/metadata.json ({err}); "
                                  f"{earlier_checkpoint(step_dir)}.") from err
    files = metadata.get("files") if isinstance(metadata, dict) else None
    if not isinstance(files, dict) or name not in files:
        return
    path = os.path.join(step_dir, name)
    try:
        size = os.path.getsize(path)
        if size > small_files.MAX_SMALL_FILE_BYTES:
            raise CheckpointError(f"refusing {path}: it is {size:,} bytes, more than any checkpoint's small file; "
                                  f"{earlier_checkpoint(step_dir)}.")
        with open(path, "rb") as f:
            crc = zlib.crc32(f.read())
    except OSError as err:
        raise CheckpointError(f"cannot read {path} ({err.strerror or err}); the checkpoint is incomplete: "
                              f"{earlier_checkpoint(step_dir)}.") from err
    if crc != files[name]:
        raise CheckpointError(f"{path} does not match its checksum in metadata.json: the file is corrupt; "
                              f"{earlier_checkpoint(step_dir)}.")


def _numel(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


# metadata.json lists every piece (~250 bytes each): 1 GiB is 4 million pieces, far beyond any run's
MAX_METADATA_BYTES = 1 << 30


class CheckpointReader:
    """Global tensors, or any tensor-parallel slice of them, out of a saved step folder. Every read is
    checked against the checksums in ``metadata.json`` (format 3); ``checksummed`` is False for
    format 2, whose data is read unverified."""

    def __init__(self, step_dir: str):
        self.step_dir = step_dir
        try:  # bounded before it is read: a crafted size never reaches the parser
            self.metadata = json.loads(small_files.read_small(os.path.join(step_dir, "metadata.json"),
                                                              "any run's metadata.json", MAX_METADATA_BYTES))
        except (OSError, ValueError, RecursionError) as err:
            raise CheckpointError(f"cannot read {step_dir}/metadata.json ({err}); "
                                  f"{earlier_checkpoint(step_dir)}.") from err
        version = self.metadata.get("format_version") if isinstance(self.metadata, dict) else None
        if version not in READABLE_VERSIONS:
            raise CheckpointError(f"{step_dir} is in checkpoint format {version}; this version reads formats "
                                  f"{', '.join(map(str, READABLE_VERSIONS))}.")
        self.checksummed = version >= 3
        self.chunk_bytes = CRC_CHUNK_BYTES
        self._check_metadata()
        self.index: dict[tuple[str, str], list[dict]] = {}
        for piece in self.metadata["pieces"]:
            self.index.setdefault((piece["kind"], piece["name"]), []).append(piece)
        self._handles: dict[int, object] = {}
        self.bytes_read = 0

    def _check_metadata(self) -> None:
        """The structure ``metadata.json`` must have, so that a damaged one is one CheckpointError."""
        meta, problem = self.metadata, None
        if not isinstance(meta.get("pieces"), list) or not isinstance(meta.get("layout"), dict):
            problem = "no 'pieces' list or 'layout'"
        elif self.checksummed:
            checksum = meta.get("checksum") or {}
            self.chunk_bytes = checksum.get("chunk_bytes") if checksum.get("algorithm") == "crc32" else None
            if not isinstance(self.chunk_bytes, int) or self.chunk_bytes <= 0 or self.chunk_bytes % 4:
                problem = f"checksum {checksum!r} is not crc32 over chunks of a multiple of 4 bytes"
        files = meta.get("files", {})
        if problem is None and (not isinstance(files, dict) or not all(
                isinstance(k, str) and SMALL_FILE.fullmatch(k) and isinstance(v, int) for k, v in files.items())):
            problem = "'files' names a file the format does not write"
        for piece in meta["pieces"] if problem is None else ():
            problem = self._piece_problem(piece)
            if problem:
                break
        problem = problem or overlap(meta["pieces"])
        if problem:
            raise CheckpointError(f"{self.step_dir}/metadata.json is damaged ({problem}); "
                                  f"{earlier_checkpoint(self.step_dir)}.")

    def _piece_problem(self, piece) -> str | None:
        lacking = [field for field in PIECE_FIELDS if not isinstance(piece, dict) or field not in piece]
        if lacking:
            return f"a piece lacks {lacking[0]!r}"
        wrong = wrong_field(piece)
        if wrong:
            return f"a piece's {wrong!r} is {str(piece[wrong])[:40]!r}, not what the format holds"
        if not 0 <= piece["lo"] < piece["hi"]:
            return f"a piece of {piece['name']!r} has the range [{piece['lo']}, {piece['hi']})"
        chunks = -(-4 * (piece["hi"] - piece["lo"]) // self.chunk_bytes)
        if self.checksummed and (not isinstance(piece.get("crc32"), list) or len(piece["crc32"]) != chunks):
            return f"a piece of {piece['name']!r} lacks a checksum per chunk"
        return None

    @property
    def names(self) -> list[str]:
        return sorted({name for kind, name in self.index if kind == "param"})

    def global_shape(self, name: str) -> tuple:
        return tuple(self.index[("param", name)][0]["global_shape"])

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.index

    def _path(self, rank: int) -> str:
        return os.path.join(self.step_dir, f"rank{rank}.bin")

    def verify(self) -> None:
        """Every rank file exists and holds every byte its pieces need (sizes only: cheap)."""
        need: dict[int, int] = {}
        for piece in self.metadata["pieces"]:
            end = piece["offset"] + 4 * (piece["hi"] - piece["lo"])
            need[piece["rank"]] = max(need.get(piece["rank"], 0), end)
        for rank, size in sorted(need.items()):
            path = self._path(rank)
            have = os.path.getsize(path) if os.path.isfile(path) else None
            if have is None or have < size:
                what = "is missing" if have is None else f"holds {have} bytes of {size}"
                raise CheckpointError(f"{path} {what}; the checkpoint is incomplete or damaged: "
                                      f"{earlier_checkpoint(self.step_dir)}.")

    def verify_file(self, name: str) -> None:
        """``name`` (common.json, config.yaml, rank{r}.rng.json) matches its recorded checksum."""
        verify_file(self.step_dir, name, self.metadata)

    def verify_all(self) -> tuple[int, int]:
        """Check every checksum (every piece, whole, and every recorded file) and that every small file is
        plain checkpoint data; returns (pieces, bytes) checked. Reads the whole checkpoint, one chunk at a time."""
        self.verify()
        for name in sorted((self.metadata.get("files") or {}) if self.checksummed else ()):
            self.verify_file(name)
        pieces = nbytes = 0
        step = self.chunk_bytes // 4
        for piece in self.metadata["pieces"]:
            for lo in range(piece["lo"], piece["hi"], step):
                self.read_piece(piece, lo, min(lo + step, piece["hi"]))
            pieces, nbytes = pieces + 1, nbytes + 4 * (piece["hi"] - piece["lo"])
        self.common()  # and every small file is plain data (a crafted pickle is refused, never run)
        for rank in sorted({int(m.group(1)) for name in os.listdir(self.step_dir)
                            if (m := re.fullmatch(r"rank(\d+)\.rng\.(?:json|pt)", name))}):
            self.rng_state(rank)
        return pieces, nbytes

    def _handle(self, rank: int):
        handle = self._handles.get(rank)
        if handle is None:
            try:
                handle = self._handles[rank] = open(self._path(rank), "rb")
            except OSError as err:
                raise CheckpointError(f"cannot read {self._path(rank)} ({err.strerror or err}); the checkpoint is "
                                      f"incomplete or damaged: {earlier_checkpoint(self.step_dir)}.") from err
        return handle

    def read_piece(self, piece: dict, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """The piece's values (or those of ``[lo, hi)`` within its flat range), fp32, checked: the
        chunks of the piece that ``[lo, hi)`` touches are read whole and compared with their CRC-32."""
        lo = piece["lo"] if lo is None else lo
        hi = piece["hi"] if hi is None else hi
        size, first, last = 4 * (piece["hi"] - piece["lo"]), 4 * (lo - piece["lo"]), 4 * (hi - piece["lo"])
        chunk = self.chunk_bytes
        a, b = (first // chunk * chunk, min(-(-last // chunk) * chunk, size)) if self.checksummed else (first, last)
        out = torch.empty((b - a) // 4, dtype=torch.float32)
        raw = out.numpy().view(np.uint8)
        handle = self._handle(piece["rank"])
        handle.seek(piece["offset"] + a)
        self.bytes_read += b - a
        if handle.readinto(raw) != b - a:
            raise CheckpointError(f"{self._path(piece['rank'])} is shorter than its metadata says; the checkpoint "
                                  f"is incomplete or damaged: {earlier_checkpoint(self.step_dir)}.")
        if self.checksummed:
            for k in range(a // chunk, -(-b // chunk)):
                if zlib.crc32(raw[k * chunk - a:min((k + 1) * chunk, size) - a]) != piece["crc32"][k]:
                    start = piece["offset"] + k * chunk
                    raise CheckpointError(
                        f"{self._path(piece['rank'])}: checksum mismatch in {piece['kind']} {piece['name']!r} "
                        f"(bytes {start}-{start + min(chunk, size - k * chunk)}): the file is corrupt; "
                        f"{earlier_checkpoint(self.step_dir)}.")
        return out[(first - a) // 4:(last - a) // 4]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
    def full(self, kind: str, name: str) -> torch.Tensor:
        """The whole global tensor (fp32), assembled from its saved tensor-parallel slices."""
        pieces = self.index[(kind, name)]
        first = pieces[0]
        tp_size, dim = first["tp_size"], first["partition_dim"]
        local_numel = _numel(first["local_shape"])
        slices = [torch.zeros(local_numel) for _ in range(tp_size)]
        filled = [0] * tp_size
        for piece in pieces:
            slices[piece["tp_rank"]][piece["lo"]:piece["hi"]] = self.read_piece(piece)
            filled[piece["tp_rank"]] += piece["hi"] - piece["lo"]
        if any(n != local_numel for n in filled):
            raise CheckpointError(f"the checkpoint holds only part of {kind} {name!r}; it is incomplete.")
        shaped = [t.view(first["local_shape"]) for t in slices]
        return torch.cat(shaped, dim=dim) if dim is not None and tp_size > 1 else shaped[0]

    def local_range(self, kind: str, name: str, global_shape: tuple, partition_dim: int | None, tp_rank: int,
                    tp_size: int, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor-parallel slice ``tp_rank`` of ``tp_size`` (along
        ``partition_dim``) of the global tensor, for a model whose global shape is ``global_shape``.

        When the checkpoint was cut the same way, only the saved pieces overlapping ``[lo, hi)`` are
        read; otherwise the global tensor is assembled (one tensor at a time). A word embedding or
        untied output layer whose padded vocabulary differs (the padding depends on tp) is trimmed or
        zero-padded."""
        pieces = self.index[(kind, name)]
        first = pieces[0]
        saved_split = first["partition_dim"] is not None and first["tp_size"] > 1
        split = partition_dim is not None and tp_size > 1
        same_cut = tuple(first["global_shape"]) == tuple(global_shape) and (
            (not saved_split and not split)
            or (saved_split and split and first["partition_dim"] == partition_dim and first["tp_size"] == tp_size))
        if same_cut:
            want_rank = tp_rank if saved_split else 0
            out = torch.empty(hi - lo)
            covered = 0
            for piece in pieces:
                a, b = max(lo, piece["lo"]), min(hi, piece["hi"])
                if piece["tp_rank"] == want_rank and a < b:
                    out[a - lo:b - lo] = self.read_piece(piece, a, b)
                    covered += b - a
            if covered != hi - lo:
                raise CheckpointError(f"the checkpoint holds only part of {kind} {name!r}; it is incomplete.")
            return out
        full = self.full(kind, name)
        if is_vocab_padded(name) and tuple(full.shape) != tuple(global_shape):
            resized = torch.zeros(global_shape)
            rows = min(full.shape[0], global_shape[0])
            resized[:rows] = full[:rows]
            full = resized
        local = full if partition_dim is None or tp_size == 1 else full.chunk(tp_size, dim=partition_dim)[tp_rank]
        return local.reshape(-1)[lo:hi].clone()

    @property
    def legacy_small_files(self) -> bool:
        """Formats 2 and 3 keep common and RNG states in pickles (``.pt``), read restricted."""
        return self.metadata["format_version"] < 4

    def _load_small(self, name: str, decode):
        """A small file of the step folder, checked against its checksum, read as plain data and checked
        by ``decode`` (a crafted or damaged one is one CheckpointError; a pickle never runs code)."""
        self.verify_file(name)
        path = os.path.join(self.step_dir, name)
        try:
            raw = small_files.read_legacy_pt(path) if name.endswith(".pt") else small_files.read_json(path)
            return decode(raw)
        except small_files.UnsafeCheckpoint as err:
            raise CheckpointError(f"refusing {path}: {err}; do not use this checkpoint unless you trust who made "
                                  f"it: {earlier_checkpoint(self.step_dir)}.") from err
        except Exception as err:
            raise CheckpointError(f"cannot read {path} ({type(err).__name__}: {' '.join(str(err).split())}); the "
                                  f"checkpoint is damaged: {earlier_checkpoint(self.step_dir)}.") from err

    def common(self) -> dict:
        """``common.json`` (``common.pt`` before format 4): step, AdamW step, loss scaler, train state and the
        resolved configuration, every field checked."""
        name = small_files.LEGACY_COMMON_FILE if self.legacy_small_files else small_files.COMMON_FILE
        return self._load_small(name, small_files.check_common)

    def rng_state(self, rank: int) -> dict | None:
        """Rank ``rank``'s RNG streams, or None when the checkpoint has none for it (a converted one)."""
        legacy = self.legacy_small_files
        name = small_files.rng_file(rank, legacy)
        recorded = name in (self.metadata.get("files") or {})
        if not recorded and not os.path.isfile(os.path.join(self.step_dir, name)):
            return None
        return self._load_small(name, lambda raw: small_files.decode_rng(raw, legacy))
