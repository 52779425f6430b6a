"""Checkpoints: exact resume, resume under another layout, atomic saves, save on SIGTERM, a bad
checkpoint or output folder (every rank stops with one line, nothing written), ``--save X --load X``
and metrics.jsonl after a resume."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megatron.checkpoint import CheckpointReader
from tests.functional.launch import (
    ROOT,
    TINY,
    losses,
    outcome,
    parity_layouts,
    run,
    run_here,
    run_several,
    whole_share,
)
from tests.functional.processes import popen

pytestmark = [pytest.mark.slow, pytest.mark.shared_runs("saved-dp2")]

FOUR_LAYERS = [*TINY, "--num-layers", "4"]


def _save_then_resume(name: str, saved: tuple[int, list[str]], resumed: tuple[int, list[str]]) -> str:
    """Register a run that saves at step 5 (of 10) under one layout and one that resumes it under another, as
    ``{name}-saved`` and ``{name}``; the resumed run's name."""
    (nproc_saved, saved_args), (nproc_resumed, resumed_args) = saved, resumed
    parity_layouts({f"{name}-saved": (nproc_saved, [*saved_args, "--save-interval", "5"]),
                    name: (nproc_resumed, [*resumed_args, "--load", f"{{runs}}/{name}-saved/step_5"],
                           (f"{name}-saved",))})
    return name


def _saved_and_resumed(parity, name: str) -> tuple[list[float], list[float]]:
    """The train losses of the saving run (which ended with step 10's checkpoint) and of the resumed one."""
    saved = parity.outcome(f"{name}-saved").check()
    assert (saved / "latest").read_text() == "step_10"
    return losses(saved), losses(parity.outcome(name).check())


DROPOUT = ["--hidden-dropout-prob", "0.1", "--attention-probs-dropout-prob", "0.1", "--eval-freq", "3"]
SAME_LAYOUT = [_save_then_resume(f"resume-{name}", (nproc, [*FOUR_LAYERS, *layout]), (nproc, [*FOUR_LAYERS, *layout]))
               for name, nproc, layout in [
                   ("single", 1, []), ("single-dropout", 1, DROPOUT),
                   ("tp2-pp2-dropout", 4, ["--tp", "2", "--pp", "2", *DROPOUT]),
                   ("sharding2-stage3-fp16", 2, ["--sharding", "2", "--sharding-stage", "3", "--fp16"])]]


@pytest.mark.parametrize("layout", SAME_LAYOUT)
def test_resume_in_the_same_layout_is_bitwise_identical(parity, layout):
    full, resumed = _saved_and_resumed(parity, layout)
    # exactly: same masters, AdamW states, scaler, RNG streams (dropout; the save at step 5 is not an
    # evaluation step) and data position
    assert resumed == full[5:]


ANOTHER_LAYOUT = [_save_then_resume(f"resume-{name}", (saved_n, [*FOUR_LAYERS, *saved]),
                                    (loaded_n, [*FOUR_LAYERS, *loaded]))
                  for name, saved, saved_n, loaded, loaded_n in [
                      ("tp2-pp2-to-dp2", ["--tp", "2", "--pp", "2"], 4, ["--dp", "2"], 2),
                      ("dp2-sharding2-stage3-to-tp2", ["--dp", "2", "--sharding", "2", "--sharding-stage", "3"], 4,
                       ["--tp", "2"], 2),
                      ("pp2-vpp2-to-pp1", ["--pp", "2", "--vpp", "2"], 2, [], 1)]]


@pytest.mark.parametrize("layout", ANOTHER_LAYOUT)
def test_resume_in_another_layout_continues_the_run(parity, reference4, layout):
    _, resumed = _saved_and_resumed(parity, layout)
    # the uninterrupted single-process run, steps 6-10 (fp32 round-off of the other layouts only)
    assert resumed == pytest.approx(reference4[0][5:], rel=1e-5)


