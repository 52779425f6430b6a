"""The single-process reference run that every parallel layout is compared with."""

from __future__ import annotations

import pytest

from tests.functional.launch import TINY, curves, run


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """(train losses, validation losses, gradient norms) of TINY in one process."""
    out = tmp_path_factory.mktemp("single")
    result = run(out, *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    return curves(out)


@pytest.fixture(scope="session")
def reference4(tmp_path_factory):
    """The same with four decoder layers (enough for pp 4, and for pp 2 x vpp 2)."""
    out = tmp_path_factory.mktemp("single4")
    result = run(out, *TINY, "--num-layers", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    return curves(out)
