"""The LAMBADA task's figures and per-example records, in both modes (see ``tasks``).

Per mode, lm-eval's ``lambada_openai`` metrics: ``acc`` (the share of examples whose every target token
is the model's argmax, given the context and the target's earlier tokens) and ``perplexity``
(``exp(-mean over examples of the target's log-likelihood)``: of the target word, not of a token).

Each example's ``greedy`` continuation is what the model writes after the context, greedily, for as
many tokens as the target has: the argmax tokens up to the first that differs from the target, then
further forwards from the model's own tokens (one more pass over the examples still unfinished, per
token). It equals the target exactly when the example counts as right.
"""

from __future__ import annotations

import math

from megatron.evaluation.tasks import ClozeItem, Sample, cloze_items

MODES = {"strict": "lm-eval's lambada_openai: every token of the last word (with its leading space) predicted "
                   "greedily",
         "non_strict": "Megatron-LM's default: only the text's last token predicted (a word of several tokens "
                       "needs only its final piece right)"}


def plan(texts: list[str], tokenizer, seq_len: int) -> dict[str, list[ClozeItem]]:
    """Each mode's items. ValueError naming a text with nothing to predict."""
    return {mode: cloze_items(texts, tokenizer, seq_len, strict=mode == "strict") for mode in MODES}


def greedy_continuations(evaluator, items: list[ClozeItem], seq_len: int, label: str):
    """(the scores of the items' samples, each item's greedy continuation as token ids). Collective."""
    scores = evaluator.cloze([item.sample for item in items], label, "examples")
    greedy, pending = [], []
    for i, (item, score) in enumerate(zip(items, scores)):
        wrong = [k for k, (a, b) in enumerate(zip(score.predicted, item.target_ids)) if a != b]
        cut = len(item.target_ids) if not wrong else wrong[0] + 1
        greedy.append(score.predicted[:cut])
        if cut < len(item.target_ids):
            pending.append(i)
    while pending:  # the same on every rank: the scores are
        samples = []
        for i in pending:
            tokens = (items[i].context_ids + greedy[i] + [0])[-(seq_len + 1):]  # 0: the unknown next token
            samples.append(Sample(tokens, [0] * (len(tokens) - 2) + [1]))
        for i, score in zip(pending, evaluator.cloze(samples)):
            greedy[i].append(score.predicted[-1])
        pending = [i for i in pending if len(greedy[i]) < len(items[i].target_ids)]
    return scores, greedy


def figures(evaluator, planned: dict[str, list[ClozeItem]], tokenizer, seq_len: int) -> tuple[dict, list[dict]]:
    """(the results' fields, one record per example). Collective."""
    result, records = {"examples": len(planned["strict"]), "modes": MODES}, None
    for mode, items in planned.items():
        scores, greedy = greedy_continuations(evaluator, items, seq_len, f"lambada ({mode.replace('_', '-')})")
        correct = sum(s.right for s in scores)
        mean = sum(s.loglikelihood for s in scores) / len(scores)
        result[mode] = {"acc": correct / len(scores), "perplexity": math.exp(-mean) if -mean < 709.0 else math.inf,
                        "correct": correct, "target_tokens": sum(len(item.target_ids) for item in items)}
        examples = [{"context": item.context, "target": item.target, "greedy": tokenizer.detokenize(ids),
                     "match": score.right, "target_loglikelihood": score.loglikelihood,
                     "target_tokens": len(item.target_ids)}
                    for item, score, ids in zip(items, scores, greedy)]
        if records is None:
            records = [{"index": i, **example} for i, example in enumerate(examples)]
        else:
            for record, example in zip(records, examples):
                record[mode] = {k: v for k, v in example.items() if k != "context"}
    return result, records


def summary(result: dict) -> list[str]:
    """The log lines that name each figure."""
    return [f"lambada {mode.replace('_', '-')} ({'lm-eval' if mode == 'strict' else 'Megatron-LM'}): acc "
            f"{result[mode]['acc']:.6g} ({result[mode]['correct']}/{result['examples']}) | perplexity (of the "
            f"target) {result[mode]['perplexity']:.6g}" for mode in MODES]
