#!/usr/bin/env bash
# Long context: the Llama-style 7B of pretrain_llama_7b.sh at 32K tokens per sample on 8 GPUs, packed documents
# kept apart (attention and positions restart at every document), written with Megatron-LM's flags. Each sample is
# cut over 4 context-parallel ranks (ring attention, each rank 8K tokens) and the remaining 2 ranks of the node are
# a tensor-parallel pair with sequence parallelism; 1 data-parallel replica. tools/plan_layout.py proposes and
# tools/estimate_memory.py checks such layouts (docs/context_parallel.md says when to choose which --cp-comm-type).
# Usage: examples/pretrain_llama_7b_32k.sh DATA_PREFIX TOKENIZER_MODEL CHECKPOINT_DIR [more flags]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_PATH=${1:?data prefix from tools/preprocess_data.py}
TOKENIZER_MODEL=${2:?Llama 2 tokenizer.model}
CHECKPOINT_PATH=${3:?checkpoint folder}
shift 3

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
    --seq-length 32768 --max-position-embeddings 32768
    --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-5
    --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 128 --train-iters 20000
    --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-iters 500
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
    --bf16 --recompute-activations
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 4 --cp-comm-type p2p
    --use-distributed-optimizer
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --split 969,30,1
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
    --reset-attention-mask --reset-position-ids --eod-mask-loss
)
OUTPUT_ARGS=(
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 500
    --log-interval 10 --eval-interval 500 --eval-iters 10
)
torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" "$@"
