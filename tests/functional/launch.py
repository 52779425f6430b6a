"""Run pretrain_gpt.py in one process or under torchrun and read back its per-step losses; run the parity layouts
of one world size in one launch (``several_runs.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# fp32, no dropout, mock data: any layout must reproduce the single-process losses.
TINY = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--vocab-size", "256", "--max-seq-len", "32", "--max-position-embeddings", "32", "--global-batch-size", "16",
        "--micro-batch-size", "4", "--max-steps", "10", "--lr", "3e-3", "--hidden-dropout-prob", "0",
        "--attention-probs-dropout-prob", "0", "--eval-freq", "5", "--eval-iters", "2", "--logging-freq", "1",
        "--num-workers", "0", "--grad-clip", "0.3"]  # the gradient norm is ~0.5-0.8: clipping is active


def run(out: Path, *args: str, nproc: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(nproc)]
    return subprocess.run([*launcher, str(ROOT / "pretrain_gpt.py"), *args, "--save", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def run_here(*args: str) -> subprocess.CompletedProcess:
    """``pretrain_gpt.py args`` in this process, for a run that stops before training (a configuration, data or
    checkpoint error): what it prints and its exit status, as a launch would give them, without starting an
    interpreter and importing torch again (seconds on a small machine)."""
    import contextlib
    import io

    import pretrain_gpt

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = pretrain_gpt.main(list(args))
    return subprocess.CompletedProcess(["pretrain_gpt.py", *args], status, out.getvalue(), err.getvalue())


def program_module(path: str):
    """A script of the repository (``tools/x.py``, ``pretrain_gpt.py``) as a module, loaded once under its stem."""
    import importlib.util

    name = Path(path).stem
    module = sys.modules.get(name)
    if module is None or getattr(module, "__file__", None) != str(ROOT / path):
        spec = importlib.util.spec_from_file_location(name, ROOT / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def run_tool_here(path: str, *args: str) -> subprocess.CompletedProcess:
    """A tool of the repository (``tools/x.py``, whose ``main(argv)`` returns its exit status) in this process:
    what it prints and its status, without starting an interpreter and importing torch again."""
    import contextlib
    import io

    module = program_module(path)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = module.main(list(args))
    return subprocess.CompletedProcess([path, *args], status, out.getvalue(), err.getvalue())


def losses(out: Path, split: str = "train", key: str = "loss") -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if r["split"] == split]


def curves(out: Path) -> tuple[list[float], list[float], list[float]]:
    """(train losses, validation losses, gradient norms) of a finished run."""
    return losses(out), losses(out, "valid"), losses(out, key="grad_norm")


# Every run the functional tests share: name -> (processes, pretrain_gpt.py arguments[, runs it needs first]).
# "{runs}" in an argument stands for the folder that holds every run's folder (``--load {runs}/a/step_5``), "{corpus}"
# for the suite's tiny BPE corpus (``tests/functional/corpus.py``, built when a launch first needs it). The
# test modules register theirs (``parity_layouts``); ``ParityRuns`` trains those a session selects, by world size.
PARITY: dict[str, tuple] = {}


def parity_layouts(cases: dict[str, tuple]) -> list[str]:
    """Register ``cases`` (names unique over the suite); their names, to parametrize a test's ``layout``."""
    for name, case in cases.items():
        assert PARITY.setdefault(name, case) == case, f"parity layout {name!r} registered twice"
    return list(cases)


# The single-process runs others are compared with: trained whenever any shared run is, in the one-process
# launch (conftest's ``references``: name -> (train losses, validation losses, gradient norms)).
REFERENCES: set[str] = set()


def reference_runs(cases: dict[str, list[str]]) -> None:
    """Register single-process reference runs: name -> pretrain_gpt.py arguments."""
    parity_layouts({name: (1, args) for name, args in cases.items()})
    REFERENCES.update(cases)


reference_runs({"tiny": TINY, "tiny4": [*TINY, "--num-layers", "4"]})
# 5 steps (a validation at the 5th): the parity of a layout is as strict, at half the cost of its run
FIVE = [*TINY, "--max-steps", "5"]


