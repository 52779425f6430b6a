"""The gloo rank pools of ``harness.run_distributed`` live as long as this package's tests run."""

from __future__ import annotations

import pytest

from tests.distributed.harness import close_pools


@pytest.fixture(scope="package", autouse=True)
def _rank_pools():
    yield
    close_pools()  # their processes would otherwise hold memory through the rest of the session
