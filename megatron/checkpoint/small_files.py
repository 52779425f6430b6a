"""The small files of a step folder as plain data: a checkpoint is data, never code.

Format 4 writes ``common.json`` (step, AdamW step, loss scaler, train state, the configuration as
YAML text) and ``rank{r}.rng.json`` (that rank's RNG streams: Python's Mersenne Twister words,
NumPy's, and torch's generator states as base64 bytes). Reading them runs no code: ``json`` builds
dicts, lists, strings and numbers, and every field is checked for its type and range before it is
used, so a crafted file is a one-line CheckpointError, never a traceback deep in a setter.

Formats 2 and 3 wrote the same content with ``torch.save`` (a pickle) as ``common.pt`` and
``rank{r}.rng.pt``. They are still read, with ``torch.load(weights_only=True)``: PyTorch's
restricted unpickler builds only tensors and plain containers, plus the three NumPy names an RNG
state needs (``_reconstruct``, ``ndarray``, ``dtype`` and the uint32 dtype), allowed explicitly
here. A pickle that names anything else (``os.system``, ``builtins.eval``, any class) is refused
before anything in it runs. The checksums in ``metadata.json`` are no defence against a crafted
checkpoint (whoever wrote the file wrote them too): the safety is in what the readers accept.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import zipfile

import numpy as np
import torch

COMMON_FILE = "common.json"
LEGACY_COMMON_FILE = "common.pt"  # formats 2 and 3
CUDA_STATE_BYTES = 16  # a CUDA generator's state: its seed and offset
COUNT_MAX = 2**53  # steps and samples: beyond it they are not even exact as floats (metrics, schedules)
MAX_SMALL_FILE_BYTES = 64 << 20  # common.json / rng files are kilobytes; a bigger one is not a checkpoint's


def rng_file(rank: int, legacy: bool = False) -> str:
    return f"rank{rank}.rng.pt" if legacy else f"rank{rank}.rng.json"


class UnsafeCheckpoint(ValueError):
    """A small file that is not plain checkpoint data: its message says what it holds."""


# Writing ----------------------------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).decode("ascii")


def encode_rng(state: dict) -> dict:
    """An RNG state (``save_load.rng_state``) as JSON-able data."""
    version, words, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    out = {"python": {"version": int(version), "state": [int(w) for w in words],
                      "gauss_next": None if gauss is None else float(gauss)},
           "numpy": {"name": str(name), "keys": [int(k) for k in np.asarray(keys, dtype=np.uint32)], "pos": int(pos),
                     "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
           "torch": _b64(state["torch"]), "tracker": {k: _b64(v) for k, v in state["tracker"].items()}}
    if "cuda" in state:
        out["cuda"] = _b64(state["cuda"])
    return out


def to_json_bytes(value: dict) -> bytes:
    """``value`` as strict JSON (NaN and infinities are not JSON: a non-finite number is an error)."""
    return json.dumps(value, allow_nan=False, sort_keys=True).encode()


# Reading ----------------------------------------------------------------------------------------


def read_small(path: str, what: str = "any checkpoint's small file", limit: int = MAX_SMALL_FILE_BYTES) -> bytes:
    """The bytes of a file that is at most ``limit`` bytes long (``what``: the kind of file, for the message);
    UnsafeCheckpoint when it is longer, before anything is read."""
    size = os.path.getsize(path)
    if size > limit:
        raise UnsafeCheckpoint(f"it is {size:,} bytes, more than {what} ({limit:,})")
    with open(path, "rb") as f:
        return f.read()


def read_json(path: str) -> object:
    """A JSON file, bounded in size; UnsafeCheckpoint when it is not JSON."""
    raw = read_small(path)
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:
        raise UnsafeCheckpoint(f"it is not valid JSON ({' '.join(str(err).split())[:120]})") from err


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a checkpoint holds")


def _numpy_allowed() -> list:
    """The NumPy globals an RNG state's pickle names (under NumPy 2's and NumPy 1's module names)."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
               (reconstruct, "numpy.core.multiarray._reconstruct"),
               (reconstruct, "numpy._core.multiarray._reconstruct")]
    return allowed


