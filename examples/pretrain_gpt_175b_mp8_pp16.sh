#!/usr/bin/env bash
# GPT-3 175B with tp 8 x pp 16 (seed 001): run this on each of 16 nodes of 8 GPUs, with
# NODE_RANK = 0..15 and MASTER_ADDR = node 0's address. More nodes (a multiple of 16) add data
# parallelism. Extra flags override the YAML, e.g. --vpp 2 for the interleaved schedule.
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --nnodes "${NNODES:-16}" --node-rank "${NODE_RANK:?set NODE_RANK}" --nproc-per-node 8 \
    --master-addr "${MASTER_ADDR:?set MASTER_ADDR}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py -c examples/configs/gpt_175b_mp8_pp16.yaml "$@"
