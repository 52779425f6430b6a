"""Agreement between ranks on a checkpoint failure, and the start-up check of a run's output folder.

``on_every_rank`` runs a step on each rank and, if any rank failed, makes every rank raise the same
one-line CheckpointError (the first failing rank's message, through ``megatron.agreement``).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from megatron.agreement import first_failure
from megatron.checkpoint import ownership
from megatron.checkpoint.format import CheckpointError
from megatron.file_lock import make_writable_folder
from megatron.metrics import get_logger

T = TypeVar("T")
# files the run writes into output_dir
_IN_THE_WAY = ("latest", "latest.tmp", "metrics.jsonl", "config.yaml", ownership.RUN_FILE, ownership.LOCK_FILE)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def one_line(err: BaseException, what: str, todo: str) -> str:
    """A CheckpointError's own message, or ``what (Type: message); todo`` on one line."""
    if isinstance(err, CheckpointError):
        return " ".join(str(err).split())
    detail = " ".join(str(err).split())
    return f"{what} ({type(err).__name__}: {detail}); {todo}."


def all_ranks_ok(error: str | None, device: torch.device) -> None:
    """Raise CheckpointError on every rank if any rank failed (collective: call on every rank)."""
    error = first_failure(error, device)
    if error is not None:
        raise CheckpointError(error)


def on_every_rank(fn: Callable[[], T], device: torch.device, what: str, todo: str) -> T:
    """``fn()`` on this rank; if it fails on any rank, every rank raises the same one-line CheckpointError
    (``what`` and ``todo`` frame an unexpected exception's message). Collective."""
    error, value = None, None
    try:
        value = fn()
    except Exception as err:
        error = one_line(err, what, todo)
    all_ranks_ok(error, device)
    return value


def ranks_with(flag: bool, device: torch.device) -> int:
    """How many ranks have ``flag`` set (collective)."""
    count = torch.tensor([1.0 if flag else 0.0], device=device)
    if _world() > 1:
        dist.all_reduce(count)
    return int(count.item())


def check_output_dir(output_dir: str, rank: int, device: torch.device, saves: bool = True) -> None:
    """At start-up, before anything is trained: rank 0 creates ``output_dir`` if needed, checks that
    it can write there, takes the folder's lock for the run's lifetime (``ownership.lock``: a second live
    run there is refused) and checks that nothing is in the way of the files the run writes (the
    ``step_N.tmp`` folders of interrupted saves are removed once the folder is claimed: ``claim_output_dir``);
    with ``saves`` (the run will checkpoint) and several
    ranks, every rank must see rank 0's folder (``_check_shared``). Any problem stops every rank with
    one line. Collective. The lock is dropped by ``ownership.release`` (or when the process ends)."""
    warning = on_every_rank(lambda: _prepare(output_dir) if rank == 0 else None, device, f"cannot use the output "
                            f"folder {output_dir}", "fix it or give --save another folder")
    if warning:
        get_logger().warning(warning)
    if saves and _world() > 1:
        _check_shared(output_dir, rank, device)


def _check_shared(output_dir: str, rank: int, device: torch.device) -> None:
    """Each rank writes its part of a checkpoint into rank 0's ``step_N.tmp``: a folder that is not the
    same on every node (a local disk) would fail the first save, after hours of training. Rank 0 writes a
    random token into the folder and broadcasts it; every rank must read it there. Collective."""
    token = torch.tensor([secrets.randbits(62) if rank == 0 else 0], dtype=torch.int64, device=device)
    marker = os.path.join(output_dir, ".shared_check")
    error = None
    if rank == 0:
        try:
            with open(marker, "w") as f:
                f.write(str(int(token)))
        except OSError as err:
            error = f"cannot write {marker} ({err.strerror or err}); fix the folder or give --save another one."
    all_ranks_ok(error, device)
    try:
        dist.broadcast(token, src=0)
        if rank != 0:
            try:
                with open(marker) as f:
                    seen = f.read().strip()
            except OSError:
                seen = None
            if seen != str(int(token)):
                error = (f"the output folder {output_dir} is not the one rank 0 writes to (rank {rank} on "
                         f"{socket.gethostname()} does not see rank 0's files): checkpoints need a folder every "
                         f"node shares; give --save a shared folder, or train without checkpoints "
                         f"(--no-save-at-end and no --save-interval).")
        all_ranks_ok(error, device)
    finally:
        if rank == 0 and os.path.exists(marker):
            os.remove(marker)


