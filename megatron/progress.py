"""Progress of a long loop, on stderr: a bar on a terminal, a plain line every few seconds in a file or pipe.

    with Progress("preprocess", total=n_docs, unit="docs") as bar:
        for doc in docs:
            ...
            bar.update(1)

- On a terminal: tqdm's bar (tqdm comes with the core dependencies through ``tokenizers``), or a minimal
  ``\\r`` bar where tqdm cannot be imported.
- In a file or pipe (a log, a CI job, ``2> log``): one line every ``interval`` seconds, ``desc: done/total
  unit (pct%), rate, ETA`` (``done unit, rate`` when the total is unknown), and one closing line.
- Silent when ``enabled`` is false, and on every rank but 0 under torchrun (``RANK``, or the initialised default
  process group).

``total`` may be None (unknown) or set later (``set_total``). ``unit="B"`` formats counts as KiB / MiB / GiB.
``clock`` is injectable (tests pass a fake one; nothing here sleeps).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "is_rank_zero", "format_count", "format_seconds"]


def is_rank_zero() -> bool:
    """True on the process that reports: rank 0 of an initialised default group, else ``RANK`` (torchrun) 0."""
    dist = sys.modules.get("torch.distributed")  # never imports torch itself
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


def format_count(n: float, unit: str) -> str:
    """``1234 docs``; bytes (``unit="B"``) as ``1.21 KiB`` / ``3.40 MiB`` / ``1.02 GiB``."""
    if unit == "B":
        for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if n >= scale:
                return f"{n / scale:.2f} {name}"
        return f"{n:.0f} B"
    return f"{n:.0f} {unit}" if unit else f"{n:.0f}"


def format_seconds(seconds: float) -> str:
    """``0:07``, ``12:30``, ``2:05:09``."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _rate(done: float, elapsed: float, unit: str) -> str:
    if elapsed <= 0:
        return "-"
    rate = done / elapsed
    if unit != "B" and rate < 100:  # 0.2 tensors/s, 12.5 docs/s
        return f"{rate:.3g} {unit}/s" if unit else f"{rate:.3g}/s"
    return f"{format_count(rate, unit)}/s"


class Progress:
    """A progress report for one loop; see the module's docstring. A context manager (closes on exit)."""

    def __init__(self, desc: str, total: float | None = None, *, unit: str = "it", enabled: bool = True,
                 stream: TextIO | None = None, interval: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 bar: str | None = None, summary: bool = True):
        """``bar``: ``"tqdm"``, ``"simple"`` (the minimal terminal bar) or ``"lines"``; None picks by the stream
        (a terminal: tqdm where importable, else simple; otherwise lines). ``summary=False``: a loop that ends
        before its first periodic line says nothing (a small conversion stays quiet), and a terminal's bar is
        cleared when done."""
        self.desc, self.total, self.unit, self.interval, self.clock = desc, total, unit, interval, clock
        self.summary_always, self.lines = summary, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and is_rank_zero()
        self.done = 0
        self.postfix = ""
        self.start = self.last = clock()
        self.closed = False
        self._tqdm = None
        self._width = 0  # the simple bar's last line length (to blank a shorter one)
        if not self.enabled:
            self.mode = "off"
            return
        if bar is None:
            bar = "tqdm" if _isatty(self.stream) else "lines"
        if bar == "tqdm":
            try:
                from tqdm import tqdm
            except ImportError:
                bar = "simple"
            else:
                self._tqdm = tqdm(total=total, desc=desc, unit=unit, file=self.stream,
                                  unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                                  dynamic_ncols=True, leave=summary)
        if bar not in ("tqdm", "simple", "lines"):
            raise ValueError(f"Progress: bar must be 'tqdm', 'simple' or 'lines', not {bar!r}.")
        self.mode = bar

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(final=exc_type is None)

    def set_total(self, total: float | None) -> None:
        """The total, once known (or corrected)."""
        self.total = total
        if self._tqdm is not None:
            self._tqdm.total = total
            self._tqdm.refresh()

    def set_postfix(self, text: str) -> None:
        """A second count shown after the first (``12000 docs`` beside the bytes), in the bar and every line."""
        self.postfix = text
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(text, refresh=False)

    def update(self, n: float = 1) -> None:
        """``n`` more units done; reports if it is time to."""
        self.done += n
        if self.mode == "off" or self.closed:
            return
        if self._tqdm is not None:
            self._tqdm.update(n)
            return
        now = self.clock()
        if self.mode == "simple":
            if now - self.last >= min(self.interval, 0.2) or self._finished():
                self.last = now
                self._draw_simple(now)
        elif now - self.last >= self.interval:
            self.last = now
            self.lines += 1
            self._write(self.line(now) + "\n")

    def close(self, final: bool = True) -> None:
        """The closing report (once): tqdm's final bar, or a ``desc: done unit in 0:12 (rate)`` line. Not
        ``final`` (the loop failed; a context manager's exception): the bar is cleared and no line is written, so
        the error is the last word."""
        if self.closed:
            return
        self.closed = True
        if self.mode == "off":
            return
        if self._tqdm is not None:
            self._tqdm.leave = final and self._tqdm.leave
            self._tqdm.close()
        elif self.mode == "simple" and final:
            self._draw_simple(self.clock())
            self._write("\n")
        elif self.mode == "simple":
            self._write("\r" + " " * self._width + "\r")
        elif final and (self.summary_always or self.lines):
            self._write(self.summary(self.clock()) + "\n")

    def line(self, now: float) -> str:
        """The periodic plain line: ``desc: 40/100 docs (40%), 8 docs/s, ETA 0:07``."""
        elapsed = now - self.start
        rate = _rate(self.done, elapsed, self.unit)
        extra = f", {self.postfix}" if self.postfix else ""
        if not self.total:
            done = format_count(self.done, self.unit)
            return f"{self.desc}: {done}{extra}, {rate}, {format_seconds(elapsed)} elapsed"
        pct = 100.0 * self.done / self.total
        if self.unit == "B":
            done = f"{format_count(self.done, self.unit)}/{format_count(self.total, self.unit)}"
        else:
            done = f"{self.done:.0f}/{format_count(self.total, self.unit)}"
        eta = "ETA -"
        if self.done > 0 and elapsed > 0:
            eta = f"ETA {format_seconds(max(0.0, self.total - self.done) * elapsed / self.done)}"
        return f"{self.desc}: {done} ({pct:.0f}%){extra}, {rate}, {eta}"

    def summary(self, now: float) -> str:
        """The closing plain line: ``desc: 100 docs in 0:12 (8 docs/s)`` (then the postfix)."""
        elapsed = now - self.start
        extra = f", {self.postfix}" if self.postfix else ""
        return f"{self.desc}: {format_count(self.done, self.unit)} in {format_seconds(elapsed)} " \
               f"({_rate(self.done, elapsed, self.unit)}){extra}"

    def _finished(self) -> bool:
        return bool(self.total) and self.done >= self.total

    def _draw_simple(self, now: float) -> None:
        if self.total:
            filled = int(20 * min(1.0, self.done / self.total))
            text = f"{self.desc}: [{'#' * filled}{'.' * (20 - filled)}] " + self.line(now).split(": ", 1)[1]
        else:
            text = self.line(now)
        self._write("\r" + text.ljust(self._width))
        self._width = len(text)

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: progress is never worth a crash
            self.mode = "off"


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
