"""Activation offloading (--cpu-offloading-num-layers, --fine-grained-activation-offloading --offload-modules,
--min-offloaded-tensor-size; megatron/offload.py, megatron/ops/offload.py): on the CPU the pack/unpack path copies
each storage to a separate buffer and back, so the loss and every gradient equal those without offloading bitwise;
the hooks pack exactly the chosen parts' saves above the size; the memory estimate's bytes sent to host equal the
bytes packed, and the device's saved bytes drop by what it subtracts."""

from __future__ import annotations

import pytest
import torch

from megatron.config import ConfigError, parse_config, validate
from megatron.data.loader import build_batch
from megatron.data.mock_dataset import MockGPTDataset
from megatron.memory import estimate
from megatron.memory.activations import activation_bytes_per_microbatch
from megatron.memory.measure import SavedActivations
from megatron.memory.offload import freed_bytes, offload_terms, offloaded_bytes
from megatron.parallelize_gpt import build_model
from pretrain_gpt import forward_step

TINY = ("--mock-data", "--device", "cpu", "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
        "--vocab-size", "200", "--max-seq-len", "16", "--max-position-embeddings", "32", "--micro-batch-size", "2")
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")  # the flash kernel: its output the dense input
LLAMA = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear")
MOE = (*LLAMA, "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1,1]", "--moe-ffn-hidden-size",
       "32")
