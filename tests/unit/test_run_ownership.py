"""``megatron/checkpoint/ownership.py`` on folders made by hand: which run a folder holds, which run a start
is, the refusal and ``--overwrite-output-dir``, and the lock (a live holder in another process refuses, a
killed one does not, a file system without locks warns). The same through pretrain_gpt.py:
tests/functional/test_run_folder.py."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys

import pytest

from megatron.checkpoint import ownership
from megatron.checkpoint.format import CheckpointError
from megatron.checkpoint.ownership import Start, claim, held_run
from tests.functional.processes import popen


def run_folder(path, run_id: str | None = "aaaa", steps=(1, 2), metrics: bool = True):
    """A folder as a run leaves it (step folders with a file each, latest, metrics.jsonl, run.json)."""
    path.mkdir(parents=True, exist_ok=True)
    for step in steps:
        (path / f"step_{step}").mkdir()
        (path / f"step_{step}" / "metadata.json").write_text("{}")
    if steps:
        (path / "latest").write_text(f"step_{max(steps)}")
    if metrics:
        (path / "metrics.jsonl").write_text('{"step": 1}\n')
    if run_id:
        (path / "run.json").write_text(json.dumps({"run_id": run_id}))
    return path


def test_what_a_folder_holds(tmp_path):
    assert held_run(str(tmp_path / "none")) is None
    only_run_json = run_folder(tmp_path / "failed-start", steps=(), metrics=False)  # wrote nothing else
    assert held_run(str(only_run_json)) is None
    assert held_run(str(run_folder(tmp_path / "a"))).what == "run aaaa, latest step_2"
    legacy = held_run(str(run_folder(tmp_path / "legacy", run_id=None)))
    assert (legacy.run_id, legacy.what) == (None, "a run from before run ids, latest step_2")
    never_saved = held_run(str(run_folder(tmp_path / "m", steps=())))
    assert never_saved.what == "run aaaa: metrics.jsonl, no checkpoint"
    (tmp_path / "a" / "run.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"cannot read .*/a/run.json \(JSONDecodeError: .*\): it says which "
                                              r"run the folder holds; restore it"):
        held_run(str(tmp_path / "a"))


def test_which_starts_may_write_into_a_folder(tmp_path):
    a = str(run_folder(tmp_path / "a"))
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert claim(Start(empty), False, None)[0] != "aaaa"  # a new run: a new id, recorded
    assert json.loads((tmp_path / "empty" / "run.json").read_text())["run_id"] != "aaaa"
    assert claim(Start(a, a, f"{a}/step_2", "aaaa"), False, None)[0] == "aaaa"  # --load A --save A
    assert claim(Start(a, f"{a}/step_1", f"{a}/step_1", None), False, None)[0] == "aaaa"  # an earlier step of A
    b = str(run_folder(tmp_path / "b", run_id="aaaa", steps=(3,)))
    with pytest.raises(CheckpointError, match="a run loaded from .* that saves elsewhere is a new run"):
        claim(Start(b, a, f"{a}/step_2", "aaaa"), False, None)  # B holds another branch of A's run: never spliced
    legacy_ckpt = str(run_folder(tmp_path / "legacy", run_id=None))
    assert claim(Start(legacy_ckpt, legacy_ckpt, f"{legacy_ckpt}/step_2", None), False, None)[0]  # adopted
    assert (tmp_path / "legacy" / "run.json").exists()
    for start in (Start(a), Start(a, a, f"{a}/step_2", "aaaa", finetune=True),
                  Start(a, b, f"{b}/step_3", "bbbb"), Start(str(run_folder(tmp_path / "old", run_id=None)))):
        before = sorted(os.listdir(start.output_dir))
        with pytest.raises(CheckpointError, match="holds another run"):
            claim(start, False, None)
        assert sorted(os.listdir(start.output_dir)) == before


def test_overwrite_deletes_only_what_the_other_run_wrote(tmp_path):
    a = run_folder(tmp_path / "a")
    (a / "tensorboard").mkdir()
    (a / "notes.txt").write_text("mine")
    (a / "step_3.old").mkdir()
    run_id, note = claim(Start(str(a)), True, None)
    assert note == f"--overwrite-output-dir: deleted the earlier run in {a} (run aaaa, latest step_2)"
    assert sorted(os.listdir(a)) == ["notes.txt", "run.json"] and run_id != "aaaa"


HOLDER = ("import fcntl, sys; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); f.write('pid 1 on x'); "
          "f.flush(); print('held', flush=True); sys.stdin.read()")


def test_a_lock_held_by_another_process_refuses_and_a_killed_holder_leaves_none(tmp_path):
    holder = popen([sys.executable, "-c", HOLDER, str(tmp_path / "run.lock")], stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(CheckpointError, match=r"another run is writing to .* \(pid 1 on x, holding "):
            ownership.lock(str(tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    try:
        assert ownership.lock(str(tmp_path)) is None  # the kernel dropped the dead holder's lock
        assert ownership.lock(str(tmp_path)) is None  # this process's own (an in-process caller's next run)
        assert (tmp_path / "run.lock").read_text().startswith(f"pid {os.getpid()} on ")
    finally:
        ownership.release(str(tmp_path))
    assert not (tmp_path / "run.lock").exists()  # released: the file goes with it


def test_a_file_system_without_locks_warns(tmp_path, monkeypatch):
    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)  # as NFS mounted without the lock service
    try:
        warning = ownership.lock(str(tmp_path))
    finally:
        ownership.release(str(tmp_path))
    assert warning.startswith(f"cannot lock {tmp_path}/run.lock (No locks available): this file system has no "
                              f"locks, so a second run")
