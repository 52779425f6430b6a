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