def claim_output_dir(start: ownership.Start, rank: int, device: torch.device, overwrite: bool,
                     tensorboard_dir: str | None) -> str | None:
    """After loading, before the run writes anything: rank 0 checks that ``output_dir`` holds no other run
    (``ownership.claim``: refused in one line on every rank, or deleted with ``overwrite``) and records this
    run there. The run's id on rank 0 (None elsewhere). Collective."""
    claimed = on_every_rank(lambda: _claim(start, overwrite, tensorboard_dir) if rank == 0 else None,
                            device, f"cannot claim the output folder {start.output_dir}",
                            "fix it or give --save another folder")
    if claimed is None:
        return None
    run_id, note = claimed
    if note:
        get_logger().warning(note)
    return run_id


def _claim(start: ownership.Start, overwrite: bool, tensorboard_dir: str | None):
    """Rank 0: claim the folder, then remove the ``step_N.tmp`` of its run's interrupted saves (never those of
    a run the claim refused)."""
    def tidy() -> None:
        for path in _leftovers(start.output_dir):
            remove_leftover(path)

    return ownership.claim(start, overwrite, tensorboard_dir, tidy)


def _leftovers(output_dir: str) -> list[str]:
    """The ``step_N.tmp`` entries of ``output_dir``: the folders of interrupted saves."""
    return [os.path.join(output_dir, name) for name in sorted(os.listdir(output_dir))
            if re.fullmatch(r"step_\d+\.tmp", name)]


def _prepare(output_dir: str) -> str | None:
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise CheckpointError(f"the output folder {output_dir} is a file; give --save a folder, or move the file.")
    try:
        make_writable_folder(output_dir)
    except OSError as err:
        raise CheckpointError(f"the output folder {output_dir} is not writable ({err.strerror or err}); fix its "
                              f"permissions or give --save another folder.") from err
    _not_in_the_way(os.path.join(output_dir, ownership.LOCK_FILE))
    warning = ownership.lock(output_dir)  # before touching anything: a live run's step_N.tmp is its save
    try:
        for name in _IN_THE_WAY:
            _not_in_the_way(os.path.join(output_dir, name))
        for name in sorted(os.listdir(output_dir)):
            if re.fullmatch(r"step_\d+(\.old)?", name) and not os.path.isdir(os.path.join(output_dir, name)):
                step_not_in_the_way(os.path.join(output_dir, name))
        for path in _leftovers(output_dir):  # removed once the folder is this run's (claim_output_dir)
            if os.path.islink(path) or not os.path.isdir(path):
                remove_leftover(path)  # in the way: one line
    except Exception:
        ownership.release(output_dir)
        raise
    return warning


def _not_in_the_way(path: str) -> None:
    if os.path.lexists(path) and not os.path.isfile(path):
        kind = "a directory" if os.path.isdir(path) else "not a regular file"
        raise CheckpointError(f"{path} is in the way: the run writes a file there but it is {kind}; move it away.")


def step_not_in_the_way(path: str) -> None:
    """``step_N`` and ``step_N.old`` are the run's checkpoint folders: a save of step N renames an earlier
    ``step_N`` to ``step_N.old``, then removes it. Anything else under those names (a file, a link) is not the
    run's to move or remove: a one-line CheckpointError, at start-up (every entry) and when a save begins."""
    if not os.path.lexists(path) or (os.path.isdir(path) and not os.path.islink(path)):
        return
    kind = "a link" if os.path.islink(path) else "a file" if os.path.isfile(path) else "not a folder"
    raise CheckpointError(f"{path} is in the way of saves: it is {kind}, not a checkpoint folder, and a save of that "
                          f"step would move it aside; move it out of the folder or give --save another folder.")


def remove_leftover(path: str) -> None:
    """Remove ``step_N.tmp``, the folder of an interrupted save; one-line CheckpointError if it is not
    such a folder or cannot be removed."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise CheckpointError(f"{path} is in the way of saves: it is a file, not the folder of an interrupted "
                              f"save; move it away.")
    try:
        shutil.rmtree(path)
    except OSError as err:
        raise CheckpointError(f"cannot remove {path}, the folder of an interrupted save ({err.strerror or err}); "
                              f"remove it by hand or give --save another folder.") from err
