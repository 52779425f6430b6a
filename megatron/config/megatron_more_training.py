"""Megatron-LM core_v0.16.1's flags of its model, parallelism, optimizer, training-loop and checkpoint groups that are
not ours, as ``megatron_flags`` merges them into its tables: those accepted without effect (grouped by why) and
those of features not built here (grouped by feature; a flag with the values that make it a no-op, accepted)."""

from __future__ import annotations

from megatron.config.megatron_absent import _FP8, _INFERENCE
from megatron.config.megatron_no_effect import _CKPT, _IMPL, _LOG, _PERF

_NO_EFFECT: dict[str, tuple[str, ...]] = {
    "the backend is NCCL on GPUs and gloo on the CPU, chosen by the device": (
        "--pipeline-model-parallel-comm-backend",),
    ("weights are always initialised here (a loaded checkpoint then replaces them); Megatron-LM skips initialisation"
     " only to start faster before a load"): (
        "--no-initialization",),
    "deprecated in Megatron-LM, which ignores it": (
        "--no-async-tensor-model-parallel-allreduce", "--disable-async-tensor-model-parallel-allreduce",),
    _PERF: (
        "--no-tp-comm-bulk-wgrad", "--disable-tp-comm-bulk-wgrad", "--no-tp-comm-bulk-dgrad",
        "--disable-tp-comm-bulk-dgrad", "--no-tp-comm-overlap-ag", "--disable-tp-comm-overlap-ag",
        "--no-tp-comm-overlap-rs", "--disable-tp-comm-overlap-rs", "--tp-comm-overlap-rs-dgrad",
        "--no-tp-comm-split-ag", "--disable-tp-comm-split-ag", "--no-tp-comm-split-rs", "--disable-tp-comm-split-rs",
        "--tp-comm-bootstrap-backend",
        "--ep-overlap-early-attn-memory-release", "--distribute-saved-activations",
        "--cuda-graph-warmup-steps", "--external-cuda-graph", "--no-clone-scatter-output-in-embedding",
        "--disable-clone-scatter-output-in-embedding", "--symmetric-ar-type", "--train-sync-interval",
        "--overlap-cpu-optimizer-d2h-h2d", "--no-pin-cpu-grads", "--no-pin-cpu-params",
        "--high-priority-stream-groups", "--reuse-grad-buf-for-mxfp8-param-ag", "--no-overlap-p2p-communication",),
    _IMPL: (
        "--use-ring-exchange-p2p", "--use-fused-weighted-squared-relu", "--use-te-activation-func",
        "--disable-jit-fuser",),
    ("Megatron's combined 1F1B schedule (one micro-batch's token exchanges hidden behind another's attention, on "
     "CUDA streams); here --moe-shared-expert-overlap and --delay-wgrad-compute overlap a micro-batch's exchanges "
     "with its own shared expert and weight gradients"): (
        "--overlap-moe-expert-parallel-comm",),
    "set by Megatron-LM from its pipeline layout; it changes only how its pipeline stages exchange tensor shapes": (
        "--mtp-standalone",),
    "a start-up memory option of Megatron FSDP's; initialisation here is layout-invariant": (
        "--init-model-with-meta-device",),
    _LOG: (
        "--config-logger-dir",),
    "Megatron's batch-invariant kernels (bitwise-equal results across batch sizes); nothing to choose here": (
        "--batch-invariant-mode",),
    "an implementation path of Megatron's Mamba layers (not built here); nothing to choose here": (
        "--disable-mamba-mem-eff-path",),
    "read only by Megatron-LM's T5 model; its GPT (pretrain_gpt.py) ignores it": (
        "--decoder-num-layers", "--relative-attention-num-buckets", "--relative-attention-max-distance",),
    ("read only by Megatron-LM's legacy models (--use-legacy-models); Megatron Core's GPT, which this framework "
     "follows, ignores it"): (
        "--openai-gelu", "--onnx-safe",),
    "read only by Megatron-LM's BERT model; its GPT (pretrain_gpt.py) has no binary head": (
        "--bert-no-binary-head",),
    "a CUDA memory-history dump of Megatron's; --profile records memory here (output_dir/profile/)": (
        "--record-memory-history", "--memory-snapshot-path",),
    "SIGTERM and SIGUSR1 always save and exit here": (
        "--exit-signal-handler-for-dataloader",),
    "Python's garbage collector runs as usual": (
        "--no-manual-gc-eval", "--disable-manual-gc-eval",),
    "where optimizer states live, not their values; here --sharding-offload keeps all of them on the CPU": (
        "--optimizer-offload-fraction",),
    "the CPU optimizer implementation of Megatron's offload; nothing to choose here": (
        "--use-torch-optimizer-for-cpu-offload",),
    "a debugging dump of Megatron's optimizer parameter groups; nothing to dump here": (
        "--dump-param-to-param-group-map",),
    ("turns off an RL option of Megatron's, which is off by default; RL is not built here (text generation is "
     "tools/generate.py and tools/serve.py)"): (
        "--no-langrl-external-server", "--no-rl-offload-kv-cache-during-training",
        "--no-rl-remove-kv-cache-during-training", "--no-rl-reset-cuda-graphs", "--no-rl-partial-rollouts",
        "--no-rl-inference-logprobs-is-correction", "--no-rl-use-sequence-packing", "--no-rl-training-cuda-graphs",
        "--no-rl-offload-inference-model-weights-when-idle", "--no-rl-verify-model-weights-swap",
        "--no-rl-skip-bos-token",),
    ("always the case here: the fp32 master weights are read from the checkpoint, with or without the optimizer "
     "states"): (
        "--load-main-params-from-ckpt",),
    "checkpoints here load into any layout; the run uses the command line's parallel sizes": (
        "--use-mp-args-from-checkpoint-args",),
    "the tokenizer is the command line's, or the saved run's when resuming": (
        "--disable-use-tokenizer-model-from-checkpoint-args",),
    ("a --load that holds no checkpoint stops the run here (except the run's own --save folder, which starts from "
     "scratch)"): (
        "--exit-on-missing-checkpoint",),
    _CKPT: (
        "--disable-ckpt-fully-parallel-save", "--no-strict-fsdp-dtensor-load", "--disable-strict-fsdp-dtensor-load",
        "--dist-ckpt-save-pre-mcore-014", "--distrib-optim-fully-reshardable-mem-efficient", "--replication",
        "--replication-jump", "--replication-factor",),
    "deprecated in Megatron-LM, where it has no effect (--ckpt-format chooses the format)": (
        "--use-dist-ckpt", "--dist-ckpt-format",),
    "here --distributed-timeout-minutes applies to every collective, at start and after": (
        "--distributed-timeout-seconds-after-init",),
}
_ABSENT: dict[str, tuple] = {
    ("Megatron's hybrid context parallelism (packed samples of varying length balanced over the data- and "
     "context-parallel ranks); here --context-parallel-size splits every sample evenly"): (
        "--max-seqlen-per-dp-cp-rank", "--hybrid-context-parallel",),
    "an fp32 residual stream under fp16 or bf16; here the residual stream is in the training dtype": (
        "--fp32-residual-connection",),
    "BERT's residual ordering (the residual taken after the layer norm); here layers are pre-norm": (
        "--apply-residual-connection-post-layernorm",),
    "Llama 4's L2 normalisation of the queries and keys; here --qk-layernorm normalises them": (
        "--qk-l2-norm",),
    _FP8: (
        "--no-fp8-wgrad", "--disable-fp8-wgrad",),
    ("the first and last transformer layers kept in bf16 under FP8 (every layer's linear layers run in FP8 here; "
     "docs/fp8.md)"): (
        ("--num-layers-at-start-in-bf16", ("1",)), ("--num-layers-at-end-in-bf16", ("1",)),),
    ("NVIDIA Kitchen's attention (its quantized attention backends); attention here runs in PyTorch's "
     "scaled_dot_product_attention"): (
        "--use-kitchen-attention", ("--kitchen-attention-backend", ("sdpa",)),),
    "multimodal rotary embeddings (mRoPE, --position-embedding-type mrope)": (
        "--mrope-section",),
    ("Megatron's allocation of a hybrid model's layers by ratios; here hybrid_override_pattern gives them one by one"
     ): (
        ("--hybrid-attention-ratio", ("0", "0.0")), ("--hybrid-mlp-ratio", ("0", "0.0")),),
    _INFERENCE: (
        ("--mlp-chunks-for-prefill", ("1",)), ("--langrl-inference-server-type", ("inplace_megatron",)),
        "--langrl-inference-server-conversation-template", "--langrl-external-server",),
    ("linear position interpolation of the rotary embeddings; here --position-embedding-type yarn with "
     "--rotary-scaling-factor extends the context"): (
        ("--rotary-seq-len-interpolation-factor", ("1",)),),
    ("Llama 3.x's rotary frequency scaling; here --position-embedding-type yarn with --rotary-scaling-factor extends"
     " the context"): (
        "--use-rope-scaling", ("--rope-scaling-factor", ("8", "8.0")),),
    "layers without rotary embeddings (NoPE layers, Llama 4)": (
        "--no-rope-freq",),
    ("shrinking the global batch to a multiple of micro batch x data-parallel size; here --global-batch-size must be"
     " one"): (
        "--decrease-batch-size-if-needed",),
    "saving and exiting on another signal; here SIGTERM, SIGUSR1 and a first Ctrl-C save and exit": (
        ("--exit-signal", ("SIGTERM", "SIGUSR1", "SIGINT")),),
    "skipping the batches of chosen iterations (Megatron's --iterations-to-skip)": (
        "--iterations-to-skip",),
    ("Megatron-LM's removed --batch-size (Megatron-LM refuses it too); the batch here is '--global-batch-size' or "
     "'--micro-batch-size'"): (
        "--batch-size",),
    ("Megatron-LM's removed --checkpoint-activations (Megatron-LM stops on it too); use --recompute-activations or "
     "--recompute-granularity"): (
        "--checkpoint-activations",),
    ("Megatron's cyclic and external data loaders; here the samples are read in order, as Megatron's single loader "
     "reads them"): (
        ("--dataloader-type", ("single",)),),
    "different initial weights on each data-parallel rank; here every replica starts from the same weights": (
        "--data-parallel-random-init",),
    "Xavier-uniform initialisation; here weights are drawn from a normal of --init-method-std": (
        "--init-method-xavier-uniform",),
    "Megatron-LM's removed --warmup (Megatron-LM refuses it too); use --lr-warmup-fraction or --lr-warmup-iters": (
        "--warmup",),
    "Megatron's dumps of the weight or activation gradients to files": (
        "--save-wgrads-interval", "--save-dgrads-interval",),
    ("Megatron's non-persistent (frequent, temporary) checkpoints; here --save-interval with --keep-last-checkpoints"
     " keeps the latest ones"): (
        "--non-persistent-save-interval", "--non-persistent-ckpt-type", "--non-persistent-global-ckpt-dir",
        "--non-persistent-local-ckpt-dir", ("--non-persistent-local-ckpt-algo", ("fully_parallel",)),),
    "fine-tuning from a second checkpoint folder when --load holds none; use --load DIR --finetune": (
        "--pretrained-checkpoint",),
    "loading a step chosen by number; here --load takes that step's step_N folder": (
        "--ckpt-step",),
    ("Megatron's in-run checkpoint conversion (load, save in another format, exit); here tools/convert_checkpoint.py"
     " converts checkpoints"): (
        "--ckpt-convert-format", "--ckpt-convert-save", "--ckpt-convert-update-legacy-dist-opt-format",),
    ("checkpoints without the optimizer states; here a checkpoint always holds them (--no-load-optim skips them when"
     " loading)"): (
        "--no-save-optim",),
    ("checkpoints without the RNG states; here a checkpoint always holds them (--no-load-rng skips them when "
     "loading)"): (
        "--no-save-rng",),
    "the output layer's cross entropy in fp16; here the loss is always computed in fp32": (
        "--fp16-lm-cross-entropy",),
    "Megatron-LM's removed --model-parallel-size (Megatron-LM refuses it too); use --tensor-model-parallel-size": (
        "--model-parallel-size",),
}

NO_EFFECT: dict[str, str] = {flag: why for why, flags in _NO_EFFECT.items() for flag in flags}
# flag -> (the feature, the values with which the flag changes nothing)
ABSENT: dict[str, tuple[str, tuple[str, ...]]] = {
    entry if isinstance(entry, str) else entry[0]: (feature, () if isinstance(entry, str) else entry[1])
    for feature, entries in _ABSENT.items() for entry in entries}
