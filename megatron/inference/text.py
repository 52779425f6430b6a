"""The text of a sequence as its tokens arrive: deltas safe to show, and stop strings.

A token can end in the middle of a character (byte-level BPE splits UTF-8 sequences) and the text
so far can end with the beginning of a stop string; neither may be shown yet. ``add`` returns the
part of the text that is final: decoded, not an incomplete character, and not a possible start of
a stop string. When a stop string appears the text is cut before it and the sequence is done.
"""

from __future__ import annotations

from collections.abc import Callable

_INCOMPLETE = "\ufffd"  # what a decoder gives for a partial UTF-8 sequence


_CONTEXT_TOKENS = 4  # prompt tokens decoded before the new ones


class TextTracker:
    """``prompt``: the ids before the tracked ones; its last few are decoded with them and their text removed,
    so that the new text starts as it does after the prompt (a tokenizer that joins ids with spaces, or a
    SentencePiece model that drops the leading space of a decoded text, would otherwise glue it on)."""

    def __init__(self, detokenize: Callable[[list[int]], str], stop: list[str], prompt: list[int] = ()):
        self.stop = list(stop)
        context = list(prompt)[-_CONTEXT_TOKENS:]
        head = detokenize(context) if context else ""

        def decode(tokens: list[int]) -> str:
            text = detokenize(context + tokens) if context else detokenize(tokens)
            return text[len(head):] if context and text.startswith(head) else detokenize(tokens)

        self.detokenize = decode
        self.tokens: list[int] = []
        self.text = ""  # the final text so far (everything returned by add)
        self.stopped = False

    def add(self, token: int) -> str:
        """Append ``token``; return the newly final text (possibly empty)."""
        self.tokens.append(token)
        full = self.detokenize(self.tokens)
        if self.stop:
            cut = self._first_stop(full)
            if cut is not None:
                self.stopped = True
                return self._advance(full[:cut])
        safe = len(full) - self._held_back(full)
        return self._advance(full[:safe])

    def finish(self) -> str:
        """The sequence ended without a stop string: whatever was held back is final now."""
        if self.stopped:
            return ""
        return self._advance(self.detokenize(self.tokens))

    def _advance(self, final: str) -> str:
        if not final.startswith(self.text):  # a decoder that rewrote earlier text: show nothing new
            return ""
        delta, self.text = final[len(self.text):], final
        return delta

    def _first_stop(self, full: str) -> int | None:
        start = max(0, len(self.text) - max(len(s) for s in self.stop))
        found = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held_back(self, full: str) -> int:
        if full.endswith(_INCOMPLETE):
            return len(full) - len(full.rstrip(_INCOMPLETE))
        longest = 0
        for s in self.stop:  # the longest end of the text that begins a stop string
            for n in range(min(len(s) - 1, len(full)), longest, -1):
                if full.endswith(s[:n]):
                    longest = n
                    break
        return longest
