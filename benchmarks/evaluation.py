"""Evaluation throughput against the training forward's, on one process (CPU by default).

    python benchmarks/evaluation.py            # print the figures
    python benchmarks/evaluation.py --write    # also update the evaluation section of docs/benchmarks.md

A random GPT is written as a checkpoint, loaded by ``megatron.evaluation.runner.Evaluator`` (as
``tools/evaluate.py`` does) and timed on perplexity windows of random token ids (no overlap), in
three ways over the same micro-batches:

- **evaluation**: ``Evaluator.score`` (no autograd, the forward-only schedule, losses masked and summed);
- **training forward**: the same forward with autograd recording, as a training step's forward is;
- **training step**: that forward and its backward (no optimizer step).

Tokens/s are scored tokens over wall time, the median of ``--repeats`` after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.report import write_section  # noqa: E402
from megatron import parallel_state  # noqa: E402
from megatron.checkpoint.convert import write_params  # noqa: E402
from megatron.config import parse_config, validate  # noqa: E402
from megatron.data.loader import split_micro_batches  # noqa: E402
from megatron.evaluation.runner import Evaluator, batch_of, loss_step  # noqa: E402
from megatron.evaluation.tasks import perplexity_samples  # noqa: E402
from megatron.model.gpt import GPTModel  # noqa: E402
from megatron.model.init import init_parameters  # noqa: E402
from megatron.parallelize_gpt import parallelize_gpt  # noqa: E402


def _cpu_flags() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown CPU flags"
    return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx512_bf16", "amx_bf16"))


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args()

    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads",
             str(args.heads), "--vocab-size", str(args.vocab), "--max-seq-len", str(args.seq),
             "--max-position-embeddings", str(args.seq), "--device", "cpu", "--hidden-dropout-prob", "0",
             "--attention-probs-dropout-prob", "0"]
    parallel_state.initialize()
    with tempfile.TemporaryDirectory() as folder:
        config = parse_config(flags)
        validate(config, training_data=False)
        model = GPTModel(config.model, config.padded_vocab_size)
        with torch.no_grad():
            init_parameters(model, 1, config.model)
        write_params(os.path.join(folder, "run"), config, {n: t.detach() for n, t in model.named_parameters()})
        del model
        config = parse_config([*flags, "--load", os.path.join(folder, "run"), "--micro-batch-size",
                               str(args.micro_batch_size), "--local-batch-size", str(args.micro_batch_size)])
        validate(config, training_data=False)
        device = torch.device("cpu")
        run = parallelize_gpt(config, device)
        evaluator = Evaluator(config, run, device, progress=False)
    ids = torch.randint(0, args.vocab, (args.windows * args.seq + 1,), generator=torch.Generator().manual_seed(0))
    samples = perplexity_samples(ids.tolist(), args.seq)
    tokens = sum(sum(s.mask) for s in samples)
    batches = [batch_of(samples[i:i + args.micro_batch_size], args.seq, device)
               for i in range(0, len(samples), args.micro_batch_size)]

    def training(backward: bool):
        run.model.train()
        for batch in batches:
            for micro in split_micro_batches(batch, args.micro_batch_size):
                output, loss_fn = loss_step(micro, run.model)
                loss, _ = loss_fn(output)
                if backward:
                    loss.backward()
        run.model.zero_grad(set_to_none=True)

    timed = {"evaluation (`Evaluator.score`)": _median_seconds(lambda: evaluator.score(samples), args.repeats),
             "training forward (autograd recording)": _median_seconds(lambda: training(False), args.repeats),
             "training step (forward + backward)": _median_seconds(lambda: training(True), args.repeats)}
    base = timed["training forward (autograd recording)"]
    rows = ["| what | seconds | tokens/s | vs training forward |", "| --- | ---: | ---: | ---: |"]
    for name, seconds in timed.items():
        rows.append(f"| {name} | {seconds:.2f} | {tokens / seconds:,.0f} | {base / seconds:.2f}x |")
    params = sum(t.numel() for t in run.model.parameters()) / 1e6
    head = (f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocabulary {args.vocab}, "
            f"{params:.1f}M parameters, fp32; {len(samples)} windows of {args.seq} tokens ({tokens} scored), "
            f"micro-batch {args.micro_batch_size}; {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores ({_cpu_flags()}), {torch.get_num_threads()} threads, torch {torch.__version__}; "
            f"median of {args.repeats} after a warm-up.")
    body = head + "\n\n" + "\n".join(rows) + "\n"
    print(body)
    if args.write:
        write_section("evaluation", "Evaluation: tools/evaluate.py's runner against the training forward",
                      "python benchmarks/evaluation.py --write", body,
                      intro="`benchmarks/evaluation.py` times `megatron.evaluation.runner.Evaluator` (what "
                            "`tools/evaluate.py` runs) on perplexity windows against the same forward with autograd "
                            "recording and against forward plus backward, on the same micro-batches.")


if __name__ == "__main__":
    main()
