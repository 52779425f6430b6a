"""Asynchronous saves (``--async-save``): training stops only for a copy to host memory.

A save runs the phases of ``save_load.save_checkpoint``, split across time:

1. **Begin** (main thread, every rank, collective): rank 0 makes ``step_N.tmp`` empty; each rank copies the
   pieces it writes (``save_load.rank_pieces``: its master slices and their AdamW states) into one reusable
   host staging buffer (pinned when the device is a GPU: ``device.host_buffer``) and takes its RNG streams.
   This is all training waits for.
2. **Write** (a background thread per rank): ``rank{r}.bin`` (with its CRC-32s, fsync'ed) and
   ``rank{r}.rng.json`` from the staging buffer, while the next steps train. No collective runs here.
3. **Seal** (main thread, every rank, collective): at a step boundary once every rank's write is done (one
   small all-reduce per step while a write is pending, ``poll``), the pieces are gathered to rank 0, which
   writes ``common.json``, ``config.yaml`` and ``metadata.json``, renames the folder into place, points
   ``latest`` at it and prunes: ``save_load.Save.seal``, the synchronous save's own code.

Why the collectives stay on the main thread: a collective issued by a background thread on the training's
process group would interleave with the training's collectives in an order that differs between ranks (a
hang or a mixed-up message); a separate group for checkpoints would avoid that at the cost of one more
process group per run and a second communicator per GPU. The per-step poll is one all-reduce of one number.

A writer failure (a read-only folder, a full disk) is caught in the thread and becomes, at the next step
boundary, the same one-line CheckpointError on every rank (``run_dir.first_failure``); ``step_N.tmp`` is
removed and the previous checkpoint and ``latest`` are untouched. A kill at any moment leaves
``step_N.tmp`` unrenamed: the previous checkpoint stays the one ``latest`` names.
"""

from __future__ import annotations

import threading
import time

import torch

from megatron import device as dev
from megatron.checkpoint.run_dir import all_ranks_ok, one_line, ranks_with
from megatron.checkpoint.save_load import (
    Save,
    after_a_failed_save,
    begin_save,
    rank_pieces,
    rng_state,
    write_rank_files,
)


def _write_files(tmp: str, rank: int, pieces: list, rng: dict) -> tuple[list, dict]:
    """The background thread's work: this rank's files (a module function, so that tests can hook it)."""
    return write_rank_files(tmp, rank, pieces, rng)


class PendingSave:
    """A save whose rank files a background thread is writing."""

    def __init__(self, save: Save, began: float, thread_args: tuple):
        self.save, self.began = save, began
        self.blocked_s = time.perf_counter() - began  # training waited for the staging copy
        self.written: tuple[list, dict] | None = None
        self.error: str | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._write, args=thread_args, name=f"checkpoint-writer-{save.step}",
                                       daemon=True)
        self.thread.start()

    def _write(self, *args) -> None:
        try:
            self.written = _write_files(*args)
        except BaseException as err:  # noqa: BLE001 - reported on every rank at the next step boundary
            self.error = one_line(err, f"cannot save {self.save.final}", after_a_failed_save(self.save.output_dir))
        finally:
            self.done.set()


class AsyncSaver:
    """One rank's background checkpoint writer: at most one save pending, one staging buffer reused."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer: torch.Tensor | None = None
        self.pending: PendingSave | None = None

    def begin(self, output_dir: str, step: int, model, optimizer, ps, config, train_state: dict) -> None:
        """Stage this rank's pieces and start writing them (collective; no save may be pending)."""
        assert self.pending is None, "finish the pending save first"
        began = time.perf_counter()
        save = begin_save(output_dir, step, optimizer, ps, config, train_state)
        staged = save.agreed(lambda: self._stage(rank_pieces(model, optimizer, ps)))
        self.pending = PendingSave(save, began, (save.tmp, ps.rank, staged, rng_state()))

    @torch.no_grad()
    def _stage(self, pieces) -> list:
        """Copy ``pieces`` into the staging buffer (grown only when a save needs more room); the
        (description, view) pairs the writer reads."""
        pieces = list(pieces)
        total = sum(tensor.numel() for _, tensor in pieces)
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = None  # the old one is freed before the new one is taken
            self.buffer = dev.host_buffer(total, self.device)
        staged, at = [], 0
        for description, tensor in pieces:
            view = self.buffer[at:at + tensor.numel()]
            view.copy_(tensor.reshape(-1), non_blocking=True)
            staged.append((description, view))
            at += tensor.numel()
        dev.wait_for_copies(self.device)
        return staged

    def poll(self) -> bool:
        """Whether every rank's write is done (a step boundary; collective while a save is pending)."""
        if self.pending is None:
            return False
        return ranks_with(self.pending.done.is_set(), self.device) == self.pending.save.ps.world_size

    def finish(self) -> tuple[int, str, float, float]:
        """Wait for this rank's write, then seal the save (collective): (its step, its folder, the seconds
        training was blocked by it: the staging copy, this wait and the seal, the seconds from its start to its
        seal). A writer's failure on any rank raises the same one-line CheckpointError on every rank."""
        pending, self.pending = self.pending, None
        waited = time.perf_counter()
        pending.done.wait()
        try:
            all_ranks_ok(pending.error, self.device)
        except Exception:
            pending.save.abort()
            raise
        path, now = pending.save.seal(pending.written), time.perf_counter()
        return pending.save.step, path, pending.blocked_s + now - waited, now - pending.began

    def close(self) -> None:
        """The run ends abnormally (it raised; a second Ctrl-C): the save is dropped unsealed (no collective now).
        Its writer is a daemon thread, not waited for: its ``step_N.tmp`` is never renamed into place and is
        removed when a run next claims the folder."""
        self.pending = None
