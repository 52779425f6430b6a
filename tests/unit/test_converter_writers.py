"""``tools/convert_checkpoint.py``'s output folders: one writer at a time, private temporary names, and failures
that leave nothing behind (every command: from-hf, from-megatron, reshard, to-hf, to-megatron).

- a second writer of an output folder (another conversion, the same one started twice, or a training run) is
  refused in one line naming the first one's pid and command, exit 2, nothing written by it;
- two conversions into one folder at once, paused deterministically (``Writers``: each thread stops before its
  checkpoint's last file until the test lets it go): the second is refused and the first's checkpoint is whole;
  with locks that do nothing (a file system without them), private temporary folders still keep the two apart;
- a killed writer's private temporaries are removed by the next writer of the folder;
- a full disk (ENOSPC from our writes, torch.save's own RuntimeError, safetensors' and DCP's errors) is one line,
  exit 2, and leaves the output folder as it was: no temporary, no half-written output, ``latest`` untouched, a
  folder the command created removed.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import subprocess
import threading

import pytest
import torch

import megatron.checkpoint.convert as convert_module
from megatron import file_lock, parallel_state
from megatron.checkpoint import format as checkpoint_format
from megatron.checkpoint import ownership
from megatron.checkpoint.convert import open_checkpoint, read_tensors
from tests.unit.test_megatron_checkpoints import SHAPES, convert, our_checkpoint

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
TORCH_SAVE_ENOSPC = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"  # what torch.save raises


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Our checkpoints (GPT-2 and Llama shapes, both at step 12), their legacy Megatron exports and the GPT-2's
    Hugging Face export: what the five commands read."""
    folder = tmp_path_factory.mktemp("sources")
    parallel_state.initialize()
    try:
        for name, shape in (("run", "gpt2"), ("run2", "llama")):
            our_checkpoint(folder / name, SHAPES[shape])
        for run, meg in (("run", "meg"), ("run2", "meg2")):
            assert convert.main(["to-megatron", str(folder / run), str(folder / meg)]) == 0
        assert convert.main(["to-hf", str(folder / "run"), str(folder / "hf"), "--no-tokenizer"]) == 0
    finally:
        parallel_state.destroy()
    return folder


SOURCE = {"to-hf": "run", "from-hf": "hf", "from-megatron": "meg", "to-megatron": "run", "reshard": "run"}


def command(name: str, sources, out) -> list[str]:
    source = SOURCE[name]
    extra = {"to-hf": ["--no-tokenizer"], "reshard": ["--tp", "2"]}.get(name, [])
    return [name, str(sources / source), str(out), *extra]


def tree(path) -> dict | None:
    """Every entry under ``path`` with its bytes (None for a folder); None when ``path`` does not exist."""
    if not os.path.exists(path):
        return None
    entries = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            entries[os.path.relpath(os.path.join(root, d), path)] = None
        for f in files:
            with open(os.path.join(root, f), "rb") as handle:
                entries[os.path.relpath(os.path.join(root, f), path)] = handle.read()
    return entries


def assert_same_params(out, run) -> None:
    """``out``'s latest checkpoint holds exactly the weights of ``run``'s (every checksum checked on reading)."""
    theirs, ours = read_tensors(open_checkpoint(str(out))[0]), read_tensors(open_checkpoint(str(run))[0])
    assert theirs.keys() == ours.keys()
    for name, t in ours.items():
        assert torch.equal(theirs[name], t), name


# ---------------------------------------------------------------- one writer at a time


