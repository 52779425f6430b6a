"""Evaluate a checkpoint: perplexity of documents or LAMBADA cloze accuracy, on lm-eval's definitions, or
lm-evaluation-harness tasks, under any parallel layout the training runs under.

    python tools/evaluate.py --task perplexity --input docs.jsonl --load output/run [--overlapping-eval 128]
    python tools/evaluate.py --task lambada --input lambada_test.jsonl --load output/run --output-examples ex.jsonl
    python tools/evaluate.py --task lm-eval --lm-eval-tasks lambada_openai,hellaswag --load output/run --output r.json
    torchrun --nproc-per-node 4 tools/evaluate.py --task lambada --input l.jsonl --load output/run --tp 2 --pp 2

``--input``: a plain text file (one document) or JSON lines with a ``text`` key (``--json-key``).
Every other flag is a pretrain_gpt.py flag: the checkpoint's saved configuration is the base (its model,
tokenizer, ``max_seq_len``, precision) and the flags given now set the layout (``--tp``, ``--pp``,
``--dp``, ``--sharding-stage``, ...) and the micro-batch size. A checkpoint of any layout evaluates under
any other. Progress goes to stderr (a bar on a terminal, a line every 10 s in a file); the results are one
JSON object on the last line of stdout (and in ``--output``). Exit status 2, with a one-line message, for bad
input, a missing or damaged checkpoint.

Perplexity (lm-eval's rolling windows: each document on its own, its first token scored after the
BOS or end-of-document token): ``word_perplexity``, ``byte_perplexity``, ``bits_per_byte`` as lm-eval
defines them, and ``token_perplexity``; with ``--overlapping-eval`` also ``strided`` (Megatron-LM's
overlapping windows: ``loss``, ``perplexity``, ``adjusted_perplexity``). LAMBADA, in ``strict``
(lm-eval's ``lambada_openai``) and ``non_strict`` (Megatron-LM's default) modes: ``acc`` and
``perplexity`` (of the target) each; ``--output-examples`` writes one JSON line per example.
lm-eval: lm-evaluation-harness's evaluator on the checkpoint (``megatron.evaluation.lm_eval_model``), its
results dictionary in ``--output`` (``results`` keyed by task, metrics as lm-eval names them; each example
with ``--log-samples``), lm-eval's results table and then its ``results`` on stdout; an unknown task, lm-eval
not installed, a bad ``--limit`` or a task YAML that YAML cannot read is one line, exit 2, before the checkpoint
is read. A task folder
(``--include-path``) is code: lm-eval runs the Python its YAML names with ``!function``; the tool says so in
one line when the folder holds any. ``--output``'s folder is made (or refused) before the model is loaded.
docs/evaluation.md says more.
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
from megatron.evaluation import harness, lambada, perplexity  # noqa: E402
from megatron.evaluation.loading import configure, load_evaluator  # noqa: E402
from megatron.evaluation.tasks import read_texts  # noqa: E402
from megatron.file_lock import make_writable_folder  # noqa: E402
from megatron.initialize import shutdown  # noqa: E402
from megatron.tokenizer import TokenizerError  # noqa: E402

PROG = "evaluate.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog=f"{CONFIG_FLAGS_NOTE} The checkpoint's saved configuration is the base; "
                                       "the flags given now set the layout (--tp, --pp, --dp, ...) and the "
                                       "micro-batch size.")
    p.add_argument("--task", choices=("perplexity", "lambada", "lm-eval"), required=True,
                   help="perplexity of documents, LAMBADA cloze accuracy (lm-eval's definitions), or "
                        "lm-evaluation-harness tasks.")
    p.add_argument("--input", default=None,
                   help="perplexity, lambada: text file (one document) or JSON lines with a text key.")
    p.add_argument("--json-key", default="text", help="The key of each JSON line's text.")
    p.add_argument("--overlapping-eval", type=int, default=None, metavar="STRIDE",
                   help="perplexity: also the strided figures (Megatron-LM's): windows of max_seq_len tokens every "
                        "STRIDE tokens over the joined documents, each later one scoring only its last STRIDE.")
    p.add_argument("--output", default=None, help="Also write the results' JSON here.")
    p.add_argument("--output-examples", default=None, metavar="FILE.jsonl",
                   help="lambada: one JSON line per example (context, target, the model's greedy continuation, "
                        "whether it matched, the target's log-likelihood).")
    g = p.add_argument_group("lm-eval (--task lm-eval; pip install -e .[eval])")
    g.add_argument("--lm-eval-tasks", default=None, metavar="T1,T2",
                   help="lm-eval task (or group) names, comma-separated.")
    g.add_argument("--include-path", default=None, metavar="DIR",
                   help="A folder of your own lm-eval task YAML files (searched first). A task folder is code: "
                        "lm-eval runs the Python its YAML names with !function; pass only folders you trust.")
    g.add_argument("--limit", type=float, default=None,
                   help="At most this many examples per task (a whole number, 1 or more), or that share of them (a "
                        "fraction above 0, below 1).")
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


def prepare(args: argparse.Namespace, texts: list[str], tokenizer, seq_len: int):
    """The task's samples, made before any collective (ValueError for a bad stride or text)."""
    if args.task == "perplexity":
        return perplexity.plan(texts, tokenizer, seq_len, args.overlapping_eval)
    return lambada.plan(texts, tokenizer, seq_len)


