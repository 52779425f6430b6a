"""Request batching for the server: one thread owns the engine and runs one batch at a time.

Why one thread: the engine is a collective over the tensor-parallel group and keeps a KV cache per
batch, so only one ``engine.stream`` may run at once. HTTP handlers (asyncio) ``submit`` jobs (a job
is one HTTP request: one row per prompt, any number of them); when the engine is idle the thread
takes queued rows, oldest job first, up to ``max_batch_size`` of them as one batch, so requests that
arrive while a batch runs share the next one, and 16 clients get about 16 times the tokens per step
of one. A job with more rows than the batch has room for runs in slices: the rows that fit now, the
rest queued again behind the jobs waiting (a request of thousands of prompts does not hold up the
others for its whole length). Each step's events go back to their job's asyncio queue with
``loop.call_soon_threadsafe`` (indices renumbered to the job's own rows), followed by ``DONE`` when
the job's last row ends, so a short request does not wait for the batch's longest. A job marked
``cancelled`` (its client went away) is skipped while queued and its rows are dropped by the engine
at the next step.

With tensor parallelism, rank 0 runs this scheduler and broadcasts each batch's requests before
running it; the other ranks ``follow``: receive a batch, run the same ``engine.stream``, repeat,
until the ``None`` batch. While idle, rank 0 sends an empty batch every ``KEEPALIVE_SECONDS`` so
the followers' waiting broadcast never reaches the process group's timeout.

Only requests the engine's ``check`` accepts are queued (the HTTP side checks every field first),
so a bad request never reaches a batch or a collective. A batch that fails anyway fails only its
own requests (a 500; a job with rows still to run is cancelled), and the server keeps serving: on
every rank when the engine raised ``BatchError`` (every rank left the batch at the same step); on
rank 0 alone when delivering the events failed, after which rank 0 cancels the batch's rows and runs
the engine to their end so the other ranks finish the batch with it. Any other error from the engine
under tensor parallelism may have left the ranks out of step (one inside a collective the others
skipped): the server stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.inference.engine import BatchError, Event, InferenceEngine, Request
from megatron.inference.sampling import RequestError
from megatron.metrics import get_logger

DONE = None  # put on a job's queue after its last row ended
KEEPALIVE_SECONDS = 60.0  # far below any process-group timeout
_ids = itertools.count()


class BatchFailed(Exception):
    """The job has no result: the batch it ran in raised (HTTP ``status`` 500), or the server stopped
    before running it (503). The message is one line."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class Unavailable(RuntimeError):
    """The scheduler is stopping (or stopped after a fatal error) and takes no more jobs."""


