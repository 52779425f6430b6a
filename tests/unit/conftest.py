"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_process():
    """The rank grid of one process (no process group), torn down after the test."""
    from megatron import parallel_state

    parallel_state.initialize()
    yield
    parallel_state.destroy()