MLA = ("--multi-latent-attention", "--position-embedding-type", "rope", "--kv-lora-rank", "24", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--q-lora-rank", "20", "--qk-layernorm")
ALL = ("--min-offloaded-tensor-size", "0")


def fine(*modules: str) -> tuple[str, ...]:
    return ("--fine-grained-activation-offloading", "--offload-modules", *modules)


def config_of(*flags: str):
    config = parse_config([*TINY, *flags])
    validate(config, world_size=1, cuda_available=False)
    return config


def batch_of(config, index: int = 0) -> dict:
    data = MockGPTDataset(8, config.dataset.max_seq_len, config.model.vocab_size, seed=1)
    samples = [data[index + i] for i in range(config.batch_size.micro_batch_size)]
    return {k: v.clone() for k, v in build_batch(samples, data.eod_id).items()}


def step(config, micro_batches: int = 1, trace: bool = True):
    """(losses, gradients, model) of ``micro_batches`` forwards, then their backwards in reverse order (several
    micro-batches in flight, as a pipeline stage holds them)."""
    torch.manual_seed(0)
    model = build_model(config).train()
    if model.activation_offload is not None:
        model.activation_offload.packed = [] if trace else None
    torch.manual_seed(1234)
    losses = []
    for m in range(micro_batches):
        output, loss_fn = forward_step(batch_of(config, 2 * m), model)
        losses.append(loss_fn(output)[0])
    for loss in reversed(losses):
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack([loss.detach() for loss in losses]), grads, model


def assert_bitwise(flags: tuple[str, ...], offload: tuple[str, ...], micro_batches: int = 1):
    ref_losses, ref_grads, _ = step(config_of(*flags), micro_batches)
    losses, grads, model = step(config_of(*flags, *offload), micro_batches)
    assert torch.equal(losses, ref_losses)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    return model


CASES = {
    "attn_norm": ((), fine("attn_norm")),
    "qkv_linear": ((), fine("qkv_linear")),
    "core_attn": (NO_DROPOUT, fine("core_attn")),
    "core_attn+attn_proj": ((), fine("core_attn", "attn_proj")),
    "mlp_norm": (LLAMA, fine("mlp_norm")),
    "expert_fc1": (MOE, fine("expert_fc1")),
    "moe_act": (MOE, fine("moe_act")),
    "mla": (MLA, fine("qkv_linear", "core_attn", "attn_proj")),
    "2 layers": (MOE, ("--cpu-offloading-num-layers", "2")),
}


@pytest.mark.parametrize("case", CASES)
def test_gradients_equal_no_offload_bitwise(case):
    flags, offload = CASES[case]
    model = assert_bitwise(flags, (*offload, *ALL), micro_batches=2)
    packed = model.activation_offload.packed
    chosen = set(offload[2:]) if offload[0].startswith("--fine") else {"layer"}
    assert packed and {region for region, _, _ in packed} == chosen
    if case == "2 layers":  # the first two layers of the chunk, whole
        assert {layer for _, layer, _ in packed} == {0, 1}


def test_min_size_leaves_the_small_tensors_on_the_device():
    """The norm's input [s, b, h] (2048 elements) packs, its mean and rstd [s, b, 1] (32 each) stay."""
    _, _, model = step(config_of(*fine("attn_norm", "mlp_norm"), "--min-offloaded-tensor-size", "33"))
    shapes = {shape for _, _, shape in model.activation_offload.packed}
    assert shapes == {(16, 2, 64)}
    _, _, model = step(config_of(*fine("attn_norm", "mlp_norm"), "--min-offloaded-tensor-size", "2049"))
    assert model.activation_offload.packed == [] and model.activation_offload.packed_bytes == 0


def test_recomputed_parts_have_nothing_to_offload():
    """A selective recompute of core_attn and full recompute of a layer keep nothing of them: no region, and the
    gradients still equal."""
    selective = ("--recompute-granularity", "selective", "--recompute-modules", "core_attn")
    model = assert_bitwise(selective, (*fine("core_attn", "attn_proj", "attn_norm"), *ALL))
    assert {region for region, _, _ in model.activation_offload.packed} == {"attn_proj", "attn_norm"}
    block = ("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1")
    model = assert_bitwise(block, ("--cpu-offloading-num-layers", "2", *ALL))
    assert {layer for _, layer, _ in model.activation_offload.packed} == {1}


ESTIMATED = {
    **{case: (*flags, *offload) for case, (flags, offload) in CASES.items() if case not in ("mla", "expert_fc1")},
    "core_attn alone, flash": (*NO_DROPOUT, *fine("core_attn")),  # its output, the dense input, stays too
    "norms above the size": (*LLAMA, *fine("attn_norm", "mlp_norm"), "--min-offloaded-tensor-size", "33"),
    "only_attn": (*fine("attn_norm", "mlp_norm", "core_attn"), "--recompute-granularity", "only_attn"),
    "1 layer, bf16": ("--bf16", *LLAMA, "--cpu-offloading-num-layers", "1"),
}


@pytest.mark.parametrize("case", ESTIMATED)
def test_estimate_equals_packed_and_saved_bytes(case):
    """The bytes the estimate sends to host are those the hooks pack, and the device keeps what the activation
    estimate predicts less what it frees (measured by the saved-tensor meter, outside the offload hooks)."""
    flags = ESTIMATED[case]
    config = config_of(*flags, *(() if "--min-offloaded-tensor-size" in flags else ALL))
    torch.manual_seed(0)
    model = build_model(config).train()
    with SavedActivations(exclude=model.parameters()) as saved:
        output, loss_fn = forward_step(batch_of(config), model)
        loss, _ = loss_fn(output)
    assert model.activation_offload.packed_bytes == offloaded_bytes(config), offload_terms(config)
    assert saved.total == activation_bytes_per_microbatch(config) - freed_bytes(config), offload_terms(config)
    loss.backward()
    assert estimate(config).offloaded_per_microbatch == freed_bytes(config) > 0


def test_memory_estimate_subtracts_the_offloaded_bytes():
    base, offloaded = config_of(*LLAMA), config_of(*LLAMA, "--cpu-offloading-num-layers", "2", *ALL)
    before, after = estimate(base), estimate(offloaded)
    assert after.activations == before.activations - freed_bytes(offloaded)
    assert after.cpu == before.cpu + freed_bytes(offloaded)


@pytest.mark.parametrize("flags, message", [
    (("--cpu-offloading-num-layers", "3"), "cpu_offloading_num_layers must be between 0 and num_layers - 1 (2)"),
    (("--offload-modules", "core_attn"), "add --fine-grained-activation-offloading, or drop --offload-modules"),
    (("--fine-grained-activation-offloading",), "needs the parts to offload: give --offload-modules"),
    ((*fine("attn_proj"),), "attn_proj needs core_attn too"),
    ((*fine("moe_act"),), "are parts of the experts, but the model has no MoE layers"),
    ((*fine("core_attn"), "--cpu-offloading-num-layers", "1"), "both choose what to offload"),
    ((*fine("core_attn"), "--compile"), "breaks each layer's graph at every offloaded part"),
    (("--min-offloaded-tensor-size", "-1"), "min_offloaded_tensor_size must be at least 0"),
])
def test_refused_settings(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_of(*flags)