_KILL_DURING_SECOND_SAVE = """
import os, runpy, signal, sys
from megatron.checkpoint.format import RankFileWriter
real_close = RankFileWriter.close
def close(self):
    real_close(self)
    if "step_10" in self._file.name:  # the first file of the second checkpoint is written: die as kill -9 would
        os.kill(os.getpid(), signal.SIGKILL)
RankFileWriter.close = close
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(tmp_path, parity):
    out = tmp_path / "killed"
    killed = subprocess.run([sys.executable, "-c", _KILL_DURING_SECOND_SAVE, *FOUR_LAYERS, "--save", str(out),
                             "--save-interval", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    assert (out / "latest").read_text() == "step_5" and not (out / "step_10").exists()
    assert (out / "step_10.tmp").is_dir()  # the partial save, never renamed into place
    full, _ = _saved_and_resumed(parity, "resume-single")  # the same run, uninterrupted
    resumed = run_here(*FOUR_LAYERS, "--load", str(out), "--save", str(tmp_path / "resumed"))  # the folder: step_5
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path / "resumed") == full[5:]


# TINY's first ten steps in a run that trains until it is stopped: the schedule pinned to TINY's (decay_steps
# 10), and data-loader workers, which a preemption signals with the rest of the process group.
_UNTIL_STOPPED = [*TINY, "--num-workers", "1", "--max-steps", "100000", "--lr-decay-iters", "10"]
parity_layouts({"dp2": (2, TINY)})  # the uninterrupted runs: this and the reference "tiny"


def _signal_the_group_at_step(command: list[str], step: int) -> tuple[int, str]:
    """Start ``command`` in a process group of its own and SIGTERM the whole group (as ``kill -- -PGID``,
    ``scancel`` or systemd would) once training step ``step`` is logged; its exit status and output."""
    process = popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # own session
    guard = threading.Timer(300, os.killpg, (process.pid, signal.SIGKILL))  # a hang fails the test, not the suite
    guard.start()
    output = []
    try:
        for line in process.stdout:
            output.append(line)
            if f" - global step {step}," in line:
                os.killpg(process.pid, signal.SIGTERM)
        process.wait()
    finally:
        guard.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, "".join(output)


@pytest.mark.shared_runs("dp2")
@pytest.mark.parametrize("nproc, uninterrupted", [(1, "tiny"), (2, "dp2")])
def test_sigterm_to_the_process_group_saves_and_the_run_resumes_bitwise(tmp_path, parity, nproc, uninterrupted):
    """SIGTERM to the run's whole process group, data-loader workers included (under torchrun: to torchrun's
    group; torchrun sends it on to each rank's group): the step finishes, the run saves and its ranks exit 0
    (torchrun itself exits 1: it re-raises the signal), and a resume from that save trains the losses of the
    run that was never stopped, bitwise."""
    out = tmp_path / "run"
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(nproc)]
    status, output = _signal_the_group_at_step([*launcher, str(ROOT / "pretrain_gpt.py"), *_UNTIL_STOPPED,
                                                "--save", str(out)], 3)
    assert status == (0 if nproc == 1 else 1), output[-3000:]
    stopped = int((out / "latest").read_text().removeprefix("step_"))
    assert 3 <= stopped < 10 and f"saving at step {stopped} and exiting" in output
    assert f"saved checkpoint {out / f'step_{stopped}'}" in output and "DataLoader worker" not in output
    assert ("Traceback" not in output) if nproc == 1 else ("ChildFailedError" not in output)  # every rank exited 0
    resume = [*_UNTIL_STOPPED, "--load", str(out), "--exit-interval", "10"]
    if nproc == 1:
        resumed = run_here(*resume, "--save", str(out))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    else:
        resumed = run(out, *resume, nproc=nproc)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming at step {stopped}" in resumed.stderr
    assert losses(out) == parity.curves(uninterrupted)[0]  # metrics.jsonl: the stopped run's steps, then the resumed


parity_layouts({"saved-dp2": (2, [*TINY, "--max-steps", "2", "--save-interval", "2"])})


@pytest.fixture(scope="module")
def saved_dp2(parity):
    """A 2-rank (dp 2) run folder saved at step 2: rank0.bin, rank1.bin (empty: a replica) and an RNG
    file per rank. Tests copy it (``_copy_run``) before damaging it."""
    return parity.outcome("saved-dp2").check()


def _copy_run(saved: Path, to: Path) -> Path:
    """The checkpoint of ``saved`` (step folders and latest, not its metrics) in a fresh run folder."""
    to.mkdir()
    shutil.copytree(saved / "step_2", to / "step_2")
    shutil.copy(saved / "latest", to / "latest")
    return to


def _flip(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _snapshot(folder: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


# name: (what to do to the copied step folder, nproc, the message every rank prints). Damage that the
# configuration layer finds (before any process group) runs on one rank; the unit tests cover the rest.
DAMAGE = {
    "missing": (None, 2, "no checkpoint at"),
    "truncated": (lambda d: (d / "rank0.bin").write_bytes((d / "rank0.bin").read_bytes()[:1000]), 2,
                  "the checkpoint is incomplete or damaged"),
    "bit-flip": (lambda d: _flip(d / "rank0.bin", 5000), 2, "rank0.bin: checksum mismatch in "),
    "rank1-rng": (lambda d: _flip(d / "rank1.rng.json"), 2, "rank1.rng.json does not match its checksum"),
    "other-model": (None, 2, "with hidden_size 128, but the saved run has 64: a setting of the model (its shape or "
                             "what it computes)"),
    "dangling-latest": (lambda d: (d.parent / "latest").write_text("step_9"), 1, "which holds no checkpoint"),
    "config": (lambda d: _flip(d / "config.yaml", 10), 1, "config.yaml does not match its checksum"),
    # the folder belongs to another run (--load saved-dp2 --save X), or another live run holds X's lock
    "another-run": (lambda d: (d.parent / "run.json").write_text('{"run_id": "0123456789abcdef"}'), 2,
                    "holds another run (run 0123456789abcdef, latest step_2), and a run loaded from"),
    "live-writer": (None, 2, "another run is writing to"),
}


@pytest.fixture(scope="module")
def damaged(saved_dp2, tmp_path_factory) -> dict[str, tuple]:
    """Every DAMAGE case on its own copy of the run, launched with ``--save X --load X`` (the ranks of one
    world size in one launch; the one-process cases, which stop before any process group, in this process):
    name -> (the outcome, the copy, its files before the launch)."""
    root, cases = tmp_path_factory.mktemp("damaged"), {}
    for name, (harm, nproc, _) in DAMAGE.items():
        out = _copy_run(saved_dp2, root / name)
        if harm is not None:
            harm(out / "step_2")
        load = {"missing": root / "nowhere", "another-run": saved_dp2}.get(name, out)
        extra = ["--hidden-size", "128"] if name == "other-model" else []
        if name == "live-writer":  # a run writing there now (a lock belongs to the open file: this one)
            writer = open(out / "run.lock", "w")
            fcntl.flock(writer, fcntl.LOCK_EX | fcntl.LOCK_NB)
        cases[name] = (nproc, out, _snapshot(out), [*TINY, *extra, "--save", str(out), "--load", str(load)])
    results = {}
    try:
        for nproc in {case[0] for case in cases.values()}:
            batch = {name: case for name, case in cases.items() if case[0] == nproc}
            if nproc == 1:  # stopped by the configuration layer, before any process group: in this process
                launch = subprocess.CompletedProcess([], 0)
                for name, (_, _, _, args) in batch.items():
                    logs = root / f"{name}-logs"
                    logs.mkdir()
                    done = run_here(*args)
                    (logs / "rank0.log").write_text(done.stderr)
                    (logs / "rank0.out").write_text(done.stdout)
                    (logs / "rank0.rc").write_text(str(done.returncode))
            else:
                launch = run_several([(root / f"{name}-logs", case[3]) for name, case in batch.items()], nproc)
            results.update({name: (outcome(root / f"{name}-logs", nproc, launch), out, before)
                            for name, (_, out, before, _) in batch.items()})
    finally:
        writer.close()
    return results


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_bad_checkpoint_stops_every_rank_before_anything_is_written(damaged, damage):
    """``--save X --load X`` on a damaged X (or --load of a folder that is not there, or of another run's
    checkpoint into X, or X locked by a live run): every rank stops with the same one line (exit 2), and
    nothing in X is written, created or removed."""
    _, nproc, message = DAMAGE[damage]
    result, out, before = damaged[damage]
    for rank in range(nproc):
        log = (result.out / f"rank{rank}.log").read_text()
        assert (result.out / f"rank{rank}.rc").read_text() == "2", result.log[-3000:]
        assert log.count("pretrain_gpt.py: error: ") == 1, result.log[-3000:]
        assert log.count(message) == 1  # every rank says why; none waits in a collective
        assert "Traceback" not in log  # no traceback from our code
    assert _snapshot(out) == before  # nothing written (no metrics.jsonl, no config.yaml, no checkpoint)


def _records(out: Path, split: str) -> list[int]:
    return [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def test_save_and_load_the_same_folder_starts_fresh_resumes_and_keeps_each_step_once(tmp_path):
    """Megatron's ``--save X --load X``: the first launch finds no checkpoint in X (only the metrics of a
    run that never saved) and starts from scratch; the next resumes from X's latest; a resume from an
    earlier step into X drops X's later records from metrics.jsonl before writing its own."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"split": "train", "step": 1, "loss": 9.9}\n{"split": "tr')
    (out / "config.yaml").write_text("not: [a checkpoint\n")
    schedule = [*TINY, "--save-interval", "3", "--load"]
    first = run_here(*schedule, str(out), "--max-steps", "3", "--save", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"no checkpoint in {out}: starting from scratch" in first.stderr
    assert (out / "latest").read_text() == "step_3" and _records(out, "train") == [1, 2, 3]
    second = run_here(*schedule, str(out), "--max-steps", "6", "--save", str(out))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"loaded checkpoint {out / 'step_3'}: resuming at step 3" in second.stderr
    assert (out / "latest").read_text() == "step_6"
    continued = losses(out)[3:]
    again = run_here(*schedule, str(out / "step_3"), "--max-steps", "6", "--save", str(out))  # 4-6 again, into X
    assert again.returncode == 0, again.stderr[-3000:]
    assert "dropped 7 record(s) of an earlier run past step 3" in again.stderr  # train, valid, test and save
    assert _records(out, "train") == [1, 2, 3, 4, 5, 6]
    assert _records(out, "valid") == [3, 5, 6] and _records(out, "test") == [3, 6]
    assert losses(out)[3:] == continued  # the same steps, bitwise


def _unprivileged() -> None:
    """In the child, before exec: as root, drop the capabilities that bypass file permissions (so a
    folder without write permission is one, as for any other user)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP: the exec'ed python has none of them


def _unremovable_tmp(out: Path) -> None:
    (out / "step_4.tmp").mkdir()
    (out / "step_4.tmp" / "rank0.bin").touch()
    (out / "step_4.tmp").chmod(0o500)


def _latest_a_directory(out: Path) -> None:
    (out / "latest").unlink()
    (out / "latest").mkdir()


OBSTACLES = {  # name: (what is in the way, nproc, with --load, the message)
    "output-is-a-file": (lambda out: out.write_text("x"), 1, False, "is a file; give --save a folder"),
    "latest-is-a-directory": (_latest_a_directory, 1, False,
                              "latest is in the way: the run writes a file there but it is a directory"),
    "tmp-is-a-file": (lambda out: (out / "step_4.tmp").write_text("x"), 2, True, "step_4.tmp is in the way of saves"),
    "tmp-cannot-be-removed": (_unremovable_tmp, 1, True,
                              "step_4.tmp, the folder of an interrupted save (Permission denied)"),
    "not-writable": (lambda out: out.chmod(0o500), 1, True, "is not writable (Permission denied)"),
}


def _prepare(obstacle: str, out: Path, saved: Path):
    """The run folder ``out`` with the obstacle in place; what is there before the run."""
    if obstacle != "output-is-a-file":
        _copy_run(saved, out)
    OBSTACLES[obstacle][0](out)
    return _snapshot(out) if out.is_dir() else out.read_text()


def _unblock(out: Path) -> None:
    for path in (out, out / "step_4.tmp"):
        if path.is_dir():
            path.chmod(0o755)


@pytest.fixture(scope="module")
def blocked(saved_dp2, tmp_path_factory) -> dict[str, tuple]:
    """The one-process OBSTACLES, each in its own copy of the run, launched in turn by one unprivileged process
    (``run_several``): name -> (the outcome, the folder, what was there before)."""
    root, cases = tmp_path_factory.mktemp("blocked"), {}
    for name, (_, nproc, with_load, _) in OBSTACLES.items():
        if nproc == 1:
            out = root / name / "run"
            (root / name).mkdir()
            cases[name] = (out, _prepare(name, out, saved_dp2),
                           [*TINY, "--save", str(out), *(["--load", str(out)] if with_load else [])])
    try:
        launch = run_several([(root / f"{name}-logs", args) for name, (_, _, args) in cases.items()], 1,
                             preexec_fn=_unprivileged)
    finally:
        for out, _, _ in cases.values():
            _unblock(out)
    return {name: (outcome(root / f"{name}-logs", 1, launch), out, before) for name, (out, before, _) in cases.items()}


def _unchanged(out: Path, before) -> None:
    assert (_snapshot(out) if out.is_dir() else out.read_text()) == before  # nothing written or removed
    if out.is_dir():
        assert CheckpointReader(str(out / "step_2")).verify_all()[0] > 0  # the checkpoint is whole: every checksum


@pytest.mark.skipif(sys.platform != "linux", reason="drops root's capabilities with prctl")
@pytest.mark.parametrize("obstacle", [name for name, case in OBSTACLES.items() if case[1] == 1])
def test_an_unusable_output_folder_stops_the_run_at_start(blocked, obstacle):
    """Checked before training (rank 0, agreed by every rank): one line, exit 2, nothing lost."""
    result, out, before = blocked[obstacle]
    log = (result.out / "rank0.log").read_text()
    assert result.returncode == 2, result.log[-3000:]
    assert log.count("pretrain_gpt.py: error: ") == log.count(OBSTACLES[obstacle][3]) == 1, result.log[-3000:]
    assert "global step" not in log  # stopped before training
    _unchanged(out, before)


@pytest.mark.skipif(sys.platform != "linux", reason="drops root's capabilities with prctl")
def test_an_unusable_output_folder_under_torchrun_is_one_line_for_the_job(tmp_path, saved_dp2):
    """The same under torchrun (2 ranks): rank 0's line, once for the job, exit 1 from torchrun."""
    out = tmp_path / "run"
    before = _prepare("tmp-is-a-file", out, saved_dp2)
    message = OBSTACLES["tmp-is-a-file"][3]
    try:
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", str(ROOT / "pretrain_gpt.py"), *TINY, "--save", str(out), "--load", str(out)],
                                cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=_unprivileged)
    finally:
        _unblock(out)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("pretrain_gpt.py: error: ") == result.stderr.count(message) == 1, \
        result.stderr[-3000:]  # agreed by every rank, said once per job (rank 0's line under torchrun)
    assert "global step" not in result.stderr
    _unchanged(out, before)