@pytest.mark.parametrize("name", ["to-hf", "from-hf", "from-megatron", "to-megatron", "reshard"])
def test_a_second_writer_is_refused_in_one_line_naming_the_first(sources, tmp_path, one_process, capsys, name):
    """Another conversion holds the output folder (before: the second wrote into it all the same)."""
    out = tmp_path / "out"
    out.mkdir()
    first = f"convert_checkpoint.py {name} {sources}/other {out}"
    held = file_lock.hold(str(out / "run.lock"), what=first)  # the first writer (a lock is per open file)
    try:
        assert convert.main(command(name, sources, out)) == 2
        assert os.listdir(out) == ["run.lock"]  # nothing written by the second
    finally:
        file_lock.drop(held, str(out / "run.lock"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"convert_checkpoint\.py: error: another process is writing to {out} \(pid {os.getpid()} on "
        rf"{re.escape(socket.gethostname())} since [0-9: -]+, running {re.escape(first)}, holding {out}/run\.lock\): "
        rf"two writers of one folder would mix their files; wait for it to end, or give another output folder\.",
        err[0]), err
    assert convert.main(command(name, sources, out)) == 0  # once the first has ended
    assert "run.lock" not in os.listdir(out)


def test_a_training_run_and_a_converter_exclude_each_other(sources, tmp_path, one_process, capsys):
    """Converters hold the lock a training run holds on its --save folder (run.lock), and the holder line names
    the command: a run refused by a converter's folder says which conversion writes there."""
    ownership.lock(str(tmp_path))  # a run saving into tmp_path: a converter may not write there
    try:
        assert convert.main(command("reshard", sources, tmp_path)) == 2
        assert f"another process is writing to {tmp_path} (pid {os.getpid()} on " in capsys.readouterr().err
    finally:
        ownership.release(str(tmp_path))
    out = tmp_path / "out"
    held = file_lock.OutputFolder(str(out), "run.lock", "convert_checkpoint.py reshard a b")
    held.acquire()
    try:
        with pytest.raises(checkpoint_format.CheckpointError, match=rf"another run is writing to {out} \(pid "
                           rf"{os.getpid()} on .*, running convert_checkpoint\.py reshard a b, holding "):
            ownership.lock(str(out))
    finally:
        held.release(failed=False)


def test_a_file_system_without_locks_is_a_warning(sources, tmp_path, one_process, monkeypatch, capsys):
    """Where flock is refused (NFS mounted nolock) the conversion goes on, saying that a second writer would not
    be detected, and leaves no lock file."""
    def refused(path, what=None):
        open(path, "a").close()  # as hold's open does before its flock fails
        raise file_lock.Unsupported("Function not implemented")

    monkeypatch.setattr(file_lock, "hold", refused)
    out = tmp_path / "out"
    assert convert.main(command("reshard", sources, out)) == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"convert_checkpoint.py: warning: cannot lock {out}/run.lock (Function not implemented): this file system has "
        f"no locks, so a second writer of {out} at the same time would not be detected."]
    assert sorted(os.listdir(out)) == ["latest", "step_12"]


def test_a_killed_writers_temporaries_are_removed_by_the_next_one(sources, tmp_path, one_process):
    """A writer killed mid-write leaves its private temporaries (no other process would take them over); the next
    writer of the folder removes those of this host's processes that are gone. Another host's are kept: where locks
    are local to each node, their writer may be alive."""
    gone = _ended_pid()
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]
    out = tmp_path / "out"
    (out / f"step_12.tmp.{host}-{gone}.0123abcd").mkdir(parents=True)
    (out / f"step_12.tmp.{host}-{gone}.0123abcd" / "rank0.bin").write_bytes(b"half")
    (out / f"latest.tmp.{host}-{gone}.89abcdef").write_text("step_12")
    kept = [f"step_12.tmp.{host}-{os.getpid()}.00000000", f"step_12.tmp.othernode-{gone}.11111111", "notes.tmp.txt"]
    for name in kept:
        (out / name).write_text("a live writer's, another node's, the user's")
    assert convert.main(["from-megatron", str(sources / "meg"), str(out)]) == 0
    assert sorted(os.listdir(out)) == sorted(["latest", "step_12", *kept])


def _ended_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


class Writers:
    """Conversions run in threads, each stopped when it writes its checkpoint's ``metadata.json`` (the last file
    of a step folder) until ``go(name)``: a deterministic interleaving of two writers of one folder."""

    def __init__(self, monkeypatch):
        self.paused_or_done: dict[str, threading.Event] = {}
        self.released: dict[str, threading.Event] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.status: dict[str, int] = {}
        original = convert_module.write_text

        def write_text(path: str, text: str) -> int:
            me = threading.current_thread().name
            if path.endswith("metadata.json") and me in self.released:
                self.paused_or_done[me].set()
                assert self.released[me].wait(60), f"{me} was never let go"
            return original(path, text)

        monkeypatch.setattr(convert_module, "write_text", write_text)

    def start(self, name: str, argv: list[str]) -> None:
        """Start ``argv`` and wait until it is paused before its last file, or has ended (refused)."""
        self.paused_or_done[name], self.released[name] = threading.Event(), threading.Event()

        def run() -> None:
            try:
                self.status[name] = convert.main(argv)
            finally:
                self.paused_or_done[name].set()

        self.threads[name] = threading.Thread(target=run, name=name, daemon=True)
        self.threads[name].start()
        assert self.paused_or_done[name].wait(60)

    def finish(self, name: str) -> int:
        self.released[name].set()
        self.threads[name].join(60)
        assert not self.threads[name].is_alive()
        return self.status[name]


