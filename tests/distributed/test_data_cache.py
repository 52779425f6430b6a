"""The dataset cache over several ranks (gloo, 2 processes): who builds, per-node folders, agreed failures.

Two processes stand for two nodes when both have LOCAL_RANK 0 (each is its node's local rank 0), or for
two ranks of one node when LOCAL_RANK is 0 and 1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

import numpy as np
import torch.distributed as dist

from megatron.data import gpt_dataset, token_check
from megatron.data.blended_dataset import build_datasets
from megatron.data.indexed_dataset import DatasetError, IndexedDatasetWriter
from tests.distributed.harness import run_distributed

SAMPLES, SEQ, EOD = (40, 8, 8), 8, 0


def _make(prefix: str) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(60):
            writer.add_document(rng.integers(1, 500, size=int(rng.integers(1, 30))))


@contextlib.contextmanager
def _counting() -> Iterator[dict]:
    """Count index builds and token scans in this process while the block runs."""
    counts = {"indices": 0, "scans": 0}
    build, scan = gpt_dataset.build_indices, token_check.scan_token_range

    def counted_build(*args):
        counts["indices"] += 1
        return build(*args)

    def counted_scan(*args):
        counts["scans"] += 1
        return scan(*args)

    gpt_dataset.build_indices, token_check.scan_token_range = counted_build, counted_scan
    try:
        yield counts
    finally:
        gpt_dataset.build_indices, token_check.scan_token_range = build, scan


def _build(prefix: str, cache: str, vocab_size: int = 500):
    return build_datasets(prefix, "80,10,10", SAMPLES, SEQ, 3, EOD, cache, vocab_size=vocab_size)


def _nodes(rank: int, world_size: int, root: str) -> dict:
    with _counting() as counts:
        # Two nodes, no shared disk: each has its own copy of the data (another path) and its own cache folder.
        os.environ["LOCAL_RANK"] = "0"
        train, valid, test = _build(os.path.join(root, f"node{rank}", "ds"), os.path.join(root, f"cache{rank}"))
        per_node = dict(counts)
        # One node, one shared cache folder: only global rank 0 builds.
        os.environ["LOCAL_RANK"] = str(rank)
        counts.update(indices=0, scans=0)
        _build(os.path.join(root, "node0", "ds"), os.path.join(root, "shared"))
        shared = dict(counts)
    return {"per_node": per_node, "shared": shared, "files": sorted(os.listdir(os.path.join(root, f"cache{rank}"))),
            "samples": [ds[i].tolist() for ds in (train, valid, test) for i in range(len(ds))]}


def test_per_node_cache_folders_and_copies_at_other_paths(tmp_path):
    for node in ("node0", "node1"):
        (tmp_path / node).mkdir()
    _make(str(tmp_path / "node0" / "ds"))
    for suffix in (".bin", ".idx"):
        shutil.copyfile(tmp_path / "node0" / f"ds{suffix}", tmp_path / "node1" / f"ds{suffix}")
    first, second = run_distributed(_nodes, 2, str(tmp_path))
    indices = [[f for f in node["files"] if not f.endswith("-token_range.json")] for node in (first, second)]
    assert indices[0] == indices[1] and indices[0]  # the same key for both copies (the token range: also by mtime)
    assert first["samples"] == second["samples"]
    assert first["per_node"] == second["per_node"] == {"indices": 3, "scans": 1}  # each node built its own
    assert first["shared"] == {"indices": 3, "scans": 1} and second["shared"] == {"indices": 0, "scans": 0}


def _failures(rank: int, world_size: int, root: str) -> dict:
    os.environ["LOCAL_RANK"] = "0"  # two nodes
    messages = {}
    # Node 1's cache folder cannot be created (a file is in the way): node 1 fails, node 0 must not wait.
    cache = os.path.join(root, "blocked" if rank == 1 else "cache0")
    try:
        _build(os.path.join(root, "ds"), cache)
    except DatasetError as err:
        messages["unwritable"] = str(err)
    try:  # ids of up to 499 against a vocabulary of 100: every rank stops
        _build(os.path.join(root, "ds"), os.path.join(root, f"cache{rank}"), vocab_size=100)
    except DatasetError as err:
        messages["vocab"] = str(err)
    dist.barrier()  # every rank is still in step: none is stuck in a collective
    return messages


def test_a_failure_on_one_node_stops_every_rank(tmp_path):
    _make(str(tmp_path / "ds"))
    (tmp_path / "blocked").write_text("a file where node 1's cache folder should be")
    first, second = run_distributed(_failures, 2, str(tmp_path))
    assert second["unwritable"].startswith(f"cannot write the dataset index cache in {tmp_path}/blocked")
    assert first["unwritable"] == second["unwritable"]  # every rank says the failing rank's line
    assert first["vocab"] == second["vocab"]
    assert "holds token id 499 but the model's vocabulary has 100 ids" in first["vocab"]


def _differing_copies(rank: int, world_size: int, root: str) -> dict:
    os.environ["LOCAL_RANK"] = "0"  # two nodes, each with its own copy of the data and its own cache
    outcome = {}
    for case in ("same", "other_bytes"):
        try:
            node = os.path.join(root, case, f"node{rank}")
            train, _, _ = _build(os.path.join(node, "ds"), os.path.join(root, case, f"cache{rank}"))
            outcome[case] = len(train)
        except DatasetError as err:
            outcome[case] = str(err)
    dist.barrier()  # every rank is still in step
    return outcome


def test_a_node_local_copy_that_differs_stops_every_rank(tmp_path):
    """Two nodes, each with its own copy: identical copies train; a copy whose .bin holds other tokens (same
    .idx, same size: the content key alone cannot tell) is one line on every rank naming both hosts and paths.
    (Before, each node silently trained on its own data.)"""
    for case in ("same", "other_bytes"):
        for node in ("node0", "node1"):
            (tmp_path / case / node).mkdir(parents=True)
        _make(str(tmp_path / case / "node0" / "ds"))
        for suffix in (".bin", ".idx"):
            shutil.copy2(tmp_path / case / "node0" / f"ds{suffix}", tmp_path / case / "node1" / f"ds{suffix}")
    tokens = np.fromfile(tmp_path / "other_bytes" / "node1" / "ds.bin", np.uint16)
    tokens[len(tokens) // 3] = (tokens[len(tokens) // 3] + 1) % 500  # one token of node 1's copy
    tokens.tofile(tmp_path / "other_bytes" / "node1" / "ds.bin")
    first, second = run_distributed(_differing_copies, 2, str(tmp_path))
    assert isinstance(first["same"], int) and first["same"] == second["same"]
    assert first["other_bytes"] == second["other_bytes"], (first, second)
    message = first["other_bytes"]
    assert message.startswith("dataset 0 of input_dir ") and "differs between ranks" in message, message
    assert f"{tmp_path}/other_bytes/node0/ds" in message and f"{tmp_path}/other_bytes/node1/ds" in message
    assert "bin_crc32" in message and "\n" not in message
