"""The training step (gradient accumulation, token-exact loss), the mock data and batching, and short
mixed-precision runs of the Trainer."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.config import Config, parse_config, validate
from megatron.data.loader import GlobalBatchSampler, build_batch, build_loader, split_micro_batches
from megatron.data.mock_dataset import SUCCESSOR_PROBS, MockGPTDataset
from megatron.distributed.parallelize import parallelize, plan_sharding
from megatron.metrics import get_logger
from megatron.optimizer import build_optimizer
from megatron.parallel_state import single_process_state
from megatron.parallelize_gpt import build_model
from megatron.training import Trainer, set_seed, train_step
from tests.grads import assert_grads_close

VOCAB, SEQ = 128, 16
EOD = VOCAB - 1
TINY = ("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", str(VOCAB),
        "--max-seq-len", str(SEQ), "--max-position-embeddings", str(SEQ))


def make_config(*argv: str) -> Config:
    config = parse_config(["--mock-data", "--device", "cpu", *argv])
    validate(config, world_size=1, cuda_available=False)
    return config


# ---------------------------------------------------------------- gradient accumulation


def _samples_with_eod(seed: int) -> list[np.ndarray]:
    """4 samples of SEQ + 1 tokens with 0, 1, 3 and 6 end-of-document tokens: the loss masks of
    the micro-batches (one sample each) cover different numbers of tokens."""
    rng = np.random.default_rng(seed)
    samples = []
    for n_eod in (0, 1, 3, 6):
        s = rng.integers(0, EOD, size=SEQ + 1)
        s[rng.choice(SEQ, size=n_eod, replace=False)] = EOD  # among the input positions
        samples.append(s.astype(np.int64))
    return samples


def _run_steps(micro_batch_size: int, batches: list[dict]):
    config = make_config(*TINY, "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "4",
                         "--micro-batch-size", str(micro_batch_size), "--grad-clip", "0")
    assert config.num_micro_batches == 4 // micro_batch_size
    plan = plan_sharding(config, single_process_state())
    model, buffer, _ = parallelize(build_model(config), plan)
    optimizer = build_optimizer(buffer, plan, config)
    out = []
    for lr, batch in zip((1e-2, 5e-3), batches):
        loss, result = train_step(pretrain_gpt.forward_step, batch, model, buffer, optimizer, lr, micro_batch_size)
        assert result.applied
        # grad_clip 0: the buffer still holds the (unclipped) gradient of this step
        out.append((loss, result.grad_norm, [p.main_grad.clone() for p in model.parameters()],
                    [p.detach().clone() for p in model.parameters()]))
    return model, out


def _reference(batch: dict) -> tuple[float, list[torch.Tensor], float]:
    """The token-mean loss of the whole batch and its gradient, computed in one piece, and the
    mean of per-sample token means (what per-micro-batch normalisation would give)."""
    config = make_config(*TINY, "--hidden-dropout", "0", "--attention-dropout", "0")
    model = build_model(config)
    losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    mask = batch["loss_mask"]
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    naive = float(((losses.detach() * mask).sum(dim=1) / mask.sum(dim=1)).mean())
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()], naive


def test_gradient_accumulation_is_token_exact():
    batches = [build_batch(_samples_with_eod(seed), EOD) for seed in (0, 1)]
    for batch in batches:
        per_sample = batch["loss_mask"].sum(dim=1)
        assert per_sample.tolist() == [SEQ - n for n in (0, 1, 3, 6)]  # masks differ across micro-batches
    _, whole = _run_steps(4, batches)
    model, accumulated = _run_steps(1, batches)
    ref_loss, ref_grad, naive = _reference(batches[0])
    # fp32: the micro-batch gradients are summed in a different order than one batched backward,
    # so results agree to fp32 round-off (a few ulps), not bit for bit.
    assert whole[0][0] == pytest.approx(ref_loss, rel=1e-6)
    assert accumulated[0][0] == pytest.approx(ref_loss, rel=1e-6)
    # a mean of per-micro-batch means (the usual bug) weights the tokens of short masks more,
    # and is measurably different here, so the checks above can tell the two apart
    assert abs(naive - ref_loss) > 1e-4
    assert_grads_close(whole[0][2], ref_grad, "batched vs reference")
    for step, ((loss_w, norm_w, grad_w, params_w), (loss_a, norm_a, grad_a, params_a)) in enumerate(
            zip(whole, accumulated)):
        assert loss_a == pytest.approx(loss_w, rel=1e-6), step
        assert norm_a == pytest.approx(norm_w, rel=1e-5), step
        assert_grads_close(grad_a, grad_w, f"step {step}")
        for p, q in zip(params_a, params_w):
            # AdamW normalises each update to ~lr * g / (|g| + eps), whose slope is up to lr / (4 eps) where
            # |g| ~ eps; the key part of the QKV bias even has an exactly zero true gradient (softmax is
            # invariant to a per-query shift of the scores), so its computed gradient is pure round-off.
            # fp32 gradient round-off (~1e-9 here) therefore moves such weights by up to ~4e-4 x lr
            # (seen: 3.8e-6 at lr 1e-2). Allow 1e-3 x lr = 1e-5: still 1000x below the size of one
            # update, so a wrongly weighted micro-batch (which changes update directions) fails.
            torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=f"step {step}")
    # and the parameters did move (the comparison is not between two untouched models)
    initial = build_model(make_config(*TINY))
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), initial.parameters()))


def test_split_micro_batches():
    batch = build_batch(_samples_with_eod(3), EOD)
    parts = split_micro_batches(batch, 2)
    assert len(parts) == 2
    for key in batch:
        assert torch.equal(torch.cat([p[key] for p in parts]), batch[key])


# ---------------------------------------------------------------- mock data


def test_mock_samples_are_a_function_of_seed_split_index():
    a = MockGPTDataset(50, SEQ, VOCAB, seed=3, split="train")
    b = MockGPTDataset(1000, SEQ, VOCAB, seed=3, split="train")  # another size: the same samples
    for i in (0, 1, 17, 49):
        assert np.array_equal(a[i], b[i])
    assert np.array_equal(a[7], a[7])  # random access is repeatable
    assert not np.array_equal(a[0], a[1])
    for other in (MockGPTDataset(50, SEQ, VOCAB, seed=3, split="valid"),
                  MockGPTDataset(50, SEQ, VOCAB, seed=3, split="test"),
                  MockGPTDataset(50, SEQ, VOCAB, seed=4, split="train")):
        assert all(not np.array_equal(a[i], other[i]) for i in range(5))
    assert a.eod_id == EOD
    with pytest.raises(IndexError):
        a[50]
    with pytest.raises(IndexError):
        a[-1]


def test_mock_sample_dtype_shape_range_and_language():
    ds = MockGPTDataset(64, SEQ, VOCAB, seed=5)
    assert len(ds) == 64
    tokens = np.stack([ds[i] for i in range(64)])
    assert tokens.dtype == np.int64 and tokens.shape == (64, SEQ + 1)
    assert tokens.min() >= 0 and tokens.max() < VOCAB
    # the bigram language: after a non-eod token comes eod or one of its 4 successors
    for row in tokens:
        for prev, nxt in zip(row[:-1], row[1:]):
            if prev != EOD and nxt != EOD:
                assert nxt in ds.successors[prev]
    assert ds.successors.shape == (EOD, len(SUCCESSOR_PROBS))


def test_global_batch_sampler_slices_and_resumes():
    s0 = list(GlobalBatchSampler(20, 0, 8, dp_rank=0, dp_size=2))
    s1 = list(GlobalBatchSampler(20, 0, 8, dp_rank=1, dp_size=2))
    assert s0 == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert s1 == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert len(GlobalBatchSampler(20, 0, 8, 0, 2)) == 2
    # resuming from consumed samples continues exactly where the run stopped
    assert list(GlobalBatchSampler(20, 8, 8, dp_rank=1, dp_size=2)) == s1[1:]
    full = list(GlobalBatchSampler(100, 0, 6))
    for k in range(len(full) + 1):
        resumed = GlobalBatchSampler(100, 6 * k, 6)
        assert list(resumed) == full[k:] and len(resumed) == len(full) - k
    with pytest.raises(ValueError):
        GlobalBatchSampler(20, 0, 9, dp_rank=0, dp_size=2)


def test_build_batch_masks_eod_inputs():
    samples = _samples_with_eod(4)
    batch = build_batch(samples, EOD)
    data = torch.from_numpy(np.stack(samples))
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert torch.equal(batch["tokens"], data[:, :-1]) and torch.equal(batch["labels"], data[:, 1:])
    assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["loss_mask"], (batch["tokens"] != EOD).float())
    assert (batch["loss_mask"] == 0).sum() == 10  # 0 + 1 + 3 + 6 eod inputs
    assert torch.equal(batch["position_ids"], torch.arange(SEQ).expand(4, SEQ))
    unmasked = build_batch(samples, EOD, eod_mask_loss=False)
    assert torch.equal(unmasked["loss_mask"], torch.ones(4, SEQ))


def test_loader_follows_the_sampler():
    ds = MockGPTDataset(24, SEQ, VOCAB, seed=1)
    batches = list(build_loader(ds, 8, 8, ds.eod_id, True))
    assert len(batches) == 2
    assert torch.equal(batches[0]["tokens"], torch.from_numpy(np.stack([ds[i][:-1] for i in range(8, 16)])))


# ---------------------------------------------------------------- short mixed-precision runs


RUN = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", str(VOCAB),
       "--max-seq-len", "32", "--max-position-embeddings", "32", "--global-batch-size", "16",
       "--max-steps", "30", "--lr", "1e-2", "--min-lr", "1e-3", "--eval-iters", "1")


@pytest.mark.parametrize("precision,dtype", [("--bf16", torch.bfloat16), ("--fp16", torch.float16)])
def test_trainer_low_precision_loss_falls(tmp_path, precision, dtype):
    config = make_config(*RUN, precision, "--save", str(tmp_path))
    logger = get_logger()
    level = logger.level
    logger.setLevel(logging.WARNING)  # keep the test output short
    try:
        set_seed(config.seed)
        model = build_model(config)
        trainer = Trainer(config, model, pretrain_gpt.forward_step, pretrain_gpt.datasets_provider(config),
                          torch.device("cpu"))
        state = trainer.run()
    finally:
        logger.setLevel(level)
    assert state.step == 30 and state.consumed_samples == 30 * 16
    assert all(p.dtype == dtype for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in trainer.optimizer.masters)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 31))
    losses = [r["loss"] for r in train]
    assert all(math.isfinite(x) for x in losses)
    # Starts at ~ln(128) = 4.85; with these settings the loss reaches ~3.0 after 30 steps
    # (ratio ~0.61 in fp32, bf16 and fp16 alike). Asserting < 0.75 x the first loss leaves a
    # margin of ~0.6 nats for precision and platform differences while still demanding that
    # the model learned a good part of the bigram structure (a broken update would stay near 4.85).
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.15)
    assert losses[-1] < 0.75 * losses[0]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0
    if precision == "--fp16":
        assert trainer.optimizer.grad_scaler is not None
        assert trainer.optimizer.loss_scale > 0
        assert all(r["loss_scale"] > 0 for r in train)
        # overflow-skipped steps, if any, are few: most of the 30 steps were applied
        assert state.skipped_steps <= 5
    else:
        assert trainer.optimizer.grad_scaler is None
        assert state.skipped_steps == 0
        assert all(r["loss_scale"] is None for r in train)
    assert {r["split"] for r in records} == {"train", "valid", "test", "save"}  # save: the checkpoint at the end


def test_data_that_runs_out_is_said_at_start_and_end(tmp_path):
    """A training set of 5 global batches under max_steps 8 (one epoch): the run says at start that it
    will stop at step 5, stops there, and says why, instead of ending early in silence."""
    config = make_config(*RUN, "--max-steps", "8", "--output-dir", str(tmp_path), "--eval-iters", "0")
    train = MockGPTDataset(5 * 16, 32, VOCAB, seed=1)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = get_logger()
    logger.addHandler(handler)
    try:
        set_seed(config.seed)
        state = Trainer(config, build_model(config), pretrain_gpt.forward_step, (train, None, None),
                        torch.device("cpu")).run()
    finally:
        logger.removeHandler(handler)
    assert state.step == 5
    assert any("gives 5 steps of global batch 16, fewer than max_steps (8); training stops at step 5" in m
               for m in messages), messages
    assert any(m.startswith("stopped at step 5 of max_steps 8: the training data ran out") for m in messages)
