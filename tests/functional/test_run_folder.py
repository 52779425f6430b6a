"""A run folder belongs to one run (``megatron/checkpoint/ownership.py``), as a user meets it: a fresh run, a
``--load A --save B`` or a ``--finetune`` into a folder holding another run is refused in one line (exit 2,
nothing written, removed or trimmed); a resume of the same run (its own folder, or an empty one) goes on, and
``--overwrite-output-dir`` replaces the other run. A second live writer is refused while the first holds the
folder's lock. All in this process (``run_here``), tiny runs of two steps."""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

import pytest

from megatron.checkpoint import CheckpointReader
from megatron.checkpoint.resume import resumed_config
from tests.functional.launch import TINY, run_here


def tiny(steps: int, *extra: str) -> list[str]:
    args = list(TINY)
    args[args.index("--max-steps") + 1] = str(steps)
    return [*args, "--eval-iters", "0", *extra]


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` (but the lock, which records its last holder) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "run.lock"}  # (a refused run's test holds it)


def run_id(folder: Path) -> str:
    return json.loads((folder / "run.json").read_text())["run_id"]


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Run A: two steps, a checkpoint after each (step_1, step_2), its metrics."""
    out = tmp_path_factory.mktemp("runs") / "A"
    result = run_here(*tiny(2, "--save", str(out), "--save-interval", "1"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def copy(saved: Path, to: Path) -> Path:
    shutil.copytree(saved, to)
    return to


def test_a_new_run_into_a_folder_holding_another_is_refused(saved, tmp_path):
    a = copy(saved, tmp_path / "A")
    before = snapshot(a)
    for extra, why in (([], "a run without --load is a new run"),
                       (["--load", str(a), "--finetune"], "a --finetune run is a new run")):
        line = error_line(run_here(*tiny(3, "--save", str(a), "--seed", "7", *extra)))
        assert f"{a} holds another run (run {run_id(a)}, latest step_2) and {why}" in line
        assert f"resume that run with --load {a}, give --save another folder, or pass --overwrite-output-dir" in line
        assert snapshot(a) == before  # no step folder replaced, latest and metrics.jsonl as they were


def test_load_a_save_b_is_refused_when_b_holds_another_run_and_branches_into_an_empty_b(saved, tmp_path):
    a, b = saved, copy(saved, tmp_path / "B")
    (b / "run.json").write_text(json.dumps({"run_id": "0123456789abcdef"}))  # B: another run's folder
    before = snapshot(b)
    line = error_line(run_here(*tiny(3, "--load", str(a), "--save", str(b))))
    assert (f"{b} holds another run (run 0123456789abcdef, latest step_2), and a run loaded from {a} that saves "
            f"elsewhere is a new run (a branch)") in line
    assert snapshot(b) == before  # metrics.jsonl not trimmed, latest not repointed

    c = tmp_path / "C"  # an empty folder: the branch continues there as a run of its own
    result = run_here(*tiny(3, "--load", str(a / "step_1"), "--save", str(c)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert run_id(c) not in (None, run_id(a))
    assert CheckpointReader(str(c / "step_3")).common()["train_state"]["run_id"] == run_id(c)
    before = snapshot(c)  # another branch of A into C is refused: C's steps are never spliced with another's
    line = error_line(run_here(*tiny(3, "--load", str(a / "step_1"), "--save", str(c), "--lr", "1e-3")))
    assert f"{c} holds another run (run {run_id(c)}, latest step_3)" in line and snapshot(c) == before


def test_overwrite_output_dir_replaces_the_other_run_and_is_not_inherited(saved, tmp_path):
    a = copy(saved, tmp_path / "A")
    old = run_id(a)
    result = run_here(*tiny(1, "--save", str(a), "--overwrite-output-dir"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"--overwrite-output-dir: deleted the earlier run in {a} (run {old}, latest step_2)" in result.stderr
    assert sorted(p.name for p in a.glob("step_*")) == ["step_1"] and run_id(a) != old
    records = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in records] == [("train", 1), ("save", 1)]  # only the new run's
    assert not resumed_config(["--load", str(a)]).save_load.overwrite_output_dir  # a resume asks again


def test_a_second_live_writer_is_refused_until_the_first_ends(saved, tmp_path):
    a = copy(saved, tmp_path / "A")
    before = snapshot(a)
    with open(a / "run.lock", "w") as held:  # another process's lock (flock: per open file, even here)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242 on node7 since 2026-01-01 00:00:00\n")
        held.flush()
        line = error_line(run_here(*tiny(3, "--load", str(a), "--save", str(a))))
    assert (f"another run is writing to {a} (pid 4242 on node7 since 2026-01-01 00:00:00, holding {a}/run.lock): "
            f"two runs in one folder would replace each other's checkpoints; wait for it to end, stop it, or give "
            f"--save another folder.") in line
    assert snapshot(a) == before  # its step_N.tmp (a save in progress) would not even have been removed
    result = run_here(*tiny(3, "--load", str(a), "--save", str(a)))  # the lock went with its holder
    assert result.returncode == 0, result.stderr[-3000:]
    assert (a / "latest").read_text() == "step_3" and not (a / "run.lock").exists()  # released at the end
