"""num_train_epochs: a cap on passes over the training data, built into the train split (not a slice of
a many-epoch shuffle), and the run that stops at the cap."""

from __future__ import annotations

import json
import logging
from collections import Counter

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.config import ConfigError, parse_config, validate
from megatron.data.blended_dataset import build_datasets
from megatron.data.indexed_dataset import DatasetError, IndexedDatasetWriter
from megatron.metrics import get_logger
from megatron.parallelize_gpt import build_model
from megatron.tokenizer import configured_tokenizer
from megatron.training import Trainer, set_seed

SEQ, GBS, EOD = 8, 4, 0


def _unique_tokens(prefix: str, num_sequences: int, first_token: int = 1, seed: int = 0) -> list[np.ndarray]:
    """Sequences of consecutive, never repeated token ids: a sample's tokens say which stream positions it holds."""
    lengths = np.random.default_rng(seed).integers(5, 40, num_sequences)
    starts = first_token + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    sequences = [np.arange(s, s + n) for s, n in zip(starts, lengths)]
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for sequence in sequences:
            writer.add_document(sequence)
    return sequences


def _inputs(dataset) -> Counter:
    """How often each token is a model input (the last token of a sample is only a label)."""
    return Counter(int(t) for i in range(len(dataset)) for t in dataset[i][:-1])


@pytest.mark.parametrize("epochs", [1, 2])
def test_the_train_split_is_built_for_whole_passes(tmp_path, epochs):
    """max_steps 1000 is 50 passes of this data: num_train_epochs caps the build, so E passes take every
    train token E times (1 pass: exactly once), except the tail of the last global batch."""
    sequences = _unique_tokens(str(tmp_path / "ds"), 60)
    train_tokens = np.concatenate(sequences[:54])  # split 90,10,0: 54 of 60 sequences
    per_epoch = (len(train_tokens) - 1) // SEQ
    train, valid, _ = build_datasets(str(tmp_path / "ds"), "90,10,0", (1000 * GBS, 2 * GBS, 0), SEQ, 1, EOD,
                                     str(tmp_path / "cache"), train_epochs=epochs, global_batch_size=GBS)
    assert len(train) == epochs * per_epoch // GBS * GBS < 1000 * GBS
    assert train.samples_per_epoch == per_epoch and len(valid) >= 2 * GBS
    seen = _inputs(train)
    assert set(seen) <= set(train_tokens.tolist())
    assert max(seen.values()) == epochs  # no token more than once per pass
    unseen = epochs * len(train_tokens) - sum(seen.values())
    assert unseen <= GBS * SEQ  # less than a global batch of samples, and the last partial sample
    if epochs == 1:
        assert unseen == len(train_tokens) - len(train) * SEQ


def test_a_blend_pass_is_the_sum_of_its_members_passes(tmp_path):
    """Weighted by token count, one pass of a blend takes each member's tokens about once."""
    a = _unique_tokens(str(tmp_path / "a"), 40, seed=1)
    b = _unique_tokens(str(tmp_path / "b"), 25, first_token=10_000, seed=2)
    per_epoch = sum((sum(len(s) for s in member) - 1) // SEQ for member in (a, b))
    train, _, _ = build_datasets(str(tmp_path), "1", (1000 * GBS, 0, 0), SEQ, 1, EOD, str(tmp_path / "cache"),
                                 train_epochs=1, global_batch_size=GBS)
    assert len(train) == per_epoch // GBS * GBS and train.samples_per_epoch == per_epoch
    seen = _inputs(train)
    repeated = sum(count - 1 for count in seen.values())
    assert repeated <= 2 * SEQ  # the greedy blend may draw a member's share one or two samples past one pass
    assert len(seen) >= (per_epoch - GBS - 2) * SEQ


def test_a_cap_below_one_global_batch_is_one_line(tmp_path):
    _unique_tokens(str(tmp_path / "ds"), 3)
    with pytest.raises(DatasetError) as err:
        build_datasets(str(tmp_path / "ds"), "1", (100 * 64, 0, 0), SEQ, 1, EOD, str(tmp_path / "cache"),
                       train_epochs=1, global_batch_size=64)
    message = str(err.value)
    assert "\n" not in message and message.startswith("num_train_epochs 1 gives ")
    assert message.endswith("fewer than one global batch of 64; raise num_train_epochs, lower global_batch_size "
                            "or add data.")


def _byte_tokenizer(folder) -> tuple[str, str]:
    """A GPT-2 BPE of the 256 byte symbols and <|endoftext|> (id 256), without merges."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def _config(tmp_path, *argv: str):
    vocab, merges = _byte_tokenizer(tmp_path)
    config = parse_config(["--input-dir", str(tmp_path / "ds"), "--tokenizer-type", "GPT2BPETokenizer",
                           "--vocab-file", vocab, "--merge-file", merges, "--device", "cpu", "--num-layers", "1",
                           "--hidden-size", "32", "--num-attention-heads", "4", "--max-seq-len", str(SEQ),
                           "--max-position-embeddings", str(SEQ), "--global-batch-size", str(GBS),
                           "--eval-iters", "0", "--save", str(tmp_path / "out"), *argv])
    validate(config, world_size=1, cuda_available=False,
             tokenizer_vocab_size=configured_tokenizer(config.tokenizer).vocab_size)
    return config


def test_a_run_with_one_epoch_stops_after_it_and_says_so(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "ds"), np.uint16) as writer:
        for d in range(30):
            writer.add_document((np.arange(20 + d) * 7 + d) % 256)
    tokens = sum(20 + d for d in range(30))
    steps = (tokens - 1) // SEQ // GBS
    config = _config(tmp_path, "--max-steps", "1000", "--num-train-epochs", "1", "--split", "1")
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    get_logger().addHandler(handler)
    try:
        set_seed(config.seed)
        datasets = pretrain_gpt.datasets_provider(config, configured_tokenizer(config.tokenizer))
        state = Trainer(config, build_model(config), pretrain_gpt.forward_step, datasets, torch.device("cpu")).run()
    finally:
        get_logger().removeHandler(handler)
    assert state.step == steps and state.consumed_samples == steps * GBS
    warnings = [m for m in messages if m.startswith(("the training data", "training stops"))]
    assert warnings == [
        f"the training data holds {(tokens - 1) // SEQ} samples per epoch: num_train_epochs (1) gives {steps} steps "
        f"of global batch {GBS}, fewer than max_steps (1000); training stops at step {steps} (raise "
        f"num_train_epochs or add data)",
        f"training stops at step {steps}, before decay_steps (1000): the learning rate will not reach min_lr "
        f"(1e-05); set --decay-steps {steps} to decay it fully"]


def test_num_train_epochs_defaults_to_no_cap_and_must_be_positive(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "ds"), np.uint16) as writer:
        writer.add_document(np.arange(100) % 256)
    assert _config(tmp_path).num_train_epochs is None
    assert _config(tmp_path, "--num-train-epochs", "3").num_train_epochs == 3
    with pytest.raises(ConfigError, match="num_train_epochs must be at least 1, got 0"):
        _config(tmp_path, "--num-train-epochs", "0")
