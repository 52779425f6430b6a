"""``--async-save``: training goes on while a background thread writes the checkpoint; what it writes resumes
bitwise (and under another layout); a kill during the write, a writer failure and a stop signal during the write
each leave the run folder as the promises say. Most runs are in-process (``run_here``): TINY, 10 steps, a save
every 2 steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from megatron.checkpoint import CheckpointReader, async_save
from megatron.training.step_log import StepLog
from tests.functional.launch import ROOT, TINY, losses, parity_layouts, run_here
from tests.functional.processes import error_lines

pytestmark = pytest.mark.slow

ASYNC = [*TINY, "--async-save", "--save-interval", "2"]


def _save_records(out) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "save"]


def _hook_writer(monkeypatch, before_write) -> None:
    """Call ``before_write(step_tmp_folder, staged pieces)`` on the writer thread before it writes a rank's
    files."""
    real = async_save._write_files

    def hooked(tmp, rank, pieces, rng):
        before_write(tmp, pieces)
        return real(tmp, rank, pieces, rng)

    monkeypatch.setattr(async_save, "_write_files", hooked)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """TINY with --async-save every 2 steps, each write (but the last, at the end of training) held until the
    next training step has begun: a save that blocked training would never see it (and fail the run). Returns
    (run folder, the staging buffer's address at each save)."""
    out, began, buffers = tmp_path_factory.mktemp("async") / "run", threading.Event(), []
    with pytest.MonkeyPatch.context() as monkeypatch:
        real_started, real_begin = StepLog.step_started, async_save.AsyncSaver.begin

        def step_started(self):
            real_started(self)
            began.set()

        def begin(self, *args):
            began.clear()  # on the main thread, before the writer starts
            real_begin(self, *args)

        def hold(tmp, pieces):
            buffers.append(pieces[0][1].untyped_storage().data_ptr())
            if not tmp.endswith("step_10.tmp"):
                assert began.wait(120), "training did not go on while the checkpoint was being written"

        monkeypatch.setattr(StepLog, "step_started", step_started)
        monkeypatch.setattr(async_save.AsyncSaver, "begin", begin)
        _hook_writer(monkeypatch, hold)
        done = run_here(*ASYNC, "--save", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out, buffers


def test_async_saves_overlap_training_and_report_their_cost(async_run):
    out, buffers = async_run
    saves = _save_records(out)
    assert [r["save_step"] for r in saves] == [2, 4, 6, 8, 10]
    # each save but the last was sealed at a later step than its own: the write overlapped the next step(s)
    assert all(r["step"] > r["save_step"] for r in saves[:-1]) and saves[-1]["step"] == 10
    assert all(0 < r["save_blocked_s"] <= r["save_total_s"] for r in saves)
    assert len(set(buffers)) == 1  # one staging buffer, reused by every save
    assert (out / "latest").read_text() == "step_10" and not list(out.glob("step_*.tmp"))
    for step in (2, 4, 6, 8, 10):
        CheckpointReader(str(out / f"step_{step}")).verify()  # sealed: every file there, every checksum right


def test_a_run_resumed_from_an_async_checkpoint_continues_bitwise(async_run, reference, tmp_path):
    out, _ = async_run
    assert losses(out) == reference[0]  # saving in the background changes nothing in the run
    resumed = run_here(*TINY, "--load", str(out / "step_4"), "--save", str(tmp_path / "resumed"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path / "resumed") == reference[0][4:]


_KILL_DURING_BACKGROUND_WRITE = """
import os, runpy, signal, sys, threading
from megatron.checkpoint.format import RankFileWriter
real_add = RankFileWriter.add
def add(self, tensor):
    where = real_add(self, tensor)
    if "step_4" in self._file.name:  # a piece of the second checkpoint is written: die as kill -9 would
        self._file.flush()
        print("killed on thread", threading.current_thread().name, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return where
RankFileWriter.add = add
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint(tmp_path, reference):
    out = tmp_path / "killed"
    killed = subprocess.run([sys.executable, "-c", _KILL_DURING_BACKGROUND_WRITE, *ASYNC, "--save", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "killed on thread checkpoint-writer-4" in killed.stdout  # the writer thread, mid-write
    assert (out / "latest").read_text() == "step_2" and not (out / "step_4").exists()
    assert (out / "step_4.tmp" / "rank0.bin").is_file()  # the partial write, never renamed into place
    resumed = run_here(*TINY, "--load", str(out), "--save", str(out))  # the run folder resolves to step_2
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 2" in resumed.stderr
    assert losses(out)[-8:] == reference[0][2:]


def test_a_writer_failure_stops_the_run_in_one_line(tmp_path, monkeypatch):
    """A file in the way of the writer (as a full disk or a read-only folder would fail it): at the next step
    boundary the run stops with one line and exit status 2; the previous checkpoint and ``latest`` stay."""
    def in_the_way(tmp, pieces):
        if tmp.endswith("step_4.tmp"):
            os.mkdir(os.path.join(tmp, "rank0.bin"))

    _hook_writer(monkeypatch, in_the_way)
    out = tmp_path / "run"
    failed = run_here(*ASYNC, "--save", str(out))
    assert failed.returncode == 2
    errors = error_lines(failed.stderr)
    assert len(errors) == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert f"cannot save {out / 'step_4'} (IsADirectoryError" in errors[0]
    assert "the previous checkpoint and 'latest' are unchanged" in errors[0]
    assert (out / "latest").read_text() == "step_2" and not list(out.glob("step_4*"))


def test_a_stop_signal_during_a_background_write_seals_it_and_saves(tmp_path, monkeypatch):
    """SIGTERM while step 4's checkpoint is being written: that save is finished and sealed, the stop's own save
    follows, and the run exits 0."""
    def terminate(tmp, pieces):
        if tmp.endswith("step_4.tmp"):
            os.kill(os.getpid(), 15)

    _hook_writer(monkeypatch, terminate)
    out = tmp_path / "run"
    stopped = run_here(*ASYNC, "--save", str(out))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    at = int((out / "latest").read_text().removeprefix("step_"))  # the step the signal was agreed at: 4 or after
    assert at >= 4 and f"saving at step {at} and exiting" in stopped.stderr
    assert [r["save_step"] for r in _save_records(out)] == [*range(2, at + 1, 2), *([at] if at % 2 else [])]
    CheckpointReader(str(out / "step_4")).verify()
    assert not list(out.glob("step_*.tmp"))


RESUMED = parity_layouts({
    "async-tp2-saved": (2, [*ASYNC, "--tp", "2"]),
    "async-tp2-to-dp2": (2, [*TINY, "--dp", "2", "--load", "{runs}/async-tp2-saved/step_4"], ("async-tp2-saved",)),
})


@pytest.mark.shared_runs(*RESUMED)
def test_two_ranks_save_asynchronously_and_resume_under_another_layout(parity, reference):
    saved = parity.outcome("async-tp2-saved").check()
    assert (saved / "latest").read_text() == "step_10"
    assert [r["save_step"] for r in _save_records(saved)] == [2, 4, 6, 8, 10]
    assert losses(saved) == pytest.approx(reference[0], rel=1e-5)
    resumed = losses(parity.outcome("async-tp2-to-dp2").check())
    assert resumed == pytest.approx(reference[0][4:], rel=1e-5)  # the sync, uninterrupted run's steps 5-10


def test_a_divergence_seals_the_pending_save_and_names_the_good_one(tmp_path, monkeypatch):
    """Resumed at lr 1e6 with a save every step: step 5's loss is already huge, so step_5 is written (held until
    step 9 has begun) but never confirmed; steps 6-9 are non-finite. The divergence stop (exit 3) at step 9 seals
    the pending step_5 first, then points 'latest' back at step_4, which step 5's finite loss confirmed (the
    synchronous run ends the same way)."""
    out, step_nine = tmp_path / "run", threading.Event()
    real_started = StepLog.step_started

    def step_started(self):
        real_started(self)
        if self.state.step == 8:  # step 9 begins
            step_nine.set()

    monkeypatch.setattr(StepLog, "step_started", step_started)
    _hook_writer(monkeypatch, lambda tmp, pieces: tmp.endswith("step_5.tmp") and step_nine.wait(120))
    ckpt = ["--save", str(out), "--load", str(out), "--save-interval", "1", "--keep-last-checkpoints", "1",
            "--async-save"]
    assert run_here(*TINY, "--max-steps", "3", "--lr", "1e-3", *ckpt).returncode == 0
    diverged = run_here(*TINY, "--max-steps", "40", "--lr", "1e6", "--min-lr", "1e6",
                        "--max-consecutive-skipped-steps", "4", *ckpt)
    assert diverged.returncode == 3, diverged.stderr[-3000:]
    errors = [line for line in diverged.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "training diverged: 4 steps in a row up to step 9" in errors[0], errors
    assert f"last good checkpoint: {out / 'step_4'}, which 'latest' now names again" in errors[0]
    log = diverged.stderr
    assert log.index(" - global step 9,") < log.index(f"saved checkpoint {out / 'step_5'} ")  # sealed at the stop
    assert (out / "latest").read_text() == "step_4"
    CheckpointReader(str(out / "step_5")).verify()
    assert not list(out.glob("step_*.tmp"))