def whole_share(data_ranks: int = 1) -> list[str]:
    """One micro-batch a step: each of ``data_ranks`` ranks (dp x sharding) takes its whole share of the global batch
    of 16 at once. The loss is the token mean of the global batch however it is cut into micro-batches, so such a
    run equals a reference that accumulates 4 micro-batches within fp32 rounding (~1e-7), and a layout without
    pipelining need not repeat its collectives 4 times a step: a tp 2 run took 0.6 s instead of 1.5 s. Not for a
    MoE model (its auxiliary losses are per micro-batch: its references take the whole batch too) nor for what
    checks accumulation itself (ZeRO, the distributed optimizer, pipelining)."""
    return ["--micro-batch-size", str(16 // data_ranks)]
reference_runs({"tiny-5": FIVE, "tiny4-5": [*FIVE, "--num-layers", "4"]})


def run_several(runs: list[tuple[Path, list[str]]], nproc: int, timeout: float = 900, program: str = "pretrain_gpt.py",
                preexec_fn=None, background: bool = False) -> subprocess.CompletedProcess:
    """Each (folder, args) of ``runs`` run in turn by one launch of ``nproc`` ranks (``several_runs.py``) of
    ``program`` (a path in the repository whose ``main(argv)`` returns the exit status): the folder gets the
    run's files (a training run's checkpoints and metrics), ``rank{r}.log`` (stderr), ``rank{r}.out`` (stdout)
    and ``rank{r}.rc``. ``preexec_fn``: run in the launch's process before it starts (``subprocess.Popen``'s).
    ``background``: a launch in the background of the tests (``processes.popen``: on idle cores only, and killed
    with the session)."""
    plan = runs[0][0].parent / f"plan-{runs[0][0].name}.json"
    plan.write_text(json.dumps([{"out": str(out), "args": list(args), "program": program} for out, args in runs]))
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(nproc)]
    command = [*launcher, str(ROOT / "tests" / "functional" / "several_runs.py"), str(plan)]
    if not background:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=preexec_fn)
    assert preexec_fn is None, "a background launch runs processes.popen's preparation"
    from tests.functional import processes  # here: several_runs.py's ranks import this module, and need none of it

    process = processes.popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              background=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@dataclass
class RunOutcome:
    out: Path
    returncode: int | None  # the worst rank's; None when the launch never finished the run
    log: str  # every rank's stderr, and the launch's when a rank has no exit code

    @property
    def stdout(self) -> str:
        """Rank 0's standard output."""
        return (self.out / "rank0.out").read_text()

    def check(self) -> Path:
        assert self.returncode == 0, self.log[-4000:]
        return self.out


def outcome(out: Path, nproc: int, launch: subprocess.CompletedProcess) -> RunOutcome:
    codes = [(out / f"rank{r}.rc").read_text() if (out / f"rank{r}.rc").exists() else None for r in range(nproc)]
    log = "".join(f"--- rank {r}\n" + (out / f"rank{r}.log").read_text() for r in range(nproc)
                  if (out / f"rank{r}.log").exists())
    if None in codes:
        log += f"--- the launch (exit code {launch.returncode})\n{launch.stderr[-4000:]}"
    worst = None if None in codes else max((int(c) for c in codes), key=abs)
    return RunOutcome(out, worst, log)


