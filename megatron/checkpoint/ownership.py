"""Who a run folder belongs to: one run, and at most one live writer.

**A run** is one training history: it gets a random id (``run_id``) when it starts afresh (no ``--load``,
or ``--finetune``: a new run from someone's weights). A run that resumes a checkpoint *is* that
checkpoint's run: every checkpoint records its run's id in its train state (``run_id``), and the run
folder records it in ``run.json`` (written atomically when a run starts writing there). So a resume of
the same folder, ``--load A --save B`` into an empty B, or into a B holding the same run (an earlier
resume of A), are all the same run. A checkpoint from before run ids (or a converted one) has no id: it is
the run of its folder's ``run.json`` if that names one, else a new run.

**A folder holds a run** when it holds something a run would lose: a checkpoint (``latest`` or a
``step_N`` folder) or the records of ``metrics.jsonl``. A folder holding only a ``run.json`` (a run that
failed before it wrote anything) holds nothing. Writing a *different* run into a folder that holds one
would replace its ``step_N`` folders, repoint its ``latest`` and trim its ``metrics.jsonl``: it is refused
in one line (``claim``), unless ``--overwrite-output-dir`` asks to delete that run's files first. A run
whose ``--load`` is its own ``--save`` folder (or a step folder in it) always continues the folder's run.

**A live writer** holds ``run.lock`` in the folder: rank 0 (the rank that writes ``latest``, ``run.json``,
``config.yaml`` and commits the step folders; every launch into the folder has one) takes ``fcntl.flock`` on it
for as long as the run lives (``megatron/file_lock.py``), so a second launch into the same folder is refused at
once (``lock``), and a killed run's lock is gone with its process (the kernel drops it): nothing stale to clean
up. Where the file system refuses ``flock`` the run goes on with a warning; where locks are node-local (NFS
mounted ``nolock``) two launches on different nodes are not detected.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron import file_lock
from megatron.checkpoint.format import CheckpointError, same_folder, write_text

RUN_FILE, LOCK_FILE = "run.json", "run.lock"
_STEP = re.compile(r"step_(\d+)")
_RUN_FILES = ("latest", "latest.tmp", "metrics.jsonl", "config.yaml", RUN_FILE)  # what --overwrite-output-dir removes
_HELD: dict[str, object] = {}  # realpath of a folder -> the open lock file this process holds on it


def new_run_id() -> str:
    return secrets.token_hex(8)


# The live writer -------------------------------------------------------------------------------------------

def lock(output_dir: str) -> str | None:
    """Rank 0 at start-up: hold ``output_dir/run.lock`` until ``release`` (or this process ends). CheckpointError,
    one line, when another live process holds it; a warning (returned) where the file system has no locks."""
    key = os.path.realpath(output_dir)
    if key in _HELD:  # this process holds it: an in-process caller's earlier run
        return None
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        _HELD[key] = file_lock.hold(path)
    except file_lock.Busy as busy:
        raise CheckpointError(f"another run is writing to {output_dir} ({busy.holder}, holding {path}): two runs in "
                              f"one folder would replace each other's checkpoints; wait for it to end, stop it, or "
                              f"give --save another folder.") from None
    except file_lock.Unsupported as err:
        return (f"cannot lock {path} ({err}): this file system has no locks, so a second run writing to "
                f"{output_dir} at the same time would not be detected.")
    except OSError as err:
        raise CheckpointError(f"cannot open {path} ({err.strerror or err}); fix the folder or give --save another "
                              f"one.") from err
    return None


def release(output_dir: str) -> None:
    """Drop this process's lock on ``output_dir`` (and its file), if it holds one: the end of a run."""
    f = _HELD.pop(os.path.realpath(output_dir), None)
    if f is not None:
        file_lock.drop(f, os.path.join(output_dir, LOCK_FILE))


# The run a folder holds ------------------------------------------------------------------------------------

@dataclass
class HeldRun:
    run_id: str | None  # None: a folder written before run ids
    what: str  # "run 3f2a..., latest step_40", for messages
    latest: str | None = None  # None: metrics only, no checkpoint to resume


def _latest_step(output_dir: str) -> str | None:
    try:
        with open(os.path.join(output_dir, "latest"), errors="replace") as f:
            return f.read(256).strip() or None  # a step folder's name: never read more
    except OSError:
        steps = [int(m.group(1)) for d in os.listdir(output_dir) if (m := _STEP.fullmatch(d))]
        return f"step_{max(steps)}" if steps else None


def run_json_id(folder: str) -> str | None:
    """The ``run_id`` that ``folder/run.json`` records; None when there is no such file. CheckpointError for
    one that cannot be read."""
    path = os.path.join(folder, RUN_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            run_id = json.load(f)["run_id"]
        if not isinstance(run_id, str) or not run_id:
            raise ValueError("run_id is not a string")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"cannot read {path} ({type(err).__name__}: {err}): it says which run the folder "
                              f"holds; restore it, or remove it if the folder holds one run.") from err
    return run_id


