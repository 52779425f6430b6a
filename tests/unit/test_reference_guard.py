"""The reference guard (tests/reference_guard.py): without the ``reference`` extra's packages the tests that need
them skip, and collection never fails; under MEGATRON_REQUIRE_REFERENCE=1 (CI) their absence fails instead.
The packages cannot be uninstalled here: a subprocess collects the tests with them blocked (``sys.modules[name] =
None``, so that importing them raises ImportError, as when they are absent)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reference_guard import REQUIRE_REFERENCE, missing_package

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ("transformers", "lm_eval", "megatron.core", "accelerate", "openai", "fastapi", "uvicorn", "wandb",
             "tiktoken", "tenacity")
_USES = re.compile(r"\b(transformers|lm_eval|megatron_core|megatron\.core|openai|fastapi|uvicorn|wandb|tiktoken)\b")


def test_a_missing_package_is_told_from_other_skips():
    assert missing_package("could not import 'transformers': No module named 'transformers'")
    assert missing_package("lm-eval is not installed: pip install -e .[eval]")
    assert missing_package("megatron-core 0.15.0 is installed; the reference is pinned to 0.16.1")
    assert not missing_package("needs a CUDA device")
    assert not missing_package("zstandard is installed: .zst inputs are read")


def _collect(tmp_path: Path, files: list[str], require: bool) -> subprocess.CompletedProcess:
    (tmp_path / "block_reference.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in REFERENCE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    env.pop(REQUIRE_REFERENCE, None)
    if require:
        env[REQUIRE_REFERENCE] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "block_reference", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *files], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_without_the_reference_packages_collection_skips_and_ci_fails(tmp_path):
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if _USES.search(p.read_text()) and p.name != "test_reference_guard.py")
    assert len(files) > 20
    done = _collect(tmp_path, files, require=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout.strip().splitlines()[-1]
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED [")]  # -ra's summary
    assert "error" not in summary and re.search(r"\d+ tests? collected", summary), summary
    assert any("could not import 'transformers'" in line for line in skipped), done.stdout[-3000:]
    assert any("lm-eval is not installed" in line for line in skipped), done.stdout[-3000:]  # whole modules skip
    required = _collect(tmp_path, ["tests/inference/test_lm_eval.py"], require=True)  # one module is enough
    assert required.returncode != 0 and REQUIRE_REFERENCE in required.stdout, required.stdout[-3000:]
