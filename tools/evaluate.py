"""Evaluate a checkpoint: perplexity of documents or LAMBADA cloze accuracy, on lm-eval's definitions,
under any parallel layout the training runs under.

    python tools/evaluate.py --task perplexity --input docs.jsonl --load output/run [--overlapping-eval 128]
    python tools/evaluate.py --task lambada --input lambada_test.jsonl --load output/run --output-examples ex.jsonl
    torchrun --nproc-per-node 4 tools/evaluate.py --task lambada --input l.jsonl --load output/run --tp 2 --pp 2

``--input``: a plain text file (one document) or JSON lines with a ``text`` key (``--json-key``).
Every other flag is a pretrain_gpt.py flag: the checkpoint's saved configuration is the base (its model,
tokenizer, ``max_seq_len``, precision) and the flags given now set the layout (``--tp``, ``--pp``,
``--dp``, ``--sharding-stage``, ...) and the micro-batch size. A checkpoint of any layout evaluates under
any other. Progress goes to stderr; the results are one JSON object on the last line of stdout (and in
``--output``). Exit status 2, with a one-line message, for bad input, a missing or damaged checkpoint.

Perplexity (lm-eval's rolling windows: each document on its own, its first token scored after the
BOS or end-of-document token): ``word_perplexity``, ``byte_perplexity``, ``bits_per_byte`` as lm-eval
defines them, and ``token_perplexity``; with ``--overlapping-eval`` also ``strided`` (Megatron-LM's
overlapping windows: ``loss``, ``perplexity``, ``adjusted_perplexity``). LAMBADA, in ``strict``
(lm-eval's ``lambada_openai``) and ``non_strict`` (Megatron-LM's default) modes: ``acc`` and
``perplexity`` (of the target) each; ``--output-examples`` writes one JSON line per example.
docs/evaluation.md says more.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron import device as dev  # noqa: E402
from megatron.checkpoint import CheckpointError, find_checkpoint, resumed_config  # noqa: E402
from megatron.config import ConfigError, validate  # noqa: E402
from megatron.config.help import CONFIG_FLAGS_NOTE  # noqa: E402
from megatron.distributed.parallelize import plan_sharding  # noqa: E402
from megatron.evaluation import lambada, perplexity  # noqa: E402
from megatron.evaluation.runner import Evaluator  # noqa: E402
from megatron.evaluation.tasks import read_texts  # noqa: E402
from megatron.initialize import initialize_distributed, launch_env, shutdown  # noqa: E402
from megatron.model import build_model  # noqa: E402
from megatron.tensor_parallel import tensor_parallel_seed  # noqa: E402
from megatron.tokenizer import TokenizerError, configured_tokenizer  # noqa: E402
from megatron.training import parallel_model  # noqa: E402

PROG = "evaluate.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog=f"{CONFIG_FLAGS_NOTE} The checkpoint's saved configuration is the base; "
                                       "the flags given now set the layout (--tp, --pp, --dp, ...) and the "
                                       "micro-batch size.")
    p.add_argument("--task", choices=("perplexity", "lambada"), required=True,
                   help="perplexity of documents, or LAMBADA cloze accuracy (lm-eval's definitions).")
    p.add_argument("--input", required=True, help="Text file (one document) or JSON lines with a text key.")
    p.add_argument("--json-key", default="text", help="The key of each JSON line's text.")
    p.add_argument("--overlapping-eval", type=int, default=None, metavar="STRIDE",
                   help="perplexity: also the strided figures (Megatron-LM's): windows of max_seq_len tokens every "
                        "STRIDE tokens over the joined documents, each later one scoring only its last STRIDE.")
    p.add_argument("--output", default=None, help="Also write the results' JSON here.")
    p.add_argument("--output-examples", default=None, metavar="FILE.jsonl",
                   help="lambada: one JSON line per example (context, target, the model's greedy continuation, "
                        "whether it matched, the target's log-likelihood).")
    return p


def configure(rest: list[str]):
    """The evaluation's validated configuration (the checkpoint's, with the layout given now) and the
    tokenizer; ConfigError, CheckpointError or TokenizerError with one line."""
    warnings: list[str] = []
    config = resumed_config(rest, warnings, training=False)
    if not config.save_load.ckpt_dir:
        raise ConfigError("--load CKPT is required: the checkpoint to evaluate.")
    if find_checkpoint(config.save_load.ckpt_dir) is None:
        raise CheckpointError(f"no checkpoint at {config.save_load.ckpt_dir}: expected a step folder with "
                              f"metadata.json or a run folder with a 'latest' file.")
    config.dataset.input_dir, config.dataset.mock_data = None, False  # the data is the task's file
    tokenizer = configured_tokenizer(config.tokenizer, config.model.vocab_size)
    if tokenizer is None:
        raise ConfigError(f"{config.save_load.ckpt_dir} was trained without a tokenizer (synthetic data): give "
                          f"--tokenizer-type and its files.")
    if config.distributed.context_parallel_size != 1:
        raise ConfigError("tools/evaluate.py scores whole samples on each rank: drop --context-parallel-size (a "
                          "checkpoint trained with context parallelism loads at any layout; use --tp / --pp to "
                          "spread a large model).")
    b = config.batch_size
    b.micro_batch_size = b.micro_batch_size or 4
    b.global_batch_size, b.local_batch_size = None, b.micro_batch_size * config.distributed.pp_degree
    world, _, _ = launch_env()
    validate(config, world_size=world, cuda_available=dev.cuda_available(), tokenizer_vocab_size=tokenizer.vocab_size,
             training_data=False)
    return config, tokenizer


def prepare(args: argparse.Namespace, texts: list[str], tokenizer, seq_len: int):
    """The task's samples, made before any collective (ValueError for a bad stride or text)."""
    if args.task == "perplexity":
        return perplexity.plan(texts, tokenizer, seq_len, args.overlapping_eval)
    return lambada.plan(texts, tokenizer, seq_len)


