"""Data-pipeline throughput: preprocessing against the bare tokenizer, sample-index builds, dataset random access.

    python benchmarks/data.py            # the defaults below: about a minute on 2 cores
    python benchmarks/data.py --write    # also update the data section of docs/benchmarks.md

TOKENIZERS_PARALLELISM=false is set for this process and every subprocess, so the `tokenizers` library
encodes on one thread and "one process" means one core. MB = 2^20 bytes of JSONL input.

1. Preprocessing. tools/make_stdlib_corpus.py writes the standard library's docstrings (~2 MB of JSONL); its
   lines are repeated into a --corpus-mb corpus in a temporary folder. tools/train_tokenizer.py trains a
   --vocab-size byte-level BPE on the unrepeated corpus. Then, in --repeats rounds (medians reported):
   - the tokenizer alone: megatron.tokenizer.build_tokenizer("GPT2BPETokenizer", ...) and tokenize_batch over
     the corpus's "text" strings in batches of --batch-size, in this process; it is credited with the corpus's
     MB, so its MB/s and preprocessing's MB/s count the same documents;
   - tools/preprocess_data.py --append-eod --workers 1 and --workers 2 as subprocesses (wall time, CPU time of
     the process and its workers); tokens are read from the output .idx (one EOD per document included);
   - preprocess_data.py --workers 2 on a one-document file: the fixed cost (interpreter, imports, pool, exit).
   The figure of merit is the 2-worker ratio (2-worker MB/s) / (2 x tokenizer MB/s); the aim is >= 0.8.
   Then the gap between the 2-worker wall time and half the tokenizer time is split into: the fixed cost; the
   CPU time of preprocess_data.py's other stages (reading, JSON decoding, EOD + np.asarray conversion, pickling
   tasks and results between processes, the writer), timed stage by stage in this process with the tool's own
   code where it has a function for it, halved since two cores share it; the load imbalance of the batches
   over 2 workers, from replaying the per-batch times through the tool's dispatch rule (batches in order to the
   first free worker, at most 2 x workers in flight, results consumed in order); and a remainder (contention,
   noise). The two outputs are checked to be identical and to hold the tokenizer's tokens plus one EOD each.
2. Sample index: --num-docs documents of random sizes (uniform 1 .. 2 x --mean-doc-tokens - 1, so ~10^9
   tokens by default) in one shuffled epoch; megatron.data.helpers.build_sample_idx (C++) against
   megatron.data.helpers_reference.build_sample_idx_reference (NumPy): best time of 3 and peak traced memory
   (tracemalloc, which sees NumPy's allocations; the output included, the inputs not), checked equal; and
   megatron.data.gpt_dataset.build_indices (document index shuffle + sample index + shuffle index) for one
   epoch of samples.
3. Random access: a synthetic indexed dataset of --dataset-tokens random uint16 ids in documents of random
   length (mean --mean-doc-tokens) written with IndexedDatasetWriter; a GPTDataset (--seq-length, one epoch)
   over it; GPTDataset.__getitem__ at --samples random indices after --warmup others, page cache warm.
Temporary files are removed at the end.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import pickle
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before `tokenizers` is imported; inherited by subprocesses

import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")
sys.path.insert(0, REPO)
sys.path.insert(0, TOOLS)

import preprocess_data  # noqa: E402  (tools/preprocess_data.py: its reader and Encoder, for the stage profile)

from benchmarks.report import write_section  # noqa: E402
from megatron.data.gpt_dataset import GPTDataset, build_indices  # noqa: E402
from megatron.data.helpers import build_sample_idx, helpers_compiled  # noqa: E402
from megatron.data.helpers_reference import build_sample_idx_reference  # noqa: E402
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, best_dtype  # noqa: E402
from megatron.tokenizer import build_tokenizer  # noqa: E402

MB = 2**20
AIM = 0.8
INTRO = """`benchmarks/data.py` measures the data pipeline on this machine: `tools/preprocess_data.py` on a
corpus of the standard library's docstrings against the tokenizer's own single-process batch encoding
(`TOKENIZERS_PARALLELISM=false`, so one core per process; the aim is a 2-worker ratio of at least 0.8),
the sample-index build in C++ and in NumPy at 10^6 documents / 10^9 tokens, and random access to a
`GPTDataset`. The script's docstring says how each figure is taken."""


