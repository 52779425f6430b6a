#!/usr/bin/env bash
# GPT 6.7B over 8 GPUs with ZeRO stage 2 and CPU offload: the fp32 master weights and AdamW states
# (1/8 each) live in host memory, with a host copy of the gradient shard; the optimizer step runs on
# the CPU and the updated parameters are copied back. Same YAML as pretrain_gpt_6.7b_sharding8.sh;
# add --sharding-stage 3 to offload on top of stage 3.
# Per-rank model states, about 15.5 GiB on the GPU + 12.4 GiB on the host:
#   python tools/estimate_memory.py -c examples/configs/gpt_6.7b_sharding8.yaml --sharding-offload
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py -c examples/configs/gpt_6.7b_sharding8.yaml --sharding-offload \
    --output-dir ./output/gpt_6.7b_sharding8_offload "$@"
