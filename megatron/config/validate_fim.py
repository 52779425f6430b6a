"""Fill-in-the-middle (``--fim-data``): the checks of its settings that need no tokenizer (part of ``validate``).
That the tokenizer holds the FIM tokens is checked once it is built, before any process group
(``megatron.data.fim.fim_tokens``, from ``pretrain_gpt.resolve``)."""

from __future__ import annotations

import math

from megatron.config.cli import fail as _fail
from megatron.config.schema import Config

RATES = ("fim_rate", "fim_spm_rate", "fim_fragment_rate")
SENTINELS = ("fim_prefix_token", "fim_middle_token", "fim_suffix_token", "fim_eod_token", "fim_split_sample")


def _flag(leaf: str) -> str:
    return "--" + leaf.replace("_", "-")


def check_fim(config: Config) -> None:
    """Real data, probabilities in [0, 1], a fragment rate with a split token, a tokenizer with token strings,
    and sentinels that differ from one another (the rearranged text must be readable back)."""
    d = config.dataset
    for leaf in RATES:  # with or without --fim-data: no value outside [0, 1] means anything
        value = getattr(d, leaf)
        if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
            _fail(f"{leaf} ({_flag(leaf)}) is a probability, so it must be in [0, 1], got {value}; give a value "
                  f"from 0 to 1.")
    if not d.fim_data:
        return
    if d.mock_data:
        _fail("--fim-data rearranges the documents of real data, but mock_data is set; give --data-path and the "
              "tokenizer the data was made with, or drop --fim-data.")
    if d.fim_split_sample is not None and d.fim_fragment_rate is None:
        _fail(f"--fim-split-sample {d.fim_split_sample} cuts documents into fragments, each rearranged with "
              f"probability --fim-fragment-rate, which is not set; give --fim-fragment-rate (0 to 1), or drop "
              f"--fim-split-sample.")
    if config.tokenizer.tokenizer_type == "NullTokenizer":
        _fail("--fim-data cuts a document's text at character positions and tokenizes the pieces again, which needs "
              "a tokenizer with token strings; NullTokenizer (ids written as numbers) has none: give the tokenizer "
              "the data was made with, or drop --fim-data.")
    seen: dict[str, str] = {}
    for leaf in SENTINELS:
        token = getattr(d, leaf)
        if token is not None and token in seen:
            _fail(f"{_flag(leaf)} and {_flag(seen[token])} are both {token!r}, but FIM needs them told apart in the "
                  f"rearranged samples; give each its own token.")
        seen.setdefault(token, leaf)
