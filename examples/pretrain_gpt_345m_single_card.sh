#!/usr/bin/env bash
# GPT 345M on one GPU, fp16 (seed 004). Extra flags override the YAML, e.g. --bf16 --no-use-pure-fp16.
set -euo pipefail
cd "$(dirname "$0")/.."
python pretrain_gpt.py -c examples/configs/gpt_345m_single_card.yaml "$@"