def _outputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    return [(flag, path) for flag, path in (("--output", args.output), ("--output-examples", args.output_examples))
            if path]


def check_outputs(args: argparse.Namespace) -> None:
    """Before anything is read, and without writing: ValueError (one line) for an output that could not be
    written at the end of the evaluation: a folder in its place, a file where its folder (or one above it) would
    be, a folder that cannot be written. A folder that does not exist yet is made by ``make_output_folders``."""
    if args.output_examples and args.task != "lambada":
        raise ValueError("--output-examples is for --task lambada (one line per example).")
    for flag, path in _outputs(args):
        if os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a folder: give a file path (for example "
                             f"{os.path.join(path, 'results.json')}).")
        existing = os.path.dirname(os.path.abspath(path))
        while not os.path.lexists(existing):  # the nearest folder there is: the new ones are made in it
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise ValueError(f"{flag} {path} cannot be written: {existing} is not a folder; give another "
                             f"path.")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path} cannot be written: {existing} is not writable; give another path.")


def make_output_folders(args: argparse.Namespace) -> None:
    """Once the checkpoint is found, before it is loaded and anything is scored: the folders of ``--output``
    and ``--output-examples`` made (on every rank: the same folders where the ranks share a disk), and written
    to once, so that the evaluation is never lost to an output it cannot write at its end. ValueError, one
    line, when that fails."""
    rank = int(os.environ.get("RANK", 0))
    for flag, path in _outputs(args):
        folder = os.path.dirname(os.path.abspath(path))
        try:
            make_writable_folder(folder, f"rank{rank}.")
        except OSError as err:
            raise ValueError(f"{flag} {path} cannot be written ({err.strerror or err}: {err.filename or folder}); "
                             f"give another path.") from None


