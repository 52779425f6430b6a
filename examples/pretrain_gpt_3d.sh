#!/usr/bin/env bash
# 3D parallelism on 8 devices (seed 001's demo): dp 2 x tp 2 x pp 2 on a 345M-wide, 4-layer GPT.
# The segmentation log ("segment result:0, 3, 7") is printed at start. On a CPU-only machine:
#   DEVICE=cpu bash examples/pretrain_gpt_3d.sh --hidden-size 128 --num-attention-heads 4 --max-steps 20
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --nproc-per-node "${GPUS_PER_NODE:-8}" pretrain_gpt.py -c examples/configs/gpt_345m_single_card.yaml \
    -o Distributed.dp_degree=2 -o batch_size.local_batch_size=null --tp 2 --pp 2 --num-layers 4 \
    --global-batch-size 16 --micro-batch-size 2 --device "${DEVICE:-gpu}" --output-dir ./output/gpt_3d "$@"
