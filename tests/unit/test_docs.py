"""The configuration reference is generated from the schema and must stay in step with it."""

from pathlib import Path

from megatron.config.docs import render_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_current():
    on_disk = (ROOT / "docs" / "configuration.md").read_text()
    assert on_disk == render_markdown(), "regenerate with: python -m megatron.config.docs > docs/configuration.md"