def check_lm_eval_args(args: argparse.Namespace) -> None:
    """The lm-eval flags' numbers, before anything is read: ValueError, one line naming the flag and value.
    ``--limit``: lm-eval takes a value below 1 as the share of each task's examples (rounded up) and any
    other as a count (truncated): so a count of at least 1, or a share above 0 and below 1."""
    limit = args.limit
    if limit is not None and not (0 < limit < 1 or (limit >= 1 and math.isfinite(limit) and limit == int(limit))):
        raise ValueError(f"--limit {limit:g}: give a number of examples per task (a whole number, 1 or more) or "
                         f"a share of them (a fraction above 0 and below 1).")
    for flag, value, least in (("--batch-size", args.batch_size, 1), ("--num-fewshot", args.num_fewshot, 0),
                               ("--max-gen-toks", args.max_gen_toks, 1),
                               ("--bootstrap-iters", args.bootstrap_iters, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} {value}: give {least} or more.")


def read_input(args: argparse.Namespace) -> list[str]:
    """The texts of ``--input``; ValueError when it holds no words (empty, blank lines: a perplexity of
    whitespace tokens, per a word count of 0, would be a number that means nothing)."""
    if args.input is None:
        raise ValueError(f"--task {args.task} needs --input FILE: the text to evaluate.")
    texts = read_texts(args.input, args.json_key)
    if not any(text.split() for text in texts):
        raise ValueError(f"{args.input} holds no words (it is empty, or only blank lines): nothing to evaluate.")
    return texts


def evaluate(args: argparse.Namespace, config, tokenizer, texts: list[str]) -> tuple[dict, list[dict] | None]:
    """(the results, the LAMBADA per-example records or None). Collective."""
    seq_len = config.dataset.max_seq_len
    planned = prepare(args, texts, tokenizer, seq_len)
    evaluator = load_evaluator(config)
    ps = evaluator.ps
    result = {"task": args.task, "input": args.input, "checkpoint": evaluator.path, "step": evaluator.step,
              "layout": {"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size, "sharding": ps.sharding_size}}
    if args.task == "perplexity":
        result.update(perplexity.figures(evaluator, texts, planned))
        return result, None
    figures, records = lambada.figures(evaluator, planned, tokenizer, seq_len)
    result.update(figures)
    return result, records


def evaluate_lm_eval(args: argparse.Namespace, rest: list[str]) -> dict | None:
    """lm-eval's results dictionary on the checkpoint (``harness.evaluate``), with where the numbers come
    from under ``megatron`` (None on the ranks lm-eval gives none). The tasks are found before the checkpoint
    is read."""
    tasks = [t.strip() for t in (args.lm_eval_tasks or "").split(",") if t.strip()]
    if not tasks:
        raise ValueError("--task lm-eval needs --lm-eval-tasks T1,T2: the lm-eval tasks to run.")
    check_lm_eval_args(args)
    if args.include_path is not None:
        if not os.path.isdir(args.include_path):
            raise ValueError(f"--include-path {args.include_path} is not a folder: give the folder of your task "
                             f"YAML files.")
        code = harness.read_include_path(args.include_path)
        if code and int(os.environ.get("RANK", 0)) == 0:
            shown = "; ".join(code[:3]) + (f"; and {len(code) - 3} more" if len(code) > 3 else "")
            print(f"{PROG}: note: --include-path {args.include_path} holds Python that lm-eval may run ({shown}): "
                  f"a task folder is code, pass only folders you trust.", file=sys.stderr, flush=True)
    manager = harness.task_manager(tasks, args.include_path)
    from megatron.evaluation.lm_eval_model import MegatronLM

    config, tokenizer = configure(rest)
    make_output_folders(args)
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


def _write(path: str, lines: list[str]) -> None:
    """``lines`` into ``path``, whole or not at all (written beside it, then renamed)."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        check_outputs(args)  # an output that cannot be written is said before anything is read
        if args.task == "lm-eval":
            result, records = evaluate_lm_eval(args, rest), None
            summary = result and {"results": result["results"], "megatron": result["megatron"]}
        else:
            texts = read_input(args)  # a bad input is said before the checkpoint is read
            config, tokenizer = configure(rest)
            make_output_folders(args)
            result, records = evaluate(args, config, tokenizer, texts)
            summary = result
        if rank == 0:
            if args.task != "lm-eval":
                for line in (perplexity if args.task == "perplexity" else lambada).summary(result):
                    print(line, file=sys.stderr)
            if args.output_examples:
                _write(args.output_examples, [json.dumps(record) for record in records])
            if args.output:
                _write(args.output, [json.dumps(result)])
            if args.task == "lm-eval":  # lm-eval's table, as its own command prints it; the JSON line stays last
                print(harness.table(result), flush=True)
            print(json.dumps(summary), flush=True)
    except (ConfigError, CheckpointError, TokenizerError, ValueError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
