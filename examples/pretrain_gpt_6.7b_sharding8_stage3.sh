#!/usr/bin/env bash
# GPT 6.7B over 8 GPUs with ZeRO stage 3: master weights, AdamW states, gradients and the parameters
# themselves sharded; each decoder layer is all-gathered around its forward and backward (at most two
# at once). Same YAML as pretrain_gpt_6.7b_sharding8.sh (stage 2), stage overridden on the command line.
# Per-rank model states, about 13.9 GiB:
#   python tools/estimate_memory.py -c examples/configs/gpt_6.7b_sharding8.yaml --sharding-stage 3
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py -c examples/configs/gpt_6.7b_sharding8.yaml --sharding-stage 3 \
    --output-dir ./output/gpt_6.7b_sharding8_stage3 "$@"
