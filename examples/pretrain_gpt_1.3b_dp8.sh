#!/usr/bin/env bash
# GPT 1.3B, data parallel over 8 GPUs of one node (seed 002). Multi-node: set NNODES, NODE_RANK
# and MASTER_ADDR on every node. Extra flags override the YAML (e.g. --bf16 --no-use-pure-fp16).
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py -c examples/configs/gpt_1.3b_dp8.yaml "$@"
