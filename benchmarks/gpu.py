"""Speed on one GPU, in one prepared call: the measured bf16 peak, the seed's models (345M; 1.3B with and without
recompute; bf16 and fp16 as the seed ran), a peer on the same shape, MoE against the dense model of equal active
parameters, FP8 against bf16, and the context-parallel block kernel against the plain one.

    python benchmarks/gpu.py --out gpu-bench                 # on a CUDA device: the full sizes (about 6 minutes)
    python benchmarks/gpu.py --device cpu --out /tmp/g       # every piece at toy size (the suite runs this)
    python benchmarks/gpu.py --only models peer --write      # some pieces; --write updates docs/benchmarks.md

Each piece runs in this process, one after another; one that fails is recorded with its error and the others
go on. It prints one table and writes ``results.json`` to ``--out``. On a CUDA device it first runs the
``gpu``-marked tests (``pytest -m gpu``): the fused paths against the plain ones.

- **peak**: a square matmul in bf16 (8192 on a GPU), the mean of ten after three warm-ups: MFU's denominator.
- **models**: ``examples/configs/gpt_345m_single_card.yaml`` and ``gpt_1.3b_single_card.yaml`` (the seed's
  shapes: sequence 1024, micro-batch 8, dropout 0.1) built and stepped as ``pretrain_gpt.py`` does
  (``parallelize_gpt``, ``train_step``): tokens/s (median step), MFU (``model_flops_per_token`` over the
  measured peak), the device's peak allocated memory against ``megatron.memory.estimate`` and the last loss.
- **peer**: Hugging Face's ``GPT2LMHeadModel`` of the same shape (SDPA attention, ``torch.compile``, bf16
  autocast over fp32 parameters, fused AdamW, clipping 1.0), stepped on the same batches.
- **moe**: a 4-layer Llama shape, dense (ffn 5632) against 8 experts of 2816, top-2 (the same active
  parameters), grouped GEMM where the device has it.
- **fp8**: the 1.3B model with ``--fp8-format hybrid`` against bf16, or the one line that refuses it.
- **activation_offload**: the 1.3B model in bf16 without recompute, with its first 12 layers' activations in host
  memory and with every layer's attention core and projection there (``megatron.offload``): tokens/s and the
  peak memory against the estimate (which subtracts what goes to host).
- **cp_kernel**: one causal block of a long sequence (32K on a GPU) forward and backward through
  ``attention.blocks`` as dispatched, against the plain fp32 kernel.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pretrain_gpt  # noqa: E402
from benchmarks.report import write_section  # noqa: E402
from megatron import device as dev  # noqa: E402
from megatron.config import parse_config, validate  # noqa: E402
from megatron.data.loader import build_batch  # noqa: E402
from megatron.data.mock_dataset import MockGPTDataset  # noqa: E402
from megatron.memory import estimate  # noqa: E402
from megatron.metrics import model_flops_per_token  # noqa: E402
from megatron.parallelize_gpt import build_model, parallelize_gpt  # noqa: E402
from megatron.training.step import train_step  # noqa: E402

SEED_V100_TOKENS_S = 16_500  # the seed's 345M on one 32 GB V100, fp16 (ips_total)
TOY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
       "--max-seq-len", "64", "--max-position-embeddings", "64", "--vocab-size", "512", "--micro-batch-size", "2",
       "--local-batch-size", "2", "--global-batch-size", "2"]
LLAMA = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--swiglu",
         "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--vocab-size", "32000", "--max-seq-len", "2048", "--max-position-embeddings", "2048",
         "--micro-batch-size", "4", "--global-batch-size", "4", "--hidden-dropout-prob", "0",
         "--attention-probs-dropout-prob", "0"]
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]


class Bench:
    """The device, the sizes and the step counts of this call."""

    def __init__(self, args):
        self.device = dev.get_device("gpu" if args.device == "cuda" else "cpu")
        self.cuda = self.device.type == "cuda"
        self.steps, self.warmup = args.steps, args.warmup
        self.peak_tflops: float | None = None

    def config(self, argv: list[str], yaml: str | None = None, keep: tuple[str, ...] = ()):
        """A validated configuration: ``yaml`` (under examples/configs) with ``argv`` over it; on the CPU the toy
        sizes over both, except the flags in ``keep``."""
        flags = (["-c", os.path.join(ROOT, "examples", "configs", yaml)] if yaml else []) + [
            "--mock-data", "--device", "gpu" if self.cuda else "cpu", "--max-steps", "1000",
            "--save", os.path.join("/tmp", "gpu_bench_unused")]
        toy = [] if self.cuda else [value for i in range(0, len(TOY), 2) if TOY[i] not in keep
                                    for value in TOY[i:i + 2]]
        config = parse_config(flags + argv + toy)
        validate(config, cuda_available=self.cuda)
        return config

    def sync(self) -> None:
        dev.synchronize(self.device)

    def timed(self, step, count: int) -> list[float]:
        times = []
        for i in range(count):
            self.sync()
            start = time.perf_counter()
            step(i)
            self.sync()
            times.append(time.perf_counter() - start)
        return times

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)


def batches(config, count: int = 4) -> list[dict]:
    data = MockGPTDataset(1000, config.dataset.max_seq_len, config.model.vocab_size, seed=1)
    b = config.batch_size.global_batch_size
    return [build_batch([data[i * b + j] for j in range(b)], data.eod_id) for i in range(count)]


# ----------------------------------------------------------------------------- pieces
def measure_peak(bench: Bench) -> dict:
    n = 8192 if bench.cuda else 512
    dtype = torch.bfloat16 if bench.cuda or dev.half_precision("bf16").native else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=bench.device)
    b = torch.randn(n, n, dtype=dtype, device=bench.device)
    for _ in range(3):
        a @ b
    times = bench.timed(lambda _: [a @ b for _ in range(10)], 1)
    bench.peak_tflops = 2 * n ** 3 * 10 / times[0] / 1e12
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "tflops": bench.peak_tflops,
            "table_tflops": dev.peak_tflops(bench.device)}


def train_case(bench: Bench, config) -> dict:
    """Build and step ``config``'s model as pretrain_gpt.py does; tokens/s of the median step and the rest."""
    bench.free()
    torch.manual_seed(config.seed)
    run = parallelize_gpt(config, bench.device, None, build_model(config, bench.device))
    data = [dict((k, v.to(bench.device)) for k, v in b.items()) for b in batches(config)]
    mbs, losses = config.batch_size.micro_batch_size, []

    def step(i: int) -> None:
        loss, _ = train_step(pretrain_gpt.forward_step, data[i % len(data)], run.model, run.buffer, run.optimizer,
                             1e-4, mbs)
        losses.append(loss)

    bench.timed(step, bench.warmup)
    times = bench.timed(step, bench.steps)
    tokens = config.batch_size.global_batch_size * config.dataset.max_seq_len
    median = statistics.median(times)
    flops = model_flops_per_token(config) * tokens / median / 1e12
    predicted = estimate(config).total
    measured = dev.peak_memory_bytes(bench.device) if bench.cuda else None
    return {"tokens_s": tokens / median, "step_s": median, "tflops": flops,
            "mfu": flops / bench.peak_tflops if bench.peak_tflops else None, "loss": losses[-1],
            "memory_gib": measured / 2**30 if measured else None, "estimate_gib": predicted / 2**30,
            "memory_vs_estimate": measured / predicted if measured else None}


