#!/usr/bin/env bash
# A Llama-style 7B (Llama 2 7B's shape) on 8 GPUs written as a Megatron-LM user writes it: Megatron-LM's
# flags only (see docs/megatron.md). The same run from YAML: pretrain_gpt.py -c examples/configs/llama_7b.yaml
# Usage: examples/pretrain_llama_7b.sh DATA_PREFIX TOKENIZER_MODEL CHECKPOINT_DIR [more flags]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_PATH=${1:?data prefix from tools/preprocess_data.py}
TOKENIZER_MODEL=${2:?Llama 2 tokenizer.model}
CHECKPOINT_PATH=${3:?checkpoint folder}
shift 3

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
    --seq-length 4096 --max-position-embeddings 4096
    --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --norm-epsilon 1e-5
    --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 1024 --train-iters 250000
    --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
    --bf16 --recompute-activations
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --split 969,30,1
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
)
OUTPUT_ARGS=(
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 1000
    --log-interval 10 --eval-interval 1000 --eval-iters 10
)
torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" "$@"
