#!/usr/bin/env bash
# A Llama-style 1B (Llama 3.2 1B's shape) on 8 GPUs, data parallel with the distributed optimizer, bf16.
# Real data: --input-dir PREFIX --no-mock-data --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py -c examples/configs/llama_1b.yaml "$@"
