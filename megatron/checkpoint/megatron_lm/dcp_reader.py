"""Reading a PyTorch distributed checkpoint (DCP: a ``.metadata`` index and ``*.distcp`` data files) that someone
else wrote, as data and never as code, and never outside its folder.

DCP's own ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load`` (a crafted file runs code) and opens
whatever paths the index names (``../../x`` or ``/etc/x``). ``SafeReader`` replaces both:

- ``.metadata`` is read by ``MetadataUnpickler``, which resolves only the (module, name) pairs in ``ALLOWED``:
  DCP's metadata and planner dataclasses, ``torch.Size``, torch's dtypes, layouts and memory formats, and a few
  containers. Nothing else is looked up: no dotted names (protocol 4's ``STACK_GLOBAL`` with ``os.system`` after
  an allowed module), no module attributes beyond the list.
- ``.metadata`` itself, and every entry of the index, is checked before a byte of data is read (``check_storage``):
  ``.metadata`` a file inside the folder; each data file's path a string, relative, with no ``..``, resolving
  (symlinks followed) to a regular file inside the folder (``format.file_inside``); its byte range inside that file,
  stored as written (no compression or other transform); every tensor's size and dtype, their product computed in
  Python's integers (a ``torch.Size`` whose element count overflows int64 wraps to a small number in PyTorch), all
  of them together within what the data files hold (a crafted size cannot allocate more memory than the
  checkpoint's own bytes); its chunks inside its shape, tiling it exactly (no gap, which would leave memory
  unwritten, no overlap), each with its data's entry, at least as many bytes long as the chunk's elements.
- Reading the data (``SafeReader.read_data``, in place of DCP's): only tensors (a saved object would go through
  ``torch.load(weights_only=False)`` in DCP's planner), each ``torch.load``-ed with ``weights_only=True`` and
  checked to be the chunk the index says (its shape and dtype) before it is copied: DCP narrows a larger one to the
  index's size without a word.
- A truncated or garbage data file is one line (``load_error``), not DCP's multi-rank exception traceback.
"""

from __future__ import annotations