class Job:
    """One submitted request: its rows and the asyncio queue its events arrive on.

    Queue items: a list of ``Event``/``PromptScores`` of one step (``index`` = row of this job),
    ``BatchFailed``, or ``DONE``."""

    def __init__(self, rows: list[Request], loop: asyncio.AbstractEventLoop):
        self.id = next(_ids)
        self.rows, self.loop = rows, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.taken = 0  # rows handed to batches so far (the scheduler thread's)
        self.left = len(rows)  # rows that have not ended yet

    def cancel(self) -> None:
        """Stop spending work on this job (its client is gone); safe from any thread, idempotent."""
        self.cancelled = True

    def put(self, item) -> None:
        """Hand ``item`` to the job's event loop (called from the scheduler thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled = True


@dataclass
class RowEnd:
    """How one row ended (kept for monitoring and tests)."""

    job: int
    row: int
    reason: str
    tokens: int


@dataclass
class Stats:
    batches: int = 0
    rows: int = 0
    largest_batch: int = 0
    tokens: int = 0


class Scheduler:
    """Owns ``engine`` on tensor-parallel rank 0: ``start()``, ``submit(rows)`` from the event loop,
    ``stop()``. ``on_fatal`` is called (from the scheduler thread) when it stops by itself."""

    def __init__(self, engine: InferenceEngine, max_batch_size: int = 32, keepalive_seconds: float = KEEPALIVE_SECONDS):
        if max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be at least 1, got {max_batch_size}.")
        self.engine, self.max_batch_size, self.keepalive_seconds = engine, max_batch_size, keepalive_seconds
        self.tp = engine.tp_size
        self.stats = Stats()
        self.ended: deque[RowEnd] = deque(maxlen=1024)
        self.error: str | None = None  # why the scheduler stopped by itself
        self.on_fatal = None
        self._pending: deque[Job] = deque()
        self._running: list[Job] = []
        self._stopping = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def submit(self, rows: list[Request]) -> Job:
        """Queue ``rows`` as one job (call from the event loop that will read its queue). Raises the
        engine's PromptError/ValueError for a bad row, so a bad request never reaches a batch."""
        if not rows:
            raise ValueError("a job has at least one row.")
        for row in rows:
            self.engine.check(row)
        job = Job(rows, asyncio.get_running_loop())
        with self._cv:
            if self._stopping or self.error:
                raise Unavailable(self.error or "the server is shutting down: send the request to another server.")
            self._pending.append(job)
            self._cv.notify()
        return job

    def stop(self, timeout: float | None = 30.0) -> None:
        """Cancel every job, end the thread (which sends the followers the ``None`` batch)."""
        with self._cv:
            self._stopping = True
            for job in [*self._pending, *self._running]:
                job.cancel()
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # The scheduler thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                batch = self._take()
                if batch is None:
                    break
                if batch:
                    self._generate(batch)
                else:
                    share_batch([], self.engine.device)  # keepalive
            if not self.error:
                share_batch(None, self.engine.device)
        except Exception as error:  # a bug here must not leave requests waiting forever
            self._die(f"the scheduler stopped: {_one_line(error)}", list(self._running))

    def _take(self) -> list[tuple[Job, int, int]] | None:
        """The next batch as (job, first row, end row) slices: oldest jobs first, at most ``max_batch_size``
        rows, a job that does not fit split (its rest queued again behind the others); [] on a keepalive
        timeout (tp > 1); None when stopping."""
        with self._cv:
            while True:
                while self._pending and self._pending[0].cancelled:
                    self._pending.popleft()
                if self._stopping or self.error:
                    for job in self._pending:
                        job.put(BatchFailed("the server is shutting down: send the request again.", 503))
                    self._pending.clear()
                    return None
                if self._pending:
                    break
                if not self._cv.wait(self.keepalive_seconds if self.tp > 1 else None):
                    return []
            batch, room = [], self.max_batch_size
            while self._pending and room:
                job = self._pending.popleft()
                if job.cancelled:
                    continue
                take = min(room, len(job.rows) - job.taken)
                batch.append((job, job.taken, job.taken + take))
                job.taken += take
                room -= take
                if job.taken < len(job.rows):
                    self._pending.append(job)
            self._running = [job for job, _, _ in batch]
            return batch

    def _generate(self, batch: list[tuple[Job, int, int]]) -> None:
        requests = [job.rows[i] for job, start, end in batch for i in range(start, end)]
        owner = [(job, i) for job, start, end in batch for i in range(start, end)]
        left = {job.id: end - start for job, start, end in batch}  # this batch's rows of each job not ended
        jobs = [job for job, _, _ in batch]
        produced = [0] * len(requests)
        self.stats.batches += 1
        self.stats.rows += len(requests)
        self.stats.largest_batch = max(self.stats.largest_batch, len(requests))
        failed: list[Exception] = []  # delivering the events failed: every row is cancelled at the next step
        try:
            share_batch(requests, self.engine.device)
            for items in self.engine.stream(requests, cancelled=lambda i: bool(failed) or owner[i][0].cancelled):
                if failed:
                    continue  # run the engine to the rows' end, in step with the other ranks
                try:
                    self._deliver(items, owner, left, produced)
                except Exception as error:
                    failed.append(error)
                    get_logger().exception(f"delivering a step's tokens failed: {_one_line(error)}")
        except (BatchError, RequestError) as error:  # raised at the same step on every rank
            failed.append(error)
        except Exception as error:
            message = f"generation failed: {_one_line(error)}"
            unfinished = [job for job in jobs if left[job.id] > 0]
            if self.tp > 1:  # the ranks may now be out of step: stop rather than risk a hang
                self._die(f"{message} (tp {self.tp}: the ranks may be out of step, so the server stops)", unfinished)
                return
            failed.append(error)
        finally:
            self.stats.tokens += sum(produced)
            self._running = []
        if failed:
            message = f"generation failed: {_one_line(failed[0])}"
            unfinished = [job for job in jobs if left[job.id] > 0]
            get_logger().error(f"{message}; failing the {len(unfinished)} request(s) of this batch",
                               exc_info=failed[0])
            for job in unfinished:
                job.cancel()  # its rows in later batches, if any, are not run
                job.put(BatchFailed(f"{message}: the server logged it and keeps serving; send the request again."))

    def _deliver(self, items: list, owner: list, left: dict, produced: list) -> None:
        """Hand one step's events to their jobs (``DONE`` after a job's last row, of whichever batch)."""
        by_job: dict[int, tuple[Job, list]] = {}
        for item in items:
            job, local = owner[item.index]
            by_job.setdefault(job.id, (job, []))[1].append(dataclasses.replace(item, index=local))
            if isinstance(item, Event):
                produced[item.index] += item.token is not None
                if item.finish_reason is not None:
                    left[job.id] -= 1
                    job.left -= 1
                    self.ended.append(RowEnd(job.id, local, item.finish_reason, produced[item.index]))
        for job, its in by_job.values():
            job.put(its)
            if job.left == 0:
                job.put(DONE)

    def _die(self, message: str, jobs: list[Job]) -> None:
        """Stop for good (called while handling the error): fail ``jobs`` and the queued ones."""
        get_logger().error(message, exc_info=True)
        with self._cv:
            self.error = message
            jobs = list(dict.fromkeys(jobs + list(self._pending)))  # a split job may be in both
            self._pending.clear()
        for job in jobs:
            job.put(BatchFailed(message))
        if self.on_fatal is not None:
            self.on_fatal()


def _one_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


# Tensor-parallel ranks other than 0 --------------------------------------------------------------

def share_batch(batch: list[Request] | None, device: torch.device) -> list[Request] | None:
    """Broadcast ``batch`` from rank 0 to every rank (a no-op on one rank); what rank 0 sent. The
    engine's ``device`` carries it under NCCL."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return batch
    box = [batch]
    dist.broadcast_object_list(box, src=0, device=device if dist.get_backend() == "nccl" else None)
    return box[0]


def follow(engine: InferenceEngine) -> None:
    """Tensor-parallel ranks > 0: run every batch rank 0 broadcasts, until it sends ``None``. The
    events are rank 0's to deliver; the engine takes the cancellation flags from rank 0 at every step."""
    while True:
        batch = share_batch(None, engine.device)
        if batch is None:
            return
        try:
            for _ in engine.stream(batch):  # the cancellations come from rank 0
                pass
        except (BatchError, RequestError) as error:  # every rank left this batch at the same step
            get_logger().error(f"rank {dist.get_rank()}: a batch failed ({_one_line(error)}); rank 0 fails its "
                               "requests and the server keeps serving", exc_info=error)
