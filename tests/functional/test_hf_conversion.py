"""End to end with pretrain_gpt.py: a trained run exported to Hugging Face GPT-2 gives the same logits,
a Hugging Face import continues pretraining as the original weights do, and a checkpoint resharded
to tp 2 resumes a tp-2 run (vocabulary re-padded)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from megatron import parallel_state
from megatron.checkpoint import CheckpointReader, resolve_checkpoint
from megatron.config import parse_config, validate
from megatron.parallelize_gpt import build_model
from megatron.tensor_parallel import tensor_parallel_seed
from tests.functional.launch import TINY, losses, parity_layouts, run, run_here, run_tool_here

VOCAB = 250  # pads to 256 (tp 1 and 2): the padding rows are exercised


def _tool(path: str, *args: str) -> subprocess.CompletedProcess:
    return run_tool_here(path, *args)  # the converters' main in this process


def _train(out, *args: str, nproc: int = 1) -> list[float]:
    flags = [*TINY, "--vocab-size", str(VOCAB), *args]
    result = run_here(*flags, "--save", str(out)) if nproc == 1 else run(out, *flags, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(out)


SCHEDULE = ("--max-steps", "3", "--decay-steps", "3", "--warmup-steps", "0")  # not the saved run's
parity_layouts({
    "hf-saved": (1, [*TINY, "--vocab-size", str(VOCAB), "--max-steps", "2", "--save-interval", "2"]),
    # the original weights, fresh optimizer and step 0 (--finetune)
    "hf-finetune": (1, [*TINY, "--vocab-size", str(VOCAB), *SCHEDULE, "--load", "{runs}/hf-saved", "--finetune"],
                    ("hf-saved",)),
    "hf-vocab300": (1, [*TINY, "--vocab-size", "300", "--max-steps", "4", "--save-interval", "2"])})
pytestmark = [pytest.mark.slow, pytest.mark.shared_runs("hf-saved", "hf-finetune", "hf-vocab300")]


def test_a_trained_run_exports_to_hf_with_the_same_logits(tmp_path, parity):
    transformers = pytest.importorskip("transformers")
    run_dir = parity.outcome("hf-saved").check()
    result = _tool("tools/convert_checkpoint.py", "to-hf", str(run_dir), str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()

    config = parse_config([*TINY, "--vocab-size", str(VOCAB)])
    validate(config)
    parallel_state.initialize()
    tensor_parallel_seed(config.seed, 0, torch.device("cpu"))
    model = build_model(config).eval()
    reader = CheckpointReader(resolve_checkpoint(str(run_dir)))
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.full("param", name))
        torch.testing.assert_close(model(ids)[..., :VOCAB], hf(ids).logits, rtol=0, atol=1e-4)

    info = _tool("tools/checkpoint_info.py", str(run_dir))
    assert info.returncode == 0 and "step: 2 " in info.stdout


def test_an_hf_import_continues_pretraining_like_the_original_weights(tmp_path, parity):
    pytest.importorskip("transformers")
    run_dir = parity.outcome("hf-saved").check()
    original = losses(parity.outcome("hf-finetune").check())
    # ... and the same weights through Hugging Face and back (a step-0, weights-only checkpoint)
    for args in (("to-hf", str(run_dir), str(tmp_path / "hf")),
                 ("from-hf", str(tmp_path / "hf"), str(tmp_path / "imported"))):
        result = _tool("tools/convert_checkpoint.py", *args)
        assert result.returncode == 0, result.stderr
    imported = _train(tmp_path / "continued", *SCHEDULE, "--load", str(tmp_path / "imported"))
    assert len(imported) == 3 and imported == original  # bitwise: the round trip is exact


def test_a_checkpoint_resharded_to_tp2_resumes_a_tp2_run(tmp_path, parity):
    # vocab 300: 384 rows under tp 1, 512 under tp 2; reshard re-pads them
    saved = parity.outcome("hf-vocab300").check()
    full = losses(saved)
    result = _tool("tools/convert_checkpoint.py", "reshard", str(saved / "step_2"), str(tmp_path / "tp2"), "--tp", "2")
    assert result.returncode == 0, result.stderr
    resumed = _train(tmp_path / "resumed", "--vocab-size", "300", "--max-steps", "4", "--tp", "2", "--load",
                     str(tmp_path / "tp2"), nproc=2)
    assert resumed == pytest.approx(full[2:], rel=1e-5)  # tp 2 sums in another order: fp32 round-off only
