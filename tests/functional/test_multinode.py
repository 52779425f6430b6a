"""Two "nodes" on one machine: two torchrun launchers joined by c10d rendezvous, each with its own copy
of a preprocessed corpus at another path and its own index cache (no shared disk), train the same losses as one
process."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.functional.corpus import build
from tests.functional.launch import curves, run_here
from tests.functional.processes import free_port, popen

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

WORDS = ["the cat", "a dog", "my friend", "sees", "likes", "finds", "the ball", "a book", "the garden", "bread"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """400 documents of 10-40 words, a 300-token BPE tokenizer and their mmap dataset (``corpus.build``)."""
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) + "." for _ in range(400)]
    return build(tmp_path_factory.mktemp("corpus"), docs, 300)


def _flags(corpus: Path, data: Path, cache: Path, out: Path) -> list[str]:
    """fp32, no dropout: a data-parallel run must reproduce the single-process losses."""
    return ["--input-dir", str(data / "c_text_document"), "--data-cache-path", str(cache),
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(corpus / "tok" / "vocab.json"),
            "--merge-file", str(corpus / "tok" / "merges.txt"), "--device", "cpu", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--max-seq-len", "32",
            "--max-position-embeddings", "32", "--global-batch-size", "16", "--micro-batch-size", "4",
            "--max-steps", "12", "--eval-freq", "6", "--eval-iters", "2", "--lr", "5e-3", "--logging-freq", "1",
            "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0", "--num-workers", "0",
            "--split", "90,8,2", "--distributed-timeout-minutes", "2", "--save", str(out),
            "--no-save-at-end"]  # each node its own output folder: no checkpoints (they need a shared one)


def _node(corpus: Path, root: Path) -> tuple[Path, Path, Path]:
    """This node's (data copy, cache folder, output folder): nothing shared with the other node."""
    data = root / "local-disk" / "data"
    shutil.copytree(corpus / "data", data)
    return data, root / "local-disk" / "cache", root / "out"


def test_two_nodes_with_their_own_disks_train_the_single_process_losses(corpus, tmp_path):
    single = run_here(*_flags(corpus, corpus / "data", tmp_path / "single-cache", tmp_path / "single"))
    assert single.returncode == 0, single.stderr[-3000:]
    reference = curves(tmp_path / "single")

    port, nodes, launchers = free_port(), [_node(corpus, tmp_path / f"node{n}") for n in range(2)], []
    for data, cache, out in nodes:
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
                   str(ROOT / "pretrain_gpt.py"), *_flags(corpus, data, cache, out)]
        launchers.append(popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        logs = [p.communicate(timeout=300)[0] for p in launchers]
    finally:
        for p in launchers:
            p.kill()
    for p, log in zip(launchers, logs):
        assert p.returncode == 0, log[-3000:]
    # the logging rank (the last one) is on whichever node rendezvous made node 1
    outs = [out for _, _, out in nodes if (out / "metrics.jsonl").exists()]
    assert len(outs) == 1
    got = curves(outs[0])
    assert [len(c) for c in got] == [len(c) for c in reference] == [12, 2, 12]
    for g, want in zip(got, reference):
        assert g == pytest.approx(want, rel=1e-5)
    assert reference[0][-1] < 0.8 * reference[0][0]  # and it learns
    cached = [sorted(p.name for p in cache.glob("*.npy")) for _, cache, _ in nodes]
    assert cached[0] == cached[1], "each node must hold the same (content-keyed) index files"
    for kind in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert sum(name.endswith(f"_{kind}.npy") for name in cached[0]) == 3, cached[0]  # train, valid, test