def read_legacy_pt(path: str) -> object:
    """A format-2/3 ``.pt`` file through PyTorch's restricted unpickler (tensors, plain containers and
    the NumPy RNG-state types only); UnsafeCheckpoint when it names anything else."""
    size = os.path.getsize(path)
    if size > MAX_SMALL_FILE_BYTES:
        raise UnsafeCheckpoint(f"it is {size:,} bytes, more than any checkpoint's small file "
                               f"({MAX_SMALL_FILE_BYTES:,})")
    if zipfile.is_zipfile(path):  # torch.save's format: what it unpacks to is bounded too (a deflated tensor)
        with zipfile.ZipFile(path) as archive:
            unpacked = sum(info.file_size for info in archive.infolist())
        if unpacked > MAX_SMALL_FILE_BYTES:
            raise UnsafeCheckpoint(f"it unpacks to {unpacked:,} bytes, more than any checkpoint's small file")
    try:
        with torch.serialization.safe_globals(_numpy_allowed()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = _unsafe_names(path)
        what = f"names {', '.join(found[:3])}" if found else "is not plain data"
        raise UnsafeCheckpoint(f"its pickle {what}, which a checkpoint never holds: it may be crafted to run "
                               f"code and was not loaded") from err


def _unsafe_names(path: str) -> list[str]:
    """The globals the pickle at ``path`` names beyond the allowed ones (for the message only)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - a file too damaged to list: the message says less
        return []
    return [name for name in names if not name.startswith(_ALLOWED_PREFIXES)]


_ALLOWED_PREFIXES = ("numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray",
                     "numpy.dtype")


# Checking ---------------------------------------------------------------------------------------


def _int(value, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UnsafeCheckpoint(f"{what} is {_show(value)}, not an integer >= {low}")
    return value


def _at_most(value, high: int, what: str) -> int:
    if _int(value, what) > high:
        raise UnsafeCheckpoint(f"{what} is {value}, not an integer from 0 to {high}")
    return value


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UnsafeCheckpoint(f"{what} is {_show(value)}, not a finite number")
    return float(value)


def _is_plain(value, limit: int = 100_000) -> bool:
    """JSON's own kinds of value (None, booleans, numbers, text, lists and text-keyed mappings), nested at most 8
    deep and ``limit`` values in all (a pickle may share one list many times over: never walked without bound)."""
    stack, seen = [(value, 0)], 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > limit or depth > 8:
            return False
        if item is None or isinstance(item, (bool, int, float, str)):
            continue
        if isinstance(item, list):
            stack += [(v, depth + 1) for v in item[:limit]]
        elif isinstance(item, dict) and all(isinstance(k, str) for k in list(item)[:limit]):
            stack += [(v, depth + 1) for v in list(item.values())[:limit]]
        else:
            return False
    return True


def _show(value) -> str:
    """A short rendering for a message (never the repr of a container: a crafted one may be vast)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value) if not isinstance(value, str) or len(value) <= 40 else ""
        if text and len(text) <= 40:
            return text
    return f"a {type(value).__name__}"


def check_common(value: object) -> dict:
    """``common``'s fields checked for their types; returns it (UnsafeCheckpoint otherwise)."""
    if not isinstance(value, dict):
        raise UnsafeCheckpoint(f"it holds {_show(value)}, not a mapping")
    for key in ("step", "adam_step", "grad_scaler", "train_state", "config"):
        if key not in value:
            raise UnsafeCheckpoint(f"it lacks {key!r}")
    _at_most(value["step"], COUNT_MAX, "step")
    if _number(value["adam_step"], "adam_step") < 0:
        raise UnsafeCheckpoint(f"adam_step is {value['adam_step']}, below 0")
    scaler = value["grad_scaler"]
    if scaler is not None:
        if not isinstance(scaler, dict) or not all(isinstance(k, str) for k in scaler):
            raise UnsafeCheckpoint(f"grad_scaler is {_show(scaler)}, not a mapping")
        for k, v in scaler.items():
            _number(v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v, f"grad_scaler.{k}")
    state = value["train_state"]
    if not isinstance(state, dict):
        raise UnsafeCheckpoint(f"train_state is {_show(state)}, not a mapping")
    for k, v in state.items():
        if not isinstance(k, str) or not _is_plain(v):
            raise UnsafeCheckpoint(f"train_state holds {_show(k)}: {_show(v)}, which is not plain data")
    for k in ("consumed_samples", "skipped_steps", "schedule_samples"):
        if k in state:
            _at_most(state[k], COUNT_MAX, f"train_state.{k}")
    if not isinstance(value["config"], str):
        raise UnsafeCheckpoint(f"config is {_show(value['config'])}, not YAML text")
    return value


