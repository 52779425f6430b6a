"""Data-loader workers leave the stop signals to the trainer: a preemption signals the whole process group,
and a worker that died of it would take the run's final save with it."""

from __future__ import annotations

import signal
import subprocess

import pytest

from megatron.data.loader import build_loader
from megatron.data.mock_dataset import MockGPTDataset
from megatron.training.stopping import SIGNALS

pytestmark = pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="POSIX signals (Linux)")


def _loader(stop_signals=SIGNALS):
    dataset = MockGPTDataset(64, 8, 32, seed=1)
    return build_loader(dataset, 0, 8, dataset.eod_id, True, num_workers=1, stop_signals=stop_signals)


def test_a_worker_ignores_the_stop_signals_of_others_and_ends_on_its_parents_sigterm():
    loader = _loader()
    expected = [b["tokens"] for b in build_loader(loader.dataset, 0, 8, loader.dataset.eod_id, True)]
    batches = iter(loader)
    got = [next(batches)["tokens"]]  # the worker runs
    worker = batches._workers[0]
    for sig in SIGNALS:  # as kill -- -PGID, scancel or torchrun would: from another process
        subprocess.run(["kill", f"-{signal.Signals(sig).name[3:]}", str(worker.pid)], check=True)
    got += [b["tokens"] for b in batches]  # the worker went on (a dead one: RuntimeError here)
    assert worker.is_alive() and len(got) == len(expected)
    assert all((a == b).all() for a, b in zip(got, expected))
    # its parent's SIGTERM (the DataLoader's own terminate, multiprocessing's at exit) still ends it
    worker.terminate()
    worker.join(timeout=60)
    assert worker.exitcode == 0

