"""``--compile`` against eager: a few fp32 training steps (GPT-2, Llama, DeepSeek-V3 and gpt-oss shapes, recompute
full and selective), generation with the KV cache, the fallback to eager where torch.compile fails (tp2 under
torchrun: tests/functional/test_tensor_parallel.py). Compiling costs seconds per graph on 2 cores (inductor
compiles its kernels with the C++ compiler; a second compilation of the same graph is a cache hit): 2
layers, few runs."""

from __future__ import annotations

import logging

import pytest
import torch

import pretrain_gpt
from megatron import device as dev
from megatron.compile import _Compiled
from megatron.config import Config, parse_config, validate
from megatron.data.loader import build_batch
from megatron.data.mock_dataset import MockGPTDataset
from megatron.distributed.parallelize import parallelize, plan_sharding
from megatron.inference import InferenceEngine, Request, SamplingParams
from megatron.metrics import get_logger
from megatron.optimizer import build_optimizer
from megatron.parallel_state import single_process_state
from megatron.parallelize_gpt import build_model
from megatron.training import train_step

pytestmark = pytest.mark.slow  # compiles (seconds per graph)

VOCAB, SEQ = 200, 16
TINY = ("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", str(VOCAB),
        "--max-seq-len", str(SEQ), "--max-position-embeddings", str(SEQ), "--hidden-dropout", "0",
        "--attention-dropout", "0", "--global-batch-size", "4", "--micro-batch-size", "2", "--grad-clip", "0")
LLAMA = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear")
RECOMPUTE = ("--use-recompute", "--recompute-granularity")
MOE = ("--num-experts", "4", "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01")
DEEPSEEK = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8",
            "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--qk-layernorm", "--rotary-scaling-factor", "4",
            "--mtp-num-layers", "1")
# gpt-oss's attention and MLP: YaRN, a window of 5 keys in alternate layers (the sequence is 16), learnable sinks,
# the clamped quick GeGLU with biases (dense: the experts' eager MoE layer is the DeepSeek case's)
GPT_OSS = ("--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--original-max-position-embeddings",
           "8", "--no-yarn-correction-range-round-to-int", "--normalization", "RMSNorm", "--group-query-attention",
           "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--quick-geglu", "--glu-linear-offset",
           "1", "--activation-func-clamp-value", "0.5", "--window-size", "5,0", "--window-attn-skip-freq", "2",
           "--softmax-type", "learnable")


def make_config(*argv: str) -> Config:
    config = parse_config(["--mock-data", "--device", "cpu", *TINY, *argv])
    validate(config, world_size=1, cuda_available=False)
    return config


def train(*argv: str, steps: int = 3) -> tuple[list[float], list[torch.Tensor], torch.nn.Module]:
    """(each step's loss, the first step's gradients, the model) of ``steps`` AdamW steps (no clipping:
    the buffer holds the gradient as the backward left it)."""
    config = make_config(*argv)
    plan = plan_sharding(config, single_process_state())
    model, buffer, _ = parallelize(build_model(config), plan)
    optimizer = build_optimizer(buffer, plan, config)
    data = MockGPTDataset(4 * steps, SEQ, VOCAB, seed=1)
    losses, grads = [], []
    for step in range(steps):
        batch = build_batch([data[4 * step + j] for j in range(4)], data.eod_id,
                            mtp_depth=config.model.mtp_num_layers or 0)
        loss, result = train_step(pretrain_gpt.forward_step, batch, model, buffer, optimizer, 3e-3, 2)
        assert result.applied
        losses.append(loss)
        grads = grads or [p.main_grad.clone() for p in model.parameters()]
    return losses, grads, model