def _bytes_tensor(text, what: str) -> torch.Tensor:
    if not isinstance(text, str):
        raise UnsafeCheckpoint(f"{what} is {_show(text)}, not base64 text")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as err:
        raise UnsafeCheckpoint(f"{what} is not base64") from err
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def _generator_state(t, what: str, like: torch.Tensor | None = None, other: int | None = None) -> torch.Tensor:
    """A torch generator state: a 1-D uint8 tensor (of ``like``'s size, the CPU generator's, or ``other`` bytes)."""
    sizes = [n for n in (None if like is None else like.numel(), other) if n is not None]
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 or (
            sizes and t.numel() not in sizes) or t.numel() > 1 << 20:
        raise UnsafeCheckpoint(f"{what} is not a generator state" + (
            f" of {' or '.join(map(str, sizes))} bytes" if sizes else ""))
    return t


def decode_rng(value: object, legacy: bool = False) -> dict:
    """The RNG state (as ``save_load._set_rng_state`` takes it) from ``rank{r}.rng.json`` (or, ``legacy``,
    from the unpickled ``rank{r}.rng.pt``), every field checked; UnsafeCheckpoint otherwise."""
    if not isinstance(value, dict):
        raise UnsafeCheckpoint(f"it holds {_show(value)}, not a mapping")
    for key in ("python", "numpy", "torch", "tracker"):
        if key not in value:
            raise UnsafeCheckpoint(f"it lacks {key!r}")
    like = torch.get_rng_state()
    if legacy:
        py, npy = value["python"], value["numpy"]
        if not (isinstance(py, tuple) and len(py) == 3 and isinstance(py[1], tuple)):
            raise UnsafeCheckpoint("its Python RNG state is not (version, words, gauss)")
        if len(py[1]) != 625:
            raise UnsafeCheckpoint("its Python RNG state is not 624 32-bit words and a position")
        python = {"version": py[0], "state": list(py[1]), "gauss_next": py[2]}
        if not (isinstance(npy, tuple) and len(npy) == 5 and isinstance(npy[1], np.ndarray) and npy[1].size == 624):
            raise UnsafeCheckpoint("its NumPy RNG state is not (name, keys, pos, has_gauss, cached)")
        numpy = {"name": npy[0], "keys": npy[1].tolist(), "pos": npy[2], "has_gauss": npy[3],
                 "cached_gaussian": npy[4]}
        torch_state, tracker, cuda = value["torch"], value["tracker"], value.get("cuda")
    else:
        python, numpy = value["python"], value["numpy"]
        if not isinstance(python, dict) or not isinstance(numpy, dict):
            raise UnsafeCheckpoint("its Python or NumPy RNG state is not a mapping")
        if not isinstance(value["tracker"], dict):
            raise UnsafeCheckpoint("its tracker states are not a mapping")
        torch_state = _bytes_tensor(value["torch"], "torch")
        tracker = {k: _bytes_tensor(v, f"tracker.{k}") for k, v in value["tracker"].items()}
        cuda = _bytes_tensor(value["cuda"], "cuda") if "cuda" in value else None
    words = python.get("state")
    if not isinstance(words, list) or len(words) != 625 or not all(
            isinstance(w, int) and not isinstance(w, bool) and 0 <= w < 2**32 for w in words[:624]):
        raise UnsafeCheckpoint("its Python RNG state is not 624 32-bit words and a position")
    if _int(words[624], "the Python RNG position") > 624:
        raise UnsafeCheckpoint(f"the Python RNG position is {words[624]}, beyond its 624 words")
    gauss = python.get("gauss_next")
    keys = numpy.get("keys")
    if numpy.get("name") != "MT19937" or not isinstance(keys, list) or len(keys) != 624 or not all(
            isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 2**32 for k in keys):
        raise UnsafeCheckpoint("its NumPy RNG state is not an MT19937 state of 624 32-bit words")
    if not isinstance(tracker, dict) or not all(isinstance(k, str) for k in tracker):
        raise UnsafeCheckpoint("its tracker states are not a mapping of names")
    state = {
        "python": (_int(python.get("version"), "the Python RNG version"), tuple(words),
                   None if gauss is None else _number(gauss, "the Python RNG's gauss_next")),
        "numpy": ("MT19937", np.array(keys, dtype=np.uint32), _at_most(numpy.get("pos"), 624, "the NumPy RNG position"),
                  _at_most(numpy.get("has_gauss"), 1, "the NumPy RNG's has_gauss"),
                  _number(numpy.get("cached_gaussian"), "the NumPy RNG's cached gaussian")),
        "torch": _generator_state(torch_state, "torch", like),
        "tracker": {k: _generator_state(v, f"tracker.{k}", like, CUDA_STATE_BYTES) for k, v in tracker.items()},
    }
    if cuda is not None:
        state["cuda"] = _generator_state(cuda, "cuda")
    return state
