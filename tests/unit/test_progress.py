"""megatron/progress.py: plain lines in a file (by a fake clock), a bar on a terminal, silence when disabled or
on a rank other than 0."""

from __future__ import annotations

import io

import pytest

from megatron.progress import Progress, format_count, format_seconds, is_rank_zero


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


def test_file_gets_a_line_every_interval_with_rate_and_eta():
    clock, out = FakeClock(), io.StringIO()
    with Progress("scoring", total=100, unit="windows", stream=out, interval=10, clock=clock) as bar:
        assert bar.mode == "lines"
        for _ in range(40):
            clock.now += 0.25  # 4 windows/s
            bar.update(1)
        lines = out.getvalue().splitlines()
        assert lines == ["scoring: 40/100 windows (40%), 4 windows/s, ETA 0:15"]  # at 10 s
        for _ in range(60):
            clock.now += 0.25
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert lines[1] == "scoring: 80/100 windows (80%), 4 windows/s, ETA 0:05"  # at 20 s; none at 25 s
    assert lines[-1] == "scoring: 100 windows in 0:25 (4 windows/s)"
    assert len(lines) == 3
    assert "\r" not in out.getvalue()


def test_unknown_total_and_bytes():
    clock, out = FakeClock(), io.StringIO()
    with Progress("preprocess", unit="B", stream=out, interval=5, clock=clock) as bar:
        clock.now += 5
        bar.set_postfix("12 docs")
        bar.update(3 * 2**20)
        bar.set_total(None)
    lines = out.getvalue().splitlines()
    assert lines == ["preprocess: 3.00 MiB, 12 docs, 614.40 KiB/s, 0:05 elapsed",
                     "preprocess: 3.00 MiB in 0:05 (614.40 KiB/s), 12 docs"]


def test_total_set_later_gives_an_eta():
    clock, out = FakeClock(), io.StringIO()
    bar = Progress("convert", unit="tensors", stream=out, interval=1, clock=clock)
    bar.set_total(10)
    clock.now += 2
    bar.update(4)
    bar.close()
    bar.close()  # once only
    lines = out.getvalue().splitlines()
    assert lines == ["convert: 4/10 tensors (40%), 2 tensors/s, ETA 0:03", "convert: 4 tensors in 0:02 (2 tensors/s)"]


def test_terminal_gets_a_bar(monkeypatch):
    out = Terminal()
    with Progress("evaluate", total=3, unit="batches", stream=out) as bar:
        assert bar.mode == "tqdm"
        bar.set_postfix("7 docs")
        bar.update(3)
    text = out.getvalue()
    assert "\r" in text and "evaluate" in text and "3/3" in text and "100%" in text and "7 docs" in text


def test_terminal_without_tqdm_gets_the_simple_bar(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    clock, out = FakeClock(), Terminal()
    with Progress("evaluate", total=4, unit="batches", stream=out, clock=clock) as bar:
        assert bar.mode == "simple"
        for _ in range(4):
            clock.now += 1
            bar.update(1)
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    frames = text.rstrip("\n").split("\r")[1:]
    assert frames[-1].rstrip() == "evaluate: [####################] 4/4 batches (100%), 1 batches/s, ETA 0:00"
    assert any("[##########..........] 2/4" in f for f in frames)


def test_disabled_and_other_ranks_are_silent(monkeypatch):
    out = Terminal()
    with Progress("x", total=5, stream=out, enabled=False) as bar:
        bar.update(5)
    assert bar.done == 5 and out.getvalue() == ""
    monkeypatch.setenv("RANK", "1")
    assert not is_rank_zero()
    for stream in (Terminal(), io.StringIO()):
        with Progress("x", total=5, stream=stream, interval=0) as bar:
            bar.update(5)
        assert stream.getvalue() == ""
    monkeypatch.setenv("RANK", "0")
    assert is_rank_zero()


@pytest.mark.parametrize("bar", ["lines", "simple", "tqdm"])
def test_a_failed_loop_leaves_no_closing_report(bar):
    clock, out = FakeClock(), Terminal()
    with pytest.raises(RuntimeError), Progress("x", total=9, stream=out, clock=clock, bar=bar) as progress:
        clock.now += 1
        progress.update(2)
        raise RuntimeError("the loop failed")
    text = out.getvalue()
    assert "\n" not in text and "in 0:01" not in text  # no closing line: the error is the last word
    if bar == "simple":
        assert "2/9" in text and text.split("\r")[-2].strip() == ""  # the bar drawn, then blanked


def test_without_summary_a_short_loop_is_quiet_and_a_long_one_closes():
    clock, out = FakeClock(), io.StringIO()
    with Progress("convert", total=4, unit="tensors", stream=out, interval=10, clock=clock, summary=False) as bar:
        clock.now += 9
        bar.update(4)
    assert out.getvalue() == ""
    with Progress("convert", total=4, unit="tensors", stream=out, interval=10, clock=clock, summary=False) as bar:
        clock.now += 10
        bar.update(2)
        clock.now += 10
        bar.update(2)
    assert out.getvalue().splitlines() == ["convert: 2/4 tensors (50%), 0.2 tensors/s, ETA 0:10",
                                           "convert: 4/4 tensors (100%), 0.2 tensors/s, ETA 0:00",
                                           "convert: 4 tensors in 0:20 (0.2 tensors/s)"]


def test_a_broken_stream_turns_progress_off():
    out = io.StringIO()
    out.close()
    with Progress("x", stream=out, interval=0) as bar:
        bar.update(1)  # no ValueError from the closed stream
    assert bar.mode == "off"


def test_formats():
    assert format_seconds(7) == "0:07" and format_seconds(750) == "12:30" and format_seconds(7509) == "2:05:09"
    assert format_count(1234, "docs") == "1234 docs" and format_count(1536, "B") == "1.50 KiB"
    assert format_count(2**30, "B") == "1.00 GiB"
    with pytest.raises(ValueError, match="bar must be"):
        Progress("x", bar="fancy", stream=io.StringIO())
