"""When a run stops before its last step: a signal (SIGTERM, SIGUSR1, Ctrl-C), a time limit or an exit interval,
agreed by every rank so that all of them save at the same step."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron.config import Config

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # the training loader workers ignore them (data_loader)


class StopRequests:
    def __init__(self, config: Config, device: torch.device, world_size: int):
        self.exit_duration_in_mins = config.save_load.exit_duration_in_mins
        self.exit_interval = config.save_load.exit_interval
        self.device, self.world_size = device, world_size
        self.signal_name: str | None = None  # the name of the signal that asked the run to stop
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """The stop signals handled for the block, the previous handlers back however it ends (an in-process
        caller keeps its own)."""
        previous = {sig: signal.signal(sig, self.on_signal) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def on_signal(self, signum, frame) -> None:
        """SIGTERM, SIGUSR1, and a first SIGINT (Ctrl-C): save at the end of this step and exit 0. A second
        Ctrl-C stops at once (KeyboardInterrupt: one line, exit 130, nothing saved)."""
        if signum == signal.SIGINT and self.signal_name:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def reason(self, step: int) -> str | None:
        """Why this rank wants to stop after ``step``; None to go on."""
        if self.signal_name:
            hint = " (Ctrl-C again to stop at once, without saving)" if self.signal_name == "SIGINT" else ""
            return f"{self.signal_name} received{hint}"
        limit = self.exit_duration_in_mins
        if limit is not None and time.perf_counter() - self.started >= 60 * limit:
            return f"exit_duration_in_mins ({limit:g}) reached"
        if self.exit_interval and step % self.exit_interval == 0:
            return f"exit_interval ({self.exit_interval}) reached"
        return None

    def agreed(self, step: int) -> str | None:
        """Why the run stops after ``step`` (the same on every rank: an all-reduce of whether any rank wants
        to), or None to go on."""
        mine = self.reason(step)
        flag = torch.tensor([0.0 if mine is None else 1.0], device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return None
        return mine or "another rank received a stop signal"