# ----------------------------------------------------------------------------- helpers
def run_tool(argv: list[str]) -> tuple[float, float]:
    """Run a tools/ script as a subprocess -> (wall s, CPU s of it and its waited-for children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"benchmarks/data.py: {' '.join(argv[:1])} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def timed(fn, repeats: int = 3):
    """(best wall time of `repeats` calls, the last result)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        result = None
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def traced_peak(fn) -> float:
    """Peak bytes allocated (tracemalloc, NumPy included) while `fn` runs, above what was allocated before."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
        del result
    finally:
        tracemalloc.stop()
    return peak


def simulate_pool(batch_times: list[float], workers: int, window: int) -> float:
    """Makespan of preprocess_data.py's dispatch: batches in order to the first free worker, at most `window`
    in flight, the main process waiting for the oldest result before submitting more."""
    free, finish, submit = [0.0] * workers, [], 0.0
    for k, duration in enumerate(batch_times):
        if k >= window:
            submit = max(submit, finish[k - window])
        w = min(range(workers), key=free.__getitem__)
        free[w] = max(submit, free[w]) + duration
        finish.append(free[w])
    return max(finish, default=0.0)


# ----------------------------------------------------------------------------- 1. preprocessing
def build_corpus(tmp: str, corpus_mb: float) -> dict:
    base = os.path.join(tmp, "stdlib.jsonl")
    start = time.perf_counter()
    run_tool([os.path.join(TOOLS, "make_stdlib_corpus.py"), "--output", base, "--max-mb", "100000"])
    corpus_s = time.perf_counter() - start
    with open(base, "rb") as f:
        lines = [line for line in f if line.strip()]
    path, size, docs = os.path.join(tmp, "corpus.jsonl"), 0, 0
    with open(path, "wb") as f:
        while size < corpus_mb * MB:
            for line in lines:
                f.write(line)
                size, docs = size + len(line), docs + 1
                if size >= corpus_mb * MB:
                    break
    one = os.path.join(tmp, "one.jsonl")
    with open(one, "wb") as f:
        f.write(lines[0])
    return {"base": base, "base_docs": len(lines), "base_bytes": os.path.getsize(base), "path": path,
            "bytes": size, "docs": docs, "one": one, "corpus_s": corpus_s}


def tokenizer_round(tok, texts: list[str], batch_size: int) -> dict:
    tokens = 0
    cpu, start = time.process_time(), time.perf_counter()
    for i in range(0, len(texts), batch_size):
        tokens += sum(map(len, tok.tokenize_batch(texts[i:i + batch_size])))
    return {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu, "tokens": tokens}


def profile_stages(corpus: dict, tok, batch_size: int, tmp: str) -> dict:
    """One in-process pass of preprocess_data.py's work, timed stage by stage (one core)."""
    stages = dict.fromkeys(["read", "task IPC", "decode + JSON", "tokenize", "EOD + np.asarray", "result IPC",
                            "writer"], 0.0)
    dtype, eod = best_dtype(tok.vocab_size), tok.eod
    start = time.perf_counter()
    records = list(preprocess_data.read_records([corpus["path"]], "file"))
    stages["read"] = time.perf_counter() - start
    encoder = preprocess_data.Encoder(argparse.Namespace(json_keys=["text"], append_eod=True, workers=2))
    writer = IndexedDatasetWriter(os.path.join(tmp, "profile"), dtype)
    batch_times = []
    for i in range(0, len(records), batch_size):
        batch = records[i:i + batch_size]
        t0 = time.perf_counter()
        batch = pickle.loads(pickle.dumps((encoder.encode, (batch,))))[1][0]
        t1 = time.perf_counter()
        texts = [json.loads(raw.decode("utf-8"))["text"] for _, _, raw in batch]
        t2 = time.perf_counter()
        ids = tok.tokenize_batch(texts)
        t3 = time.perf_counter()
        arrays = [np.asarray(x + [eod], dtype=dtype) for x in ids]
        t4 = time.perf_counter()
        arrays = pickle.loads(pickle.dumps(([arrays], sum(len(r[2]) for r in batch), [])))[0][0]
        t5 = time.perf_counter()
        for array in arrays:
            writer.add_document(array)
        t6 = time.perf_counter()
        for name, a, b in (("task IPC", t0, t1), ("decode + JSON", t1, t2), ("tokenize", t2, t3),
                           ("EOD + np.asarray", t3, t4), ("result IPC", t4, t5), ("writer", t5, t6)):
            stages[name] += b - a
        batch_times.append(t5 - t0)  # a worker's part: the task's unpickling .. the result's pickling
    start = time.perf_counter()
    writer.finalize()
    stages["writer"] += time.perf_counter() - start
    return {"stages": stages, "batch_times": batch_times}


