"""Run a function in N processes over gloo on the CPU, for tests.

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on ``world_size`` ranks that
have joined one default process group, and returns the per-rank return values (picklable). The ranks are a
pool, started once per world size and reused by every call: starting a process that imports torch costs
seconds on a small machine, a call milliseconds. Between calls each rank is put back as it was: the rank grid
(``parallel_state``) destroyed with its process groups (and any group ``fn`` created itself), so that a rank's
threads and sockets do not grow with the calls it serves (``test_group_lifecycle.py``); the environment, the
working folder, torch's default dtype and the global RNG restored. A rank that raises fails the test with its
traceback; a rank that is still running after ``timeout`` seconds prints every thread's stack (faulthandler) and
exits, and the test fails instead of hanging. After any failure the pool is discarded (a rank may be left inside a
collective), and the next call starts a fresh one. A test that patches a module inside ``fn`` undoes it before
returning.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CONTEXT = mp.get_context("spawn")
_GRACE_S = 5.0  # after a rank failed: how long the others may take to report (their own error) before the pool goes


def _call(rank: int, world_size: int, fn: Callable, args: tuple, timeout: float) -> tuple[str, Any]:
    """``fn`` on this rank, then the rank put back as it was."""
    from megatron import parallel_state

    environ, cwd, dtype, rng = dict(os.environ), os.getcwd(), torch.get_default_dtype(), torch.get_rng_state()
    threads = _threads()
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        return "ok", fn(rank, world_size, *args)
    except BaseException:  # reported to the parent, which fails the test
        return "error", traceback.format_exc()
    finally:
        faulthandler.cancel_dump_traceback_later()
        parallel_state.destroy()  # the groups initialize() created, and with them their threads and sockets
        _destroy_other_groups()
        if _threads() > threads:  # a destroyed group's threads end with the group object: something holds one
            _release_hooked_tensors()
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        torch.set_default_dtype(dtype)
        torch.set_rng_state(rng)


def _destroy_other_groups() -> None:
    """Any group ``fn`` created itself (``dist.new_group``) and left: each holds gloo threads until destroyed."""
    from torch.distributed.distributed_c10d import GroupMember, _world

    for group in [g for g in _world.pg_map if g is not GroupMember.WORLD]:
        dist.destroy_process_group(group)


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if sys.platform.startswith("linux") else 0


def _release_hooked_tensors() -> None:
    """Free what parameters' gradient hooks keep alive. A hook that closes over its model (DataParallel's
    ``register_post_accumulate_grad_hook``) makes a cycle through autograd, which Python's collector does not
    see: the model, its buffers and the process groups it holds (three gloo threads each) would live as long as
    the rank. Emptied, the collector frees them."""
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and getattr(obj, "_post_accumulate_grad_hooks", None):
            obj._post_accumulate_grad_hooks.clear()
    gc.collect()


def _join(rank: int, world_size: int, store_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _serve(rank: int, world_size: int, store_dir: str, tasks, results) -> None:
    """A pool rank: join the group, then run each task sent until told to stop (None)."""
    try:
        _join(rank, world_size, store_dir)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while (task := tasks.get()) is not None:
        fn, args, timeout = task
        results.put((rank, *_call(rank, world_size, fn, args, timeout)))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.store_dir = tempfile.mkdtemp(prefix="gloo-pool-")
        self.tasks = [_CONTEXT.SimpleQueue() for _ in range(world_size)]
        self.results = _CONTEXT.Queue()
        self.procs = [_CONTEXT.Process(target=_serve, args=(r, world_size, self.store_dir, self.tasks[r], self.results),
                                       daemon=True) for r in range(world_size)]
        for proc in self.procs:
            proc.start()

    def run(self, fn: Callable, args: tuple, timeout: float) -> tuple[list[Any], list[str]]:
        for task in self.tasks:
            task.put((fn, args, timeout))
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = None  # set once a rank failed: the others get _GRACE_S more
        while len(outcomes) < self.world_size:
            try:
                rank, status, value = self.results.get(timeout=1.0)
                outcomes[rank] = (status, value)
                if status == "error" and deadline is None:
                    deadline = time.monotonic() + _GRACE_S
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in outcomes]
                if dead or (deadline is not None and time.monotonic() > deadline):
                    for r in range(self.world_size):
                        outcomes.setdefault(r, ("error", "no result (the rank died, timed out or is stuck)"))
        errors = [f"rank {r}:\n{value}" for r, (status, value) in sorted(outcomes.items()) if status == "error"]
        return [outcomes[r][1] for r in range(self.world_size)], errors

    def close(self) -> None:
        """Kill the ranks: they hold nothing to save, and a rank may be stuck in a collective."""
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.join()
        shutil.rmtree(self.store_dir, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}


@atexit.register
def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    pool = _POOLS.get(world_size) or _POOLS.setdefault(world_size, _Pool(world_size))
    results, errors = pool.run(fn, args, timeout)
    if errors:
        _POOLS.pop(world_size).close()  # a rank may be inside a collective: start afresh next time
        print("\n".join(errors), file=sys.stderr)
        raise AssertionError("distributed test failed:\n" + "\n".join(errors))
    return results