@pytest.mark.parametrize("second", ["meg2", "meg"], ids=["another-checkpoint", "the-same-conversion"])
def test_two_conversions_into_one_folder_at_once(sources, tmp_path, one_process, monkeypatch, capsys, second):
    """Before: both wrote the shared step_12.tmp; one exited 0 with a checkpoint mixing both sources (or the
    second failed with a race's message)."""
    out, writers = tmp_path / "out", Writers(monkeypatch)
    first = ["from-megatron", str(sources / "meg"), str(out)]
    writers.start("A", first)
    assert writers.threads["A"].is_alive()  # paused, holding the folder
    writers.start("B", ["from-megatron", str(sources / second), str(out)])
    assert writers.finish("A") == 0 and writers.finish("B") == 2
    assert sorted(os.listdir(out)) == ["latest", "step_12"]
    assert_same_params(out, sources / "run")  # the first writer's checkpoint, whole
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"convert_checkpoint.py: error: another process is writing to {out} "
                                               f"(pid {os.getpid()} on "), err
    assert f", running convert_checkpoint.py {' '.join(first)}, holding {out}/run.lock)" in err[0]


def test_without_locks_private_temporaries_keep_two_writers_apart(sources, tmp_path, one_process, monkeypatch,
                                                                  capsys):
    """Where the file system's locks do nothing, two conversions of different checkpoints into one folder still
    never share a temporary folder: the first to finish writes step_12, the other is one line and leaves nothing."""
    monkeypatch.setattr(file_lock, "hold", lambda path, what=None: open(path, "a+"))  # a lock that locks nothing
    out, writers = tmp_path / "out", Writers(monkeypatch)
    writers.start("A", ["from-megatron", str(sources / "meg"), str(out)])
    writers.start("B", ["from-megatron", str(sources / "meg2"), str(out)])
    assert writers.threads["B"].is_alive()  # both paused inside their checkpoints
    assert writers.finish("A") == 0 and writers.finish("B") == 2
    assert sorted(os.listdir(out)) == ["latest", "step_12"]  # no temporary folder of B's
    assert_same_params(out, sources / "run")  # A's checkpoint, none of B's files in it
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"convert_checkpoint.py: error: {out}/step_12 appeared while this checkpoint was written; choose "
                   f"another output folder or pass --force."]


# ---------------------------------------------------------------- a full disk


def failing(after: int, error: BaseException, partial: bool = True):
    """A writer ``(obj, path, ...)`` that writes ``after`` times, then writes a few bytes and raises ``error``."""
    calls = []

    def wrap(original):
        def write(obj, path, *args, **kwargs):
            calls.append(path)
            if len(calls) > after:
                if partial and isinstance(path, (str, os.PathLike)):
                    with open(path, "wb") as f:
                        f.write(b"partial")
                raise error
            return original(obj, path, *args, **kwargs)
        return write
    return wrap