def bench_preprocess(args, tmp: str) -> dict:
    corpus = build_corpus(tmp, args.corpus_mb)
    tok_dir = os.path.join(tmp, "tok")
    train_s, _ = run_tool([os.path.join(TOOLS, "train_tokenizer.py"), "--input", corpus["base"], "--type", "bpe",
                           "--vocab-size", str(args.vocab_size), "--output-dir", tok_dir])
    vocab, merges = os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt")
    tok = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    with open(corpus["path"], "rb") as f:
        texts = [json.loads(line)["text"] for line in f]

    def preprocess(inp: str, workers: int, out: str) -> tuple[float, float]:
        return run_tool([os.path.join(TOOLS, "preprocess_data.py"), "--input", inp, "--output-prefix", out,
                         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                         "--append-eod", "--workers", str(workers), "--batch-size", str(args.batch_size)])

    rounds: dict[str, list] = {"tokenizer": [], "workers 1": [], "workers 2": [], "startup": []}
    tokens = 0
    for r in range(args.repeats):
        t = tokenizer_round(tok, texts, args.batch_size)
        tokens = t["tokens"]
        rounds["tokenizer"].append((t["wall"], t["cpu"]))
        for workers in (1, 2):
            rounds[f"workers {workers}"].append(preprocess(corpus["path"], workers, os.path.join(tmp, f"w{workers}")))
        rounds["startup"].append(preprocess(corpus["one"], 2, os.path.join(tmp, "one")))
        print(f"  round {r + 1}/{args.repeats}: tokenizer {rounds['tokenizer'][-1][0]:.2f} s, preprocess "
              f"1 worker {rounds['workers 1'][-1][0]:.2f} s, 2 workers {rounds['workers 2'][-1][0]:.2f} s, "
              f"one-document run {rounds['startup'][-1][0]:.2f} s", flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in rounds.items()}

    out1, out2 = (os.path.join(tmp, f"w{w}_text_document") for w in (1, 2))
    idx_tokens = IndexedDataset(out2).num_tokens
    identical = all(filecmp.cmp(out1 + ext, out2 + ext, shallow=False) for ext in (".bin", ".idx"))
    if not identical or idx_tokens != tokens + corpus["docs"]:
        sys.exit(f"benchmarks/data.py: the outputs differ or miscount: identical={identical}, .idx tokens "
                 f"{idx_tokens}, tokenizer tokens {tokens} + {corpus['docs']} EODs")

    profile = profile_stages(corpus, tok, args.batch_size, tmp)
    size_mb = corpus["bytes"] / MB
    rows = {}
    for name, key, n_tokens in (("tokenizer.tokenize_batch, 1 process", "tokenizer", tokens),
                                ("preprocess_data.py --workers 1", "workers 1", idx_tokens),
                                ("preprocess_data.py --workers 2", "workers 2", idx_tokens)):
        wall, cpu = med[key]
        rows[name] = {"wall": wall, "cpu": cpu, "mb_s": size_mb / wall, "tokens_s": n_tokens / wall}
    tok_wall, pre2_wall = med["tokenizer"][0], med["workers 2"][0]
    ratio = tok_wall / (2 * pre2_wall)  # = 2-worker MB/s / (2 x tokenizer MB/s), the same MB on both sides
    stages = profile["stages"]
    overhead_cpu = sum(v for k, v in stages.items() if k != "tokenize")
    makespan = simulate_pool(profile["batch_times"], 2, 4)
    imbalance = makespan - sum(profile["batch_times"]) / 2
    gap = pre2_wall - tok_wall / 2
    causes = {"fixed cost (one-document run)": med["startup"][0],
              "other stages' CPU / 2 cores": overhead_cpu / 2,
              "batch load imbalance over 2 workers": imbalance}
    causes["remainder (contention, noise)"] = gap - sum(causes.values())
    return {"corpus": corpus, "train_s": train_s, "vocab_size": tok.vocab_size, "tokens": tokens,
            "idx_tokens": idx_tokens, "rows": rows, "ratio": ratio, "ratio_no_fixed":
            tok_wall / (2 * (pre2_wall - med["startup"][0])), "stages": stages, "overhead_cpu": overhead_cpu,
            "gap": gap, "ideal": tok_wall / 2, "causes": causes, "n_batches": len(profile["batch_times"]),
            "batch_min": min(profile["batch_times"]), "batch_max": max(profile["batch_times"])}


