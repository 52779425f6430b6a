"""Text to token ids and back, the way every endpoint of the server does it (``/v1/completions``'
text prompts, chat, ``/tokenize``, ``/detokenize``), and vLLM's ``/tokenizer_info``.

The text of the tokenizer's end-of-document and beginning-of-sequence tokens (``<|endoftext|>``,
``</s>``) is that token, as Hugging Face tokenizers (and so vLLM) read their special tokens: a chat
template writes them as text, and lm-eval finds the end-of-document id by tokenizing its text. The
project's GPT-2 BPE and SentencePiece tokenizers read that text as ordinary text (documents must not
forge a document boundary in training data): the server splits the text at those spellings first.
No other token is added (no BOS): the model was trained without one.
"""

from __future__ import annotations

import re

from megatron.inference.server.errors import ApiError


class Vocabulary:
    """The engine's tokenizer as the server uses it; ``size`` is the ids a prompt may hold."""

    def __init__(self, tokenizer, size: int, positions: int):
        self.tokenizer, self.size, self.positions = tokenizer, size, positions
        self.eos = tokenizer.spelling(tokenizer.eod)
        self.bos = tokenizer.spelling(tokenizer.bos) if tokenizer.bos is not None else None
        specials = {text: i for text, i in ((self.eos, tokenizer.eod), (self.bos, tokenizer.bos))
                    if text and tokenizer.tokenize(text) != [i]}
        self.specials = specials
        self.pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) \
            if specials else None

    def encode(self, text: str, what: str = "prompt ", param: str = "prompt") -> list[int]:
        """The ids of ``text``; a text the tokenizer refuses (NullTokenizer's non-ids, a lone surrogate) or
        ids outside the model's vocabulary are the client's 400 (naming ``what``), never a 500."""
        try:
            if self.pattern is None:
                ids = list(self.tokenizer.tokenize(text))
            else:
                ids, at = [], 0
                for found in self.pattern.finditer(text):
                    ids += self.tokenizer.tokenize(text[at:found.start()]) if found.start() > at else []
                    ids.append(self.specials[found.group()])
                    at = found.end()
                ids += self.tokenizer.tokenize(text[at:]) if at < len(text) else []
        except Exception as err:  # noqa: BLE001 - any tokenizer's refusal of this text
            raise ApiError(400, f"{what}cannot be tokenized ({type(err).__name__}: "
                           f"{' '.join(str(err).split())[:200]}).", param) from None
        self.check(ids, what, param, "gives")
        return ids

    def check(self, ids: list[int], what: str = "prompt ", param: str = "prompt", verb: str = "has") -> None:
        bad = next((t for t in ids if not 0 <= t < self.size), None)
        if bad is not None:
            raise ApiError(400, f"{what}{verb} token id {bad}, outside the vocabulary (0..{self.size - 1}).", param)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.detokenize(ids)

    def piece(self, token: int) -> str:
        """One id's text (a byte-level BPE token in the middle of a UTF-8 character: ``"\\ufffd"``)."""
        return self.tokenizer.detokenize([token])

    def info(self, chat_template: str) -> dict:
        """vLLM's ``GET /tokenizer_info``: the tokenizer's settings as tokenizer_config.json names them."""
        return {"tokenizer_class": self.tokenizer.name, "eos_token": self.eos, "bos_token": self.bos,
                "pad_token": None, "unk_token": None, "add_bos_token": False, "add_eos_token": False,
                "model_max_length": self.positions, "vocab_size": self.size, "chat_template": chat_template}