def seed_models(bench: Bench) -> dict:
    cases = {"345m bf16": ("gpt_345m_single_card.yaml", ["--bf16", "--no-use-pure-fp16"]),
             "345m fp16": ("gpt_345m_single_card.yaml", []),
             "1.3b bf16 recompute": ("gpt_1.3b_single_card.yaml", ["--bf16", "--no-use-pure-fp16"]),
             "1.3b bf16": ("gpt_1.3b_single_card.yaml", ["--bf16", "--no-use-pure-fp16", "--no-use-recompute"]),
             "1.3b fp16 recompute": ("gpt_1.3b_single_card.yaml", [])}
    return {name: guarded(lambda y=yaml, a=argv: train_case(bench, bench.config(a, y))) for name, (yaml, argv)
            in cases.items()}


def peer(bench: Bench) -> dict:
    """Hugging Face's GPT-2 on the 1.3B shape (the 345M's too on a GPU), compiled, bf16 autocast."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    out = {}
    for yaml in ("gpt_345m_single_card.yaml", "gpt_1.3b_single_card.yaml"):
        config = bench.config(["--bf16", "--no-use-pure-fp16", "--no-use-recompute"], yaml)
        label = yaml.split("_")[1] + " hf-gpt2" + (" compiled" if bench.cuda else "")
        out[label] = guarded(lambda c=config: _hf_case(bench, c, GPT2Config,
                                                                                          GPT2LMHeadModel))
    return out


def _hf_case(bench: Bench, config, config_class, model_class) -> dict:
    bench.free()
    m = config.model
    torch.manual_seed(config.seed)
    hf = model_class(config_class(vocab_size=config.padded_vocab_size, n_positions=m.max_position_embeddings,
                                  n_embd=m.hidden_size, n_layer=m.num_layers, n_head=m.num_attention_heads,
                                  n_inner=m.ffn_hidden_size, resid_pdrop=m.hidden_dropout_prob,
                                  embd_pdrop=m.hidden_dropout_prob, attn_pdrop=m.attention_probs_dropout_prob,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")).to(bench.device)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.01, fused=bench.cuda)
    compiled = torch.compile(hf) if bench.cuda else hf  # the CPU's toy run leaves out the compile's minutes
    data = [b["tokens"].to(bench.device) for b in batches(config)]
    losses = []

    def step(i: int) -> None:
        with torch.autocast(bench.device.type, dtype=torch.bfloat16):
            loss = compiled(input_ids=data[i % len(data)], labels=data[i % len(data)]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    bench.timed(step, bench.warmup)
    times = bench.timed(step, bench.steps)
    tokens = config.batch_size.global_batch_size * config.dataset.max_seq_len
    median = statistics.median(times)
    flops = model_flops_per_token(config) * tokens / median / 1e12
    return {"tokens_s": tokens / median, "step_s": median, "tflops": flops,
            "mfu": flops / bench.peak_tflops if bench.peak_tflops else None, "loss": float(losses[-1])}


def moe(bench: Bench) -> dict:
    grouped = ["--moe-grouped-gemm"] if bench.cuda else []
    precision = ["--bf16"] if bench.cuda else []
    keep = ("--ffn-hidden-size",)
    dense = bench.config(LLAMA + precision + ["--ffn-hidden-size", "5632" if bench.cuda else "256"], keep=keep)
    experts = bench.config(LLAMA + precision + MOE + grouped + ["--ffn-hidden-size", "2816" if bench.cuda else "128"],
                           keep=keep)
    out = {"dense": guarded(lambda: train_case(bench, dense)), "moe": guarded(lambda: train_case(bench, experts))}
    if "tokens_s" in out["dense"] and "tokens_s" in out["moe"]:
        out["moe_vs_dense"] = out["moe"]["tokens_s"] / out["dense"]["tokens_s"]
    return out


def fp8(bench: Bench) -> dict:
    base = ["--bf16", "--no-use-pure-fp16"]
    try:
        config = bench.config(base + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
                              "gpt_1.3b_single_card.yaml")
    except (SystemExit, ValueError) as err:  # argparse's exit, or the configuration's one-line refusal
        return {"refused": refusal(err)}
    out = {"bf16": guarded(lambda: train_case(bench, bench.config(base, "gpt_1.3b_single_card.yaml"))),
           "fp8": guarded(lambda: train_case(bench, config))}
    if "tokens_s" in out["bf16"] and "tokens_s" in out["fp8"]:
        out["fp8_vs_bf16"] = out["fp8"]["tokens_s"] / out["bf16"]["tokens_s"]
        out["loss_difference"] = abs(out["fp8"]["loss"] - out["bf16"]["loss"]) / out["bf16"]["loss"]
    return out


def cp_kernel(bench: Bench) -> dict:
    """One causal block (the diagonal block of a cp rank) forward and backward: as dispatched, and plain."""
    from megatron.attention import blocks

    length, heads, width = (32768, 16, 128) if bench.cuda else (256, 4, 32)
    dtype = torch.bfloat16 if bench.cuda else torch.float32
    q, k, v = (torch.randn(1, heads, length, width, dtype=dtype, device=bench.device) for _ in range(3))
    block, scale = blocks.Block(slice(0, length), slice(0, length), 0), width ** -0.5

    def run(_: int) -> None:
        out, lse = blocks.kernel_forward(q, k, v, block, scale)
        blocks.kernel_backward(torch.ones_like(out), q, k, v, out, lse, block, scale)

    result = {"length": length, "heads": heads, "width": width, "dtype": str(dtype).replace("torch.", ""),
              "kernel": blocks.kernel_name(bench.device, dtype, width)}
    saved = blocks.FUSED_ON_CPU["enabled"], blocks.FUSED_ON_GPU["enabled"]
    try:
        for name, fused in (("dispatched", saved), ("plain", (False, False))):
            blocks.FUSED_ON_CPU["enabled"], blocks.FUSED_ON_GPU["enabled"] = fused
            bench.timed(run, 1)
            result[name + "_s"] = statistics.median(bench.timed(run, max(2, bench.steps // 2)))
    finally:
        blocks.FUSED_ON_CPU["enabled"], blocks.FUSED_ON_GPU["enabled"] = saved
    result["speedup"] = result["plain_s"] / result["dispatched_s"]
    return result


def gpu_tests(bench: Bench) -> dict:
    """The ``gpu``-marked tests (fused against plain on the device), their summary line."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/unit", "tests/distributed"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    lines = done.stdout.strip().splitlines()
    return {"exit_status": done.returncode, "summary": lines[-1] if lines else done.stderr[-300:]}