parity_layouts({"keep-last-2": (1, [*TINY, "--save-interval", "2", "--keep-last-checkpoints", "2"]),
                "finetune": (1, [*TINY, "--load", "{runs}/keep-last-2", "--finetune"], ("keep-last-2",))})


@pytest.mark.parametrize("layout", ["finetune"])
def test_keep_last_checkpoints_and_finetune_from_weights_only(parity, layout):
    saved = parity.outcome("keep-last-2").check()
    assert sorted(p.name for p in saved.glob("step_*")) == ["step_10", "step_8"]
    fresh = losses(saved)
    tuned = parity.outcome(layout)
    assert "weights only (finetune)" in tuned.log
    tuned_losses = losses(tuned.check())
    assert len(tuned_losses) == 10  # the step count starts again from zero, with a new optimizer
    assert tuned_losses[0] < fresh[0] - 0.1  # but from the trained weights


# saved by 2 ranks, resumed by 1 (no launch waits for one of a smaller world size); one micro-batch a step
REPAD = [_save_then_resume(f"repad-{name}", (2, [*FOUR_LAYERS, *whole_share(), "--vocab-size", "300", *head, "--tp",
                                                 "2"]),
                           (1, [*FOUR_LAYERS, *whole_share(), "--vocab-size", "300", *head]))
         for name, head in [("tied", []), ("untied", ["--untie-embeddings-and-output-weights"])]]


@pytest.mark.parametrize("layout", REPAD)
def test_resume_under_another_tp_repads_the_vocabulary(parity, layout):
    """Vocabulary 300 pads to 512 rows at tp 2 and to 384 at tp 1: the rows past 300 are padding (of the
    word embedding, and of the untied output layer)."""
    full, resumed = _saved_and_resumed(parity, layout)
    assert resumed == pytest.approx(full[5:], rel=1e-5)


EXITS = {"exit-duration": (["--exit-duration-in-mins", "0.0001"], "exit_duration_in_mins (0.0001) reached", 1),
         "exit-interval": (["--exit-interval", "3"], "exit_interval (3) reached", 3)}
parity_layouts({name: (1, [*TINY, "--max-steps", "100000", *flags]) for name, (flags, _, _) in EXITS.items()})


@pytest.mark.parametrize("layout", list(EXITS))
def test_exit_duration_and_interval_save_and_exit_0(parity, layout):
    _, reason, step = EXITS[layout]
    result = parity.outcome(layout)
    out = result.check()
    assert f"{reason}: saving at step {step} and exiting" in result.log
    assert (out / "latest").read_text() == f"step_{step}"
