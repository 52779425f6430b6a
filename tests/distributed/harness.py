"""Run a function in N processes over gloo on the CPU, for tests.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, each joining one
process group through a FileStore in a fresh temporary folder, calls ``fn(rank, world_size,
*args)``, and returns the per-rank return values (picklable). A rank that raises fails the
test with its traceback; a rank that is still running after ``timeout`` seconds prints every
thread's stack (faulthandler) and the test fails instead of hanging.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store_dir: str, fn: Callable, args: tuple, timeout: float) -> None:
    faulthandler.dump_traceback_later(timeout, exit=True)
    torch.set_num_threads(1)
    result_path = os.path.join(store_dir, f"result{rank}.pkl")
    try:
        store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        outcome = ("ok", value)
    except BaseException:  # reported to the parent, which fails the test
        outcome = ("error", traceback.format_exc())
    finally:
        from megatron import parallel_state

        parallel_state.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(result_path, "wb") as f:
        pickle.dump(outcome, f)
    faulthandler.cancel_dump_traceback_later()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    with tempfile.TemporaryDirectory() as store_dir:
        context = mp.start_processes(_worker, args=(world_size, store_dir, fn, args, timeout), nprocs=world_size,
                                     join=False, start_method="spawn")
        try:
            while not context.join(timeout=timeout + 30):
                pass
        except mp.ProcessExitedException as err:
            raise AssertionError(f"a rank died (exit code {err.exit_code}); see its stack above") from None
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(store_dir, f"result{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: no result (killed or timed out)")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if errors:
            print("\n".join(errors), file=sys.stderr)
            raise AssertionError("distributed test failed:\n" + "\n".join(errors))
        return results