def refusal(err: BaseException) -> str:
    return str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__


def guarded(piece) -> dict:
    """The piece's figures, or its error in one line (the other pieces go on)."""
    try:
        return piece()
    except Exception as err:  # noqa: BLE001 - a benchmark reports what broke and carries on
        return {"error": dev.first_line(err)}


def activation_offload(bench: Bench) -> dict:
    """The 1.3B model in bf16 without recompute: as is, its first half of layers offloaded whole, and the attention
    core and projection of every layer offloaded (``megatron.offload``); peak memory against the estimate, which
    subtracts what goes to host."""
    base = ["--bf16", "--no-use-pure-fp16", "--no-use-recompute", "--min-offloaded-tensor-size", "1024"]
    half = "12" if bench.cuda else "1"
    cases = {"none": [], f"first {half} layers": ["--cpu-offloading-num-layers", half],
             "core_attn + attn_proj": ["--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                                       "attn_proj"]}
    return {name: guarded(lambda a=argv: train_case(bench, bench.config(base + a, "gpt_1.3b_single_card.yaml")))
            for name, argv in cases.items()}


PIECES = {"peak": measure_peak, "gpu_tests": gpu_tests, "models": seed_models, "peer": peer, "moe": moe, "fp8": fp8,
          "cp_kernel": cp_kernel, "activation_offload": activation_offload}


# ----------------------------------------------------------------------------- report
def _f(value, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _row(name: str, r: dict, best_peer: float | None = None) -> str:
    if "error" in r:
        return f"| {name} | {r['error']} | | | | |"
    vs_peer = _f(r["tokens_s"] / best_peer if best_peer else None, ".2f", "x")
    memory = (f"{r['memory_gib']:.1f} / {r['estimate_gib']:.1f} GiB ({r['memory_vs_estimate']:.2f})"
              if r.get("memory_gib") else _f(r.get("estimate_gib"), ".2f", " GiB (estimate)"))
    return (f"| {name} | {_f(r['tokens_s'])} | {_f(r.get('mfu') and 100 * r['mfu'], '.1f', '%')} | {memory} | "
            f"{_f(r.get('loss'), '.3f')} | {vs_peer} |")


def render(results: dict, environment: dict) -> str:
    peak = results.get("peak", {})
    lines = [f"{environment['device']}, torch {environment['torch']}, {environment['date']}; measured peak "
             f"{_f(peak.get('tflops'), '.1f')} TFLOP/s ({peak.get('dtype')} {peak.get('n')}^3; table "
             f"{_f(peak.get('table_tflops'), '.0f')}); median of {environment['steps']} steps after "
             f"{environment['warmup']} warm-up steps.", ""]
    if "gpu_tests" in results:
        t = results["gpu_tests"]
        lines += [f"`pytest -m gpu`: {t.get('summary', t.get('error'))}", ""]
    for name, r in results.items():
        if "error" in r:
            lines += [f"{name}: {r['error']}", ""]
    peers = {k: v for k, v in results.get("peer", {}).items() if isinstance(v, dict) and "tokens_s" in v}
    lines += ["| run | tokens/s | MFU | peak memory / estimate | last loss | vs peer |",
              "| --- | ---: | ---: | --- | ---: | ---: |"]
    for name, r in results.get("models", {}).items():
        if not isinstance(r, dict):
            continue
        size = name.split()[0]
        best = max((v["tokens_s"] for k, v in peers.items() if k.startswith(size)), default=None)
        lines.append(_row(name, r, best))
    for name, r in results.get("peer", {}).items():
        if isinstance(r, dict):
            lines.append(_row(name, r))
    moe_result = results.get("moe", {})
    for name in ("dense", "moe"):
        if name in moe_result:
            lines.append(_row(f"llama-4l {name}", moe_result[name]))
    for name, r in results.get("activation_offload", {}).items():
        if isinstance(r, dict):
            lines.append(_row(f"1.3b bf16 offload {name}", r))
    fp8_result = results.get("fp8", {})
    for name in ("bf16", "fp8"):
        if name in fp8_result:
            lines.append(_row(f"1.3b {name} (fp8 piece)", fp8_result[name]))
    lines.append("")
    if "moe_vs_dense" in moe_result:
        lines.append(f"MoE / dense tokens/s: {moe_result['moe_vs_dense']:.2f}.")
    if "refused" in fp8_result:
        lines.append(f"FP8: refused: {fp8_result['refused']}")
    elif "fp8_vs_bf16" in fp8_result:
        lines.append(f"FP8 / bf16 tokens/s: {fp8_result['fp8_vs_bf16']:.2f}; loss difference "
                     f"{100 * fp8_result['loss_difference']:.2f}%.")
    cp = results.get("cp_kernel", {})
    if "speedup" in cp:
        lines.append(f"Context-parallel block kernel, one causal block of {cp['length']} ({cp['heads']} heads of "
                     f"{cp['width']}, {cp['dtype']}), forward + backward: {cp['kernel']} {cp['dispatched_s']:.3f} s, "
                     f"plain fp32 {cp['plain_s']:.3f} s: {cp['speedup']:.2f}x.")
    elif "error" in cp:
        lines.append(f"Context-parallel block kernel: {cp['error']}")
    if any("345m" in name and "tokens_s" in r for name, r in results.get("models", {}).items()):
        lines.append(f"The seed's 345M on a 32 GB V100 (fp16): about {SEED_V100_TOKENS_S:,} tokens/s.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if dev.cuda_available() else "cpu",
                        help="cuda: the full sizes; cpu: every piece at toy size (default: cuda where there is one)")
    parser.add_argument("--only", nargs="+", choices=tuple(PIECES), help="these pieces (the peak always)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default: 10; 2 on the CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 3; 1 on the CPU)")
    parser.add_argument("--out", default="gpu-bench", help="folder for results.json")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md's section")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not dev.cuda_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu for the toy sizes")
    cpu = args.device == "cpu"
    args.steps = args.steps or (2 if cpu else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    bench = Bench(args)
    chosen = ["peak"] + [p for p in PIECES if p != "peak" and (args.only is None or p in args.only)]
    if cpu and args.only is None:
        chosen.remove("gpu_tests")  # the suite runs those tests itself (skipped without a device)
    os.makedirs(args.out, exist_ok=True)
    environment = {"device": dev.device_name(bench.device), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "warmup": args.warmup}
    results = {}
    for name in chosen:
        start = time.perf_counter()
        results[name] = guarded(lambda p=PIECES[name]: p(bench))
        print(f"gpu.py: {name} done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:  # kept up to date: a cut call keeps the rest
            json.dump({"environment": environment, "results": results}, f, indent=1)
    table = render(results, environment)
    print(table)
    if args.write:
        write_section("gpu", "Speed on one GPU: the seed's models, a peer, MoE, FP8, the cp block kernel",
                      "python benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
