"""Generation speed on the CPU (fp32): the inference engine with its KV cache, the same model recomputing the
whole sequence every step, Hugging Face transformers on the same weights, and the OpenAI-compatible server.

    python benchmarks/generation.py            # the defaults below: about 2 minutes on 2 cores
    python benchmarks/generation.py --write    # also update the generation section of docs/benchmarks.md

The model. Without ``--load``, a GPT of the flags' shape (GPT-2 small's layout, smaller: 6 layers, hidden 512,
512 positions) is written as a step-0 checkpoint in a temporary folder, its parameters randomly initialised
(``init_parameters``) as tests/inference/conftest.py does, with a tokenizer: tools/train_tokenizer.py trains a
``--vocab``-token byte-level BPE on tools/make_stdlib_corpus.py's docstrings, and the model's vocabulary is that
tokenizer's. The server needs a tokenizer, and the engine detokenizes every token it streams, as it would in
service. tools/convert_checkpoint.py to-hf exports the checkpoint, and ``GPT2LMHeadModel.from_pretrained`` loads
it in this process: every side computes with the same fp32 weights and ``torch.set_num_threads(--threads)``.

1. Batch generation, at every ``--batch`` (default 1 and 8): ``--prompt`` random token ids per row (the same
   length in every row, so there is no padding on any side; the same prompts for every side), ``--new``
   tokens, greedy, end-of-document ignored (every row makes exactly ``--new`` tokens):
   - engine: ``InferenceEngine.stream`` (the prefill fills the KV cache, then one ``[b, 1]`` forward per step);
   - no cache: the engine's model called as ``model(tokens)`` on the whole sequence so far every step (the
     logits of every position, as that call returns them), argmax of the last position;
   - transformers: ``GPT2LMHeadModel.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`` (its
     dynamic KV cache; ``min_new_tokens`` keeps an end-of-sequence id from ending a row early).
   *Prefill* is the time from the call to the first token being decided (the forward over the prompt and the
   first choice): the engine's first event that carries a token, the second ``streamer.put`` of transformers
   (the first carries the prompt), the first forward and argmax without a cache. Prefill tokens/s = batch x
   prompt / that time. The other ``N - 1`` tokens of each row come from one forward each: decode tokens/s =
   batch x (N - 1) / (total time - prefill time). Every side runs once as a warm-up (the no-cache side with
   ``--warmup-new`` tokens); then ``--repeats`` rounds, each running every side once, in an order that rotates
   from round to round so that background load falls on all of them; the medians are reported. The no-cache
   side takes part in the first ``--no-cache-rounds`` rounds only (default 1): at batch 8 one run of it costs
   more than all the other runs together, and it is the slow reference, not a contender. The tokens of the
   no-cache and transformers runs are compared with the engine's: with random weights the logits of the top
   candidates can lie within fp32 rounding of each other, and a different summation order may then pick
   another token (and the row continues differently from there).
2. One-row matmuls: at batch 1 every decode step multiplies a single row by every weight matrix, so it is bound
   by reading the weights from memory. For each matrix of the model (one layer's four and the tied LM head),
   ``F.linear`` of a [1, in] input is timed with the matrix stored [out, in] (nn.Linear's row-major layout)
   and [in, out] (the same values, the transpose contiguous, as transformers' ``Conv1D`` stores its weights;
   ``F.linear`` then reads it without a copy), cycling through ``--gemv-pool-mb`` of copies so that the cache
   does not hold them (the model's weights do not fit in it either); the median of ``--gemv-passes`` passes
   over the pool, the two layouts alternating. Which layout each side actually stores is read from the
   loaded models, and the per-step totals (layers x four matrices + head) are summed for each side's layouts
   and for the faster layout of each matrix.
3. Server throughput: tools/serve.py started on the checkpoint (``--host 127.0.0.1 --port`` a free port;
   ``OMP_NUM_THREADS=--threads``), ready when ``GET /health`` answers 200; then, for each ``--clients`` count,
   that many threads (urllib) each send their share of ``max(clients, --server-requests)`` requests to
   ``POST /v1/completions`` one after another (``model`` as ``GET /v1/models`` names it, ``prompt`` as
   ``--prompt`` token ids, ``max_tokens`` ``--new``, ``temperature`` 0, ``ignore_eos`` true). Throughput = the
   responses' ``usage.completion_tokens`` summed / the wall time from the first request to the last response;
   latency = the mean request time. One request first warms the server. Skipped, with a note, when
   tools/serve.py is missing or does not become ready.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the tokenizer is not what is measured

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")
sys.path.insert(0, REPO)

from benchmarks.report import write_section  # noqa: E402
from benchmarks.serving import bench_server  # noqa: E402
from megatron.checkpoint.convert import write_params  # noqa: E402
from megatron.config import parse_config  # noqa: E402
from megatron.inference import InferenceEngine, Request, SamplingParams, initialize, load_model, tokenizer_for  # noqa: E402
from megatron.model.gpt import GPTModel  # noqa: E402
from megatron.model.init import init_parameters  # noqa: E402

SIDES = ("engine", "no cache", "transformers")
HEADING = "Generation: KV-cache engine vs full recompute vs transformers (CPU, fp32)"
INTRO = """`benchmarks/generation.py` times greedy generation on the CPU in fp32 with `megatron.inference`'s engine (KV
cache), with the same model recomputing the whole sequence every step (`model(tokens)`, no cache), and with Hugging
Face `GPT2LMHeadModel.generate` on the same weights (exported with `tools/convert_checkpoint.py to-hf`), all in one
process with the same number of threads; then the throughput of `tools/serve.py` under 1 and 16 concurrent clients.
*Prefill* is the time to the first token (the forward over the prompt and the first choice); *decode* tokens/s
counts the other tokens over the rest of the time. At batch 1 a decode step multiplies one row by every weight
matrix, so its time is mostly that of reading the weights from memory, and how fast MKL's one-row fp32 matmul reads
a matrix depends on which way the matrix is stored: the one-row table measures each of the model's matrices both
ways and adds up each side's layouts. The script's docstring says how each figure is taken."""


# ----------------------------------------------------------------------------- the model
def run_tool(argv: list[str]) -> None:
    """Run a tool of this repository; its output is shown only when it fails."""
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{os.path.basename(argv[0])} failed:\n{proc.stdout}{proc.stderr}")


def build_checkpoint(args, tmp: str) -> str:
    """A run folder holding step 0 of a randomly initialised GPT of the flags' shape, with a BPE tokenizer
    trained on the standard library's docstrings (its actual size is the model's vocabulary)."""
    corpus, tok = os.path.join(tmp, "corpus.jsonl"), os.path.join(tmp, "tok")
    run_tool([os.path.join(TOOLS, "make_stdlib_corpus.py"), "--output", corpus])
    run_tool([os.path.join(TOOLS, "train_tokenizer.py"), "--input", corpus, "--type", "bpe", "--vocab-size",
              str(args.vocab), "--output-dir", tok])
    with open(os.path.join(tok, "vocab.json")) as f:
        vocab = len(json.load(f))
    config = parse_config(["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
                           "--num-attention-heads", str(args.heads), "--ffn-hidden-size", str(4 * args.hidden),
                           "--max-seq-len", str(args.positions), "--max-position-embeddings", str(args.positions),
                           "--vocab-size", str(vocab), "--device", "cpu", "--hidden-dropout-prob", "0",
                           "--attention-probs-dropout-prob", "0", "--initializer-range", str(args.init_std),
                           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(tok, "vocab.json"),
                           "--merge-file", os.path.join(tok, "merges.txt")])
    model = GPTModel(config.model, config.padded_vocab_size)
    init_parameters(model, args.seed, config.model)
    run = os.path.join(tmp, "run")
    write_params(run, config, {n: p.detach() for n, p in model.named_parameters()})
    return run


def load_hf(ckpt: str, tmp: str):
    """``GPT2LMHeadModel`` of the checkpoint, exported by tools/convert_checkpoint.py to-hf (fp32, eval)."""
    from transformers import GPT2LMHeadModel

    out = os.path.join(tmp, "hf")
    run_tool([os.path.join(TOOLS, "convert_checkpoint.py"), "to-hf", ckpt, out])
    return GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()


# ----------------------------------------------------------------------------- the three sides
# Each returns (seconds to the first token, total seconds, the generated tokens [b][N]).
def run_engine(engine: InferenceEngine, prompts: torch.Tensor, new: int):
    requests = [Request(row.tolist(), SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
                for row in prompts]
    out: list[list[int]] = [[] for _ in requests]
    start, first = time.perf_counter(), None
    for events in engine.stream(requests):
        # The first yield comes after the prefill with no token (the first choice opens the next step),
        # so the first token's time is that of the first event that carries one.
        for e in events:
            if getattr(e, "token", None) is not None:
                out[e.index].append(e.token)
                first = first or time.perf_counter()
    return first - start, time.perf_counter() - start, out


@torch.inference_mode()
def run_no_cache(model, vocab: int, prompts: torch.Tensor, new: int):
    tokens, start, first = prompts.clone(), time.perf_counter(), None
    for _ in range(new):
        logits = model(tokens)  # [b, s, V_padded]: the whole sequence again, every step
        tokens = torch.cat([tokens, logits[:, -1, :vocab].argmax(-1, keepdim=True)], dim=1)
        first = first or time.perf_counter()
    return first - start, time.perf_counter() - start, tokens[:, prompts.shape[1]:].tolist()


class _Clock:
    """A transformers streamer that notes when the first generated tokens arrive (its first ``put`` is the
    prompt, before any forward)."""

    def __init__(self):
        self.puts: list[float] = []

    def put(self, value):
        self.puts.append(time.perf_counter())

    def end(self):
        pass


@torch.inference_mode()
def run_transformers(hf, prompts: torch.Tensor, new: int):
    clock = _Clock()
    start = time.perf_counter()
    out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=new,
                      min_new_tokens=new, pad_token_id=0, streamer=clock)
    total = time.perf_counter() - start
    return clock.puts[1] - start, total, out[:, prompts.shape[1]:].tolist()


def bench_batches(args, engine, model, hf, vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(args.seed)
    results = []
    for batch in args.batch:
        prompts = torch.randint(0, vocab, (batch, args.prompt), generator=generator)
        sides: dict[str, Callable] = {
            "engine": lambda n, p=prompts: run_engine(engine, p, n),
            "no cache": lambda n, p=prompts: run_no_cache(model, vocab, p, n),
            "transformers": lambda n, p=prompts: run_transformers(hf, p, n),
        }
        for name, fn in sides.items():  # warm-up
            fn(args.warmup_new if name == "no cache" else args.new)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in SIDES}
        tokens: dict[str, list[list[int]]] = {}
        for r in range(args.repeats):
            order = SIDES[r % 3:] + SIDES[:r % 3]
            for name in order:
                if name == "no cache" and r >= args.no_cache_rounds:
                    continue
                first, total, out = sides[name](args.new)
                times[name].append((first, total))
                tokens[name] = out
                print(f"  batch {batch} round {r + 1}/{args.repeats} {name}: first token {first:.3f} s, "
                      f"total {total:.2f} s", flush=True)
        row = {"batch": batch}
        for name in SIDES:
            first = statistics.median(t[0] for t in times[name])
            decode = statistics.median(t[1] - t[0] for t in times[name])
            row[name] = {"prefill_s": first, "decode_s": decode,
                         "prefill_tps": batch * args.prompt / first,
                         "decode_tps": batch * (args.new - 1) / decode,
                         "same": sum(a == b for a, b in zip(tokens[name], tokens["engine"], strict=True)),
                         "agree": _agreeing(tokens[name], tokens["engine"])}
        results.append(row)
    return results


def _agreeing(rows: list[list[int]], reference: list[list[int]]) -> int:
    """Tokens equal to the reference's before each row's first difference, summed over rows."""
    total = 0
    for a, b in zip(rows, reference, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        total += n
    return total


# ----------------------------------------------------------------------------- one-row matmuls
# The decode step's matrices (our names; ``None``: the tied LM head) and their labels.
MATRICES = (("self_attention.query_key_value.weight", "QKV"), ("self_attention.dense.weight", "attention out"),
            ("mlp.dense_h_to_4h.weight", "MLP in"), ("mlp.dense_4h_to_h.weight", "MLP out"), (None, "LM head"))


def _storage(weight: torch.Tensor, conv1d: bool) -> str:
    """How a weight's matrix lies in memory, in the [out, in] terms of ``F.linear``: "[out, in]" when each
    output's row of inputs is contiguous (nn.Linear's layout), "[in, out]" when each input's row of outputs
    is (transformers' ``Conv1D`` stores its weight so)."""
    rows_contiguous = weight.stride(-1) == 1
    return "[in, out]" if rows_contiguous == conv1d else "[out, in]"


def bench_gemv(args, model, hf) -> dict:
    """Time ``F.linear`` of one row (a decode step at batch 1) against each of the model's matrices stored
    both ways, with the weights read from memory, not from the cache: a pool of ``--gemv-pool-mb`` of
    copies is cycled through. Returns the rows and the per-step totals of each side's actual layouts."""
    import torch.nn.functional as F

    from megatron.checkpoint.hf.gpt2 import name_map

    layers = len(model.layers)
    first = next(iter(model.layers.keys()))
    names = name_map(layers)
    rows = []
    for ours, label in MATRICES:
        full = ours and f"layers.{first}.{ours}"
        weight = model.get_parameter(full or "embedding.word_embeddings.weight")
        theirs = names[full] if full else "lm_head.weight"
        module = hf.get_submodule(theirs.rsplit(".", 1)[0])
        out_features, in_features = weight.shape
        size = weight.numel() * 4
        x = torch.randn(1, in_features)
        pool = [torch.randn(out_features, in_features) for _ in range(max(2, -(-args.gemv_pool_mb * 2**20 // size)))]
        layouts = {"[out, in]": pool, "[in, out]": [w.t().contiguous().t() for w in pool]}  # same matrices
        passes: dict[str, list[float]] = {k: [] for k in layouts}
        for r in range(args.gemv_passes + 1):  # the first pass warms up
            for key in (list(layouts) if r % 2 else list(layouts)[::-1]):
                start = time.perf_counter()
                for w in layouts[key]:
                    F.linear(x, w)
                if r:
                    passes[key].append((time.perf_counter() - start) / len(pool))
        del pool, layouts
        seconds = {k: statistics.median(v) for k, v in passes.items()}
        rows.append({"label": label, "shape": (out_features, in_features), "mb": size / 2**20,
                     "count": layers if ours else 1, "seconds": seconds,
                     "engine": _storage(weight, conv1d=False),
                     "transformers": _storage(module.weight, conv1d=type(module).__name__ == "Conv1D")})
    totals = {side: sum(r["count"] * r["seconds"][r[side]] for r in rows) for side in ("engine", "transformers")}
    totals["best"] = sum(r["count"] * min(r["seconds"].values()) for r in rows)
    return {"rows": rows, "totals": totals, "pool_mb": args.gemv_pool_mb, "passes": args.gemv_passes}


# ----------------------------------------------------------------------------- report
def cpu_description() -> str:
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", "unknown CPU", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    marks = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in ("avx512_bf16", "amx_bf16"))
    return f"{model}, {os.cpu_count()} cores ({marks})"


def render(args, shape: str, batches: list[dict], gemv: dict | None, server: list[dict] | None, note: str,
           elapsed: float) -> str:
    import transformers

    lines = [f"{shape}; prompt {args.prompt} tokens, {args.new} new tokens per row, greedy, end-of-document "
             f"ignored; {cpu_description()}; {args.threads} threads (`torch.set_num_threads`), torch "
             f"{torch.__version__}, transformers {transformers.__version__}; median of {args.repeats} rounds after "
             f"a warm-up (no cache: {_rounds(min(args.repeats, args.no_cache_rounds))}); run took {elapsed:.0f} s.",
             "",
             "| batch | side | prefill s | prefill tokens/s | decode tokens/s | decode vs transformers "
             "| rows equal to the engine's |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in batches:
        ref = row["transformers"]["decode_tps"]
        for name in SIDES:
            r = row[name]
            same = "-" if name == "engine" else f"{r['same']} / {row['batch']}"
            if name != "engine" and r["same"] < row["batch"]:
                same += f" ({r['agree']} of {row['batch'] * args.new} tokens before the first difference)"
            value = f"**{r['decode_tps']:.1f}**" if name == "engine" else f"{r['decode_tps']:.1f}"
            lines.append(f"| {row['batch']} | {name} | {r['prefill_s']:.3f} | {r['prefill_tps']:,.0f} | {value} | "
                         f"{r['decode_tps'] / ref:.2f}x | {same} |")
    lines.append("")
    if gemv is not None:
        t = gemv["totals"]
        lines += [f"**One-row matmuls** (a decode step at batch 1 multiplies one row by every weight matrix, read from "
                  f"memory: `F.linear` of a [1, in] input, the matrix stored [out, in] (each output's inputs "
                  f"contiguous, nn.Linear's layout) or [in, out] (each input's outputs contiguous, transformers' "
                  f"`Conv1D`); a pool of {gemv['pool_mb']} MB of copies cycled so that the cache does not hold them; "
                  f"median of {gemv['passes']} passes; MB = 2^20 bytes, GB/s = 10^9 bytes/s):", "",
                  "| matrix | out x in | MB | stored [out, in] us | GB/s | stored [in, out] us | GB/s | engine stores "
                  "| transformers stores |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
        for r in gemv["rows"]:
            a, b = r["seconds"]["[out, in]"], r["seconds"]["[in, out]"]
            gb = r["mb"] * 2**20 / 1e9
            lines.append(f"| {r['label']} | {r['shape'][0]} x {r['shape'][1]} | {r['mb']:.1f} | {a * 1e6:.0f} | "
                         f"{gb / a:.1f} | {b * 1e6:.0f} | {gb / b:.1f} | {r['engine']} | {r['transformers']} |")
        lines += ["", f"Per decode step at batch 1 ({gemv['rows'][0]['count']} layers and the head): "
                      f"{t['engine'] * 1e3:.1f} ms of matmuls with the engine's layouts, "
                      f"{t['transformers'] * 1e3:.1f} ms with transformers', {t['best'] * 1e3:.1f} ms with the "
                      f"faster layout of each matrix.", ""]
    if server is None:
        lines.append(f"**Server**: not measured: {note}.")
    else:
        lines += [f"**Server** (`tools/serve.py`, `OMP_NUM_THREADS={args.threads}`; requests of {args.prompt} prompt "
                  f"token ids and `max_tokens` {args.new}, `temperature` 0, `ignore_eos`):", "",
                  "| clients | requests | completion tokens | wall s | tokens/s | mean latency s |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['wall_s']:.2f} | {r['tps']:.1f} | "
                  f"{r['latency_s']:.2f} |" for r in server]
    return "\n".join(lines)


def _rounds(n: int) -> str:
    return "one round" if n == 1 else f"median of the first {n} rounds"


def verdict(batches: list[dict]) -> str:
    """The issue's bar: engine decode at least transformers' at batch 1 and above it at larger batches."""
    parts = []
    for row in batches:
        ratio = row["engine"]["decode_tps"] / row["transformers"]["decode_tps"]
        ok = ratio >= 1.0 if row["batch"] == 1 else ratio > 1.0
        parts.append(f"batch {row['batch']}: engine decode {ratio:.2f}x transformers ({'meets' if ok else 'misses'} "
                     f"the bar)")
    return "; ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", default=None, help="A checkpoint to use instead of a random one (run or step folder).")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--positions", type=int, default=512, help="max_position_embeddings.")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary to train (the model's vocabulary).")
    p.add_argument("--init-std", type=float, default=0.02, help="initializer_range of the random model.")
    p.add_argument("--prompt", type=int, default=128, help="Prompt tokens per row.")
    p.add_argument("--new", type=int, default=64, help="New tokens per row.")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=5, help="Timed rounds (medians reported).")
    p.add_argument("--no-cache-rounds", type=int, default=1,
                   help="Rounds the no-cache side takes part in (the first ones): at batch 8 one run of it "
                        "costs more than all the other runs together.")
    p.add_argument("--warmup-new", type=int, default=4, help="New tokens of the no-cache side's warm-up run.")
    p.add_argument("--gemv-pool-mb", type=int, default=128,
                   help="MB of weight copies each one-row matmul cycles through (several times the L3 cache).")
    p.add_argument("--gemv-passes", type=int, default=3, help="Timed passes over that pool per layout.")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads for every side.")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16], help="Concurrent server clients.")
    p.add_argument("--server-requests", type=int, default=4,
                   help="Requests per client count (at least one per client).")
    p.add_argument("--server-timeout", type=float, default=120.0, help="Seconds for the server to become ready.")
    p.add_argument("--no-server", action="store_true", help="Skip the server part.")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args()
    if args.new < 2:
        p.error("--new must be at least 2 (the first token ends the prefill; decode is the others).")
    if min(args.repeats, args.no_cache_rounds, args.gemv_passes, *args.batch, *args.clients) < 1:
        p.error("--repeats, --no-cache-rounds, --gemv-passes, --batch and --clients must be at least 1.")
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    initialize()
    with tempfile.TemporaryDirectory(prefix="generation_bench_") as tmp:
        ckpt = args.load
        if ckpt is None:
            print("writing a random checkpoint ...", flush=True)
            ckpt = build_checkpoint(args, tmp)
        model, config = load_model(ckpt, "fp32", "cpu")
        engine = InferenceEngine(model, config, tokenizer_for(config), "cpu")
        hf = load_hf(ckpt, tmp)
        m = config.model
        vocab = m.vocab_size
        shape = (f"GPT {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
                 f"{m.max_position_embeddings} positions, vocabulary {vocab} (padded {config.padded_vocab_size}), "
                 f"{sum(t.numel() for t in model.parameters()) / 1e6:.1f}M parameters"
                 + (f" ({args.load})" if args.load else ", random weights (initializer_range "
                    f"{m.initializer_range})") + f", fp32; transformers attention: {hf.config._attn_implementation}")
        print(shape, flush=True)
        batches = bench_batches(args, engine, model, hf, vocab)
        print("one-row matmuls ...", flush=True)
        gemv = bench_gemv(args, model, hf)
        del hf
        server, note = (None, "--no-server given") if args.no_server else (None, "")
        if not args.no_server:
            print("server ...", flush=True)
            server, note = bench_server(args, ckpt, vocab)
            if server is None:
                print(f"  server part skipped: {note}", flush=True)
    body = render(args, shape, batches, gemv, server, note, time.perf_counter() - started)
    print(body)
    print(verdict(batches))
    if args.write:
        write_section("generation", HEADING, "python benchmarks/generation.py " + " ".join(sys.argv[1:]), body,
                      INTRO, replace_intro=True)


if __name__ == "__main__":
    main()
