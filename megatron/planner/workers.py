"""The planner's candidates shared among processes: a search on many devices evaluates hundreds of thousands of
layouts, each independent of the others, so ``jobs`` processes share them, a slice (a run of whole blocks of
candidates) at a time.

Neighbouring slices share most of their cached figures (the candidates are ordered by tp, cp, pp, ...), so each
process starts on its own contiguous part of the slices and walks it from the front; a process whose part is
done takes slices from the back of the part with the most left (work stealing), so they finish together and the
cached figures are computed about once over all processes.

The processes are forked: they inherit the candidates and the configuration, and send back only each slice's
result (``pack``: plain tuples); where the platform cannot fork, or ``jobs`` is 1, the slices run here in order.
The results are returned in slice order, whatever order they were computed in. ``work(start, stop, before)``
gets ``before``: the results of the slices before this one in candidate order that this process has computed
(a process that took slices out of order sees only some of them), which is all the search may rely on.
"""

from __future__ import annotations

import multiprocessing
import queue
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")
SLICES_PER_JOB = 16  # enough slices that the processes finish together, few enough that each is worth a message
SLICES_ALONE = 100  # one process: a slice per percent, for the progress report
POLL_S = 1.0  # how often the parent checks that the processes are alive while it waits


def group(blocks: list[tuple[int, int]], slices: int) -> list[tuple[int, int]]:
    """Consecutive ``blocks`` (start, stop) joined into about ``slices`` slices of similar length; a block is
    never cut."""
    if not blocks:
        return []
    total = blocks[-1][1] - blocks[0][0]
    target, joined, start = max(1, total // max(1, slices)), [], blocks[0][0]
    for _, stop in blocks:
        if stop - start >= target:
            joined.append((start, stop))
            start = stop
    if start < blocks[-1][1]:
        joined.append((start, blocks[-1][1]))
    return joined


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def _take(bounds, lock, part: int) -> int | None:
    """The next slice for the process of ``part``: its own part's front, else the back of the part with the most
    slices left; None when none is left. ``bounds``: [front, back) of each part, shared."""
    with lock:
        parts = len(bounds) // 2
        if bounds[2 * part] < bounds[2 * part + 1]:
            bounds[2 * part] += 1
            return bounds[2 * part] - 1
        left = [bounds[2 * p + 1] - bounds[2 * p] for p in range(parts)]
        richest = max(range(parts), key=left.__getitem__)
        if left[richest] <= 0:
            return None
        bounds[2 * richest + 1] -= 1
        return bounds[2 * richest + 1]


def _worker(work, pack, slices, bounds, lock, results, part: int) -> None:
    done: dict[int, Any] = {}  # slice index -> result, of this process
    try:
        while (k := _take(bounds, lock, part)) is not None:
            start, stop = slices[k]
            result = work(start, stop, [done[j] for j in sorted(done) if j < k])
            done[k] = result
            results.put((k, pack(result, start) if pack is not None else result))
    except BaseException:  # noqa: B036 - reported to the parent, which raises it
        results.put((-1, traceback.format_exc()))


def map_slices(work: Callable[[int, int, list[R]], R], blocks: list[tuple[int, int]], jobs: int,
               done: Callable[[int], None] | None = None, pack: Callable[[R, int], Any] | None = None,
               unpack: Callable[[Any], R] | None = None) -> list[R]:
    """``work(start, stop, before)`` of slices that cover ``blocks``, in ``jobs`` processes; the results in slice
    order. ``done(n)``: told the candidates of each slice as it finishes. ``pack(result, start)`` / ``unpack``:
    what a forked process sends instead of a result, and the result again (cheaper to pickle)."""
    jobs = jobs if can_fork() else 1
    slices = group(blocks, SLICES_ALONE if jobs == 1 else jobs * SLICES_PER_JOB)
    if jobs == 1 or len(slices) == 1:
        results: list[R] = []
        for start, stop in slices:
            results.append(work(start, stop, results))  # every slice before it
            if done is not None:
                done(stop - start)
        return results
    jobs = min(jobs, len(slices))
    ctx = multiprocessing.get_context("fork")
    cuts = [round(len(slices) * p / jobs) for p in range(jobs + 1)]
    bounds = ctx.Array("l", [x for p in range(jobs) for x in (cuts[p], cuts[p + 1])], lock=False)
    lock, results_queue = ctx.Lock(), ctx.Queue()
    processes = [ctx.Process(target=_worker, args=(work, pack, slices, bounds, lock, results_queue, p), daemon=True)
                 for p in range(jobs)]
    got: dict[int, R] = {}
    try:
        for process in processes:
            process.start()
        while len(got) < len(slices):
            try:
                k, result = results_queue.get(timeout=POLL_S)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in processes) or all(p.exitcode == 0 for p in processes):
                    raise RuntimeError("a planner worker process died before it sent its results") from None
                continue
            if k < 0:
                raise RuntimeError(f"a planner worker process failed:\n{result}")
            got[k] = result if unpack is None else unpack(result)
            if done is not None:
                done(slices[k][1] - slices[k][0])
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
    return [got[k] for k in range(len(slices))]
