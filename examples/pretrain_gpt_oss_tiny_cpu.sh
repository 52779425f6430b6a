#!/usr/bin/env bash
# gpt-oss's shape, tiny, on the CPU (docs/attention.md, "gpt-oss"): a sliding window in every other layer, attention
# sinks, YaRN, biases everywhere, clamped quick-GeGLU experts under a router with a bias; synthetic bigram data.
# In the faster precision of this CPU (python -m megatron.device --fastest-precision says why); extra arguments go
# to pretrain_gpt.py (--bf16 / --no-bf16 there overrides the choice; --max-steps 100 for a shorter run).
set -euo pipefail
cd "$(dirname "$0")/.."
precision=$(python -m megatron.device --fastest-precision)
if [ "$precision" = bf16 ]; then precision_flag=--bf16; else precision_flag=--no-bf16; fi
echo "pretrain_gpt_oss_tiny_cpu: training in $precision ($precision_flag; pass --bf16 or --no-bf16 to choose)"
python pretrain_gpt.py -c examples/configs/gpt_oss_tiny_cpu.yaml "$precision_flag" "$@"
