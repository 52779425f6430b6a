"""Shared runs of the functional tests: the single-process references every parallel layout is compared with,
and the parity layouts, each world size trained in one launch (``launch.ParityRuns``)."""

from __future__ import annotations

import pytest

from tests.functional.launch import PARITY, REFERENCES, ParityRuns, curves, outcome, run_several

_SELECTED: set[str] = set()  # the parity layouts of the tests this session runs


def pytest_collection_finish(session):
    for item in session.items:
        if "parity" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec"):
            _SELECTED.add(item.callspec.params["layout"])


@pytest.fixture(scope="session")
def references(tmp_path_factory) -> dict[str, tuple]:
    """{name: (train losses, validation losses, gradient norms)} of every ``REFERENCES`` run, all trained by
    one single-process launch."""
    root = tmp_path_factory.mktemp("single")
    runs = [(root / name, args) for name, args in REFERENCES.items()]
    launch = run_several(runs, nproc=1)
    return {out.name: curves(outcome(out, 1, launch).check()) for out, _ in runs}


@pytest.fixture(scope="session")
def reference(references):
    """TINY in one process (two decoder layers)."""
    return references["tiny"]


@pytest.fixture(scope="session")
def reference4(references):
    """The same with four decoder layers (enough for pp 4, and for pp 2 x vpp 2)."""
    return references["tiny4"]


@pytest.fixture(scope="session")
def parity(tmp_path_factory) -> ParityRuns:
    return ParityRuns(tmp_path_factory.mktemp("parity"), PARITY, _SELECTED)