def held_run(output_dir: str) -> HeldRun | None:
    """The run ``output_dir`` holds, or None when it holds nothing a run would lose."""
    if not os.path.isdir(output_dir):
        return None
    latest = _latest_step(output_dir) if (os.path.lexists(os.path.join(output_dir, "latest")) or any(
        _STEP.fullmatch(d) for d in os.listdir(output_dir))) else None
    metrics = os.path.join(output_dir, "metrics.jsonl")
    has_metrics = os.path.isfile(metrics) and os.path.getsize(metrics) > 0
    if latest is None and not has_metrics:
        return None
    run_id = run_json_id(output_dir)
    who = f"run {run_id}" if run_id else "a run from before run ids"
    return HeldRun(run_id, f"{who}, latest {latest}" if latest else f"{who}: metrics.jsonl, no checkpoint", latest)


# The claim of a run starting now ---------------------------------------------------------------------------

@dataclass
class Start:
    """How the run starting now relates to checkpoints: ``ckpt_dir`` as given, ``loaded`` (the step folder
    loaded, None when nothing was), ``checkpoint_run`` (the run id the loaded checkpoint records), ``finetune``."""
    output_dir: str
    ckpt_dir: str | None = None
    loaded: str | None = None
    checkpoint_run: str | None = None
    finetune: bool = False

    def own_folder(self) -> bool:
        """The run continues its own --save folder (--save X --load X, or --load X/step_N)."""
        if self.finetune or not self.ckpt_dir:
            return False
        return same_folder(self.ckpt_dir, self.output_dir) or (
            self.loaded is not None and same_folder(os.path.dirname(os.path.normpath(self.loaded)), self.output_dir))


def _run_of(start: Start, held: HeldRun | None) -> str:
    if start.own_folder():
        return (held.run_id if held else None) or start.checkpoint_run or run_json_id(start.output_dir) or new_run_id()
    return new_run_id()  # a fresh start, a --finetune, or a branch: --load A --save B continues A as a new run


def claim(start: Start, overwrite: bool, tensorboard_dir: str | None,
          tidy: Callable[[], None] | None = None) -> tuple[str, str | None]:
    """Rank 0, after loading and before the run writes anything: the run's id, and a line to log when
    ``overwrite`` deleted another run. CheckpointError (one line) when ``output_dir`` holds another run.
    ``tidy`` runs once the folder is this run's, before the run is recorded in ``run.json``."""
    out = start.output_dir
    held = held_run(out)
    run_id = _run_of(start, held)
    note = None
    if held is not None and not start.own_folder() and held.run_id != run_id:
        if not overwrite:
            raise CheckpointError(_refusal(start, held, run_id))
        note = _remove_run(out, held, tensorboard_dir)
    if tidy is not None:
        tidy()
    write_text(os.path.join(out, RUN_FILE), json.dumps({"run_id": run_id, "host": socket.gethostname(),
                                                        "written": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    return run_id, note


def _refusal(start: Start, held: HeldRun, run_id: str) -> str:
    out = start.output_dir
    ways = (f"resume that run with --load {out}, give --save another folder, or pass --overwrite-output-dir to "
            f"delete it and write this run there") if held.latest else (
        "it saved no checkpoint to resume (a relaunch would start it again and drop its metrics): give --save another "
        "folder, or pass --overwrite-output-dir to delete its metrics and write this run there")
    if start.loaded and not start.finetune:
        return (f"{out} holds another run ({held.what}), and a run loaded from {start.ckpt_dir} that saves "
                f"elsewhere is a new run (a branch): writing there would replace that run's checkpoints and metrics; "
                f"{ways}.")
    new = "a --finetune run is a new run" if start.finetune else "a run without --load is a new run"
    return (f"{out} holds another run ({held.what}) and {new}: writing there would replace that run's checkpoints "
            f"and metrics; {ways}.")


def _remove_run(out: str, held: HeldRun, tensorboard_dir: str | None) -> str:
    """--overwrite-output-dir: delete what the held run wrote in ``out`` (its step folders, latest, metrics,
    config, run.json, and its TensorBoard events when they are the default ``out/tensorboard``)."""
    names = [d for d in os.listdir(out) if re.fullmatch(r"step_\d+(\.tmp|\.old)?", d)] + list(_RUN_FILES)
    if tensorboard_dir is None:
        names.append("tensorboard")
    try:
        for name in names:
            path = os.path.join(out, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)
    except OSError as err:
        raise CheckpointError(f"--overwrite-output-dir: cannot remove {err.filename or out} "
                              f"({err.strerror or err}); remove the earlier run by hand or give --save another "
                              f"folder.") from err
    return f"--overwrite-output-dir: deleted the earlier run in {out} ({held.what})"
