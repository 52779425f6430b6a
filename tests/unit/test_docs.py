"""The configuration reference is generated from the schema and must stay in step with it."""

from pathlib import Path

from megatron.config.docs import render_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_current():
    on_disk = (ROOT / "docs" / "configuration.md").read_text()
    assert on_disk == render_markdown(), "regenerate with: python -m megatron.config.docs > docs/configuration.md"


def test_every_test_reliability_md_cites_exists():
    """docs/reliability.md backs each promise with tests: every file and test function it names must exist, so a
    renamed or removed test cannot leave a promise unbacked without this failing."""
    import re

    text = (ROOT / "docs" / "reliability.md").read_text()
    defined = set()
    for path in (ROOT / "tests").rglob("*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(), flags=re.MULTILINE))
    cited = set(re.findall(r"::(test_\w+)", text)) | set(re.findall(r"`(test_\w+)`", text))
    files = set(re.findall(r"(tests/[\w/]+\.py)", text))
    assert cited and files
    assert sorted(cited - defined) == []
    assert sorted(f for f in files if not (ROOT / f).is_file()) == []
