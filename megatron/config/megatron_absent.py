"""Megatron-LM's flags of features not built here (``ABSENT``: flag -> the feature, and the values with which the
flag changes nothing), refused by name at start-up with what to do instead. Plain data: ``megatron_flags`` is the
one table that reads it."""

from __future__ import annotations

from dataclasses import dataclass

# --- absent: a feature this framework lacks ---------------------------------------------------------------
_INFERENCE = "Megatron's inference and RL scripts; here text generation is tools/generate.py and tools/serve.py"
_MOE_DISPATCH = "Megatron's DeepEP token dispatch"
_FP8 = "an FP8 option not built here (docs/fp8.md lists those built)"


@dataclass(frozen=True)
class Absent:
    feature: str
    noop: tuple[str, ...] = ()  # values with which the flag changes nothing (accepted)


ABSENT: dict[str, Absent] = {
    "--num-distributed-optimizer-instances": Absent("several distributed-optimizer instances", ("1",)),
    "--first-last-layers-bf16": Absent("the first and last transformer layers kept in bf16 under FP8 (every "
                                       "layer's linear layers run in FP8 here; docs/fp8.md)"),
    "--outer-dp-sharding-strategy": Absent(
        "hybrid-sharded data parallelism (Megatron FSDP's outer data-parallel group); --use-megatron-fsdp shards "
        "over the whole data-parallel group here", ("no_shard",)),
    "--prompts": Absent(_INFERENCE),
    "--prompt-file": Absent(_INFERENCE),
    "--num-tokens-to-generate": Absent(_INFERENCE),
    "--temperature": Absent(_INFERENCE),
    "--top_k": Absent(_INFERENCE),
    "--top_p": Absent(_INFERENCE),
    "--return-log-probs": Absent(_INFERENCE),
    "--perform-rl-step": Absent(_INFERENCE),
    "--prompt-file-num-truncate": Absent(_INFERENCE),
    "--output-path": Absent(_INFERENCE),
    "--output-every-n-results": Absent(_INFERENCE),
    "--stop-words": Absent(_INFERENCE),
    "--termination-id": Absent(_INFERENCE),
    "--top-n-logprobs": Absent(_INFERENCE),
    "--incoming-requests-per-sec": Absent(_INFERENCE),
    "--incoming-requests-per-step": Absent(_INFERENCE),
    "--max-tokens-to-oom": Absent(_INFERENCE),
    "--enable-chunked-prefill": Absent(_INFERENCE),
    "--flash-decode": Absent(_INFERENCE),
    "--decode-only-cuda-graphs": Absent(_INFERENCE),
    "--use-coordinator": Absent(_INFERENCE),
    "--use-legacy-static-engine": Absent(_INFERENCE),
    "--test-mode": Absent(_INFERENCE),
    "--refit-method": Absent(_INFERENCE),
    "--langrl-env-config": Absent(_INFERENCE),
    "--export-kd-cfg": Absent("Megatron's ModelOpt export and distillation"),
    "--export-kd-teacher-load": Absent("Megatron's ModelOpt export and distillation"),
    "--export-te-mcore-model": Absent("Megatron's ModelOpt export and distillation"),
    "--moe-use-upcycling": Absent("upcycling a dense checkpoint into experts"),
    "--moe-extended-tp": Absent("extended tensor parallelism of the experts"),
    "--moe-enable-deepep": Absent(_MOE_DISPATCH),
    "--moe-flex-dispatcher-backend": Absent(_MOE_DISPATCH),
    "--moe-apply-probs-on-input": Absent("routing probabilities applied to the experts' input"),
}
_ABSENT_PREFIXES = {"--moe-": "a mixture-of-experts option not built here (docs/moe.md lists those built)",
                    "--dsa-": "experimental attention variants",
                    "--linear-": "a linear-attention option not built here (docs/hybrid.md lists those built)",
                    "--inference-": _INFERENCE, "--grpo-": _INFERENCE, "--rl-": _INFERENCE,
                    "--fp8-": _FP8,
                    "--fp4-": "FP4 training",
                    "--megatron-fsdp-": "Megatron FSDP's own buffers and dtypes; --use-megatron-fsdp is ZeRO here "
                                        "(docs/megatron.md)"}


# The flags of core_v0.16.1 whose feature is one of the prefixes' above, by name: flag -> that feature.
_BY_FEATURE: dict[str, tuple[str, ...]] = {
    "experimental attention variants (DeepSeek sparse attention's indexer)": (
        "--dsa-indexer-n-heads", "--dsa-indexer-head-dim", "--dsa-indexer-topk", "--dsa-indexer-loss-coeff",
        "--dsa-indexer-use-sparse-loss",),
    _FP8: (
        "--fp8-quantizer-factory", "--fp8-margin", "--fp8-interval",),
    "FP4 training": (
        "--fp4-format", "--fp4-recipe", "--fp4-param-gather", "--fp4-quantizer-factory",),
    "Megatron's reinforcement-learning training (GRPO); here a run pretrains or fine-tunes on a corpus": (
        "--rl-prompts-per-eval", "--rl-default-temperature", "--rl-default-top-p", "--rl-default-top-k",
        "--rl-offload-optimizer-during-inference", "--rl-offload-kv-cache-during-training",
        "--rl-remove-kv-cache-during-training", "--rl-reset-cuda-graphs", "--rl-partial-rollouts",
        "--rl-inference-logprobs-is-correction", "--rl-importance-sampling-truncation-coef",
        "--rl-use-sequence-packing", "--rl-sequence-packing-max-sequences-per-bin", "--rl-sequence-packing-algo",
        "--rl-training-cuda-graphs", "--rl-inference-tensor-model-parallel-size",
        "--rl-inference-pipeline-model-parallel-size", "--rl-inference-expert-model-parallel-size",
        "--rl-inference-expert-tensor-model-parallel-size", "--rl-inference-model-unified-memory-level",
        "--rl-offload-inference-model-weights-when-idle", "--rl-verify-model-weights-swap",
        "--rl-parallel-generation-tasks", "--rl-skip-bos-token", "--grpo-prompts-per-step", "--grpo-group-size",
        "--grpo-iterations", "--grpo-clamp-eps-lower", "--grpo-clamp-eps-upper", "--grpo-kl-beta",
        "--grpo-entropy-term-weight", "--grpo-filter-groups-with-same-reward",),
    "a mixture-of-experts option not built here (docs/moe.md lists those built)": (
        "--moe-enable-routing-replay", "--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8",
        "--moe-use-legacy-grouped-gemm", "--moe-latent-size", "--moe-upcycling-granularity",),
}
ABSENT.update({flag: Absent(feature) for feature, flags in _BY_FEATURE.items() for flag in flags})
