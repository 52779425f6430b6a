"""Evaluate a checkpoint: perplexity of a text (overlapping windows) or LAMBADA cloze accuracy, under any
parallel layout the training runs under.

    python tools/evaluate.py --task perplexity --input doc.txt --load output/run --overlapping-eval 128
    python tools/evaluate.py --task lambada --input lambada_test.jsonl --load output/run
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
token: Megatron-LM's default). docs/evaluation.md says more.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron import device as dev  # noqa: E402
from megatron.checkpoint import CheckpointError, find_checkpoint, resumed_config  # noqa: E402
from megatron.config import ConfigError, validate  # noqa: E402
from megatron.config.help import CONFIG_FLAGS_NOTE  # noqa: E402
from megatron.distributed.parallelize import plan_sharding  # noqa: E402
from megatron.evaluation.runner import Evaluator  # noqa: E402
from megatron.evaluation.tasks import lambada_samples, perplexity_samples, read_texts, word_count  # noqa: E402
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
                   help="perplexity of a text, or LAMBADA cloze accuracy.")
    p.add_argument("--input", required=True, help="Text file (one document) or JSON lines with a text key.")
    p.add_argument("--json-key", default="text", help="The key of each JSON line's text.")
    p.add_argument("--overlapping-eval", type=int, default=None, metavar="STRIDE",
                   help="perplexity: windows of max_seq_len tokens every STRIDE tokens; each later window scores "
                        "only its last STRIDE tokens (default: max_seq_len, no overlap).")
    p.add_argument("--output", default=None, help="Also write the results' JSON here.")
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
    texts = read_texts(args.input, args.json_key)
    if not any(text.split() for text in texts):
        raise ValueError(f"{args.input} holds no words (it is empty, or only blank lines): nothing to evaluate.")
    return texts


def evaluate(args: argparse.Namespace, config, tokenizer, texts: list[str]) -> dict:
    samples = samples_for(args.task, texts, tokenizer, config.dataset.max_seq_len, args.overlapping_eval)
    ps = initialize_distributed(config)
    device = dev.get_device(config.device, launch_env()[2])
    tensor_parallel_seed(config.seed, ps.tp_rank, device)
    plan = plan_sharding(config, ps)
    run = parallel_model(config, build_model(config, device, meta_init=plan.meta_init), device, plan)
    evaluator = Evaluator(config, run, device)
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


def _exp(x: float) -> float:
    """exp, infinite past what a float holds (no silent cap: Megatron-LM's min(20, .) hides the number)."""
    return math.exp(x) if x < 709.0 else math.inf


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        texts = read_input(args)  # a bad input is said before the checkpoint is read
        config, tokenizer = configure(rest)
        result = evaluate(args, config, tokenizer, texts)
        if rank == 0:
            text = json.dumps(result)
            if args.output:
                with open(args.output, "w", encoding="utf-8") as f:
                    f.write(text + "\n")
            print(text, flush=True)
    except (ConfigError, CheckpointError, TokenizerError, ValueError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
