"""The output folder must be one folder for every rank when the run checkpoints (gloo, 2 processes).

Each rank writes its part of a checkpoint into rank 0's ``step_N.tmp``; a per-node local folder would
fail the first save, after the training. The start-up check says so on every rank, before any step.
"""

from __future__ import annotations

import os

import torch

from megatron.checkpoint import CheckpointError, check_output_dir, ownership
from tests.distributed.harness import run_distributed

CPU = torch.device("cpu")


def _check(rank: int, world_size: int, root: str, shared: bool, saves: bool) -> str | None:
    folder = os.path.join(root, "out" if shared else f"node{rank}")
    try:
        check_output_dir(folder, rank, CPU, saves)
    except CheckpointError as err:
        return str(err)
    finally:
        ownership.release(folder)  # the run's end (pretrain's): its lock (rank 0's run.lock) goes
    return None


def test_a_folder_that_is_not_shared_stops_every_rank_before_training(tmp_path):
    first, second = run_distributed(_check, 2, str(tmp_path), False, True)
    assert first == second and "is not the one rank 0 writes to (rank 1 on " in first
    assert "give --save a shared folder" in first and "--no-save-at-end" in first
    assert not os.path.exists(tmp_path / "node0" / ".shared_check")  # nothing left behind


def test_a_shared_folder_or_a_run_that_never_saves_passes(tmp_path):
    assert run_distributed(_check, 2, str(tmp_path), True, True) == [None, None]
    assert os.listdir(tmp_path / "out") == []
    assert run_distributed(_check, 2, str(tmp_path), False, False) == [None, None]