def fail_fsync_of_latest(monkeypatch) -> None:
    """``os.fsync`` of a ``latest`` file (or its temporary) fails with ENOSPC, as a delayed allocation does."""
    original = os.fsync

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("latest"):
            raise ENOSPC
        return original(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_full_disk_during_to_hf_leaves_nothing(sources, tmp_path, one_process, monkeypatch, capsys):
    """safetensors' own error for a full disk (before: a traceback, and an empty folder left)."""
    import safetensors
    import safetensors.torch

    error = safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", failing(0, error)(safetensors.torch.save_file))
    out = tmp_path / "new" / "hf"
    assert convert.main(["to-hf", str(sources / "run"), str(out), "--no-tokenizer"]) == 2
    assert not (tmp_path / "new").exists()  # the folders it created, removed
    assert_one_write_failure(capsys, out, f"SafetensorError: {error}")


def test_a_full_disk_during_to_hf_leaves_an_earlier_export_as_it_was(sources, tmp_path, one_process, monkeypatch,
                                                                     capsys):
    """An export over an earlier one: none of its files replaced unless all are written (before: the weights
    replaced, the config not, and a model.safetensors.tmp left)."""
    import safetensors.torch

    out = tmp_path / "hf"
    shutil.copytree(sources / "hf", out)
    before = tree(out)
    monkeypatch.setattr(safetensors.torch, "save_file", failing(0, ENOSPC)(safetensors.torch.save_file))
    assert convert.main(["to-hf", str(sources / "run"), str(out), "--no-tokenizer", "--dtype", "bfloat16"]) == 2
    assert tree(out) == before
    assert_one_write_failure(capsys, out, "No space left on device")


@pytest.mark.parametrize("fmt, error, reason", [
    ("legacy", ENOSPC, "No space left on device"),
    ("legacy", RuntimeError(TORCH_SAVE_ENOSPC), f"RuntimeError: {TORCH_SAVE_ENOSPC}"),
    ("torch_dist", RuntimeError(TORCH_SAVE_ENOSPC), f"RuntimeError: {TORCH_SAVE_ENOSPC}"),  # inside DCP's exception
])
def test_a_full_disk_during_to_megatron_leaves_nothing(sources, tmp_path, one_process, monkeypatch, capsys, fmt,
                                                       error, reason):
    """Before: iter_N.tmp left behind (and torch.save's own error was a traceback)."""
    out = tmp_path / "meg"
    out.mkdir()
    (out / "latest_checkpointed_iteration.txt").write_text("5")  # an earlier save, which must stay the latest
    (out / "iter_0000005").mkdir()
    before = tree(out)
    monkeypatch.setattr(torch, "save", failing(1, error, partial=fmt == "legacy")(torch.save))
    assert convert.main(["to-megatron", str(sources / "run"), str(out), "--format", fmt, "--tp", "2"]) == 2
    assert tree(out) == before
    assert_one_write_failure(capsys, out, reason)
    monkeypatch.undo()
    assert convert.main(["to-megatron", str(sources / "run"), str(tmp_path / "new"), "--format", fmt]) == 0


def test_a_full_disk_at_latest_leaves_the_earlier_checkpoint_the_latest(sources, tmp_path, one_process,
                                                                        monkeypatch, capsys):
    """The new step folder and latest appear together or not at all (before: step_0 renamed into place, latest
    still step_12 and a latest.tmp left)."""
    out = tmp_path / "out"
    assert convert.main(["from-megatron", str(sources / "meg"), str(out)]) == 0
    before = tree(out)
    fail_fsync_of_latest(monkeypatch)
    assert convert.main(["from-megatron", str(sources / "meg2"), str(out), "--finetune", "--force"]) == 2
    assert tree(out) == before and (out / "latest").read_text() == "step_12"
    assert_one_write_failure(capsys, out, "No space left on device")


@pytest.mark.parametrize("name", ["from-hf", "from-megatron", "reshard"])
def test_a_full_disk_writing_a_checkpoint_of_ours_leaves_nothing(sources, tmp_path, one_process, monkeypatch, capsys,
                                                                 name):
    """ENOSPC from the rank files' writes into a new folder two levels down: both folders removed again (before:
    left, empty)."""
    original = checkpoint_format.RankFileWriter.add

    def add(self, tensor):
        if self._offset:
            raise ENOSPC
        return original(self, tensor)

    monkeypatch.setattr(checkpoint_format.RankFileWriter, "add", add)
    out = tmp_path / "new" / "out"
    assert convert.main(command(name, sources, out)) == 2
    assert os.listdir(tmp_path) == []
    assert_one_write_failure(capsys, out, "No space left on device")


def assert_one_write_failure(capsys, out, reason: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"convert_checkpoint\.py: error: cannot write to {out} \({re.escape(reason)}; [0-9.]+ GiB free there\); "
        rf"nothing of this conversion is left there: free some space, or give another output folder\.", err[0]), err


@pytest.mark.parametrize("name, out", [
    ("to-hf", "{source}"), ("to-megatron", "{source}"), ("from-megatron", "{source}/iter_0000012"),
    ("from-hf", "{source}"), ("reshard", "{source}"), ("to-hf", "{source}/step_12"), ("to-hf", "{source}/step_12/hf"),
])
def test_an_output_folder_where_the_source_is_read_is_one_line(sources, tmp_path, one_process, capsys, name, out):
    """Before: to-hf put its files among a run folder's, to-megatron an iter_N into it, from-megatron a step_N and
    latest into Megatron's iteration folder, all exit 0 (reshard alone refused, naming the step being read). The
    source is untouched; a folder beside the steps (run/hf) stays allowed."""
    copy = tmp_path / SOURCE[name]
    shutil.copytree(sources / SOURCE[name], copy)
    before = tree(copy)
    argv = command(name, tmp_path, out.format(source=copy))
    capsys.readouterr()
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is where" in err and "give another output folder" in err, err
    assert tree(copy) == before
    if name == "to-hf" and out == "{source}":
        assert convert.main([name, str(copy), str(copy / "hf"), "--no-tokenizer"]) == 0


@pytest.mark.parametrize("odd", ["a symbolic link", "a folder"])
def test_a_lock_path_that_is_not_a_file_is_one_line_naming_it(sources, tmp_path, one_process, capsys, odd):
    """Before: 'cannot write to the output folder OUT (Too many levels of symbolic links)' / '(Is a directory)'. The
    link's target is never created or written."""
    out = tmp_path / "out"
    out.mkdir()
    if odd == "a symbolic link":
        (out / "run.lock").symlink_to(tmp_path / "target")
    else:
        (out / "run.lock").mkdir()
    capsys.readouterr()
    assert convert.main(command("to-hf", sources, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out / 'run.lock'} is {odd}, not the lock file this tool keeps there" in err
    assert sorted(os.listdir(out)) == ["run.lock"] and not (tmp_path / "target").exists()
