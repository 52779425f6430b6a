"""Our parameter names and layouts <-> Megatron Core's (``megatron.checkpoint.megatron_lm.core_names``): the round trip
is exact for every parameter of the GPT-2 and Llama shapes with MoE layers, the names are Megatron Core's (as its
``GPTModel`` names them: tests/unit/test_megatron_core_moe.py loads them into one), SwiGLU's rows are regrouped,
and a name of neither is refused in one line. Megatron Core itself is not needed here."""

from __future__ import annotations

import pytest
import torch

from megatron import parallel_state
from megatron.checkpoint.hf.common import ConversionError
from megatron.checkpoint.megatron_lm.core_names import (
    from_megatron_core,
    from_megatron_core_state,
    to_megatron_core,
    to_megatron_core_state,
)
from megatron.config import parse_config, validate
from megatron.model.gpt import GPTModel

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--vocab-size", "64",
        "--max-seq-len", "8", "--ffn-hidden-size", "12", "--num-experts", "3", "--moe-layer-freq", "[1,0]",
        "--moe-shared-expert-intermediate-size", "4"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "1"]


def _state(*flags: str) -> tuple[dict[str, torch.Tensor], bool]:
    config = parse_config([*BASE, *flags])
    validate(config)
    parallel_state.initialize()
    model = GPTModel(config.model, config.padded_vocab_size)
    generator = torch.Generator().manual_seed(0)
    return {n: torch.randn(p.shape, generator=generator) for n, p in model.named_parameters()}, config.model.swiglu


@pytest.mark.parametrize("flags", [[], LLAMA], ids=["gpt2", "llama"])
def test_round_trip_is_exact_for_every_parameter(flags):
    ours, swiglu = _state(*flags)
    core = to_megatron_core_state(ours, swiglu)
    assert len(core) == len(ours)  # no two of ours share a name
    back = from_megatron_core_state({**core, "decoder.layers.0.self_attention.linear_qkv._extra_state": None}, swiglu)
    assert back.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor), name
    fc1 = "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"
    assert {fc1, "decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.shared_experts.linear_fc2.weight",
            "decoder.layers.1.pre_mlp_layernorm.weight", "decoder.final_layernorm.weight",
            "embedding.word_embeddings.weight"} <= core.keys()
    assert ("output_layer.weight" in core) == bool(swiglu)  # untied only
    assert ("embedding.position_embeddings.weight" in core) == (not swiglu)
    changed = not torch.equal(core[fc1], ours["layers.0.mlp.experts.2.dense_h_to_4h.weight"])
    assert changed == bool(swiglu)  # only SwiGLU's first matmul changes layout


def test_swiglu_rows_go_from_interleaved_to_gate_then_up():
    ours = torch.tensor([[0.0], [10.0], [1.0], [11.0], [2.0], [12.0]])  # gate_0, up_0, gate_1, up_1, gate_2, up_2
    name, core = to_megatron_core("layers.3.mlp.shared_expert.dense_h_to_4h.weight", ours, swiglu=True)
    assert name == "decoder.layers.3.mlp.shared_experts.linear_fc1.weight"
    assert core.flatten().tolist() == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
    back_name, back = from_megatron_core(name, core, swiglu=True)
    assert back_name == "layers.3.mlp.shared_expert.dense_h_to_4h.weight" and torch.equal(back, ours)
    _, gelu = to_megatron_core("layers.0.mlp.dense_h_to_4h.bias", ours.flatten(), swiglu=False)
    assert torch.equal(gelu, ours.flatten())


@pytest.mark.parametrize("convert, name", [
    (to_megatron_core, "layers.0.mlp.experts.linear_fc1.weight"),
    (to_megatron_core, "decoder.layers.0.mlp.linear_fc1.weight"),
    (from_megatron_core, "decoder.layers.0.mlp.experts.linear_fc1.weight0"),  # Transformer Engine's grouped experts
    (from_megatron_core, "layers.0.mlp.dense_h_to_4h.weight"),
])
def test_a_name_of_neither_is_refused_in_one_line(convert, name):
    with pytest.raises(ConversionError) as err:
        convert(name, torch.zeros(2, 2), True)
    assert name in str(err.value) and "\n" not in str(err.value)
