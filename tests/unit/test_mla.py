"""Multi-latent attention (``megatron/model/mla.py``) against NVIDIA's Megatron Core (the test extra's pinned
``megatron-core``) as an independent reference: its ``GPTModel`` with ``MLASelfAttention`` (local spec), given our
weights, gives our logits, and every parameter's gradient after a backward of the same loss, within 1e-5 of the
largest magnitude of the tensor. Cases: the query down-projection with its norm (DeepSeek-V3) and without
(``q_lora_rank`` None: one query projection, DeepSeek-V2-Lite); YaRN's frequencies and concentration factor
(``--rotary-scaling-factor 4 --mscale 0.9 --mscale-all-dim 0.7``, a context of 4 original positions so the ramp
blends) and plain rope; with a mixture of experts (DeepSeek-V3's router) in the second layer. Also its
configuration's one-line refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.checkpoint.megatron_lm.core_names import from_megatron_core, to_megatron_core_state
from megatron.config import ConfigError, parse_config, validate
from megatron.model.gpt import GPTModel
from tests.unit.megatron_core_reference import (
    CORE_WARNINGS,
    SEQ,
    TINY,
    VOCAB,
    assert_close_to_scale,
    core_forward,
    megatron_core,
    tokens_and_labels,
)

pytestmark = CORE_WARNINGS

MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
       "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--kv-lora-rank", "12", "--qk-head-dim",
       "6", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "5", "--qk-layernorm"]
YARN = ["--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "0.9", "--mscale-all-dim", "0.7",
        "--original-max-position-embeddings", "4"]
DEEPSEEK_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1]", "--moe-ffn-hidden-size",
                "8", "--moe-shared-expert-intermediate-size", "8", "--moe-router-score-function", "sigmoid",
                "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                "--moe-router-topk-scaling-factor", "2.5", "--moe-token-dispatcher-type", "allgather"]


@pytest.fixture(scope="module")
def mcore():
    """Megatron Core on the CPU; its MLA module asks ``isinstance(.., TELinear)`` when it believes Transformer Engine
    present (its extensions import here, its layers do not): told it is absent."""
    with megatron_core() as env:
        from megatron.core.transformer import multi_latent_attention

        patches = pytest.MonkeyPatch()
        patches.setattr(multi_latent_attention, "HAVE_TE", False)
        try:
            yield env
        finally:
            patches.undo()


def _local_core_attention():
    """Megatron Core 0.16.1's local ``DotProductAttention`` with MLA: ``MLASelfAttention`` passes ``k_channels`` and
    ``v_channels``, which only Transformer Engine's core takes; the local one reads the value width from
    ``kv_channels`` (set to ``v_head_dim``) and the scores' from the tensors, and takes the softmax scale given."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLACore(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return LocalMLACore


def build_mla_pair(mcore, *flags: str):
    config = parse_config([*TINY, *MLA, *flags])
    validate(config)
    m = config.model
    ours = GPTModel(m, config.padded_vocab_size)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3 + (1.0 if "layernorm" in name else 0.0))
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    moe = {}
    if m.num_experts:
        moe = dict(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk, moe_layer_freq=[0, 1],
                   moe_ffn_hidden_size=m.moe_ffn_hidden_size,
                   moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                   moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5,
                   moe_token_dispatcher_type="allgather", moe_router_dtype="fp32", moe_aux_loss_coeff=0.0)
    core_config = MLATransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size, normalization=m.normalization, layernorm_epsilon=m.layernorm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, qk_layernorm=True,
        multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
        rope_type=m.rope_type or "yarn", rotary_scaling_factor=m.rotary_scaling_factor,
        original_max_position_embeddings=m.original_max_position_embeddings, mscale=m.mscale,
        mscale_all_dim=m.mscale_all_dim, rotary_base=m.rotary_base, kv_channels=m.v_head_dim, **moe)
    spec = mcore["block_spec"](core_config, use_transformer_engine=False, normalization=m.normalization)
    for layer_spec in spec.layer_specs:  # the local spec's attention core, given the head widths it does not take
        layer_spec.submodules.self_attention.submodules.core_attention = _local_core_attention()
    theirs = mcore["GPTModel"](core_config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                               position_embedding_type="rope", share_embeddings_and_output_weights=False,
                               rotary_base=m.rotary_base)
    mapped = to_megatron_core_state({n: p.detach() for n, p in ours.named_parameters()}, True)
    params = dict(theirs.named_parameters())
    assert set(mapped) == set(params), set(mapped) ^ set(params)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(mapped[name])
    return config, ours.train(), theirs.train()


@pytest.mark.parametrize("flags", [
    ["--q-lora-rank", "10", *YARN],
    ["--rope-type", "rope"],
    ["--q-lora-rank", "10", *YARN, *DEEPSEEK_MOE],
], ids=["q_lora_yarn", "one_query_projection_rope", "deepseek_v3_moe"])
def test_mla_logits_and_gradients_equal_megatron_cores(mcore, flags):
    config, ours, theirs = build_mla_pair(mcore, *flags)
    tokens, labels = tokens_and_labels()
    with torch.no_grad():
        assert_close_to_scale(core_forward(theirs, tokens), ours(tokens), "logits")
    ours(tokens, labels=labels).mean().backward()
    core_forward(theirs, tokens, labels).mean().backward()
    theirs_grads = dict(from_megatron_core(n, p.grad, True) for n, p in theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert_close_to_scale(theirs_grads[name], p.grad, f"the gradient of {name}")


@pytest.mark.parametrize("flags, message", [
    (["--rotary-scaling-factor", "8"], "rotary_scaling_factor given without --multi-latent-attention or "
                                       "--position-embedding-type yarn"),
    (["--position-embedding-type", "yarn", "--rope-type", "yarn"], "rope_type yarn is multi-latent attention's"),
    (["--multi-latent-attention", "--position-embedding-type", "learned_absolute"],
     "multi-latent attention takes --position-embedding-type rope"),
    (["--multi-latent-attention", "--position-embedding-type", "rope", "--q-lora-rank", "0"],
     "q_lora_rank must be at least 1"),
])
def test_what_multi_latent_attention_refuses_is_one_line(flags, message):
    with pytest.raises(ConfigError) as raised:
        validate(parse_config([*TINY, *flags]), world_size=2)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_context_parallelism_and_packed_documents_validate_and_compile_keeps_their_attention_eager():
    """cp and --reset-attention-mask are accepted with multi-latent attention (checked against one process in
    tests/distributed/test_context_parallel_attention.py); ``--compile`` leaves its ``planned_attention`` eager (its
    exchanges and per-document calls), as SelfAttention's."""
    from megatron import parallel_state
    from megatron.compile import _keep_eager
    from megatron.model.mla import MultiLatentAttention

    flags = [*TINY, *MLA, "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--reset-attention-mask"]
    config = parse_config(flags)
    validate(config, world_size=2)
    parallel_state.initialize()
    attention = MultiLatentAttention(config.model)
    _keep_eager(attention, 1)
    assert getattr(attention.planned_attention, "_torchdynamo_disable", False)
