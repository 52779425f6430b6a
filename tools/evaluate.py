"""Evaluate a checkpoint: perplexity of a text (overlapping windows) or LAMBADA cloze accuracy, under any
parallel layout the training runs under.

    python tools/evaluate.py --task perplexity --input doc.txt --load output/run --overlapping-eval 128
    python tools/evaluate.py --task lambada --input lambada_test.jsonl --load output/run
    python tools/evaluate.py --task lm-eval --lm-eval-tasks lambada_openai,hellaswag --load output/run --output r.json
    torchrun --nproc-per-node 4 tools/evaluate.py --task lambada --input l.jsonl --load output/run --tp 2 --pp 2

``--input``: a plain text file (one document) or JSON lines with a ``text`` key (``--json-key``).
Every other flag is a pretrain_gpt.py flag: the checkpoint's saved configuration is the base (its model,
tokenizer, ``max_seq_len``, precision) and the flags given now set the layout (``--tp``, ``--pp``,
``--dp``, ``--sharding-stage``, ...) and the micro-batch size. A checkpoint of any layout evaluates under
any other. Progress goes to stderr; the results are one JSON object on the last line of stdout (and in
``--output``). Exit status 2, with a one-line message, for bad input, a missing or damaged checkpoint.

Perplexity: ``loss`` is the mean token loss (nats) over every token but the first, ``perplexity`` its
exponential; ``adjusted_perplexity`` rescales the loss by tokens per word (Megatron-LM's word-level
figure, comparable across tokenizers). LAMBADA: ``strict_accuracy`` (every token of the last word, as
tokenized with its leading space, predicted greedily) and ``non_strict_accuracy`` (only the text's last
token: Megatron-LM's default). lm-eval: lm-evaluation-harness's evaluator on the checkpoint
(``megatron.evaluation.lm_eval_model``), its results dictionary in ``--output`` (``results`` keyed by task,
metrics as lm-eval names them; each example with ``--log-samples``) and its ``results`` on stdout; an
unknown task or lm-eval not installed is one line, exit 2, before the checkpoint is read. docs/evaluation.md
says more.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint import CheckpointError  # noqa: E402
from megatron.config import ConfigError  # noqa: E402
from megatron.config.help import CONFIG_FLAGS_NOTE  # noqa: E402
from megatron.evaluation import harness  # noqa: E402
from megatron.evaluation.loading import configure, load_evaluator  # noqa: E402
from megatron.evaluation.tasks import lambada_samples, perplexity_samples, read_texts, word_count  # noqa: E402
from megatron.initialize import shutdown  # noqa: E402
from megatron.tokenizer import TokenizerError  # noqa: E402

PROG = "evaluate.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog=f"{CONFIG_FLAGS_NOTE} The checkpoint's saved configuration is the base; "
                                       "the flags given now set the layout (--tp, --pp, --dp, ...) and the "
                                       "micro-batch size.")
    p.add_argument("--task", choices=("perplexity", "lambada", "lm-eval"), required=True,
                   help="perplexity of a text, LAMBADA cloze accuracy, or lm-evaluation-harness tasks.")
    p.add_argument("--input", default=None,
                   help="perplexity, lambada: text file (one document) or JSON lines with a text key.")
    p.add_argument("--json-key", default="text", help="The key of each JSON line's text.")
    p.add_argument("--overlapping-eval", type=int, default=None, metavar="STRIDE",
                   help="perplexity: windows of max_seq_len tokens every STRIDE tokens; each later window scores "
                        "only its last STRIDE tokens (default: max_seq_len, no overlap).")
    p.add_argument("--output", default=None, help="Also write the results' JSON here.")
    g = p.add_argument_group("lm-eval (--task lm-eval; pip install -e .[eval])")
    g.add_argument("--lm-eval-tasks", default=None, metavar="T1,T2",
                   help="lm-eval task (or group) names, comma-separated.")
    g.add_argument("--include-path", default=None, metavar="DIR",
                   help="A folder of your own lm-eval task YAML files (searched first).")
    g.add_argument("--limit", type=float, default=None,
                   help="At most this many examples per task (a fraction below 1: that share of them).")
    g.add_argument("--num-fewshot", type=int, default=None, help="Few-shot examples per prompt (the task's default).")
    g.add_argument("--batch-size", type=int, default=None,
                   help="Requests per forward (default: micro-batch size x pp x dp).")
    g.add_argument("--max-gen-toks", type=int, default=256,
                   help="Tokens generate_until makes at most when a task does not say.")
    g.add_argument("--log-samples", action="store_true",
                   help="Also write each example's requests and responses (lm-eval's samples) into --output.")
    g.add_argument("--bootstrap-iters", type=int, default=100000,
                   help="lm-eval's bootstrap iterations for the metrics' standard errors (0: none).")
    return p


def samples_for(task: str, texts: list[str], tokenizer, seq_len: int, stride: int | None):
    if task == "perplexity":
        ids = []
        for text in texts:  # documents joined by the end-of-document token, as the training data is
            ids += tokenizer.tokenize(text) + [tokenizer.eod]
        return {"all": perplexity_samples(ids[:-1], seq_len, stride)}
    return {mode: lambada_samples(texts, tokenizer.tokenize, seq_len, strict=mode == "strict")
            for mode in ("strict", "non_strict")}


def read_input(args: argparse.Namespace) -> list[str]:
    """The texts of ``--input``; ValueError when it holds no words (empty, blank lines: a perplexity of
    whitespace tokens, per a word count of 0, would be a number that means nothing)."""
    if args.input is None:
        raise ValueError(f"--task {args.task} needs --input FILE: the text to evaluate.")
    texts = read_texts(args.input, args.json_key)
    if not any(text.split() for text in texts):
        raise ValueError(f"{args.input} holds no words (it is empty, or only blank lines): nothing to evaluate.")
    return texts


def evaluate(args: argparse.Namespace, config, tokenizer, texts: list[str]) -> dict:
    samples = samples_for(args.task, texts, tokenizer, config.dataset.max_seq_len, args.overlapping_eval)
    evaluator = load_evaluator(config)
    ps = evaluator.ps
    result = {"task": args.task, "input": args.input, "checkpoint": evaluator.path, "step": evaluator.step,
              "layout": {"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size, "sharding": ps.sharding_size}}
    if args.task == "perplexity":
        windows = samples["all"]
        tokens = sum(sum(s.mask) for s in windows)
        loss = evaluator.score(windows, "loss", "perplexity: ") / tokens
        words = word_count(texts)
        ratio = tokens / max(words - 1, 1)  # Megatron-LM's (tokenized - 1) / (words - 1): tokens scored per word
        result.update(tokens=tokens, words=words, windows=len(windows), stride=args.overlapping_eval
                      or config.dataset.max_seq_len, loss=loss, perplexity=_exp(loss),
                      adjusted_perplexity=_exp(loss * ratio))
    else:
        result["examples"] = len(texts)
        result["modes"] = {"strict": "every token of the last word (with its leading space) predicted greedily",
                           "non_strict": "only the text's last token predicted (Megatron-LM's default; a word of "
                                         "several tokens needs only its final piece right)"}
        for mode, cloze in samples.items():
            correct = evaluator.score(cloze, "cloze", f"lambada ({mode.replace('_', '-')}): ")
            result[f"{mode}_correct"] = int(round(correct))
            result[f"{mode}_accuracy"] = correct / len(cloze)
    return result


def evaluate_lm_eval(args: argparse.Namespace, rest: list[str]) -> dict | None:
    """lm-eval's results dictionary on the checkpoint (``harness.evaluate``), with where the numbers come
    from under ``megatron`` (None on the ranks lm-eval gives none). The tasks are found before the checkpoint
    is read."""
    tasks = [t.strip() for t in (args.lm_eval_tasks or "").split(",") if t.strip()]
    if not tasks:
        raise ValueError("--task lm-eval needs --lm-eval-tasks T1,T2: the lm-eval tasks to run.")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise ValueError(f"--include-path {args.include_path} is not a folder: give the folder of your task "
                         f"YAML files.")
    manager = harness.task_manager(tasks, args.include_path)
    from megatron.evaluation.lm_eval_model import MegatronLM

    config, tokenizer = configure(rest)
    evaluator = load_evaluator(config, progress=False)
    lm = MegatronLM(evaluator=evaluator, tokenizer=tokenizer, batch_size=args.batch_size,
                    max_gen_toks=args.max_gen_toks, seed=config.seed)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    result = harness.evaluate(lm, tasks, manager, limit, args.num_fewshot, args.log_samples, args.bootstrap_iters)
    if result is None:  # lm-eval gives the results to the processes of local rank 0 only
        return None
    ps = evaluator.ps
    result["megatron"] = {"checkpoint": evaluator.path, "step": evaluator.step, "max_length": lm.max_length,
                          "batch_size": lm.batch_size, "layout": {"tp": ps.tp_size, "pp": ps.pp_size,
                                                                  "dp": ps.dp_size, "sharding": ps.sharding_size}}
    return result


def _exp(x: float) -> float:
    """exp, infinite past what a float holds (no silent cap: Megatron-LM's min(20, .) hides the number)."""
    return math.exp(x) if x < 709.0 else math.inf


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        if args.task == "lm-eval":
            result = evaluate_lm_eval(args, rest)
            summary = result and {"results": result["results"], "megatron": result["megatron"]}
        else:
            texts = read_input(args)  # a bad input is said before the checkpoint is read
            config, tokenizer = configure(rest)
            result = summary = evaluate(args, config, tokenizer, texts)
        if rank == 0:
            if args.output:
                with open(args.output, "w", encoding="utf-8") as f:
                    f.write(json.dumps(result) + "\n")
            print(json.dumps(summary), flush=True)
    except (ConfigError, CheckpointError, TokenizerError, ValueError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
