"""Megatron-LM's 2026 example scripts of open models, as data: the training flags they pass to pretrain_gpt.py.

``EXAMPLE_QWEN3_30B_A3B``: ``examples/rl/model_configs/qwen3_30b_a3b_moe.sh``'s ``MODEL_OPTIONS`` (its GRPO and
inference settings, its Hugging Face tokenizer and checkpoint left out: the RL loop's, not pretraining's), with
the script's defaults for its variables (TP 4, PP 1, EP 2, sequence 8192, micro-batch 1, training batch 256) and a
training length and mock data, as a pretraining user of the model config gives them.
``EXAMPLE_GPT_OSS``: ``examples/gptoss/02_train.sh``'s command line with its defaults (8 GPUs: PP 8; mock data,
FP8), ``${...}`` the paths it leaves to the environment.
"""

EXAMPLE_QWEN3_30B_A3B = (
    "--seq-length 8192 --bf16 --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 "
    "--expert-model-parallel-size 2 --attention-backend flash --transformer-impl transformer_engine --te-rng-tracker "
    "--untie-embeddings-and-output-weights --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 "
    "--num-attention-heads 32 --kv-channels 128 --max-position-embeddings 8192 --group-query-attention "
    "--num-query-groups 4 --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope "
    "--rotary-percent 1.0 --rotary-base 1000000 --use-rotary-position-embeddings --swiglu --disable-bias-linear "
    "--num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768 --moe-aux-loss-coeff 0.001 "
    "--moe-router-load-balancing-type aux_loss --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--no-masked-softmax-fusion --attention-softmax-in-fp32 --vocab-size 151936 --make-vocab-size-divisible-by 128 "
    "--dist-ckpt-strictness log_unexpected --qk-layernorm --moe-token-dispatcher-type alltoall --moe-layer-freq 1 "
    "--optimizer adam --adam-beta1 0.9 --adam-beta2 0.999 --adam-eps 1e-8 --lr 1e-6 --min-lr 1e-7 "
    "--lr-warmup-samples 0 --clip-grad 1.0 --weight-decay 0.01 --no-load-optim --ckpt-format torch_dist "
    "--micro-batch-size 1 --global-batch-size 256 --train-iters 20 --mock-data --save '${CHECKPOINT_PATH}'"
)

EXAMPLE_GPT_OSS = (
    "--no-masked-softmax-fusion --transformer-impl transformer_engine --disable-bias-linear "
    "--untie-embeddings-and-output-weights --no-rope-fusion --normalization RMSNorm --num-layers 12 --hidden-size 512 "
    "--ffn-hidden-size 2048 --num-attention-heads 64 --group-query-attention --num-query-groups 8 --seq-length 8192 "
    "--max-position-embeddings 8192 --use-mcore-models --rotary-percent 1.0 --rope-type rope "
    "--position-embedding-type rope --rotary-base 10000 --no-bias-gelu-fusion --export-force-local-attention "
    "--no-bias-dropout-fusion --quick-geglu --glu-linear-offset 1.0 --softmax-type learnable --window-attn-skip-freq 2 "
    "--activation-func-clamp-value 7.0 --window-size 127,0 --enable-gpt-oss "
    "--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 "
    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce "
    "--moe-ffn-hidden-size 2048 --moe-router-dtype fp32 --moe-z-loss-coeff 1e-3 --moe-permute-fusion "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path '${DATA_CACHE_PATH}' "
    "--tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files "
    "--num-workers 1 --micro-batch-size 1 --global-batch-size 128 --lr 1.0e-5 --train-samples 1953125000 "
    "--lr-decay-samples 1949218748 --lr-decay-style cosine --min-lr 1.0e-6 --weight-decay 0.1 "
    "--lr-warmup-fraction 0.05 --clip-grad 1.0 --bf16 --use-flash-attn --attention-softmax-in-fp32 "
    "--accumulate-allreduce-grads-in-fp32 --disable-bf16-reduced-precision-matmul --recompute-activations "
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 8 --expert-model-parallel-size 1 "
    "--sequence-parallel --context-parallel-size 1 --use-distributed-optimizer --fp8-format hybrid "
    "--fp8-param-gather --fp8-amax-compute-algo max --fp8-amax-history-len 1024 --log-interval 1 "
    "--save-interval 10000 --eval-interval 50000000 --eval-iters 0 --save '${CHECKPOINT_PATH}' "
    "--tensorboard-dir '${CHECKPOINT_PATH}/tensorboard' --moe-per-layer-logging --no-load-optim --no-load-rng "
    "--log-throughput"
)
