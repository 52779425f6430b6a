#!/bin/bash
# MoE on a CUDA device: tests/unit/test_moe_gpu.py, then MoE vs dense tokens/s in bf16 (docs/benchmarks.md,
# "Mixture of experts on a GPU"). Run from the repository root: bash benchmarks/moe_gpu.sh (OUT: a folder for logs).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'grouped_mm', hasattr(torch, '_grouped_mm'))"
python3 -m pytest tests/unit/test_moe_gpu.py -q -p no:cacheprovider 2>&1 | tail -15 | tee ${OUT:-/tmp}/gpu_tests.txt
COMMON="--mock-data --device gpu --bf16 --num-layers 4 --hidden-size 1024 --num-attention-heads 16 --swiglu
 --disable-bias-linear --normalization RMSNorm --vocab-size 32000 --max-seq-len 2048 --max-position-embeddings 2048
 --micro-batch-size 4 --global-batch-size 8 --max-steps 14 --eval-freq 1000 --eval-iters 1 --logging-freq 1
 --num-workers 0 --no-save-at-end --hidden-dropout-prob 0 --attention-probs-dropout-prob 0"
run() { name=$1; shift; timeout 150 python3 pretrain_gpt.py $COMMON --output-dir /tmp/$name "$@" > /tmp/$name.log 2>&1;
  echo "== $name rc=$?"; python3 - "$name" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"/tmp/{sys.argv[1]}/metrics.jsonl") if '"train"' in l]
late = rows[4:]
print(sys.argv[1], "tokens/s", round(sum(r["ips_total"] for r in late) / len(late)), "loss", round(rows[-1]["loss"], 3),
      "mem GB", round(max(r["max_memory_gb"] for r in rows), 2), "MFU", rows[-1].get("mfu"))
PY
  grep -i "error" /tmp/$name.log | head -3; }
# dense with the active parameters of the MoE: ffn 2 x 2816 = top-2 of 8 experts of 2816
run dense --ffn-hidden-size 5632
run moe-loop --ffn-hidden-size 2816 --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --no-moe-grouped-gemm
run moe-grouped --ffn-hidden-size 2816 --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm
tail -2 /tmp/moe-grouped.log | cut -c1-400
cp /tmp/*.log ${OUT:-/tmp}/ 2>/dev/null; true
