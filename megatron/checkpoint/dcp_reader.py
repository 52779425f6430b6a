"""Reading a PyTorch distributed checkpoint (DCP: a ``.metadata`` index and ``*.distcp`` data files) that someone
else wrote, as data and never as code, and never outside its folder.

DCP's own ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load`` (a crafted file runs code) and opens
whatever paths the index names (``../../x`` or ``/etc/x``). ``SafeReader`` replaces both:

- ``.metadata`` is read by ``MetadataUnpickler``, which resolves only the (module, name) pairs in ``ALLOWED``:
  DCP's metadata and planner dataclasses, ``torch.Size``, torch's dtypes, layouts and memory formats, and a few
  containers. Nothing else is looked up: no dotted names (protocol 4's ``STACK_GLOBAL`` with ``os.system`` after
  an allowed module), no module attributes beyond the list.
- Every entry of the index is checked before a byte of data is read (``check_storage``): its path relative, with no
  ``..``, resolving (symlinks followed) to a regular file inside the folder; its byte range inside that file; the
  tensors' declared sizes within what the data files can hold (a crafted size cannot allocate more memory than the
  checkpoint's own bytes).
- A truncated or garbage data file is one line (``load_error``), not DCP's multi-rank exception traceback.
"""

from __future__ import annotations

import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

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


def check_storage(folder: str, metadata) -> None:
    """Every data file and byte range the index names lies inside ``folder`` and its files, and the tensors it
    declares fit in those files' bytes (see the module docstring)."""
    where = os.path.join(folder, ".metadata")
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        relative = getattr(info, "relative_path", None)
        if relative not in sizes:
            sizes[relative] = os.path.getsize(file_inside(folder, relative, where))
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)) \
                or offset + length > sizes[relative]:
            raise CheckpointError(f"{where} places {getattr(index, 'fqn', index)!r} at bytes {offset!r}+{length!r} "
                                  f"of {relative} ({sizes[relative]} bytes): the data file is truncated or the index "
                                  f"damaged.")
    declared = 0
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            continue
        size, dtype = getattr(meta, "size", None), getattr(getattr(meta, "properties", None), "dtype", None)
        if not isinstance(meta, TensorStorageMetadata) or not isinstance(size, torch.Size) \
                or not isinstance(dtype, torch.dtype) or any(d < 0 for d in size):
            raise CheckpointError(f"{where} describes {key!r} as {meta!r}, not a tensor's size and dtype: the index "
                                  f"is damaged.")
        declared += size.numel() * dtype.itemsize
    if declared > sum(sizes.values()):
        raise CheckpointError(f"{where} declares {declared} bytes of tensors, more than its data files hold "
                              f"({sum(sizes.values())} bytes): the checkpoint is truncated or its index damaged.")


class SafeReader(FileSystemReader):
    """DCP's file reader with ``read_metadata`` that unpickles nothing but the index and checks every path in it."""

    def read_metadata(self):
        folder = str(self.path)
        metadata = read_metadata(os.path.join(folder, ".metadata"))
        check_storage(folder, metadata)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def load_error(folder: str, err: BaseException) -> CheckpointError:
    """One line for what DCP raised while reading the data files (a ``CheckpointException`` wraps each rank's
    error and its traceback: its innermost cause is what the user needs)."""
    if isinstance(err, CheckpointException):
        causes = [c[0] if isinstance(c, tuple) else c for c in getattr(err, "failures", {}).values()]
        err = causes[0] if causes and isinstance(causes[0], BaseException) else err
        while getattr(err, "__cause__", None) is not None:
            err = err.__cause__
    text = str(err)
    if "WeightsUnpickler error:" in text:  # torch.load's advice (weights_only=False) is not for untrusted bytes
        text = text.split("WeightsUnpickler error:", 1)[1]
    detail = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return CheckpointError(f"cannot read the tensors of {folder}: a data file is damaged or truncated "
                           f"({type(err).__name__}{': ' + detail[:200] if detail else ''}).")


__all__ = ["ALLOWED", "CheckpointException", "MetadataUnpickler", "SafeReader", "check_storage", "load_error",
           "read_metadata"]
