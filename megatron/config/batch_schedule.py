"""The global batch of every step, and how long training is: Megatron-LM's rules, as pure functions.

A step's global batch is a function of ``c``, the samples consumed before it (Megatron-LM calls
``update_num_microbatches(consumed_samples)`` at the top of every iteration; skipped steps consume
their samples too):

- constant: ``global_batch_size``;
- ramp-up ``[START, INCR, SAMPLES]`` (``--rampup-batch-size``): ``n = (global_batch_size - START) / INCR``
  increments, one every ``SAMPLES / n`` samples: ``START + INCR x int(c / (SAMPLES / n))`` while
  ``c <= SAMPLES``, then ``global_batch_size`` (the float division is Megatron's, kept bit for bit);
- step schedule ``'0:16 2.4B:320 ...'`` (``--step-batch-size-schedule``): ``TOKENS:BATCH`` pairs, K/M/B/T
  suffixes, each threshold converted to samples as ``tokens // seq_length``; the batch of the last
  threshold ``<= c``. Its last batch is the run's ``global_batch_size``.

Each size is rounded down to a multiple of ``unit = micro_batch_size x data-parallel size`` (Megatron's
``--decrease-batch-size-if-needed`` rounding): every data-parallel rank then reads a whole number of
micro-batches, and the rounded size is what the step consumes. Both forms are stored as one list of
``(threshold in samples, batch)``, so sizes, step counts and sample counts are computed phase by phase,
not step by step.

Training length (``train_steps``): ``max_steps``; or, with ``train_samples``, Megatron's derived
``train_iters``: ``train_samples // global_batch_size`` for a constant batch, else the steps taken while
``consumed < train_samples`` (the last one may pass it). ``total_train_samples`` is what those steps
consume: the size the training set is built for.

Configuration layer, standard library only: validation uses it (sizes, errors) without importing
anything above ``megatron.config``.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from megatron.config.schema import Config

__all__ = ["BatchSchedule", "build_batch_schedule", "parse_count", "parse_step_schedule", "rampup_thresholds",
           "total_train_samples", "train_steps"]

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """'2.4B' -> 2400000000: a number with an optional K/M/B/T suffix, ``int(float(x) * multiplier)`` as
    Megatron-LM parses it. Raises ValueError."""
    word = text.strip().upper()
    multiplier = _SUFFIXES.get(word[-1:], 1)
    if multiplier != 1:
        word = word[:-1]
    try:
        return int(float(word) * multiplier)
    except (ValueError, OverflowError):
        raise ValueError(f"'{text}' is not a number (with an optional K, M, B or T suffix)") from None


def parse_step_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """'0:16 2.4B:320' -> [(0, 16), (2.4e9 // seq_length, 320)]: (threshold in samples, global batch), sorted.
    Entries are separated by spaces or commas. The first threshold must be 0, the thresholds (in samples)
    strictly increasing, the batches positive. Raises ValueError with a sentence."""
    name = f"step_batch_size_schedule '{text}'"
    entries = text.replace(",", " ").split()
    if not entries:
        raise ValueError(f"{name} is empty; give 'TOKENS:BATCH' pairs such as '0:16 2.4B:320'")
    schedule = []
    for entry in entries:
        threshold, sep, batch = entry.partition(":")
        if not sep:
            raise ValueError(f"{name}: entry '{entry}' is not 'TOKENS:BATCH' (e.g. '2.4B:320')")
        try:
            schedule.append((parse_count(threshold) // seq_length, parse_count(batch)))
        except ValueError as err:
            raise ValueError(f"{name}: entry '{entry}': {err}") from None
    schedule.sort(key=lambda pair: pair[0])
    if schedule[0][0] != 0:
        raise ValueError(f"{name} must start at 0 tokens (the batch of the first step); its first threshold is "
                         f"{schedule[0][0]} samples")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            raise ValueError(f"{name}: two thresholds fall on the same sample ({after} = tokens // seq_length "
                             f"{seq_length}); make them at least one sequence apart")
    if any(batch < 1 for _, batch in schedule):
        raise ValueError(f"{name}: every batch must be at least 1")
    return schedule


def _ramp_batch(consumed: int, start: int, increment: int, samples: int, per_increment: float, final: int) -> int:
    """Megatron-LM's ramp-up batch at ``consumed`` samples (RampupBatchsizeNumMicroBatchesCalculator.update)."""
    if consumed > samples:
        return final
    return start + int(consumed / per_increment) * increment


def rampup_thresholds(start: int, increment: int, samples: int, final: int) -> list[tuple[int, int]]:
    """``[START, INCR, SAMPLES]`` ramping to ``final`` as (threshold in samples, batch) pairs: for each
    increment k the first consumed-sample count whose ramp batch is ``START + k x INCR``, found on Megatron's
    own float expression (so a boundary that division rounds is where Megatron has it). Raises ValueError."""
    if start < 1 or increment < 1 or samples < 1:
        raise ValueError(f"rampup_batch_size START INCR SAMPLES must all be at least 1, got {start} {increment} "
                         f"{samples}")
    if final < start or (final - start) % increment:
        raise ValueError(f"rampup_batch_size: global_batch_size ({final}) minus the start batch ({start}) must be a "
                         f"non-negative multiple of the increment ({increment})")
    increments = (final - start) // increment
    if increments == 0:
        return [(0, final)]
    per_increment = samples / increments
    thresholds = [(0, start)]
    for k in range(1, increments + 1):
        batch = start + k * increment
        first = min(int(k * per_increment), samples + 1)  # then moved to the exact first sample with this batch
        while first > 0 and _ramp_batch(first - 1, start, increment, samples, per_increment, final) >= batch:
            first -= 1
        while _ramp_batch(first, start, increment, samples, per_increment, final) < batch:
            first += 1
        if first == thresholds[-1][0]:
            thresholds[-1] = (first, batch)  # fewer samples than increments: a step may jump several
        else:
            thresholds.append((first, batch))
    return thresholds


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch as a function of consumed samples: ``thresholds`` (first sample, batch), sorted and
    starting at 0, each batch rounded down to a multiple of ``unit`` (micro-batch x data-parallel size)."""

    thresholds: tuple[tuple[int, int], ...]
    unit: int = 1

    def __post_init__(self) -> None:
        small = [batch for _, batch in self.thresholds if batch < self.unit]
        if small:
            raise ValueError(f"a global batch of {small[0]} is smaller than micro_batch_size x data-parallel size "
                             f"({self.unit}): every data-parallel rank needs at least one micro-batch; start the "
                             f"schedule at {self.unit} or more, or lower micro_batch_size")

    def nominal(self, consumed: int) -> int:
        """The schedule's batch at ``consumed`` samples, before rounding."""
        return self.thresholds[bisect_right([t for t, _ in self.thresholds], consumed) - 1][1]

    def __call__(self, consumed: int) -> int:
        """The global batch of the step taken after ``consumed`` samples (a multiple of ``unit``)."""
        return self.nominal(consumed) // self.unit * self.unit

    @property
    def varies(self) -> bool:
        return len(self.thresholds) > 1

    @property
    def final(self) -> int:
        return self.thresholds[-1][1] // self.unit * self.unit

    def sizes(self) -> list[int]:
        """Every global batch the schedule uses (rounded), in order."""
        return list(dict.fromkeys(batch // self.unit * self.unit for _, batch in self.thresholds))

    def rounded(self) -> list[tuple[int, int]]:
        """(batch, rounded batch) for each batch of the schedule that is not a multiple of ``unit``."""
        return [(b, b // self.unit * self.unit) for _, b in self.thresholds if b % self.unit]

    def _phase(self, consumed: int) -> tuple[int, int | None]:
        """(the batch at ``consumed``, the steps in a row that keep it; None: it never changes again)."""
        i = bisect_right([t for t, _ in self.thresholds], consumed) - 1
        batch = self.thresholds[i][1] // self.unit * self.unit
        if i + 1 == len(self.thresholds):
            return batch, None
        return batch, -(-(self.thresholds[i + 1][0] - consumed) // batch)

    def consumed_after(self, steps: int, consumed: int = 0) -> int:
        """Samples consumed after ``steps`` more steps from ``consumed``."""
        while steps > 0:
            batch, run = self._phase(consumed)
            run = steps if run is None else min(run, steps)
            consumed, steps = consumed + run * batch, steps - run
        return consumed

    def steps_to_reach(self, samples: int, consumed: int = 0) -> int:
        """Steps taken while fewer than ``samples`` are consumed (Megatron's loop: the last may pass it)."""
        steps = 0
        while consumed < samples:
            batch, run = self._phase(consumed)
            needed = -(-(samples - consumed) // batch)
            run = needed if run is None else min(run, needed)
            consumed, steps = consumed + run * batch, steps + run
        return steps

    def steps_within(self, samples: int, consumed: int = 0) -> int:
        """Steps whose whole global batch lies within the first ``samples`` samples."""
        steps = 0
        while True:
            batch, run = self._phase(consumed)
            fits = (samples - consumed) // batch
            if fits <= 0:
                return steps
            run = fits if run is None else min(run, fits)
            consumed, steps = consumed + run * batch, steps + run


def build_batch_schedule(config: Config) -> BatchSchedule:
    """The run's schedule, from a validated ``config`` (``global_batch_size`` is the final batch). Raises
    ValueError (validation turns it into a ConfigError)."""
    b = config.batch_size
    unit = b.micro_batch_size * config.data_parallel_size
    if b.step_batch_size_schedule is not None:
        thresholds = parse_step_schedule(b.step_batch_size_schedule, config.dataset.max_seq_len)
    elif b.rampup_batch_size is not None:
        if len(b.rampup_batch_size) != 3:
            raise ValueError(f"rampup_batch_size takes three numbers, START INCR SAMPLES, got {b.rampup_batch_size}")
        thresholds = rampup_thresholds(*b.rampup_batch_size, b.global_batch_size)
    else:
        thresholds = [(0, b.global_batch_size)]
    return BatchSchedule(tuple(thresholds), unit)


def train_steps(config: Config, schedule: BatchSchedule | None = None) -> int:
    """The steps training takes: ``max_steps``, or Megatron's ``train_iters`` derived from ``train_samples``
    (see the module doc)."""
    if config.train_samples is None:
        return config.max_steps
    schedule = schedule or build_batch_schedule(config)
    if not schedule.varies:
        return config.train_samples // schedule.final
    return schedule.steps_to_reach(config.train_samples)


def total_train_samples(config: Config) -> int:
    """The samples training consumes over ``train_steps(config)`` steps: what the training set is built for."""
    schedule = build_batch_schedule(config)
    return schedule.consumed_after(train_steps(config, schedule))
