"""The evaluation tasks' windows against lm-eval's own code: ``rolling_samples`` scores what
``lm_eval.utils.get_rolling_token_windows`` + ``make_disjoint_window`` (its ``hf`` backend's
``loglikelihood_rolling``) score, each prediction with the same context, for every document length around
the window's multiples; the word and byte counts are lm-eval's."""

from __future__ import annotations

import pytest

from megatron.evaluation.tasks import count_bytes, count_words, rolling_samples


def _predictions(samples) -> list[tuple[int, tuple[int, ...]]]:
    """(the token predicted, the tokens it is predicted from) for every counted prediction of ``samples``."""
    return [(s.tokens[j + 1], tuple(s.tokens[:j + 1])) for s in samples for j, m in enumerate(s.mask) if m]


def _lm_evals(doc: list[int], prefix: int, seq_len: int) -> list[tuple[int, tuple[int, ...]]]:
    """The same from lm-eval's windows, each cut as its hf backend cuts a (context, continuation) pair."""
    from lm_eval import utils

    out = []
    for context, continuation in map(utils.make_disjoint_window,
                                     utils.get_rolling_token_windows(doc, prefix, seq_len, context_len=1)):
        inp = (context + continuation)[-(seq_len + 1):][:-1]
        first = len(inp) - len(continuation)
        out += [(token, tuple(inp[:first + k + 1])) for k, token in enumerate(continuation)]
    return out


@pytest.mark.parametrize("seq_len", [1, 2, 5, 16])
def test_rolling_windows_score_what_lm_eval_scores(seq_len):
    pytest.importorskip("lm_eval", reason="lm-eval (the eval extra) is not installed")
    for n in range(0, 4 * seq_len + 3):
        doc = list(range(1000, 1000 + n))
        ours = _predictions(rolling_samples(doc, 7, seq_len))
        assert ours == _lm_evals(doc, 7, seq_len), n
        assert [token for token, _ in ours] == doc  # every token once, the first after the prefix
        assert all(len(s.tokens) <= seq_len + 1 for s in rolling_samples(doc, 7, seq_len))


def test_words_and_bytes_are_counted_as_lm_eval_counts_them():
    pytest.importorskip("lm_eval", reason="lm-eval (the eval extra) is not installed")
    from lm_eval.api.task import Task

    for text in ["", " ", "a", "a b", " a  b\n", "naïve café\tok\n\n", "line one\nline two "]:
        assert (count_words(text), count_bytes(text)) == (Task.count_words(text), Task.count_bytes(text)), text