class ParityRuns:
    """The shared runs, each trained once per test session: ``start`` trains every selected run in the background
    when the tests begin (tests/conftest.py), one launch at a time, on the cores the tests leave idle (those that
    read no shared run come first); ``outcome`` waits for a run, or has it (and what it needs first) trained if no
    launch took it yet.

    A launch runs the runs of one world size whose prerequisites are trained or come before them in it: first
    those of the largest size that has any such run, so each size's runs that resume another size's save
    (prerequisites, ``cases[name][2]``) wait in a later launch while the others train."""

    def __init__(self, root: Path, cases: dict[str, tuple], selected: set[str],
                 placeholders: dict[str, Callable[[], str]] | None = None):
        """``placeholders``: what else an argument may name ("{corpus}": a function giving its path, called when
        a launch first needs it)."""
        self.root, self.cases, self.done = root, cases, {}
        self.placeholders = {"{runs}": lambda: str(root), **(placeholders or {})}
        self._resolved: dict[str, str] = {}  # placeholder -> its value, once asked for
        self.wanted = set()
        self._changed = threading.Condition()  # guards done, wanted and _trainer; told when runs are done
        self._trainer: threading.Thread | None = None  # the background thread that launches, while there is work
        for name in selected & set(cases):
            self._want(name)

    def _want(self, name: str) -> None:
        self.wanted.add(name)
        for before in self._after(name):
            self._want(before)

    def _after(self, name: str) -> tuple[str, ...]:
        return tuple(self.cases[name][2]) if len(self.cases[name]) > 2 else ()

    def start(self) -> None:
        """Every wanted run trained from now on, in the background."""
        for placeholder in self.placeholders:  # resolved here, in the tests' thread (the corpus is built in process)
            if any(placeholder in arg for name in self.wanted for arg in self.cases[name][1]):
                self._filled(placeholder)
        with self._changed:
            self._keep_training()

    def outcome(self, name: str) -> RunOutcome:
        with self._changed:
            self._want(name)  # asked for without being selected: it, and what it needs, are wanted now
            while name not in self.done:
                self._keep_training()
                self._changed.wait()
            return self.done[name]

    def _keep_training(self) -> None:
        """The background thread started unless it runs (the caller holds the lock)."""
        if self._trainer is None:
            self._trainer = threading.Thread(target=self._train, name="shared-launches", daemon=True)
            self._trainer.start()

    def _next_launch(self) -> tuple[int, list[str]]:
        """(world size, runs) of the next launch, (0, []) when none can start (the caller holds the lock)."""
        for nproc in sorted({self.cases[n][0] for n in self.wanted if n not in self.done}, reverse=True):
            batch = []
            for n in self.cases:  # registration order: a prerequisite of the same size runs first
                if (n in self.wanted and n not in self.done and self.cases[n][0] == nproc
                        and all(b in self.done or b in batch for b in self._after(n))):
                    batch.append(n)
            if batch:
                return nproc, batch
        return 0, []

    def _train(self) -> None:
        """Launch after launch until every wanted run is done; whatever goes wrong is the outcome of its runs, for
        the tests that read them to report."""
        while True:
            with self._changed:
                nproc, batch = self._next_launch()
                if not batch:  # done, or runs whose prerequisites wait for each other: say so to their tests
                    self.done.update({n: RunOutcome(self.root / n, None, f"{n}: its prerequisites wait for it")
                                      for n in self.wanted if n not in self.done})
                    self._trainer = None
                    self._changed.notify_all()
                    return
            try:
                runs = [(self.root / n, [self._filled(a) for a in self.cases[n][1]]) for n in batch]
                launch = run_several(runs, nproc, timeout=1800, background=True)  # idle cores only: slower
                outcomes = {n: outcome(self.root / n, nproc, launch) for n in batch}
            except BaseException:  # noqa: B036 - the runs' tests report it
                outcomes = {n: RunOutcome(self.root / n, None, traceback.format_exc()) for n in batch}
            with self._changed:
                self.done.update(outcomes)
                self._changed.notify_all()

    def _filled(self, arg: str) -> str:
        for placeholder, value in self.placeholders.items():
            if placeholder in arg:
                if placeholder not in self._resolved:
                    self._resolved[placeholder] = value()
                arg = arg.replace(placeholder, self._resolved[placeholder])
        return arg

    def curves(self, name: str) -> tuple[list[float], list[float], list[float]]:
        """(train losses, validation losses, gradient norms) of a run that must have succeeded."""
        return curves(self.outcome(name).check())

    def assert_fails_on_every_rank(self, name: str, message: str) -> None:
        """The run stopped on every rank with exit status 2 and one line holding ``message``, no traceback:
        none was left waiting in a collective for the others."""
        result = self.outcome(name)
        for rank in range(self.cases[name][0]):
            log = (result.out / f"rank{rank}.log").read_text()
            assert (result.out / f"rank{rank}.rc").read_text() == "2", result.log[-3000:]
            assert log.count("pretrain_gpt.py: error: ") == log.count(message) == 1, result.log[-3000:]
            assert "Traceback" not in log

    def assert_matches(self, name: str, reference: tuple) -> None:
        """Every step's train and validation loss and gradient norm within 1e-5 of ``reference``, relative: a
        parallel layout sums the same products in another order (fp32 round-off, ~1e-7 observed), which Adam
        carries forward over the steps."""
        import pytest

        for got, want in zip(self.curves(name), reference):
            assert len(got) == len(want)
            assert got == pytest.approx(want, rel=1e-5)
