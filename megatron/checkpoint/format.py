"""The on-disk checkpoint format: rank files of raw fp32 pieces, ``metadata.json`` and a reader.

A step folder holds:

- ``rank{r}.bin``: the pieces rank r wrote, raw little-endian fp32, back to back. Reading a piece
  is a seek and a read of exactly its bytes: no pickle, no memory map that would keep pages
  resident, nothing else read.
- ``rank{r}.rng.pt``: that rank's RNG streams (restored only under the same layout).
- ``metadata.json``: the layout saved under and every piece: ``kind`` (param = fp32 master
  weight, exp_avg, exp_avg_sq), global ``name`` and ``global_shape``, the tensor-parallel slice it
  belongs to (``partition_dim``, ``tp_rank`` of ``tp_size``, ``local_shape``), its flat range
  ``[lo, hi)`` in that slice, and where it is (``rank``, byte ``offset``).
- ``common.pt`` (step, consumed samples, AdamW step, loss scaler, configuration) and
  ``config.yaml``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

FORMAT_VERSION = 2
KINDS = ("param", "exp_avg", "exp_avg_sq")  # param: the fp32 master weight
_WORD_EMBEDDING = "word_embeddings.weight"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, truncated, or from another model."""


def write_text(path: str, text: str) -> None:
    """Write ``text`` durably and atomically (temporary name, fsync, rename)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


class RankFileWriter:
    """Appends fp32 pieces to ``rank{r}.bin``; ``add`` returns the piece's location fields."""

    def __init__(self, step_dir: str, rank: int):
        self.rank = rank
        self._file = open(os.path.join(step_dir, f"rank{rank}.bin"), "wb")
        self._offset = 0

    def add(self, tensor: torch.Tensor) -> dict:
        data = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
        self._file.write(data.numpy().tobytes())
        where = {"rank": self.rank, "offset": self._offset}
        self._offset += data.numel() * 4
        return where

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def resolve_checkpoint(path: str) -> str:
    """A step folder from ``path``: a run's output folder (its ``latest``) or a step folder."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            step_dir = os.path.join(path, f.read().strip())
        if os.path.isfile(os.path.join(step_dir, "metadata.json")):
            return step_dir
        if os.path.isfile(os.path.join(step_dir + ".old", "metadata.json")):  # killed while re-saving that step
            return step_dir + ".old"
        raise CheckpointError(f"{latest} names {step_dir}, which holds no checkpoint (metadata.json is missing).")
    raise CheckpointError(f"no checkpoint at {path}: expected a step folder with metadata.json or a run folder "
                          f"with a 'latest' file.")


def _numel(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


class CheckpointReader:
    """Global tensors, or any tensor-parallel slice of them, out of a saved step folder."""

    def __init__(self, step_dir: str):
        self.step_dir = step_dir
        try:
            with open(os.path.join(step_dir, "metadata.json")) as f:
                self.metadata = json.load(f)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read {step_dir}/metadata.json: {err}") from err
        if self.metadata.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{step_dir} is in checkpoint format {self.metadata.get('format_version')}; this "
                                  f"version reads format {FORMAT_VERSION}.")
        self.index: dict[tuple[str, str], list[dict]] = {}
        for piece in self.metadata["pieces"]:
            self.index.setdefault((piece["kind"], piece["name"]), []).append(piece)
        self._handles: dict[int, object] = {}
        self.bytes_read = 0

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
        """Every rank file exists and holds every byte its pieces need."""
        need: dict[int, int] = {}
        for piece in self.metadata["pieces"]:
            end = piece["offset"] + 4 * (piece["hi"] - piece["lo"])
            need[piece["rank"]] = max(need.get(piece["rank"], 0), end)
        for rank, size in sorted(need.items()):
            path = self._path(rank)
            have = os.path.getsize(path) if os.path.isfile(path) else None
            if have is None or have < size:
                what = "is missing" if have is None else f"holds {have} bytes of {size}"
                raise CheckpointError(f"{path} {what}; the checkpoint is incomplete or damaged.")

    def read_piece(self, piece: dict, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """The piece's values (or those of ``[lo, hi)`` within its flat range), fp32."""
        lo = piece["lo"] if lo is None else lo
        hi = piece["hi"] if hi is None else hi
        out = torch.empty(hi - lo, dtype=torch.float32)
        handle = self._handles.get(piece["rank"])
        if handle is None:
            try:
                handle = self._handles[piece["rank"]] = open(self._path(piece["rank"]), "rb")
            except OSError as err:
                raise CheckpointError(f"cannot read {self._path(piece['rank'])} ({err}); the checkpoint is "
                                      f"incomplete or damaged.") from err
        handle.seek(piece["offset"] + 4 * (lo - piece["lo"]))
        self.bytes_read += 4 * (hi - lo)
        if handle.readinto(out.numpy().view(np.uint8)) != 4 * (hi - lo):
            raise CheckpointError(f"{self._path(piece['rank'])} is shorter than its metadata says; the checkpoint "
                                  f"is incomplete or damaged.")
        return out

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
        read; otherwise the global tensor is assembled (one tensor at a time). A word embedding
        whose padded vocabulary differs (the padding depends on tp) is trimmed or zero-padded."""
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
        if name.endswith(_WORD_EMBEDDING) and tuple(full.shape) != tuple(global_shape):
            resized = torch.zeros(global_shape)
            rows = min(full.shape[0], global_shape[0])
            resized[:rows] = full[:rows]
            full = resized
        local = full if partition_dim is None or tp_size == 1 else full.chunk(tp_size, dim=partition_dim)[tp_rank]
        return local.reshape(-1)[lo:hi].clone()

    def common(self) -> dict:
        path = os.path.join(self.step_dir, "common.pt")
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:
            raise CheckpointError(f"cannot read {path} ({type(err).__name__}: {err}).") from err

    def rng_state(self, rank: int) -> dict | None:
        path = os.path.join(self.step_dir, f"rank{rank}.rng.pt")
        return torch.load(path, map_location="cpu", weights_only=False) if os.path.isfile(path) else None
