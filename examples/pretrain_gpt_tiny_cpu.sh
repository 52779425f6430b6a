#!/usr/bin/env bash
# A tiny GPT on the CPU, in the faster precision of this CPU: bf16 where its bf16 matmuls are native
# (python -m megatron.device --fastest-precision measures it and says why), else fp32.
# Extra arguments go to pretrain_gpt.py; --bf16 or --no-bf16 there overrides the choice.
set -euo pipefail
cd "$(dirname "$0")/.."
precision=$(python -m megatron.device --fastest-precision)
if [ "$precision" = bf16 ]; then precision_flag=--bf16; else precision_flag=--no-bf16; fi
echo "pretrain_gpt_tiny_cpu: training in $precision ($precision_flag; pass --bf16 or --no-bf16 to choose)"
python pretrain_gpt.py -c examples/configs/gpt_tiny_cpu.yaml "$precision_flag" "$@"
