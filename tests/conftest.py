"""Runs the tests share, each trained once per session (``tests/functional/launch.py``): the single-process
references that every parallel layout is compared with, and the shared runs, those of one world size trained
by one launch (``ParityRuns``). A test names the run it checks as its ``layout`` parameter (or in a
``shared_runs`` mark); only the runs of the selected tests (and what they need first) are trained.

Also the session's process hygiene: the ``starts_early`` jobs start only when tests run, and whatever process a
test started through ``tests/functional/processes.py`` is killed when the session ends."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from tests.functional import processes
from tests.functional.corpus import corpus  # noqa: F401 (a session fixture)
from tests.functional.corpus import shared as corpus_folder
from tests.functional.launch import PARITY, REFERENCES, ParityRuns
from tests.reference_guard import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (its hooks)

# One compute thread in every process of the suite (torchrun's ranks have it from torchrun's OMP_NUM_THREADS=1; the
# runs started without torchrun from MEGATRON_CPU_THREADS, megatron/cpu_threads.py; this process here): the tiny
# models gain nothing from a second thread, a second thread on a busy 2-core machine made a launch of four tiny
# runs 6x slower (54-89 s against 9-15 s), and a fixed count keeps results independent of the machine's load.
os.environ.setdefault("MEGATRON_CPU_THREADS", "1")
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

_SELECTED: set[str] = set()  # the shared runs of the tests this session runs


def pytest_collection_finish(session):
    """What the selected tests need: their shared runs."""
    for item in session.items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if "parity" in getattr(item, "fixturenames", ()) and "layout" in params:
            _SELECTED.add(params["layout"])
        for mark in item.iter_markers("shared_runs"):  # runs a test reads through a fixture
            _SELECTED.update(mark.args)


def _tests_will_run(session) -> bool:
    option = session.config.option
    if option.collectonly or getattr(option, "setuponly", False) or getattr(option, "setupplan", False):
        return False
    return not (session.testsfailed and not option.continue_on_collection_errors)  # collection errors: none run


def _reads_shared_runs(item) -> bool:
    names = getattr(item, "fixturenames", ())
    return any(name in names for name in ("parity", "references", "reference", "reference4")) \
        or item.get_closest_marker("shared_runs") is not None


# Which folders' modules run first among those that read no shared run: mostly one process (tests/unit) while the
# launches take the other core, the gloo ranks (tests/distributed) last, which a background launch slows most.
_FOLDER_ORDER = ("unit", "inference", "functional", "distributed")


def _folder_rank(module) -> int:
    folder = Path(module.__file__).parent.name
    return _FOLDER_ORDER.index(folder) if folder in _FOLDER_ORDER else len(_FOLDER_ORDER)


def pytest_collection_modifyitems(session, config, items):
    """The modules that read no shared run first (by ``_FOLDER_ORDER``, then in their order), then the others: the
    shared launches train in the background meanwhile (``pytest_runtestloop``). A module is kept whole (its
    module fixtures are set up once)."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.module, []).append(item)
    reading = {module for module, its in modules.items() if any(_reads_shared_runs(item) for item in its)}
    order = sorted(modules, key=lambda module: (module in reading, 0 if module in reading else _folder_rank(module)))
    items[:] = [item for module in order for item in modules[module]]


_PARITY: list[ParityRuns] = []  # the session's shared runs, once made


def _parity(config) -> ParityRuns:
    if not _PARITY:
        factory = config._tmp_path_factory  # the tmp_path_factory fixture's, before any fixture is set up
        _PARITY.append(ParityRuns(factory.mktemp("shared-runs"), PARITY, _SELECTED | REFERENCES,
                                  {"{corpus}": lambda: str(corpus_folder(factory.getbasetemp()))}))
    return _PARITY[0]


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """The shared launches and the jobs of the ``starts_early`` tests started now, when the tests are about to run
    (never for ``--collect-only``), to train (or wait for a fixed grace of a launcher, say) while the other tests
    run."""
    if not _tests_will_run(session):
        return
    if any(_reads_shared_runs(item) for item in session.items):
        _parity(session.config).start()
    started = set()
    for item in session.items:
        if item.get_closest_marker("starts_early") and item.module not in started:
            started.add(item.module)
            item.module.start_early(Path(tempfile.mkdtemp(prefix=f"{item.module.__name__.split('.')[-1]}-")))


def _terminated(signum, frame):
    raise KeyboardInterrupt  # pytest then ends its session as on a Ctrl-C: pytest_unconfigure kills the leftovers


def _default_sigterm_in_child() -> None:
    """A process forked from the session (a multiprocessing pool's worker: tools/preprocess_data.py's) dies of a
    SIGTERM as by default: ``Pool.terminate`` relies on it, and with the session's handler a worker caught waiting
    for its next task was left running and the pool's join hung the suite."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # forked from another thread than the main one: it never had the session's handler run
        pass


def pytest_configure(config):
    """A SIGTERM (a CI timeout, ``kill``) ends the session as a Ctrl-C does, so that what the tests started is killed
    with it rather than left running (the default action ends the interpreter without its cleanup). Processes forked
    from the session get the default action back."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
        os.register_at_fork(after_in_child=_default_sigterm_in_child)


def pytest_unconfigure(config):
    """Every process the tests started (``tests/functional/processes.py``'s ``popen``), and its descendants,
    killed if still running: after --collect-only, a normal end, a Ctrl-C or a SIGTERM."""
    killed = processes.kill_leftovers()
    if killed:
        print(f"tests/conftest.py: killed {len(killed)} processes the tests left running: {killed}", file=sys.stderr)


@pytest.fixture(scope="session")
def parity(pytestconfig) -> ParityRuns:
    return _parity(pytestconfig)


@pytest.fixture(scope="session")
def references(parity) -> dict[str, tuple]:
    """{name: (train losses, validation losses, gradient norms)} of every reference run."""
    return {name: parity.curves(name) for name in sorted(REFERENCES)}


@pytest.fixture(scope="session")
def reference(references):
    """TINY in one process (two decoder layers)."""
    return references["tiny"]


@pytest.fixture(scope="session")
def reference4(references):
    """The same with four decoder layers (enough for pp 4, and for pp 2 x vpp 2)."""
    return references["tiny4"]
