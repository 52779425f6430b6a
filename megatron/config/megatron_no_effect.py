"""Megatron-LM's flags accepted here without effect (``NO_EFFECT``: flag -> why), listed once in the start-up line:
they concern only Megatron's implementation (kernels, fusions, Transformer Engine, CUDA graphs, communication
overlap), its checkpoint machinery, logging, or its inference and RL scripts, so the losses are the same without
them. Plain data: ``megatron_flags`` is the one table that reads it."""

from __future__ import annotations

# --- accepted, no effect here -----------------------------------------------------------------------------
_IMPL = "Megatron's implementation detail (kernels, fusions, Transformer Engine); nothing to choose here"
_CKPT = "Megatron's checkpoint machinery; checkpoints here are always written atomically and checksummed"
_LOG = "logging: the log line and metrics.jsonl always carry what exists here (loss, ppl, memory, throughput)"
_PERF = "a performance option of Megatron's; losses are the same without it"

NO_EFFECT: dict[str, str] = {
    "--use-mcore-models": _IMPL,
    "--use-legacy-models": _IMPL,
    "--transformer-impl": _IMPL,
    "--attention-backend": _IMPL,
    "--distributed-backend": "the backend is NCCL on GPUs and gloo on the CPU, chosen by the device",
    "--no-gradient-accumulation-fusion": _IMPL,
    "--gradient-accumulation-fusion": _IMPL,
    "--attention-softmax-in-fp32": _IMPL,
    "--no-masked-softmax-fusion": _IMPL,
    "--no-bias-swiglu-fusion": _IMPL,
    "--no-bias-dropout-fusion": _IMPL,
    "--no-rope-fusion": _IMPL,
    "--no-persist-layer-norm": _IMPL,
    "--use-flashinfer-fused-rope": _IMPL,
    "--cross-entropy-loss-fusion": _IMPL,
    "--cross-entropy-fusion-impl": _IMPL,
    "--no-create-attention-mask-in-dataloader": _IMPL,
    "--apply-query-key-layer-scaling": "an fp16 overflow guard that leaves the attention mathematically unchanged",
    "--te-rng-tracker": _IMPL,
    "--inference-rng-tracker": _IMPL,
    "--use-cpu-initialization": "initialisation here is layout-invariant and the same on every device",
    "--ckpt-format": ("checkpoints here are written in this project's format (atomic, checksummed); "
                      "tools/convert_checkpoint.py to-megatron writes Megatron-LM's (legacy or torch_dist), "
                      "from-megatron reads them"),
    "--auto-detect-ckpt-format": _CKPT,
    "--dist-ckpt-strictness": _CKPT,
    "--dist-ckpt-optim-fully-reshardable": "checkpoints here always load into any layout",
    "--ckpt-fully-parallel-save": _CKPT,
    "--no-ckpt-fully-parallel-save": _CKPT,
    "--ckpt-fully-parallel-load": _CKPT,
    "--ckpt-assume-constant-structure": _CKPT,
    "--async-strategy": _CKPT,
    "--async-mode": _CKPT,
    "--async-ckpt-use-cpu-shm": _CKPT,
    "--use-persistent-ckpt-worker": _CKPT,
    "--verify-integrity": "checkpoints are always verified against their checksums on load",
    "--save-retain-interval": "use --keep-last-checkpoints to prune old checkpoints here",
    "--no-use-tokenizer-model-from-checkpoint-args": "the tokenizer is the command line's, or the saved run's when "
                                                     "resuming",
    "--deterministic-mode": "runs here are deterministic on the CPU; on GPUs cuDNN's choice is PyTorch's default",
    "--timing-log-level": _LOG,
    "--timing-log-option": _LOG,
    "--log-timers-to-tensorboard": _LOG,
    "--log-memory-to-tensorboard": _LOG,
    "--log-num-zeros-in-grad": _LOG,
    "--log-params-norm": _LOG,
    "--log-validation-ppl-to-tensorboard": _LOG,
    "--log-throughput": _LOG,
    "--log-progress": _LOG,
    "--log-loss-scale-to-tensorboard": _LOG,
    "--log-world-size-to-tensorboard": _LOG,
    "--tensorboard-log-interval": _LOG,
    "--tensorboard-queue-size": _LOG,
    "--wandb-entity": "W&B logs to the default entity of the logged-in account",
    "--manual-gc": "Python's garbage collector runs as usual",
    "--manual-gc-interval": "Python's garbage collector runs as usual",
    "--empty-unused-memory-level": _PERF,
    "--no-mmap-bin-files": "the .bin files are always memory-mapped",
    "--tp-comm-overlap": _PERF,
    "--tp-comm-overlap-cfg": _PERF,
    "--overlap-p2p-communication": _PERF,
    "--overlap-p2p-communication-warmup-flush": _PERF,
    "--overlap-param-gather-with-optimizer-step": _PERF,
    "--defer-embedding-wgrad-compute": _PERF,
    "--wgrad-deferral-limit": _PERF,
    "--ddp-average-in-collective": "gradients are averaged over the data-parallel group either way",
    "--disable-gloo-process-groups": _IMPL,
    "--use-tp-pp-dp-mapping": "the rank order does not change the losses here",
    "--microbatch-group-size-per-virtual-pipeline-stage": _PERF,
    "--enable-cuda-graph": _PERF,
    "--cuda-graph-impl": _PERF,
    "--check-weight-hash-across-dp-replicas-interval": "replicas are compared by the run-health checks instead",
    "--straggler-minmax-count": _LOG,
    "--calculate-per-token-loss": "always the case here: the loss is the global batch's token mean",
    "--exit-signal-handler": "SIGTERM and SIGUSR1 always save and exit here",
    "--no-position-embedding": "positions are chosen by --position-embedding-type alone, as Megatron Core's GPTModel "
                               "reads them (rope and none add no position embedding)",
    "--moe-permute-fusion": _IMPL,
    "--use-flash-attn": "attention runs in PyTorch's scaled_dot_product_attention, which takes FlashAttention on "
                        "GPUs wherever it applies",
    "--accumulate-allreduce-grads-in-fp32": ("the default here: gradients are accumulated and reduced in fp32 "
                                             "(main_grad) unless --grad-reduce-in-bf16, which wins, as in Megatron-LM"),
    "--export-force-local-attention": "a ModelOpt export setting; tools/convert_checkpoint.py writes Megatron-LM's "
                                      "local-spec names",
    "--moe-per-layer-logging": "the log line carries the mean over MoE layers; metrics.jsonl, TensorBoard and W&B "
                               "carry each MoE layer's tokens per expert",
    "--moe-router-fusion": _IMPL,
    "--use-pytorch-profiler": ("--profile always runs PyTorch's profiler here (Megatron-LM's default without this "
                               "flag marks the steps for an outside nsys capture instead)"),
    "--logging-level": ("the level of Megatron-LM's Python loggers; the log here (the step lines, warnings and "
                        "errors) always prints"),
    "--mup-width-mult": ("muP's width multiplier is derived, hidden_size / mup_base_hidden_size (Megatron-LM "
                         "overwrites the value given under --use-mup and reads it nowhere else)"),
}

