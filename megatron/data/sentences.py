"""A dependency-free sentence splitter for ``tools/preprocess_data.py --split-sentences``.

Megatron-LM splits with nltk's punkt, whose model is a download; this is a rule instead, so the same
corpus gives the same dataset on every machine. A sentence ends after ``.``, ``!`` or ``?`` (repeated,
and followed by closing quotes or brackets) when whitespace and then an upper-case letter, a digit,
or an opening quote or bracket follow; a ``.`` does not end a sentence after a known abbreviation
("Mr.", "Dr.", "e.g.", "i.e.", "vs.", "Fig.", ...), a single initial ("J. Smith") or a dotted acronym
("U.S."). Sentences are the text between these ends, stripped of the whitespace around them; with
``keep_newlines`` (Megatron's ``--keep-newlines``) each keeps the newlines that follow it.
"""

from __future__ import annotations

import re

ABBREVIATIONS = frozenset("""
    mr mrs ms dr prof sr jr st mt vs cf fig figs no nos vol vols eq eqs ch sec sect art p pp al approx
    dept est gen gov govt capt col lt sgt rev hon inc ltd co corp bros jan feb mar apr jun jul aug sep sept
    oct nov dec
""".split())
_BOUNDARY = re.compile(r"[.!?]+[\"')\]\u2019\u201d]*(\s+)")
_OPENERS = "\"'([\u2018\u201c"
_INITIALS = re.compile(r"(?:[A-Za-z]\.)+")


def _ends_sentence(text: str, match: re.Match) -> bool:
    """Whether the punctuation of ``match`` ends a sentence: what follows starts one and what precedes is no
    abbreviation."""
    after = match.end()
    if after >= len(text) or not (text[after].isupper() or text[after].isdigit() or text[after] in _OPENERS):
        return False
    if text[match.start():match.start(1)].rstrip("\"')]\u2019\u201d") != ".":
        return True  # "!", "?", "..." and the like always end one
    word = text[:match.start() + 1].rsplit(None, 1)[-1].lstrip(_OPENERS)
    return not (_INITIALS.fullmatch(word) or word[:-1].lower() in ABBREVIATIONS)


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """The sentences of ``text``, in order, stripped of surrounding whitespace; with ``keep_newlines`` each
    ends with the newlines that follow it. None for a text of only whitespace."""
    sentences, start = [], 0
    for match in _BOUNDARY.finditer(text):
        if _ends_sentence(text, match):
            sentences.append((text[start:match.start(1)], match.group(1)))
            start = match.end()
    rest = text[start:]
    sentences.append((rest, rest[len(rest.rstrip()):]))
    return [body.strip() + ("\n" * gap.count("\n") if keep_newlines else "") for body, gap in sentences
            if body.strip()]
