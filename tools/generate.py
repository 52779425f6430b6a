"""Generate text from a trained checkpoint (any saved layout), on one process or sharded over tp ranks.

    python tools/generate.py --load output/run --prompt "def main(" --max-new-tokens 64 --temperature 0
    python tools/generate.py --load output/run --prompts-file prompts.jsonl --output-format jsonl --seed 1
    torchrun --nproc-per-node 2 tools/generate.py --load output/run --tp 2 --prompt "Once upon a time"
    python tools/generate.py --load output/run          # interactive: one prompt per line on stdin

Prompts come from ``--prompt`` (repeatable), ``--prompts-file`` (one per line; a line that is a JSON
object gives its ``prompt`` and may set that prompt's own sampling fields, e.g. ``"temperature"``)
or, without either, standard input (a terminal: interactive, each answer streamed as it is
generated). ``--temperature 0`` is greedy, as in OpenAI's API. Output: each prompt followed by its
continuation, or with ``--output-format jsonl`` one JSON object per
prompt (``prompt``, ``text``, ``tokens``, ``logprobs``, ``finish_reason``). Under torchrun, rank 0
reads the prompts and writes the output. Exit status 2, with a one-line message, for a missing or
damaged checkpoint or a prompt the model cannot take.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from megatron.checkpoint import CheckpointError  # noqa: E402
from megatron.inference import MAX_LOGPROBS, Request, SamplingParams  # noqa: E402
from megatron.inference.launch import add_model_arguments, build_engine, describe  # noqa: E402
from megatron.initialize import shutdown  # noqa: E402

PROG = "generate.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p)
    g = p.add_argument_group("prompts and output")
    g.add_argument("--prompt", action="append", default=[], help="A prompt (repeatable).")
    g.add_argument("--prompts-file", default=None, help="Prompts, one per line (plain text, or JSON with 'prompt').")
    g.add_argument("--output-format", choices=("text", "jsonl"), default="text")
    g.add_argument("--batch-size", type=int, default=8, help="Prompts generated together.")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", "--max-tokens", "--tokens-to-generate", dest="max_tokens", type=int,
                   default=64, help="Tokens to generate at most per prompt.")
    s.add_argument("--temperature", type=float, default=1.0, help="0 is greedy.")
    s.add_argument("--top-k", type=int, default=0, help="Sample among the k most likely tokens (0: all).")
    s.add_argument("--top-p", type=float, default=1.0, help="Sample among the most likely tokens whose "
                   "probabilities reach p (nucleus sampling).")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages tokens already seen.")
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None, help="Makes sampling reproducible (a 64-bit signed integer).")
    s.add_argument("--stop", action="append", default=[], help="Stop when this text is generated (repeatable).")
    s.add_argument("--ignore-eos", action="store_true", help="Do not stop at the end-of-document token.")
    s.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help=f"Report the chosen tokens' log-probabilities and the N (<= {MAX_LOGPROBS}) most likely.")
    return p


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    params.check()
    return params


def read_prompts(args: argparse.Namespace) -> list[tuple[str, dict]] | None:
    """(prompt, sampling overrides) of --prompt and of each line of --prompts-file (a JSON line may set
    any sampling field for its prompt, e.g. ``{"prompt": "...", "temperature": 0, "max_tokens": 20}``);
    None when neither is given (read standard input)."""
    prompts = [(p, {}) for p in args.prompt]
    if args.prompts_file is None:
        return prompts or None
    allowed = {f.name for f in dataclasses.fields(SamplingParams)} - {"prompt_logprobs"}
    with open(args.prompts_file, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if not line.lstrip().startswith("{"):
                prompts.append((line, {}))
                continue
            where = f"{args.prompts_file}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg}).") from err
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{where}: a JSON line needs a 'prompt' string.")
            unknown = sorted(set(record) - allowed - {"prompt"})
            if unknown:
                raise ValueError(f"{where}: unknown field {unknown[0]!r} (the sampling fields: "
                                 f"{', '.join(sorted(allowed))}).")
            prompt = record.pop("prompt")
            prompts.append((prompt, record))
    return prompts


def _shared(value, rank: int):
    """``value`` of rank 0 on every rank."""
    if not dist.is_initialized():
        return value
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _attempt(fn) -> tuple:
    """(fn(), None), or (None, the error's message): rank 0 reads, every rank learns of a failure."""
    try:
        return fn(), None
    except (ValueError, OSError) as err:
        return None, str(err)


def _record(prompt: str, completion, params: SamplingParams) -> dict:
    record = {"prompt": prompt, "text": completion.text, "tokens": completion.tokens,
              "logprobs": completion.logprobs, "finish_reason": completion.finish_reason}
    if params.logprobs:
        record["top_logprobs"] = [[[t, lp] for t, lp in top] for top in completion.top_logprobs]
    return record


def run_batches(engine, prompts: list[tuple[str, SamplingParams]], args, rank: int) -> None:
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start:start + args.batch_size]
        completions = engine.generate([Request(engine.tokenizer.tokenize(p), params) for p, params in batch])
        if rank != 0:
            continue
        for (prompt, params), completion in zip(batch, completions, strict=True):
            if args.output_format == "jsonl":
                print(json.dumps(_record(prompt, completion, params)), flush=True)
            else:
                print(f"{prompt}{completion.text}\n{'-' * 80}", flush=True)


def interactive(engine, params: SamplingParams, rank: int) -> None:
    """One prompt per line of standard input, each answer streamed as it is generated."""
    tty = sys.stdin.isatty()
    while True:
        line = None
        if rank == 0:
            if tty:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
        line = _shared(line, rank)
        if not line:
            return
        prompt = line.rstrip("\n")
        if not prompt.strip():
            continue
        try:
            request = Request(engine.tokenizer.tokenize(prompt), params)
            engine.check(request)
        except ValueError as err:
            if rank == 0:
                print(f"{PROG}: {err}", file=sys.stderr)
            continue
        for events in engine.stream([request]):
            if rank == 0:
                print("".join(e.text for e in events), end="", flush=True)
        if rank == 0:
            print(flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}.")
        params = sampling_params(args)
        read = _attempt(lambda: read_prompts(args)) if rank == 0 else (None, None)
        if read[1] is not None and int(os.environ.get("WORLD_SIZE", 1)) == 1:
            raise ValueError(read[1])  # before loading the model
        engine = build_engine(args)
        if rank == 0:
            print(describe(engine, args.load), file=sys.stderr)
        prompts, error = _shared(read, rank)
        if error is not None:
            raise ValueError(error)
        if prompts is None:
            interactive(engine, params, rank)
            return 0
        batch = [(prompt, dataclasses.replace(params, **overrides)) for prompt, overrides in prompts]
        for prompt, own in batch:
            engine.check(Request(engine.tokenizer.tokenize(prompt), own))
        run_batches(engine, batch, args, rank)
    except (ValueError, OSError, CheckpointError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        shutdown()  # a process group left to the interpreter's exit can abort it (gloo's threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
