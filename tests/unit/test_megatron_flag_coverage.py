"""Every option of Megatron-LM core_v0.16.1's ``pretrain_gpt.py`` parser (``tests/fixtures/
megatron_flags_core_v0.16.1.json``: its 680 options without ``--help``, read from the parser itself with their
values' shapes and choices) is known here: implemented, accepted without effect (and said so at start), or refused
by name with what to do instead (``megatron/config/megatron_flags.py`` and its two tables; docs/megatron.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.config import ConfigError, megatron_flags, parse_config

FLAGS: dict[str, dict] = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "megatron_flags_core_v0.16.1.json").read_text())


def _with_value(flag: str, spec: dict) -> list[str]:
    if not spec.get("takes_value"):
        return [flag]
    return [flag, spec["choices"][0] if spec.get("choices") else "1"]


def _said(argv: list[str]) -> str:
    try:
        parse_config(argv)
    except (ConfigError, ValueError) as err:
        return str(err)
    return ""


def test_the_list_is_megatron_core_0_16_1s_parser():
    assert len(FLAGS) == 680
    assert {"--tensor-model-parallel-size", "--moe-router-load-balancing-type", "--muon-momentum"} <= set(FLAGS)


def test_a_command_line_holding_every_megatron_flag_has_none_unknown():
    argv = [arg for flag, spec in FLAGS.items() for arg in _with_value(flag, spec)]
    said = _said(argv)
    assert "unknown argument" not in said, said[:2000]


def test_every_megatron_flag_is_in_one_table():
    """Implemented (ours, an alias, a rewrite, derived), accepted without effect, or absent: exactly one, by name
    (the prefix rules, ``--moe-*`` and the like, are for flags of later Megatron versions)."""
    for flag in FLAGS:
        kinds = [flag in megatron_flags.IMPLEMENTED or flag in megatron_flags.REWRITES or flag in
                 megatron_flags.DERIVED, flag in megatron_flags.NO_EFFECT, flag in megatron_flags.ABSENT]
        assert sum(kinds) == 1, (flag, kinds)


ABSENT = sorted(flag for flag in FLAGS if flag in megatron_flags.ABSENT and not set(
    _with_value(flag, FLAGS[flag])[1:]) & set(megatron_flags.ABSENT[flag].noop))


@pytest.mark.parametrize("flag", ABSENT)
def test_an_absent_feature_s_flag_is_refused_by_its_name(flag):
    said = _said(["--train-iters", "10", *_with_value(flag, FLAGS[flag])])
    assert flag in said and "unknown argument" not in said, said


def test_our_flags_kept_for_megatron_that_do_nothing_are_named_with_the_accepted_ones():
    warnings: list[str] = []
    parse_config(["--train-iters", "10", "--overlap-param-gather", "--moe-shared-expert-overlap", "--use-flash-attn"],
                 warnings=warnings)  # --moe-shared-expert-overlap does something (megatron/moe/overlap.py)
    assert ("accepted, no effect here: --use-flash-attn, --overlap-param-gather "
            "(docs/megatron.md says why).") in warnings
