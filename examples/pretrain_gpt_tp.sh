#!/usr/bin/env bash
# GPT 1.3B with tensor parallelism over the GPUs of one node (default: tp 2, dp = GPUs / 2),
# sequence parallel on. Extra flags override, e.g. --tp 8 --no-sequence-parallel.
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py -c examples/configs/gpt_1.3b_single_card.yaml -o Distributed.dp_degree=null -o batch_size.local_batch_size=null \
    --tp 2 --sequence-parallel --global-batch-size 64 --micro-batch-size 8 --no-use-recompute \
    --output-dir ./output/gpt_1.3b_tp "$@"
