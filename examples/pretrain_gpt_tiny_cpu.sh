#!/usr/bin/env bash
# A tiny GPT on the CPU. Add --bf16 for the CPU's bf16 matrix units.
set -euo pipefail
cd "$(dirname "$0")/.."
python pretrain_gpt.py -c examples/configs/gpt_tiny_cpu.yaml "$@"