import io
import math
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from megatron.checkpoint.format import CheckpointError, file_inside

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
# (module, name) pairs, each a class or constant by its own plain name: nothing else is ever looked up
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [(_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                        "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo")]
    # Megatron Core's saves keep the save plan (its planner's cache of the layout) in the metadata
    + [("torch.distributed.checkpoint.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType",
                                                                   "TensorWriteData", "BytesIOWriteData")]
    + [("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
       ("builtins", "set"), ("builtins", "frozenset"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")]
    + [("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), _TORCH_CONSTANTS)])


class MetadataUnpickler(pickle.Unpickler):
    """Builds only the objects of ``ALLOWED``; anything else is ``pickle.UnpicklingError("module.name")``."""

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:  # a dotted name is never in the list
            raise pickle.UnpicklingError(f"{module}.{name}")
        if module == "torch":
            return getattr(torch, name)
        return super().find_class(module, name)


def read_metadata(path: str):
    """The ``Metadata`` object of a DCP ``.metadata`` file; CheckpointError (one line) for anything else."""
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path} holds {err}, which this tool does not unpickle (only PyTorch's "
                              f"distributed-checkpoint metadata is read).") from err
    except (OSError, EOFError, ValueError, AttributeError, TypeError, IndexError, KeyError) as err:
        raise CheckpointError(f"cannot read {path} ({type(err).__name__}: {err}).") from err
    from torch.distributed.checkpoint.metadata import Metadata
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not a distributed checkpoint's index.")
    return metadata


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_storage(folder: str, metadata) -> tuple[dict[str, str], dict]:
    """Every data file and byte range the index names lies inside ``folder`` and its files, and the tensors it
    declares fit in those files' bytes and tile their shapes (see the module docstring); ({relative path: its real
    path}, {storage index: (the chunk's sizes, its dtype)}) for ``SafeReader.read_data``."""
    where = os.path.join(folder, ".metadata")
    files: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str) \
                or not (index.offset is None or isinstance(index.offset, torch.Size)):  # None: a saved object
            raise CheckpointError(f"{where} keys its data by {index!r}, not a tensor's name and offsets: the index is "
                                  f"damaged.")
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or relative not in files:
            files[relative] = file_inside(folder, relative, where)  # refuses a non-string before it is hashed
            sizes[relative] = os.path.getsize(files[relative])
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} stores {index.fqn!r} transformed ({info.transform_descriptors!r}), which "
                                  f"this tool does not read; re-save the checkpoint without it.")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (_whole(offset) and _whole(length)) or offset + length > sizes[relative]:
            raise CheckpointError(f"{where} places {index.fqn!r} at bytes {offset!r}+{length!r} of {relative} "
                                  f"({sizes[relative]} bytes): the data file is truncated or the index damaged.")
    total, declared, chunks = sum(sizes.values()), 0, {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{where} names a tensor by {key!r}, not a name: the index is damaged.")
        if isinstance(meta, BytesStorageMetadata):
            continue
        size, dtype = getattr(meta, "size", None), getattr(getattr(meta, "properties", None), "dtype", None)
        if not isinstance(meta, TensorStorageMetadata) or not isinstance(size, torch.Size) \
                or not isinstance(dtype, torch.dtype) or any(d < 0 for d in size):
            raise CheckpointError(f"{where} describes {key!r} as {meta!r}, not a tensor's size and dtype: the index "
                                  f"is damaged.")
        declared += math.prod(size) * dtype.itemsize  # Python's integers: torch.Size.numel() wraps past 2^63
        if declared > total:
            raise CheckpointError(f"{where} declares {declared:,} bytes of tensors (up to {key!r}, {list(size)} of "
                                  f"{dtype}), more than its data files hold ({total:,} bytes): the checkpoint is "
                                  f"truncated or its index damaged.")
        chunks.update(_chunks(key, meta, metadata.storage_data, where))
    return files, chunks


def _chunks(key: str, meta, storage: dict, where: str) -> dict:
    """{storage index: (sizes, dtype)} of the chunks of tensor ``key``; CheckpointError unless they lie inside its
    shape, tile it exactly and each has its data's entry of at least its bytes."""
    shape, dtype, out, boxes, elements = meta.size, meta.properties.dtype, {}, [], 0
    pieces = getattr(meta, "chunks", None)
    for chunk in pieces if isinstance(pieces, list) else [None]:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (isinstance(offsets, torch.Size) and isinstance(sizes, torch.Size)
                and len(offsets) == len(sizes) == len(shape)) \
                or any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
            raise CheckpointError(f"{where} gives {key!r} ({list(shape)}) a chunk {chunk!r} outside its shape: the "
                                  f"index is damaged.")
        info, count = storage.get(MetadataIndex(key, offsets)), math.prod(sizes)
        if info is None:
            raise CheckpointError(f"{where} has no data for the chunk of {key!r} at offsets {list(offsets)}: the "
                                  f"index is damaged.")
        if info.length < count * dtype.itemsize:
            raise CheckpointError(f"{where} gives the chunk of {key!r} at offsets {list(offsets)} ({list(sizes)} of "
                                  f"{dtype}, {count * dtype.itemsize:,} bytes) {info.length:,} bytes of data: the "
                                  f"index is damaged.")
        elements += count
        boxes.append((offsets, sizes))
        out[MetadataIndex(key, offsets)] = (sizes, dtype)
    if elements != math.prod(shape) or _overlap(boxes):
        raise CheckpointError(f"{where}: the chunks of {key!r} hold {elements:,} elements of its {math.prod(shape):,} "
                              f"({list(shape)}){', overlapping' if _overlap(boxes) else ''}: they do not tile it (each "
                              f"element read once, none left unset); the index is damaged.")
    return out


def _overlap(boxes: list) -> bool:
    """Whether two of the (offsets, sizes) boxes share an element: swept along dim 0, each compared with those whose
    rows reach it."""
    boxes = sorted((b for b in boxes if all(n > 0 for n in b[1])), key=lambda b: tuple(b[0]))
    active: list = []
    for offsets, sizes in boxes:
        if not offsets:
            return bool(active)  # a 0-dim tensor has one element
        active = [(o, n) for o, n in active if o[0] + n[0] > offsets[0]]
        if any(all(a < c + m and c < a + k for a, k, c, m in zip(offsets, sizes, o, n)) for o, n in active):
            return True
        active.append((offsets, sizes))
    return False


class SafeReader(FileSystemReader):
    """DCP's file reader with ``read_metadata`` that unpickles nothing but the index and checks every path in it, and
    ``read_data`` that reads only tensors, each checked to be the chunk the index says."""

    def read_metadata(self):
        folder = str(self.path)
        metadata = read_metadata(file_inside(folder, ".metadata", folder))
        self._files, self._chunks = check_storage(folder, metadata)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner) -> Future:
        folder = str(self.path)
        per_file: dict[str, list] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:  # DCP's planner would torch.load it with weights_only=False
                raise CheckpointError(f"{folder}: {item.storage_index.fqn!r} is a saved object, which this tool does "
                                      f"not read.")
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative, items in per_file.items():
            with open(self._files[relative], "rb") as f:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    f.seek(info.offset)
                    tensor = torch.load(io.BytesIO(f.read(info.length)), map_location="cpu", weights_only=True)
                    sizes, dtype = self._chunks[item.storage_index]
                    if not isinstance(tensor, torch.Tensor) or tensor.shape != sizes or tensor.dtype != dtype:
                        said = f"{list(tensor.shape)} of {tensor.dtype}" if isinstance(tensor, torch.Tensor) else \
                            f"a {type(tensor).__name__}"
                        raise CheckpointError(f"{os.path.join(folder, relative)} holds {said} for the chunk of "
                                              f"{item.storage_index.fqn!r} at offsets {list(item.storage_index.offset)}"
                                              f", which .metadata says is {list(sizes)} of {dtype}: the data and its "
                                              f"index disagree; the checkpoint is damaged.")
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        tensor = tensor.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.shape != tensor.shape:
                        raise CheckpointError(f"{folder}: the read of {item.storage_index.fqn!r} does not fit its "
                                              f"place ({list(tensor.shape)} into {list(target.shape)}).")
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done


def load_error(folder: str, err: BaseException) -> CheckpointError:
    """One line for what DCP raised while reading the data files (a ``CheckpointException`` wraps each rank's
    error and its traceback: its innermost cause is what the user needs; a ``CheckpointError`` of ours, as it is)."""
    if isinstance(err, CheckpointException):
        causes = [c[0] if isinstance(c, tuple) else c for c in getattr(err, "failures", {}).values()]
        err = causes[0] if causes and isinstance(causes[0], BaseException) else err
        while getattr(err, "__cause__", None) is not None and not isinstance(err, CheckpointError):
            err = err.__cause__
    if isinstance(err, CheckpointError):
        return err
    text = str(err)
    if "WeightsUnpickler error:" in text:  # torch.load's advice (weights_only=False) is not for untrusted bytes
        text = text.split("WeightsUnpickler error:", 1)[1]
    detail = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return CheckpointError(f"cannot read the tensors of {folder}: a data file is damaged or truncated "
                           f"({type(err).__name__}{': ' + detail[:200] if detail else ''}).")


__all__ = ["ALLOWED", "CheckpointException", "MetadataUnpickler", "SafeReader", "check_storage", "load_error",
           "read_metadata"]
