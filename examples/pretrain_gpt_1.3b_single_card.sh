#!/usr/bin/env bash
# GPT 1.3B on one GPU, fp16 + full recompute (seed 004).
set -euo pipefail
cd "$(dirname "$0")/.."
python pretrain_gpt.py -c examples/configs/gpt_1.3b_single_card.yaml "$@"