_SERVING = ("Megatron's inference server and its batching; generation here is tools/generate.py and tools/serve.py, "
            "which a training run does not start")
NO_EFFECT.update({flag: _SERVING for flag in (
    "--inference-fuse-tp-communication", "--inference-batch-times-seqlen-threshold", "--inference-max-requests",
    "--inference-max-seq-length", "--inference-max-batch-size", "--inference-dynamic-batching",
    "--inference-dynamic-batching-buffer-size-gb", "--inference-dynamic-batching-paused-buffer-size-gb",
    "--inference-dynamic-batching-block-size", "--inference-dynamic-batching-max-requests",
    "--inference-dynamic-batching-max-tokens", "--inference-dynamic-batching-num-cuda-graphs",
    "--inference-dynamic-batching-track-paused-request-events", "--inference-dynamic-batching-unified-memory-level",
    "--inference-dynamic-batching-cuda-graph-max-tokens",
    "--inference-dynamic-batching-cuda-graph-mixed-prefill-count", "--inference-logging-step-interval",
    "--inference-wandb-logging", "--inference-coordinator-port",)})
NO_EFFECT.update({flag: "a performance option of Megatron's (SMs of its DeepEP / HybridEP dispatch, CUDA graphs in "
                        "inference); losses are the same without it" for flag in (
    "--moe-deepep-num-sms", "--moe-hybridep-num-sms", "--moe-pad-experts-for-cuda-graph-inference",)})