# ----------------------------------------------------------------------------- 2. sample index
def bench_sample_index(args) -> dict:
    rng = np.random.default_rng(args.seed)
    sizes = rng.integers(1, 2 * args.mean_doc_tokens, size=args.num_docs, dtype=np.int32)
    doc_idx = rng.permutation(args.num_docs).astype(np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    seq = args.seq_length

    def cpp():
        return build_sample_idx(sizes, doc_idx, seq, 1, tokens)

    def ref():
        return build_sample_idx_reference(sizes, doc_idx, seq, 1, tokens)

    cpp_s, cpp_out = timed(cpp)
    ref_s, ref_out = timed(ref)
    if not (cpp_out.dtype == ref_out.dtype and np.array_equal(cpp_out, ref_out)):
        sys.exit("benchmarks/data.py: build_sample_idx and build_sample_idx_reference disagree")
    samples = cpp_out.shape[0] - 1
    del cpp_out, ref_out
    cpp_mem, ref_mem = traced_peak(cpp), traced_peak(ref)
    documents = np.arange(args.num_docs, dtype=np.int64)

    def indices():
        return build_indices(sizes, documents, samples, seq, args.seed)

    all_s, (d, s, sh) = timed(indices)
    if len(sh) != samples or len(d) != args.num_docs:
        sys.exit("benchmarks/data.py: build_indices returned unexpected sizes")
    del d, s, sh
    all_mem = traced_peak(indices)
    return {"tokens": tokens, "samples": samples, "cpp_s": cpp_s, "ref_s": ref_s, "cpp_mem": cpp_mem,
            "ref_mem": ref_mem, "all_s": all_s, "all_mem": all_mem, "compiled": helpers_compiled()}


# ----------------------------------------------------------------------------- 3. random access
def bench_random_access(args, tmp: str) -> dict:
    rng = np.random.default_rng(args.seed + 1)
    n_docs = max(1, round(args.dataset_tokens / args.mean_doc_tokens))
    sizes = rng.integers(1, 2 * args.mean_doc_tokens, size=n_docs)
    ends = np.cumsum(sizes)
    ids = rng.integers(0, args.vocab_size - 1, size=int(ends[-1]), dtype=np.uint16)
    prefix = os.path.join(tmp, "synthetic")
    start = time.perf_counter()
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for s, e in zip((ends - sizes).tolist(), ends.tolist()):
            writer.add_document(ids[s:e])
    write_s = time.perf_counter() - start
    total = len(ids)
    del ids
    indexed = IndexedDataset(prefix)
    seq = args.seq_length
    import torch.distributed  # noqa: F401  (GPTDataset imports it to check for ranks; not part of the timing)

    start = time.perf_counter()
    ds = GPTDataset(indexed, "train", (0, n_docs), (total - 1) // seq, seq, args.seed, os.path.join(tmp, "cache"),
                    args.vocab_size - 1)
    build_s = time.perf_counter() - start
    order = rng.integers(0, len(ds), size=args.warmup + args.samples)
    for i in order[:args.warmup].tolist():
        ds[i]
    start = time.perf_counter()
    for i in order[args.warmup:].tolist():
        ds[i]
    access_s = time.perf_counter() - start
    return {"tokens": total, "docs": n_docs, "bin_mb": os.path.getsize(prefix + ".bin") / MB, "write_s": write_s,
            "build_s": build_s, "len": len(ds), "samples_s": args.samples / access_s,
            "tokens_s": args.samples * (seq + 1) / access_s, "us": access_s / args.samples * 1e6}


# ----------------------------------------------------------------------------- report
def render(args, pre: dict | None, sidx: dict | None, acc: dict | None) -> str:
    out = [f"{os.cpu_count()} CPU cores, Python {sys.version.split()[0]}, NumPy {np.__version__}; "
           "MB = 2^20 bytes.", ""]
    if pre:
        c = pre["corpus"]
        out += [f"**Preprocessing** ({c['docs']} documents, {c['bytes'] / MB:.1f} MB of JSONL: the "
                f"{c['base_docs']} documents ({c['base_bytes'] / MB:.1f} MB) of tools/make_stdlib_corpus.py "
                f"repeated; byte-level BPE of {pre['vocab_size']} tokens from tools/train_tokenizer.py; batches of "
                f"{args.batch_size} documents; TOKENIZERS_PARALLELISM=false; median of {args.repeats} rounds):", "",
                "| run | wall s | CPU s | cores used | MB/s | tokens/s |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for name, r in pre["rows"].items():
            out.append(f"| {name} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['cpu'] / r['wall']:.2f} | {r['mb_s']:.2f} | "
                       f"{r['tokens_s']:,.0f} |")
        two = pre["rows"]["preprocess_data.py --workers 2"]["mb_s"]
        one = pre["rows"]["tokenizer.tokenize_batch, 1 process"]["mb_s"]
        verdict = "meets" if pre["ratio"] >= AIM else "misses"
        out += ["", f"2-worker ratio: {two:.2f} MB/s / (2 x {one:.2f} MB/s) = **{pre['ratio']:.2f}** ({verdict} the "
                f"aim of {AIM}); without the fixed cost: {pre['ratio_no_fixed']:.2f}. Preprocessing's tokens include "
                "one EOD per document.", "",
                f"Where the 2-worker run's time goes beyond half the tokenizer's ({pre['ideal']:.2f} s; gap "
                f"{pre['gap']:.2f} s):", "", "| cause | s | share of the gap |", "| --- | ---: | ---: |"]
        for name, v in pre["causes"].items():
            out.append(f"| {name} | {v:.2f} | {100 * v / pre['gap']:.0f}% |" if pre["gap"] > 0 else
                       f"| {name} | {v:.2f} | - |")
        two_cores = pre["rows"]["preprocess_data.py --workers 2"]
        if two_cores["cpu"] / two_cores["wall"] < 1.5:
            out += ["", f"WARNING: the 2-worker run kept only {two_cores['cpu'] / two_cores['wall']:.2f} cores busy: "
                    "other processes were competing for the CPU, so its figures and the ratio understate it."]
        stages = ", ".join(f"{k} {v:.3f}" for k, v in pre["stages"].items() if k != "tokenize")
        out += ["", "Other stages, CPU s on one core for the whole corpus (tokenize: "
                f"{pre['stages']['tokenize']:.2f}): {stages}; total {pre['overhead_cpu']:.3f}. Worker batches take "
                f"{pre['batch_min']:.2f} .. "
                f"{pre['batch_max']:.2f} s ({pre['n_batches']} batches).", ""]
    if sidx:
        kind = "C++" if sidx["compiled"] else "NOT BUILT: NumPy fallback"
        out += [f"**Sample index** ({args.num_docs:,} documents, {sidx['tokens']:,} tokens, seq_length "
                f"{args.seq_length}, one epoch = {sidx['samples']:,} samples; best of 3; peak = tracemalloc peak "
                "during the call, output included):", "",
                "| step | time s | peak MB |", "| --- | ---: | ---: |",
                f"| helpers.build_sample_idx ({kind}) | {sidx['cpp_s']:.3f} | {sidx['cpp_mem'] / MB:.1f} |",
                f"| helpers_reference.build_sample_idx_reference (NumPy) | {sidx['ref_s']:.3f} | "
                f"{sidx['ref_mem'] / MB:.1f} |",
                f"| NumPy / C++ | {sidx['ref_s'] / sidx['cpp_s']:.1f}x | {sidx['ref_mem'] / sidx['cpp_mem']:.1f}x |",
                f"| gpt_dataset.build_indices (document, sample and shuffle index) | {sidx['all_s']:.3f} | "
                f"{sidx['all_mem'] / MB:.1f} |", ""]
    if acc:
        out += [f"**Random access** (synthetic dataset: {acc['tokens']:,} uint16 tokens in {acc['docs']:,} documents, "
                f"{acc['bin_mb']:.0f} MB .bin, written in {acc['write_s']:.2f} s; GPTDataset seq_length "
                f"{args.seq_length}, one epoch = {acc['len']:,} samples, indices built in "
                f"{acc['build_s'] * 1e3:.0f} ms; "
                f"{args.samples} random samples after {args.warmup} warm-up, page cache warm):", "",
                "| samples/s | tokens/s | us/sample |", "| ---: | ---: | ---: |",
                f"| {acc['samples_s']:,.0f} | {acc['tokens_s']:,.0f} | {acc['us']:.1f} |", ""]
    return "\n".join(out).rstrip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus-mb", type=float, default=16.0, help="Size of the preprocessing corpus.")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary (and synthetic ids' range).")
    p.add_argument("--batch-size", type=int, default=256, help="Documents per tokenize_batch / preprocess batch.")
    p.add_argument("--repeats", type=int, default=5, help="Rounds of the tokenizer and preprocessing runs.")
    p.add_argument("--num-docs", type=int, default=1_000_000, help="Documents for the sample-index build.")
    p.add_argument("--mean-doc-tokens", type=int, default=1000, help="Mean synthetic document length.")
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--dataset-tokens", type=int, default=50_000_000, help="Tokens of the synthetic dataset.")
    p.add_argument("--samples", type=int, default=20000, help="Timed random __getitem__ calls.")
    p.add_argument("--warmup", type=int, default=2000, help="Untimed random __getitem__ calls first.")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--parts", nargs="+", default=["preprocess", "index", "access"],
                   choices=["preprocess", "index", "access"])
    p.add_argument("--tmp-dir", default=None, help="Where the temporary folder goes (default: the system's).")
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md (needs all parts)")
    args = p.parse_args()
    if args.write and len(set(args.parts)) < 3:
        p.error("--write needs all three --parts")
    tmp = tempfile.mkdtemp(prefix="data_bench_", dir=args.tmp_dir)
    pre = sidx = acc = None
    try:
        if "preprocess" in args.parts:
            print("preprocessing ...", flush=True)
            pre = bench_preprocess(args, tmp)
            print(f"  2-worker ratio {pre['ratio']:.2f} (aim {AIM})", flush=True)
        if "index" in args.parts:
            print("sample index ...", flush=True)
            sidx = bench_sample_index(args)
            print(f"  C++ {sidx['cpp_s']:.3f} s, NumPy {sidx['ref_s']:.3f} s, build_indices {sidx['all_s']:.3f} s",
                  flush=True)
        if "access" in args.parts:
            print("random access ...", flush=True)
            acc = bench_random_access(args, tmp)
            print(f"  {acc['samples_s']:,.0f} samples/s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    body = render(args, pre, sidx, acc)
    print(body)
    if args.write:
        write_section("data", "Data pipeline", "python benchmarks/data.py " + " ".join(sys.argv[1:]), body, INTRO)


if __name__ == "__main__":
    main()
