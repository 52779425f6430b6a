"""The syntax of the two config values that are small languages (``split`` and ``input_dir``), and of a
user's YAML (a key given twice in one mapping is an error, never last-wins).

The configuration layer owns what its values mean as text, so validation checks them without
importing the data layer; ``megatron.data`` applies them (and reports the same messages as
``DatasetError``). Nothing here reads a file: whether an ``input_dir`` prefix exists is the data
layer's question (``megatron.data.blended_dataset.parse_input_dir``).
"""

from __future__ import annotations

import math
import shlex
from typing import IO, Any

import numpy as np
import yaml

__all__ = ["RepeatedKey", "input_dir_words", "parse_split", "read_yaml", "split_words"]


class RepeatedKey(yaml.YAMLError):
    """A mapping of a YAML document gives one key twice (lines are 1-based)."""

    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(f"key '{key}' repeated at line {line} (first at line {first_line})")
        self.key, self.line, self.first_line = key, line, first_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key repeated in one mapping (a value or a whole section) raises
    ``RepeatedKey`` instead of the last one silently winning. Merge keys (``<<: *anchor``) keep their meaning:
    a key of the mapping itself overrides the merged one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the safe loader's own error says so
                continue
            if first is not None:
                raise RepeatedKey(key, key_node.start_mark.line + 1, first)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_yaml(stream: str | IO) -> Any:
    """``yaml.safe_load`` that refuses a key repeated in one mapping (``RepeatedKey``, a ``yaml.YAMLError``):
    the reader of every YAML a user writes (``-c`` files, ``-o`` values, a run's config.yaml)."""
    return yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def parse_split(split: str) -> list[float]:
    """'949,50,1' (or '949/50/1') -> three fractions summing to 1 (normalized in float64, as Megatron Core).

    Up to three finite non-negative numbers with a positive sum; missing ones are 0. The value may carry its shell
    quotes literally (``--split '99,1,0'`` in a script that quotes twice, as Megatron-LM's Llama 3 and gpt-oss
    scripts do; Megatron reads the numbers out of it). Raises ValueError."""
    text = split.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    parts = [p for p in text.replace("/", ",").split(",") if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"split '{split}' must be up to three numbers like '949,50,1'") from None
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split '{split}' must be up to three finite non-negative numbers with a positive sum")
    weights += [0.0] * (3 - len(weights))
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def _is_number(word: str) -> bool:
    """Whether ``word`` reads as a float (an input_dir weight, as opposed to a prefix)."""
    try:
        float(word)
    except ValueError:
        return False
    return True


def split_words(text: str) -> list[str]:
    """The words of a data-path value: split at whitespace, except inside quotes ("/my data/ds" or '/my data/ds')
    or after a backslash (/my\\ data/ds), as a shell would. A value without quotes or backslashes is split at
    whitespace only (a path holding a lone quote stays as it is)."""
    if not any(c in text for c in "\"'\\"):
        return text.split()
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote: a path that holds one
        return text.split()


def _weighted(words: list[str]) -> tuple[list[str], list[str]] | None:
    """(weights, prefixes) of ``w1 prefix1 w2 prefix2 ...`` where a prefix is the words up to the next number (a
    path with spaces, given as one argument of --data-path, arrives as several words), the first word after a
    weight always a prefix's (a prefix may be named 2024); None when a weight has no prefix."""
    weights, prefixes, i = [], [], 0
    while i < len(words):
        if i + 1 >= len(words) or not _is_number(words[i]):
            return None
        weights.append(words[i])
        j = i + 2
        while j < len(words) and not _is_number(words[j]):
            j += 1
        prefixes.append(" ".join(words[i + 1:j]))
        i = j
    return weights, prefixes


def input_dir_words(input_dir: str, name: str = "input_dir") -> tuple[list[str], list[float] | None]:
    """-> (words, weights): Megatron's ``w1 prefix1 w2 prefix2 ...`` gives its prefixes and weights (finite,
    non-negative, positive sum); anything else gives its words (prefixes or folders, not yet resolved) and
    None (weighting by token count). A path with spaces may be quoted (``split_words``); in the weighted form the
    words between two weights are one prefix. ``name`` is the setting's name in the messages (input_dir,
    train_data_path, ...). Raises ValueError with a hint."""
    words = split_words(input_dir)
    if not (len(words) > 1 and _is_number(words[0])):
        return words, None
    found = _weighted(words)
    if found is None:
        raise ValueError(f"{name} '{input_dir}' must alternate weights and prefixes: 'w1 prefix1 w2 prefix2'")
    texts, prefixes = found
    weights = [float(w) for w in texts]
    bad = [w for w in texts if not math.isfinite(float(w))]
    if bad:
        raise ValueError(f"{name} '{input_dir}': weight '{bad[0]}' is not a finite number; give finite "
                         f"non-negative weights, e.g. '0.3 prefix1 0.7 prefix2'")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{name} '{input_dir}': weights must be non-negative with a positive sum")
    return prefixes, weights


def string_list(items: list, choices: tuple | None) -> list[str]:
    """A list-of-names leaf's value: each item a name, one of ``choices`` when the leaf has them. Raises ValueError."""
    if any(isinstance(item, (dict, list)) for item in items):
        raise ValueError(f"must be a list of names, got {items!r}")
    words = [str(item) for item in items]
    bad = [w for w in words if choices and w not in choices]
    if bad:
        raise ValueError(f"{', '.join(bad)} not among {', '.join(choices)}")
    return words
