"""The reference guard (registered by tests/conftest.py): a test that needs a package of the ``reference`` extra
(transformers, lm-eval, megatron-core, the OpenAI client, ...) skips without it (``pytest.importorskip``), so
that ``pip install -e ".[test]"`` is enough for the edit-test loop; under ``MEGATRON_REQUIRE_REFERENCE=1`` (CI,
which installs ``.[test,reference]``: .ci/run sets it) such a skip is a failure instead, at collection (a
module-level ``importorskip``) or in the test."""

from __future__ import annotations

import os
import re

import pytest

REQUIRE_REFERENCE = "MEGATRON_REQUIRE_REFERENCE"
# what a skip for a missing package says: pytest.importorskip's message, or a test's own "... is not installed"
_MISSING = re.compile(r"could not import '|No module named|is not installed|the reference is pinned to")


def missing_package(reason: str) -> bool:
    """Whether a skip's reason is a package that is not installed (or not the pinned version)."""
    return bool(_MISSING.search(reason))


def fail_missing_reference(report) -> None:
    """Under MEGATRON_REQUIRE_REFERENCE=1: a skip for a missing package becomes a failure (CI installs them all)."""
    if os.environ.get(REQUIRE_REFERENCE) != "1" or not report.skipped:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if missing_package(reason):
        report.outcome = "failed"
        report.longrepr = (f"{reason}: {REQUIRE_REFERENCE}=1 makes a missing reference package a failure; install "
                           f'them with pip install -e ".[test,reference]", or unset {REQUIRE_REFERENCE}.')


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    fail_missing_reference(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    fail_missing_reference(outcome.get_result())