class LogLines(logging.Handler):
    """The project's logger's messages (it does not propagate to pytest's caplog)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    handler = LogLines()
    get_logger().addHandler(handler)
    yield handler.lines
    get_logger().removeHandler(handler)


def compiled_parts(model: torch.nn.Module) -> list[_Compiled]:
    return [m for module in model.modules() for m in vars(module).values() if isinstance(m, _Compiled)]


# ---------------------------------------------------------------- parity with eager


@pytest.mark.parametrize("argv, parts", [
    ((), 3),  # each layer's _layer, the head and loss
    ((*GPT_OSS, *RECOMPUTE, "full"), 3),  # the planned (windowed, sink) attention runs eager inside
    ((*LLAMA, *RECOMPUTE, "only_attn"), 7),  # per layer _attention_block, the second norm, the MLP
    ((*LLAMA, *RECOMPUTE, "core_attn"), 7),  # per layer the two norms and the MLP
    # multi-latent attention, experts (the MoE layer runs eager inside the compiled _layer: a graph break), and the
    # multi-token prediction module's layer compiled as the others: 2 + 1 layers and the head
    ((*DEEPSEEK, *MOE, *RECOMPUTE, "full"), 4),
], ids=["gpt2", "gpt-oss-recompute-full", "llama-recompute-only-attn", "llama-recompute-core-attn",
        "mla-moe-mtp-recompute-full"])
def test_compiled_training_matches_eager_in_fp32(argv, parts, log_lines):
    eager_losses, eager_grads, _ = train(*argv)
    losses, grads, model = train(*argv, "--compile")
    assert len(compiled_parts(model)) == parts
    assert not log_lines  # no fallback: the parts ran compiled
    # fp32: the compiled kernels sum in another order (~1e-7), which Adam carries over the steps
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_generation_with_the_kv_cache_runs_eager_and_is_unchanged():
    """A compiled model generates what the eager one does: KV-cache calls never enter compiled code
    (their shapes change every token)."""
    def never(*args, **kwargs):
        raise AssertionError("a KV-cache call entered compiled code")

    def greedy(*argv: str) -> list[list[int]]:
        config = make_config(*LLAMA, "--initializer-range", "0.2", *argv)
        model = build_model(config).eval()
        for part in compiled_parts(model):
            part.compiled = never
        requests = [Request(list(range(3, 3 + n)), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
                    for n in (4, 7)]
        return [c.tokens for c in InferenceEngine(model, config, tokenizer=None).generate(requests)]

    assert greedy("--compile") == greedy()


# ---------------------------------------------------------------- fallback to eager


def test_an_unavailable_backend_warns_once_and_runs_eager(monkeypatch, log_lines):
    reason = "InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx: (None, 'g++')"
    monkeypatch.setattr(dev, "compile_problem", lambda device_type: reason)
    eager_losses, _, _ = train()
    losses, _, model = train("--compile")
    assert losses == eager_losses and not compiled_parts(model)
    assert log_lines == [f"--compile: torch.compile failed ({reason}); the model runs eager"]


def test_a_compile_error_at_the_first_call_falls_back_to_eager(monkeypatch, log_lines):
    """An inductor error raised by a compiled part's first call: that call and every later one of every
    part run eager, after one warning naming the error."""
    calls = []

    def failing_compile(fn, **kwargs):
        def run(*args, **kw):
            calls.append(fn)
            raise torch._dynamo.exc.BackendCompilerFailed(failing_compile, RuntimeError("simulated codegen failure"),
                                                          None)
        return run

    monkeypatch.setattr(dev, "compile_problem", lambda device_type: None)
    monkeypatch.setattr(torch, "compile", failing_compile)
    eager_losses, _, _ = train()
    losses, _, model = train("--compile")
    assert losses == eager_losses
    assert len(compiled_parts(model)) == 3 and len(calls) == 1  # the first call failed; none was tried again
    assert len(log_lines) == 1 and log_lines[0].startswith("--compile: torch.compile failed (")
    assert "simulated codegen failure" in log_lines[0] and log_lines[0].endswith("; the model runs eager")


def test_compile_problem_names_a_missing_cxx_compiler(monkeypatch):
    """The probe with inductor pointed at a compiler that does not exist: one line that says so."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/g++",))
    torch._dynamo.reset()  # the probe's earlier compilation would be reused
    try:
        problem = dev.compile_problem.__wrapped__("cpu")
    finally:
        torch._dynamo.reset()
    assert problem is not None and "No working C++ compiler" in problem and "\n" not in problem