def read_input(args: argparse.Namespace) -> list[str]:
    """The texts of ``--input``; ValueError when it holds no words (empty, blank lines: a perplexity of
    whitespace tokens, per a word count of 0, would be a number that means nothing)."""
    if args.output_examples and args.task != "lambada":
        raise ValueError("--output-examples is for --task lambada (one line per example).")
    for path in (args.output, args.output_examples):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{path}: its folder does not exist (create it, or give another path).")
    texts = read_texts(args.input, args.json_key)
    if not any(text.split() for text in texts):
        raise ValueError(f"{args.input} holds no words (it is empty, or only blank lines): nothing to evaluate.")
    return texts


def evaluate(args: argparse.Namespace, config, tokenizer, texts: list[str]) -> tuple[dict, list[dict] | None]:
    """(the results, the LAMBADA per-example records or None). Collective."""
    seq_len = config.dataset.max_seq_len
    planned = prepare(args, texts, tokenizer, seq_len)
    ps = initialize_distributed(config)
    device = dev.get_device(config.device, launch_env()[2])
    tensor_parallel_seed(config.seed, ps.tp_rank, device)
    plan = plan_sharding(config, ps)
    run = parallel_model(config, build_model(config, device, meta_init=plan.meta_init), device, plan)
    evaluator = Evaluator(config, run, device)
    result = {"task": args.task, "input": args.input, "checkpoint": evaluator.path, "step": evaluator.step,
              "layout": {"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size, "sharding": ps.sharding_size}}
    if args.task == "perplexity":
        result.update(perplexity.figures(evaluator, texts, planned))
        return result, None
    figures, records = lambada.figures(evaluator, planned, tokenizer, seq_len)
    result.update(figures)
    return result, records


def _write(path: str, lines: list[str]) -> None:
    """``lines`` into ``path``, whole or not at all (written beside it, then renamed)."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        texts = read_input(args)  # a bad input is said before the checkpoint is read
        config, tokenizer = configure(rest)
        result, records = evaluate(args, config, tokenizer, texts)
        if rank == 0:
            for line in (perplexity if args.task == "perplexity" else lambada).summary(result):
                print(line, file=sys.stderr)
            text = json.dumps(result)
            if args.output_examples:
                _write(args.output_examples, [json.dumps(record) for record in records])
            if args.output:
                _write(args.output, [text])
            print(text, flush=True)
    except (ConfigError, CheckpointError, TokenizerError, ValueError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
