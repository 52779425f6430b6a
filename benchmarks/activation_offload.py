"""Activation offloading: step time and the bytes kept for the backward, with and without offloading.

    python benchmarks/activation_offload.py           # one process on the CPU
    python benchmarks/activation_offload.py --write   # also update docs/benchmarks.md

A small GPT trains one micro-batch per step, forward and backward, without offloading, with its first layers whole
(``--cpu-offloading-num-layers``) and with chosen parts of every layer (``--fine-grained-activation-offloading``).
Runs alternate step by step, so background load affects all alike; each row gives the median step time, the peak
bytes of saved activations the device keeps (``memory.measure.SavedActivations``, outside the offload hooks:
what they do not send to host), the bytes sent to host per micro-batch (``ActivationOffload.packed_bytes``) and
the memory estimate's figure for them. On the CPU device memory is host memory: the hooks copy each storage to a
separate buffer and back, so the time shows the copies' cost and no memory is saved in fact; on a GPU the copies
are asynchronous (pinned buffers, side streams) and the device keeps what the saved column says
(``benchmarks/gpu.py``'s ``activation_offload`` case measures it there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import write_section  # noqa: E402

VARIANTS = {
    "no offload": (),
    "first 2 layers": ("--cpu-offloading-num-layers", "2"),
    "core_attn + attn_proj": ("--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj"),
    "norms + qkv + core + proj": ("--fine-grained-activation-offloading", "--offload-modules", "attn_norm",
                                  "qkv_linear", "core_attn", "attn_proj", "mlp_norm"),
}


def _model(args: argparse.Namespace, extra: tuple[str, ...]):
    from megatron.config import parse_config, validate
    from megatron.parallelize_gpt import build_model

    flags = ["--mock-data", "--device", "cpu", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", "8", "--max-seq-len", str(args.seq), "--max-position-embeddings", str(args.seq),
             "--vocab-size", "8192", "--micro-batch-size", str(args.micro_batch), "--hidden-dropout", "0",
             "--attention-dropout", "0", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
             "--swiglu", "--disable-bias-linear", "--min-offloaded-tensor-size", str(args.min_size), *extra]
    config = parse_config(flags)
    validate(config, world_size=1, cuda_available=False)
    torch.manual_seed(0)
    return config, build_model(config).train()


def _step(model, batch) -> tuple[float, int]:
    """(seconds, peak saved bytes on the device) of one forward and backward."""
    from megatron.memory.measure import SavedActivations
    from pretrain_gpt import forward_step

    start = time.perf_counter()
    with SavedActivations(exclude=model.parameters()) as saved:
        output, loss_fn = forward_step(batch, model)
        loss, _ = loss_fn(output)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, saved.peak


def run(args: argparse.Namespace) -> str:
    from megatron.data.loader import build_batch
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.memory.offload import offloaded_bytes

    torch.set_num_threads(args.threads)
    models = {name: _model(args, extra) for name, extra in VARIANTS.items()}
    data = MockGPTDataset(64, args.seq, 8192, seed=1)
    batch = build_batch([data[i] for i in range(args.micro_batch)], data.eod_id)
    times = {name: [] for name in models}
    peaks, packed = {}, {}
    for i in range(args.warmup + args.steps):
        for name, (_, model) in models.items():
            offload = model.activation_offload
            if offload is not None:
                offload.reset()
            seconds, peaks[name] = _step(model, batch)
            packed[name] = offload.packed_bytes if offload is not None else 0
            if i >= args.warmup:
                times[name].append(seconds)
    base = statistics.median(times["no offload"])
    rows = ["| variant | step (ms) | vs none | peak saved on the device (MiB) | sent to host (MiB) | estimate (MiB) |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    mib = 2 ** 20
    for name, (config, _) in models.items():
        median = statistics.median(times[name])
        rows.append(f"| {name} | {median * 1e3:.1f} | {median / base:.2f}x | {peaks[name] / mib:.2f} | "
                    f"{packed[name] / mib:.2f} | {offloaded_bytes(config) / mib:.2f} |")
    setup = (f"{args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch {args.micro_batch}, RMSNorm + "
             f"SwiGLU + rope, fp32, {args.threads} threads, min size {args.min_size} elements; median of {args.steps} "
             f"steps after {args.warmup}.")
    return setup + "\n\n" + "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--min-size", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args()
    body = run(args)
    print(body)
    if args.write:
        intro = ("Saved-tensor hooks send what chosen layers or parts save to host memory (docs/architecture.md, "
                 "\"Activation offloading\"). On the CPU the copies cost time and save nothing; the saved column "
                 "is what a GPU would keep.")
        write_section("activation_offload", "Activation offloading: step time and saved bytes",
                      "python benchmarks/activation_offload.py " + " ".join(sys.argv[1:]), body, intro)


if __name__ == "__main__":
    main()
