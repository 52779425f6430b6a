#!/usr/bin/env bash
# GPT 6.7B with the group-sharded (ZeRO stage 2) optimizer over 8 GPUs (seed 000). Variants on the same
# YAML: pretrain_gpt_6.7b_sharding8_stage1.sh (optimizer states and master weights only),
# _stage3.sh (+ parameters) and _offload.sh (stage 2, masters and AdamW states on the CPU).
# Per-rank model-state memory: python tools/estimate_memory.py -c examples/configs/gpt_6.7b_sharding8.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py -c examples/configs/gpt_6.7b_sharding8.yaml "$@"
