#!/usr/bin/env bash
# Qwen3-MoE's shape, tiny, on the CPU (docs/moe.md, "Qwen3 and Qwen3-MoE"): grouped-query attention with QK-norm,
# no biases, a dense first layer then experts, top 2 renormalised, no shared expert; synthetic bigram data.
# In the faster precision of this CPU (python -m megatron.device --fastest-precision says why); extra arguments go
# to pretrain_gpt.py (--bf16 / --no-bf16 there overrides the choice; --max-steps 100 for a shorter run).
set -euo pipefail
cd "$(dirname "$0")/.."
precision=$(python -m megatron.device --fastest-precision)
if [ "$precision" = bf16 ]; then precision_flag=--bf16; else precision_flag=--no-bf16; fi
echo "pretrain_qwen3_moe_tiny_cpu: training in $precision ($precision_flag; pass --bf16 or --no-bf16 to choose)"
python pretrain_gpt.py -c examples/configs/qwen3_moe_tiny_cpu.yaml "$precision_flag" "$@"
