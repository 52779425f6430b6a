"""The two helpers every schema section is built with: ``opt`` (a field, its default and help text) and
``section`` (a nested section)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A config field: its default and the help text that becomes the flag's ``--help``."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, key: str, help: str) -> Any:
    """A nested section, written ``key:`` in YAML."""
    return field(default_factory=cls, metadata={"section": key, "help": help})
