"""Megatron-LM core_v0.16.1's flags of its data, tokenizer, logging, resilience (fault tolerance, in-process restart)
and other scripts' groups (BERT, T5, retrieval, vision, Mamba) that are not ours, as ``megatron_flags`` merges them
into its tables: those accepted without effect (grouped by why) and those of features not built here (grouped by
feature; a flag with the values that make it a no-op, accepted)."""

from __future__ import annotations

from megatron.config.megatron_absent import _INFERENCE
from megatron.config.megatron_no_effect import _IMPL, _LOG, _PERF

_NO_EFFECT: dict[str, tuple[str, ...]] = {
    _PERF: (
        "--no-align-grad-reduce", "--ddp-pad-buckets-for-high-nccl-busbw", "--no-align-param-gather", "--use-nccl-ub",
        "--disable-symmetric-registration", "--fsdp-manual-registration", "--use-sharp", "--sharp-enabled-group",
        "--create-all-gather-group", "--fsdp-double-buffer", "--suggested-communication-unit-size",
        "--keep-fp8-transpose-cache", "--nccl-communicator-config-path", "--dataloader-fast-cache-load",
        "--dataloader-defer-npy-index-mmap", "--num-dataset-builder-threads", "--cuda-graph-scope",),
    ("a performance option of Megatron's; losses are the same without it (--bucket-size-mb sizes the gradient "
     "buckets here)"): (
        "--ddp-num-buckets",),
    ("a performance option of Megatron's (a bucket size in elements); losses are the same without it "
     "(--bucket-size-mb sizes the gradient buckets here)"): (
        "--ddp-bucket-size",),
    "Megatron-LM core_v0.16.1 parses it and reads it nowhere": (
        "--no-scatter-gather-tensors-in-pipeline", "--enable-full-sharding-in-hsdp", "--head-lr-mult",),
    "the local rank is torchrun's (LOCAL_RANK) here": (
        "--local-rank",),
    ("a hook for an outside DDP manager (Megatron then leaves its process groups unset); here the process groups are"
     " set up from torchrun's environment"): (
        "--lazy-mpu-init",),
    _IMPL: (
        "--no-gradient-reduce-div-fusion",),
    "a memory/speed trade of PyTorch FSDP2 (ZeRO-3 here, --use-torch-fsdp2); losses are the same without it": (
        "--torch-fsdp2-no-reshard-after-forward",),
    ("a file of each dataset's sequence count that spares Megatron reading the .idx files at start; the counts are "
     "read from the .idx files here"): (
        "--per-dataset-sequences-path",),
    ("the decoder length of Megatron's encoder-decoder (T5) and multimodal models; a GPT has one sequence length, "
     "--seq-length"): (
        "--decoder-seq-length",),
    ("a setting of Megatron's legacy retrieval models (ICT, REALM, biencoder: pretrain_ict.py, its indexer); "
     "pretrain_gpt.py does not read it"): (
        "--sample-rate", "--ict-head-size", "--biencoder-projection-dim", "--biencoder-shared-query-context-model",
        "--ict-load", "--bert-load", "--titles-data-path", "--query-in-block-prob", "--use-one-sent-docs",
        "--evidence-data-path", "--retriever-report-topk-accuracies", "--retriever-score-scaling",
        "--block-data-path", "--embedding-path", "--indexer-batch-size", "--indexer-log-interval",),
    ("a setting of Megatron's BERT and T5 datasets (pretrain_bert.py, pretrain_t5.py); pretrain_gpt.py does not read"
     " it"): (
        "--mask-prob", "--short-seq-prob",),
    "where Megatron caches the index files of s3:// and msc:// datasets; data here is read from local paths": (
        "--object-storage-cache-path",),
    ("which of Megatron's two tokenizer implementations builds --tokenizer-type's tokenizer; the tokenizer here is "
     "--tokenizer-type's"): (
        "--legacy-tokenizer",),
    ("how Megatron's SentencePiece wrapper encodes special tokens in text; training reads tokenized data "
     "(tools/preprocess_data.py)"): (
        "--tokenizer-sentencepiece-legacy",),
    "which Hugging Face tokenizer class encodes text; training reads tokenized data (tools/preprocess_data.py)": (
        "--tokenizer-hf-use-fast",),
    ("whether Megatron's Hugging Face wrapper adds special tokens when it encodes text; training reads tokenized "
     "data (tools/preprocess_data.py)"): (
        "--tokenizer-hf-include-special-tokens",),
    "a Hugging Face tokenizer loads here from its tokenizer.json and runs no remote code": (
        "--trust-remote-code",),
    "the ADLR cluster's autoresume; here SIGTERM and SIGUSR1 save and exit": (
        "--adlr-autoresume", "--adlr-autoresume-interval",),
    ("a setting of Megatron's legacy vision models (ViT, Swin, DINO: pretrain_vision_*.py); pretrain_gpt.py does not"
     " read it"): (
        "--num-classes", "--img-h", "--img-w", "--num-channels", "--patch-dim", "--classes-fraction",
        "--data-per-class-fraction", "--vision-pretraining", "--vision-pretraining-type", "--vision-backbone-type",
        "--swin-backbone-type", "--mask-type", "--mask-factor", "--iter-per-epoch", "--dino-local-img-size",
        "--dino-local-crops-number", "--dino-head-hidden-size", "--dino-bottleneck-size", "--dino-freeze-last-layer",
        "--dino-norm-last-layer", "--dino-warmup-teacher-temp", "--dino-teacher-temp",
        "--dino-warmup-teacher-temp-epochs",),
    ("it matters only to Megatron's cyclic sampler (--dataloader-type cyclic); with the single sampler, Megatron's "
     "default, it changes nothing"): (
        "--no-data-sharding",),
    _INFERENCE: (
        "--cache-mla-latents", "--nccl-all-reduce-for-prefill", "--disable-chunked-prefill",
        "--no-inference-wandb-logging",),
    _LOG: (
        "--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard", "--log-memory-interval",
        "--log-device-memory-used", "--no-barrier-with-level-1-timing", "--log-energy",
        "--log-straggler", "--straggler-ctrlr-port", "--disable-straggler-on-startup",),
    "an on-demand profiling server; here --profile runs PyTorch's profiler over the steps chosen": (
        "--run-workload-inspector-server",),
    "a setting of Megatron's BERT embedder (Retro's tools/bert_embedding); pretrain_gpt.py does not read it": (
        "--output-bert-embeddings", "--bert-embedder-type",),
    ("a switch that lets Megatron's experimental code paths run; each such feature's own flag says whether it is "
     "built here"): (
        "--enable-experimental",),
    ("Transformer Engine's fused Adam keeping the optimizer states; at its default dtypes (fp32) the step is AdamW's"
     " in fp32, as here"): (
        "--use-precision-aware-optimizer",),
    "NVIDIA's internal one-logger telemetry; the log line and metrics.jsonl carry what exists here": (
        "--no-one-logger", "--one-logger-project", "--one-logger-run-name", "--one-logger-async",
        "--app-tag-run-name", "--app-tag-run-version",),
    ("Megatron's in-process restart (nvidia-resiliency-ext); here a hung rank is stopped by the watchdog "
     "(--watchdog-timeout-minutes) and a relaunched run resumes from its latest checkpoint"): (
        "--inprocess-restart", "--inprocess-max-iterations", "--inprocess-monitor-thread-interval",
        "--inprocess-monitor-process-interval", "--inprocess-progress-watchdog-interval",
        "--inprocess-heartbeat-interval", "--inprocess-soft-timeout", "--inprocess-hard-timeout",
        "--inprocess-heartbeat-timeout", "--inprocess-barrier-timeout", "--inprocess-completion-timeout",
        "--inprocess-last-call-wait", "--inprocess-termination-grace-time", "--inprocess-granularity",
        "--inprocess-active-world-size", "--inprocess-empty-cuda-cache",),
    ("NVIDIA's fault-tolerance package (heartbeat timeouts, NVIDIA-internal); here a hung rank is stopped by the "
     "watchdog (--watchdog-timeout-minutes)"): (
        "--enable-ft-package", "--calc-ft-timeouts", "--ft-num-warmup-iters",),
    "Megatron's Multi-Storage Client (object storage); files here are read from local paths": (
        "--disable-msc",),
}
_ABSENT: dict[str, tuple] = {
    ("Megatron's fake process group (one GPU posing as the whole world, every collective skipped, to profile "
     "memory); here --memory-check predicts each rank's peak memory"): (
        "--fake-process-group",),
    "evaluation without training (--skip-train); here tools/evaluate.py evaluates a checkpoint (docs/evaluation.md)": (
        "--skip-train",),
    ("validation over the whole validation split at each evaluation; here each evaluation takes the first "
     "--eval-iters batches of it"): (
        "--full-validation",),
    "a validation loss per validation dataset; here the validation datasets are blended into one validation loss": (
        "--multiple-validation-sets",),
    ("training phases (save and exit at each transition, the next phase's data built afresh and read from its "
     "start); here resume with the new data settings and --override-data-order"): (
        "--phase-transition-iterations",),
    ("the data blend read from a file (--data-args-path, --per-split-data-args-path); here give it with --data-path "
     "(or --train-data-path, --valid-data-path, --test-data-path), or input_dir in a YAML file (-c)"): (
        "--data-args-path", "--per-split-data-args-path",),
    ("another surplus for a blend's member datasets (Megatron Core's mid_level_dataset_surplus); here it is "
     "Megatron's default, 0.005"): (
        ("--mid-level-dataset-surplus", ("0.005",)),),
    ("masking out of the loss the tokens whose id is a pad id shared with another special token (end of document, "
     "say); here no token is masked as padding (--eod-mask-loss masks end-of-document tokens)"): (
        "--allow-ambiguous-pad-tokens",),
    ("an embedding of exactly this many rows (Megatron's --padded-vocab-size); here the rows are --vocab-size "
     "rounded up to a multiple of --make-vocab-size-divisible-by x tp"): (
        "--padded-vocab-size",),
    ("extra vocabulary ids (T5's <extra_id_N> sentinel tokens added to the vocabulary); here the vocabulary is the "
     "tokenizer's (--vocab-size enlarges the embedding)"): (
        ("--vocab-extra-ids", ("0",)),),
    ("Megatron's tokenizer metadata file (its library, special tokens, chat template); here --tokenizer-type and "
     "--tokenizer-model choose the tokenizer"): (
        "--tokenizer-metadata",),
    ("special tokens given on the command line (added to a Hugging Face or BPE vocabulary, or renaming "
     "TikTokenizer's); here a tokenizer's special tokens are its own (TikTokenizer's: <unk> <s> </s> <mask> <pad> "
     "<cls> <sep>, then <SPECIAL_i>; --eod-token names a Hugging Face tokenizer's end of document)"): (
        "--tokenizer-special-tokens", ("--tiktoken-special-tokens", ("<unk> <s> </s> <mask> <pad> <cls> <sep>",)),),
    ("heterogeneous layers (a per-layer configuration, Llama-Nemotron's); here every layer has the same shape, set "
     "by the model flags"): (
        "--heterogeneous-layers-config-path", "--heterogeneous-layers-config-encoded-json",),
    ("Transformer Engine's per-module precision overrides (a quantization recipe file); here --fp8-format and "
     "--fp8-recipe set FP8 for every tensor-parallel linear layer (docs/fp8.md)"): (
        "--te-precision-config-file",),
    ("a custom layer spec (--spec MODULE FUNCTION, a Megatron Core ModuleSpec); the layers here are those the model "
     "flags describe"): (
        "--spec",),
    ("Megatron's YAML argument file (--yaml-cfg); here a YAML file of this project's keys is given with -c/--config "
     "(docs/configuration.md)"): (
        "--yaml-cfg",),
    ("optimizer states, main parameters or main gradients in lower precision (Transformer Engine's precision-aware "
     "optimizer); here they are fp32"): (
        ("--main-grads-dtype", ("fp32",)), ("--main-params-dtype", ("fp32",)), ("--exp-avg-dtype", ("fp32",)),
        ("--exp-avg-sq-dtype", ("fp32",)),),
    ("Megatron's supervised fine-tuning (--sft: conversations under a chat template, the loss on the answers only); "
     "here fine-tuning (--finetune) reads tokenized documents like pretraining"): (
        "--sft", ("--sft-tokenizer-prompt-format", ("nemotron-h-aligned",)),),
}

NO_EFFECT: dict[str, str] = {flag: why for why, flags in _NO_EFFECT.items() for flag in flags}
# flag -> (the feature, the values with which the flag changes nothing)
ABSENT: dict[str, tuple[str, tuple[str, ...]]] = {
    entry if isinstance(entry, str) else entry[0]: (feature, () if isinstance(entry, str) else entry[1])
    for feature, entries in _ABSENT.items() for entry in entries}
