"""Training-step throughput of pretrain_gpt.py's step against a plain single-file PyTorch GPT,
each eager and under torch.compile.

    python benchmarks/throughput.py                      # the default shape; fp32, and bf16 where native
    python benchmarks/throughput.py --steps 8 --write    # also update docs/benchmarks.md

Both sides train the same shape on the same batches with AdamW and grad clipping 1.0:
- project: megatron's GPTModel + MixedPrecisionOptimizer + train_step (bf16 = bf16 parameters
  and compute with fp32 master weights and fp32 main grads); "compiled" is ``--compile``;
- reference: a nanoGPT-style model written below (fp32 parameters; bf16 = torch.autocast),
  with torch.optim.AdamW at its defaults; "compiled" is ``torch.compile(model)``, as nanoGPT does.
The four variants take steps in turn, round after round, and the median step time of each is
reported, so background load affects all alike. MFU is against the measured peak of a large
matmul. bf16 runs only where ``megatron.device`` finds it native (``--precisions`` overrides).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pretrain_gpt  # noqa: E402
from benchmarks.report import write_section  # noqa: E402
from megatron.config import parse_config, validate  # noqa: E402
from megatron.data.loader import build_batch  # noqa: E402
from megatron.data.mock_dataset import MockGPTDataset  # noqa: E402
from megatron.device import half_precision  # noqa: E402
from megatron.distributed.parallelize import ShardingPlan  # noqa: E402
from megatron.metrics import model_flops_per_token  # noqa: E402
from megatron.parallelize_gpt import (
    build_model,  # noqa: E402
    parallelize_gpt,  # noqa: E402
)
from megatron.training import train_step  # noqa: E402


# ----------------------------------------------------------------------------- reference
class RefAttention(nn.Module):
    def __init__(self, h: int, nh: int):
        super().__init__()
        self.c_attn, self.c_proj, self.nh = nn.Linear(h, 3 * h), nn.Linear(h, h), nh

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class RefBlock(nn.Module):
    def __init__(self, h: int, nh: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(h), RefAttention(h, nh), nn.LayerNorm(h)
        self.c_fc, self.c_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, h: int, nh: int, layers: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.h = nn.ModuleList(RefBlock(h, nh) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def reference_step(model, params: nn.Module, opt, batch, ctx):
    """``model``: the RefGPT or its torch.compile wrapper; ``params``: the RefGPT."""
    with ctx:
        loss = model(batch["tokens"], batch["labels"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- measurement
def measured_peak_tflops(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def project_config(args, precision: str, compiled: bool = False):
    flags = ["--mock-data", "--device", "cpu", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", str(args.heads), "--max-seq-len", str(args.seq), "--max-position-embeddings",
             str(args.seq), "--vocab-size", str(args.vocab), "--micro-batch-size", str(args.micro_batch),
             "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0", "--max-steps", "1000",
             "--grad-clip", "1.0", "--weight-decay", "0.01", "--save", "/tmp/throughput_bench"]
    if precision == "bf16":
        flags.append("--bf16")
    if compiled:
        flags.append("--compile")
    config = parse_config(flags)
    validate(config)
    return config


VARIANTS = ("reference", "reference compiled", "project", "project compiled")
INTRO = """`benchmarks/throughput.py` times one training step (forward, backward, clipping, AdamW) of
`pretrain_gpt.py`'s model and optimizer against a nanoGPT-style single-file GPT of the same
shape on the same batches, each eager and under torch.compile (the project's `--compile`; the
reference's `torch.compile(model)`, as nanoGPT does). The reference uses fp32 parameters with
`torch.autocast` for bf16 and `torch.optim.AdamW` at its defaults; the project uses bf16 parameters
with fp32 master weights and main grads, the fused AdamW over flat buffers, and its fused chunked
cross entropy (under `--compile`, a `logsumexp` form that inductor fuses). MFU is model FLOPs
(`megatron.metrics.model_flops_per_token`) over the peak of a 2048^3 matmul measured in the same
run, per precision. bf16 is measured where `megatron.device` finds it native. The compiled
variants compile during the warm-up steps; docs/performance.md (torch.compile) has the profiles."""


def bench_precision(args, precision: str) -> dict:
    data = MockGPTDataset(1000, args.seq, args.vocab, seed=1)
    batches = [build_batch([data[i * args.micro_batch + j] for j in range(args.micro_batch)], data.eod_id)
               for i in range(4)]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    steps = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        config = project_config(args, precision, compiled=name.endswith("compiled"))
        if name.startswith("project"):
            plan = ShardingPlan()  # one process
            run = parallelize_gpt(config, torch.device("cpu"), plan, build_model(config))
            model, buffer, _, opt = run.model, run.buffer, run.fully_sharded, run.optimizer
            steps[name] = (lambda i, m=model, b=buffer, o=opt:
                           train_step(pretrain_gpt.forward_step, batches[i % 4], m, b, o, 1e-4, args.micro_batch))
        else:
            ref = RefGPT(config.padded_vocab_size, args.seq, args.hidden, args.heads, args.layers)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.01)
            ref_model = torch.compile(ref) if name.endswith("compiled") else ref
            steps[name] = lambda i, m=ref_model, o=ref_opt, r=ref: reference_step(m, r, o, batches[i % 4], ctx)
    times = {name: [] for name in VARIANTS}
    for i in range(args.warmup):  # the compiled variants compile here
        for name in VARIANTS:
            start = time.perf_counter()
            steps[name](i)
            print(f"  {precision} warm-up {i + 1}: {name} {time.perf_counter() - start:.1f} s", flush=True)
    for i in range(args.steps):
        for name in VARIANTS:
            start = time.perf_counter()
            steps[name](i)
            times[name].append(time.perf_counter() - start)
    tokens = args.micro_batch * args.seq
    flops = model_flops_per_token(config) * tokens
    peak = measured_peak_tflops(torch.bfloat16 if precision == "bf16" else torch.float32)
    out = {"precision": precision, "peak": peak}
    for name, ts in times.items():
        t = statistics.median(ts)
        out[name] = {"step_s": t, "tokens_s": tokens / t, "mfu": flops / t / 1e12 / peak}
    return out


def render(args, results: list[dict]) -> str:
    lines = [f"Shape: layers {args.layers}, hidden {args.hidden}, heads {args.heads}, seq {args.seq}, "
             f"micro batch {args.micro_batch}, vocab {args.vocab}; {torch.get_num_threads()} CPU threads, "
             f"torch {torch.__version__}; {half_precision('bf16').describe()}; median of {args.steps} steps "
             f"after {args.warmup} warm-up steps, the four variants in turn.",
             "",
             "| precision | variant | tokens/s | step s | MFU | vs reference | vs reference compiled |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        ref, ref_c = r["reference"]["tokens_s"], r["reference compiled"]["tokens_s"]
        for name in VARIANTS:
            v = r[name]
            lines.append(f"| {r['precision']} | {name} | {v['tokens_s']:.0f} | {v['step_s']:.2f} | "
                         f"{100 * v['mfu']:.1f}% | {v['tokens_s'] / ref:.2f}x | {v['tokens_s'] / ref_c:.2f}x |")
    lines.append("")
    lines.append("Peak (a 2048^3 matmul, measured in the run): " +
                 ", ".join(f"{r['precision']} {r['peak']:.3f} TFLOP/s" for r in results) + ".")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"],
                        help="default: fp32, and bf16 where this CPU's bf16 is native")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    precisions = args.precisions or ["fp32"] + (["bf16"] if half_precision("bf16").native else [])
    results = []
    for precision in precisions:
        r = bench_precision(args, precision)
        results.append(r)
        print(f"{precision}: " + ", ".join(f"{name} {r[name]['tokens_s']:.0f} tok/s" for name in VARIANTS), flush=True)
    table = render(args, results)
    print(table)
    if args.write:
        write_section("throughput", "Training-step throughput vs a plain PyTorch GPT (CPU)",
                      "python benchmarks/throughput.py " + " ".join(sys.argv[1:]), table, INTRO, replace_intro=True)
    if any(math.isnan(r[name]["tokens_s"]) for r in results for name in VARIANTS):
        sys.exit(1)


if __name__ == "__main__":
    main()
