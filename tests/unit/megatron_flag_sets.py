"""Command lines of Megatron-LM's GPT pretraining, as data: the facts of which flags Megatron-LM has.

``EXAMPLE_175B``: the arguments of Megatron-LM's ``examples/gpt3/train_gpt3_175b_distributed.sh``.
``FUNCTIONAL``: the ``MODEL_ARGS`` of a representative set of its GPT functional-test configurations
(``tests/functional_tests/test_cases/gpt/<name>/model_config.yaml``, and two DeepSeek-like ones of ``moe/``;
YAML ``true`` written as the bare flag, quotes and comments dropped). ``${...}`` are the paths those files
leave to the environment.
"""

EXAMPLE_175B = (
    "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 "
    "--attention-backend auto --micro-batch-size 1 --global-batch-size 1536 "
    "--step-batch-size-schedule '0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536' --train-iters 500000 "
    "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 "
    "--lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000 "
    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --data-path '${DATA_PATH}' "
    "--vocab-file '${VOCAB_FILE}' --merge-file '${MERGE_FILE}' --split 949,50,1 --log-interval 100 "
    "--save-interval 10000 --eval-interval 1000 --save '${CHECKPOINT_PATH}' --load '${CHECKPOINT_PATH}' "
    "--eval-iters 10 --tensorboard-dir '${TENSORBOARD_LOGS_PATH}'"
)

FUNCTIONAL = {
    'gpt3_mcore_te_tp1_pp2_cp4_a2a_p2p_nondeterministic': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path '${DATA_PATH}/text/the_pile/shard00/my-gpt3_00_text_document' "
        "--vocab-file '${DATA_PATH}/text/the_pile/shard00/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/the_pile/shard00/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl --lr "
        '0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --context-parallel-size '
        '4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 --sequence-parallel --hidden-dropout 0.0 '
        '--attention-dropout 0.0 --no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models '
        "--ckpt-format torch_dist --dist-ckpt-strictness log_all --data-cache-path '${DATA_CACHE_PATH}' --bf16 "
        '--attention-backend flash --log-memory-to-tensorboard'),
    'gpt3_mcore_te_tp1_pp2_rope_embeddings': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --position-embedding-type '
        'rope --no-ckpt-fully-parallel-save --deterministic-mode --no-gradient-accumulation-fusion '
        '--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all '
        "--data-cache-path '${DATA_CACHE_PATH}' --bf16 --attention-backend unfused --log-memory-to-tensorboard "
        '--async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp1_pp4_swiglu': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --swiglu '
        '--ckpt-fully-parallel-load --async-save --deterministic-mode --no-gradient-accumulation-fusion '
        '--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all '
        "--data-cache-path '${DATA_CACHE_PATH}' --bf16 --attention-backend unfused --log-memory-to-tensorboard "
        '--use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp1_pp4_untie_embeddings_and_outputs': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 '
        '--untie-embeddings-and-output-weights --deterministic-mode --no-gradient-accumulation-fusion '
        '--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all '
        "--data-cache-path '${DATA_CACHE_PATH}' --bf16 --attention-backend unfused --log-memory-to-tensorboard "
        '--async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp1_pp4_disable_bias_linear': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --disable-bias-linear '
        '--async-save --deterministic-mode --no-gradient-accumulation-fusion --attention-softmax-in-fp32 '
        '--use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all --data-cache-path '
        "'${DATA_CACHE_PATH}' --bf16 --attention-backend unfused --log-memory-to-tensorboard "
        '--use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp1_pp4_sequence_parallel': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --sequence-parallel '
        '--ckpt-fully-parallel-load --deterministic-mode --no-gradient-accumulation-fusion '
        '--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable '
        "--dist-ckpt-strictness log_all --data-cache-path '${DATA_CACHE_PATH}' --bf16 --attention-backend unfused "
        '--log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp1_pp1_uniform_full_recompute': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --recompute-granularity '
        'full --recompute-method uniform --recompute-num-layers 1 --deterministic-mode '
        '--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist '
        "--dist-ckpt-optim-fully-reshardable --dist-ckpt-strictness log_all --data-cache-path '${DATA_CACHE_PATH}' "
        '--bf16 --attention-backend unfused --log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 '
        '--num-layers-per-virtual-pipeline-stage 1 --use-distributed-optimizer --overlap-grad-reduce '
        '--overlap-param-gather --check-weight-hash-across-dp-replicas-interval 10 --disable-gloo-process-groups '
        '--ckpt-fully-parallel-load --deterministic-mode --no-gradient-accumulation-fusion '
        '--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable '
        "--dist-ckpt-strictness log_all --data-cache-path '${DATA_CACHE_PATH}' --bf16 --attention-backend unfused "
        '--log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp1_pp4_vp1_calculate_per_token_loss': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 '
        '--num-layers-per-virtual-pipeline-stage 1 --calculate-per-token-loss --deterministic-mode '
        '--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist '
        "--dist-ckpt-strictness log_all --data-cache-path '${DATA_CACHE_PATH}' --bf16 --attention-backend unfused "
        '--log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp2_pp2': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --deterministic-mode '
        '--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist '
        "--dist-ckpt-optim-fully-reshardable --dist-ckpt-strictness log_all --data-cache-path '${DATA_CACHE_PATH}' "
        '--bf16 --attention-backend unfused --log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split': (
        '--num-layers 6 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 '
        '--num-virtual-stages-per-pipeline-rank 2 --untie-embeddings-and-output-weights --deterministic-mode '
        '--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist '
        "--dist-ckpt-strictness log_all --data-cache-path '${DATA_CACHE_PATH}' --bf16 "
        '--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split --attention-backend unfused '
        '--log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker'),
    'gpt3_7b_tp1_pp4_memory_speed': (
        '--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 '
        '--untie-embeddings-and-output-weights --log-throughput --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 1 --global-batch-size 8 --seq-length 8192 --max-position-embeddings 8192 --train-iters 25 '
        "--timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --tokenizer-type NullTokenizer --vocab-size 131073 --mock-data --split 949,50,1 "
        '--distributed-backend nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 '
        '--clip-grad 1.0 --lr-warmup-fraction 0.01 --log-interval 2 --save-interval 10000 --eval-interval 1000 '
        '--eval-iters 5 --transformer-impl transformer_engine --tensor-model-parallel-size 1 '
        '--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 --use-distributed-optimizer '
        '--overlap-grad-reduce --overlap-param-gather --deterministic-mode --no-gradient-accumulation-fusion '
        '--use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all --data-cache-path '
        "'${DATA_CACHE_PATH}' --bf16 --log-memory-to-tensorboard --exit-interval 25 --async-save "
        '--use-persistent-ckpt-worker'),
    'gpt3_mcore_reruns_resume': (
        '--deterministic-mode --bf16 --train-iters 50 --eval-iters 0 --manual-gc --use-mcore-models '
        '--distributed-backend nccl --sequence-parallel --tensor-model-parallel-size 1 --pipeline-model-parallel-size '
        '2 --micro-batch-size 1 --global-batch-size 128 --untie-embeddings-and-output-weights '
        '--position-embedding-type rope --rotary-percent 1.0 --max-position-embeddings 4096 --num-layers 32 '
        '--hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 32 --num-query-groups 8 --seq-length 4096 '
        '--kv-channels 128 --group-query-attention --normalization RMSNorm --swiglu --attention-dropout 0.0 '
        '--hidden-dropout 0.0 --no-create-attention-mask-in-dataloader --transformer-impl transformer_engine '
        '--disable-bias-linear --clip-grad 1.0 --overlap-grad-reduce --overlap-param-gather --lr 3e-4 '
        '--lr-warmup-samples 0 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --use-distributed-optimizer --split '
        '949,50,1 --no-gradient-accumulation-fusion --save-interval 10000 --eval-interval 1000 --ckpt-format '
        "torch_dist --dist-ckpt-strictness log_all --save '${CHECKPOINT_SAVE_PATH}' --load '${CHECKPOINT_LOAD_PATH}' "
        "--data-cache-path '${DATA_CACHE_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--timing-log-level 0 --log-interval 1 --log-params-norm --log-num-zeros-in-grad '
        '--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --log-memory-to-tensorboard --rerun-mode '
        'validate_results --async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp1_pp1_dist_optimizer_no_mmap_bin_files': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 '
        '--use-distributed-optimizer --no-mmap-bin-files --deterministic-mode --no-gradient-accumulation-fusion '
        '--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all '
        "--data-cache-path '${DATA_CACHE_PATH}' --bf16 --attention-backend unfused --log-memory-to-tensorboard "
        '--async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp2_pp2_cp2': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --tokenizer-type NullTokenizer "
        '--vocab-size 50257 --split 949,50,1 --distributed-backend nccl --lr 0.00015 --lr-decay-style cosine --min-lr '
        '1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction 0.01 --log-interval 1 --save-interval 10000 '
        '--eval-interval 1000 --eval-iters 10 --transformer-impl transformer_engine --tensor-model-parallel-size 2 '
        '--pipeline-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel --hidden-dropout 0.0 '
        '--attention-dropout 0.0 --no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models '
        "--ckpt-format torch_dist --dist-ckpt-strictness log_all --data-cache-path '${DATA_CACHE_PATH}' --bf16 "
        '--attention-backend flash --log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp1_pp2_rope_embeddings_interleaved_no_fusion': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --position-embedding-type '
        'rope --rotary-interleaved --no-rope-fusion --deterministic-mode --no-gradient-accumulation-fusion '
        '--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable '
        "--dist-ckpt-strictness log_all --data-cache-path '${DATA_CACHE_PATH}' --bf16 --attention-backend unfused "
        '--log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker'),
    'gpt3_15b_8t_release': (
        '--distributed-timeout-minutes 60 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 1 '
        '--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --use-mcore-models '
        "--sequence-parallel --disable-bias-linear --micro-batch-size 4 --step-batch-size-schedule '0:384 200B:768 "
        "400B:1152' --train-samples 19531250 --manual-gc --transformer-impl transformer_engine --data-cache-path "
        "'${DATA_CACHE_PATH}' --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "
        "'${DATA_PATH}/utils/nemotron_2_256k.model' --data-path '$DATA_BLEND' --split 99,1,0 --no-mmap-bin-files "
        '--num-workers 6 --apply-layernorm-1p --untie-embeddings-and-output-weights --position-embedding-type rope '
        '--no-rope-fusion --rotary-percent 0.5 --squared-relu --num-layers 32 --hidden-size 6144 '
        '--num-attention-heads 48 --group-query-attention --num-query-groups 8 --seq-length 4096 '
        '--max-position-embeddings 4096 --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay '
        '0.1 --lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00045 --min-lr 4.5e-05 --decoupled-lr '
        '0.0005 --decoupled-min-lr 4.5e-05 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --eval-iters 32 '
        "--eval-interval 2000 --save '${CHECKPOINT_SAVE_PATH}' --load '${CHECKPOINT_LOAD_PATH}' --save-interval 1000 "
        '--save-retain-interval 5000 --init-method-std 0.0134 --log-timers-to-tensorboard --log-memory-to-tensorboard '
        '--log-num-zeros-in-grad --log-params-norm --log-validation-ppl-to-tensorboard --log-throughput '
        "--log-interval 100 --tensorboard-dir '${TENSORBOARD_PATH}' --wandb-project megatron-core-release-runs "
        "--wandb-entity adlr --wandb-exp-name '${WANDB_EXPERIMENT}' --bf16 --exit-interval 51000 --wandb-save-dir "
        "'${WANDB_SAVE_PATH}' --async-save --use-persistent-ckpt-worker"),
    'gpt3_mcore_te_tp1_pp4_vp1_decoupled_lr': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 '
        '--num-layers-per-virtual-pipeline-stage 1 --decoupled-lr 0.0002 --deterministic-mode '
        '--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --ckpt-format torch --data-cache-path '
        "'${DATA_CACHE_PATH}' --bf16 --attention-backend unfused --log-memory-to-tensorboard"),
    'gpt3_mcore_te_tp1_pp1_mup': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 '
        '--use-distributed-optimizer --no-mmap-bin-files --deterministic-mode --no-gradient-accumulation-fusion '
        '--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all '
        "--data-cache-path '${DATA_CACHE_PATH}' --bf16 --attention-backend unfused --log-memory-to-tensorboard "
        '--use-mup --mup-base-hidden-size 256 --async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp2_pp1_multi_dist_optimizer_instances': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "50 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 '
        '--use-distributed-optimizer --num-distributed-optimizer-instances 2 --overlap-grad-reduce '
        '--overlap-param-gather --deterministic-mode --no-gradient-accumulation-fusion --attention-softmax-in-fp32 '
        '--use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all --data-cache-path '
        "'${DATA_CACHE_PATH}' --bf16 --attention-backend unfused --log-memory-to-tensorboard --async-save "
        '--use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp2_pp1_fsdp2_resume_torch_dist': (
        '--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad '
        "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--micro-batch-size 4 --global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters '
        "100 --timing-log-level 0 --lr-decay-iters 320000 --save '${CHECKPOINT_SAVE_PATH}' --load "
        "'${CHECKPOINT_LOAD_PATH}' --data-path "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --distributed-backend nccl "
        '--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction '
        '0.01 --log-interval 1 --save-interval 50 --eval-interval 1000 --eval-iters 10 --transformer-impl '
        'transformer_engine --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --use-torch-fsdp2 '
        '--untie-embeddings-and-output-weights --deterministic-mode --no-gradient-accumulation-fusion '
        '--attention-softmax-in-fp32 --use-checkpoint-opt_param-scheduler --use-mcore-models --ckpt-format torch_dist '
        "--dist-ckpt-strictness log_all --data-cache-path '${DATA_CACHE_PATH}' --bf16 --log-memory-to-tensorboard "
        '--async-save --use-persistent-ckpt-worker'),
    'gpt3_mcore_te_tp2_pp2_ep4_etp1_mtp_resume_torch_dist_fp8': (
        '--distributed-timeout-minutes 60 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 '
        '--num-virtual-stages-per-pipeline-rank 4 --expert-model-parallel-size 4 --context-parallel-size 1 '
        '--expert-tensor-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather '
        '--attention-backend unfused --use-mcore-models --sequence-parallel --disable-bias-linear --micro-batch-size '
        '4 --global-batch-size 32 --train-iters 50 --exit-duration-in-mins 230 --no-check-for-nan-in-loss-and-grad '
        '--no-rope-fusion --cross-entropy-loss-fusion --cross-entropy-fusion-impl native --manual-gc '
        '--manual-gc-interval 100 --transformer-impl transformer_engine --seq-length 4096 --data-cache-path '
        "'${DATA_CACHE_PATH}' --data-path '${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document' "
        "--vocab-file '${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt' --split 949,50,1 --num-layers 16 "
        '--hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 32 --kv-channels 128 '
        '--max-position-embeddings 4096 --position-embedding-type rope --rotary-base 10000 '
        '--make-vocab-size-divisible-by 3232 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu '
        '--untie-embeddings-and-output-weights --multi-latent-attention --mtp-num-layers 1 --mtp-loss-scaling-factor '
        '0.1 --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm '
        '--lr-warmup-fraction .01 --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 '
        "0.95 --num-experts 32 --moe-layer-freq '([0]*1+[1]*15)' --moe-ffn-hidden-size 1024 "
        '--moe-shared-expert-intermediate-size 1024 --moe-router-load-balancing-type seq_aux_loss --moe-router-topk '
        '4 --moe-token-dispatcher-type alltoall --moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff '
        '1e-4 --moe-router-group-topk 2 --moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.0 '
        '--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 '
        '--moe-router-dtype fp32 --moe-permute-fusion --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 '
        '--qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 '
        "--eval-iters 32 --eval-interval 200 --save '${CHECKPOINT_SAVE_PATH}' --load '${CHECKPOINT_LOAD_PATH}' "
        '--save-interval 25 --init-method-std 0.02 --log-timers-to-tensorboard --log-memory-to-tensorboard '
        '--log-num-zeros-in-grad --log-params-norm --log-validation-ppl-to-tensorboard --log-throughput '
        "--log-interval 1 --logging-level 40 --tensorboard-dir '${TENSORBOARD_PATH}' --bf16 --fp8-format hybrid "
        '--fp8-recipe tensorwise --exit-interval 50 --async-save --use-persistent-ckpt-worker'),
    'deepseek_proxy_fsdp_ep2_fsdp2': (
        '--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 '
        '--expert-model-parallel-size 2 --context-parallel-size 1 --expert-tensor-parallel-size 1 '
        '--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --attention-backend unfused '
        '--num-distributed-optimizer-instances 1 --use-megatron-fsdp --data-parallel-sharding-strategy '
        'optim_grads_params --outer-dp-sharding-strategy no_shard --deterministic-mode --ckpt-format fsdp_dtensor '
        '--no-gradient-accumulation-fusion --fp8-format e4m3 --fp8-recipe tensorwise --fp8-param-gather '
        '--use-mcore-models --sequence-parallel --disable-bias-linear --micro-batch-size 32 --global-batch-size 256 '
        '--train-iters 50 --exit-duration-in-mins 60 --no-check-for-nan-in-loss-and-grad --no-rope-fusion '
        '--manual-gc --manual-gc-interval 100 --transformer-impl transformer_engine --seq-length 1024 '
        "--data-cache-path '${DATA_CACHE_PATH}' --data-path "
        "'${DATA_PATH}/text/the_pile/shard00/my-gpt3_00_text_document' --vocab-file "
        "'${DATA_PATH}/text/the_pile/shard00/bpe/vocab.json' --merge-file "
        "'${DATA_PATH}/text/the_pile/shard00/bpe/merges.txt' --split 949,50,1 --num-layers 8 --hidden-size 512 "
        '--ffn-hidden-size 2048 --num-attention-heads 8 --kv-channels 128 --max-position-embeddings 1024 '
        '--position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 64 --normalization '
        'RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention '
        '--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm '
        '--lr-warmup-fraction .01 --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 '
        "0.95 --num-experts 8 --moe-layer-freq '([0]*3+[1]*5)' --moe-ffn-hidden-size 1024 "
        '--moe-shared-expert-intermediate-size 1024 --moe-router-load-balancing-type seq_aux_loss --moe-router-topk '
        '4 --moe-token-dispatcher-type alltoall --moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff '
        '1e-4 --moe-router-group-topk 2 --moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.0 '
        '--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 '
        '--moe-router-dtype fp32 --moe-permute-fusion --q-lora-rank 256 --kv-lora-rank 128 --qk-head-dim 128 '
        '--qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 1.0 --mscale 1.0 --mscale-all-dim 1.0 '
        '--eval-iters 10 --eval-interval 200 --save-interval 25 --init-method-std 0.02 --log-timers-to-tensorboard '
        '--log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm --log-validation-ppl-to-tensorboard '
        "--log-throughput --log-interval 1 --logging-level 10 --tensorboard-dir '${TENSORBOARD_PATH}' "
        '--exit-interval 50'),
}


# Every flag of the MODEL_ARGS of Megatron-LM's GPT functional-test configurations (tests/functional_tests/
# test_cases/gpt/*/model_config.yaml, 206 of them), training, inference and RL alike.
ALL_FUNCTIONAL_FLAGS = tuple((
    "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split --adam-beta1 --adam-beta2 "
    "--adam-eps --apply-layernorm-1p --apply-query-key-layer-scaling --apply-wd-to-qk-layernorm "
    "--async-ckpt-use-cpu-shm --async-mode --async-save --async-strategy --attention-backend --attention-dropout "
    "--attention-output-gate --attention-softmax-in-fp32 --auto-detect-ckpt-format --bf16 "
    "--calculate-per-token-loss --check-weight-hash-across-dp-replicas-interval --ckpt-assume-constant-structure "
    "--ckpt-format --ckpt-fully-parallel-load --ckpt-fully-parallel-save --clip-grad --context-parallel-size "
    "--cp-comm-type --cross-entropy-fusion-impl --cross-entropy-loss-fusion --cuda-graph-impl --data-cache-path "
    "--data-parallel-sharding-strategy --data-path --ddp-average-in-collective --decode-only-cuda-graphs "
    "--decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers --decoupled-lr --decoupled-min-lr "
    "--defer-embedding-wgrad-compute --deterministic-mode --disable-bias-linear --disable-gloo-process-groups "
    "--dist-ckpt-optim-fully-reshardable --dist-ckpt-strictness --distributed-backend --distributed-timeout-minutes "
    "--dsa-indexer-head-dim --dsa-indexer-loss-coeff --dsa-indexer-n-heads --dsa-indexer-topk "
    "--empty-unused-memory-level --enable-chunked-prefill --enable-cuda-graph --error-injection-rate "
    "--error-injection-type --eval-global-batch-size --eval-interval --eval-iters --exit-interval "
    "--experimental-attention-variant --expert-model-parallel-size --expert-tensor-parallel-size --export-kd-cfg "
    "--export-kd-teacher-load --export-te-mcore-model --ffn-hidden-size --fim-data --fim-rate --fim-spm-rate "
    "--finetune --first-last-layers-bf16 --flash-decode --fp16 --fp8-format --fp8-param-gather --fp8-recipe "
    "--global-batch-size --group-query-attention --grpo-clamp-eps-lower --grpo-clamp-eps-upper "
    "--grpo-entropy-term-weight --grpo-group-size --grpo-iterations --grpo-kl-beta --grpo-prompts-per-step "
    "--hidden-dropout --hidden-size --hierarchical-context-parallel-sizes --incoming-requests-per-sec "
    "--incoming-requests-per-step --inference-ckpt-non-strict --inference-dynamic-batching-async-sched-mode "
    "--inference-dynamic-batching-buffer-size-gb --inference-dynamic-batching-cuda-graph-sizing-distribution "
    "--inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens "
    "--inference-dynamic-batching-num-cuda-graphs --inference-dynamic-batching-prefix-caching "
    "--inference-dynamic-batching-prefix-caching-coordinator-policy "
    "--inference-dynamic-batching-prefix-caching-eviction-policy --inference-dynamic-batching-sampling-backend "
    "--inference-dynamic-batching-unified-memory-level --inference-fuse-tp-communication "
    "--inference-logging-step-interval --inference-max-requests --inference-max-seq-length --inference-repeat-n "
    "--inference-rng-tracker --init-method-std --kv-channels --kv-lora-rank --langrl-env-config "
    "--linear-attention-freq --linear-conv-kernel-dim --linear-key-head-dim --linear-num-key-heads "
    "--linear-num-value-heads --linear-value-head-dim --load --log-interval --log-memory-to-tensorboard "
    "--log-num-zeros-in-grad --log-params-norm --log-progress --log-throughput --log-timers-to-tensorboard "
    "--log-validation-ppl-to-tensorboard --lr --lr-decay-iters --lr-decay-samples --lr-decay-style "
    "--lr-warmup-fraction --lr-warmup-samples --make-vocab-size-divisible-by --manual-gc --max-position-embeddings "
    "--max-tokens-to-oom --megatron-fsdp-grad-comm-dtype --megatron-fsdp-main-grads-dtype "
    "--megatron-fsdp-main-params-dtype --merge-file --micro-batch-size "
    "--microbatch-group-size-per-virtual-pipeline-stage --min-lr --mock-data --moe-aux-loss-coeff "
    "--moe-ffn-hidden-size --moe-grouped-gemm --moe-router-dtype --moe-router-load-balancing-type "
    "--moe-router-score-function --moe-router-topk --moe-shared-expert-gate --moe-shared-expert-intermediate-size "
    "--moe-token-dispatcher-type --moe-z-loss-coeff --multi-latent-attention --mup-base-hidden-size "
    "--no-ckpt-fully-parallel-save --no-create-attention-mask-in-dataloader --no-gradient-accumulation-fusion "
    "--no-load-optim --no-masked-softmax-fusion --no-mmap-bin-files --no-persist-layer-norm --no-rope-fusion "
    "--no-use-tokenizer-model-from-checkpoint-args --norm-epsilon --normalization --num-attention-heads "
    "--num-distributed-optimizer-instances --num-experts --num-layers --num-layers-per-virtual-pipeline-stage "
    "--num-query-groups --num-tokens-to-generate --num-virtual-stages-per-pipeline-rank --num-workers --optimizer "
    "--output-every-n-results --output-path --overlap-grad-reduce --overlap-p2p-communication-warmup-flush "
    "--overlap-param-gather --overlap-param-gather-with-optimizer-step --override-opt_param-scheduler "
    "--perform-rl-step --pipeline-model-parallel-size --position-embedding-type --prompt-file "
    "--prompt-file-num-truncate --prompts --q-lora-rank --qk-head-dim --qk-layernorm --qk-pos-emb-head-dim "
    "--recompute-granularity --recompute-method --recompute-num-layers --refit-method --rerun-mode "
    "--return-log-probs --rl-consumption-granularity --rl-generation-lag "
    "--rl-inference-pipeline-model-parallel-size --rl-inference-tensor-model-parallel-size "
    "--rl-offload-optimizer-during-inference --rl-partial-rollouts --rl-sequence-packing-algo "
    "--rl-submission-granularity --rl-training-cuda-graphs --rl-use-sequence-packing --rotary-base "
    "--rotary-interleaved --rotary-percent --save --save-interval --save-retain-interval --seed --seq-length "
    "--sequence-parallel --split --squared-relu --step-batch-size-schedule --stop-words --straggler-minmax-count "
    "--swiglu --te-rng-tracker --temperature --tensor-model-parallel-size --tensorboard-dir "
    "--tensorboard-log-interval --termination-id --test-mode --tiktoken-pattern --timing-log-level "
    "--timing-log-option --tokenizer-model --tokenizer-type --top-n-logprobs --top_k --top_p --tp-comm-overlap "
    "--tp-comm-overlap-cfg --train-iters --train-samples --transformer-impl --untie-embeddings-and-output-weights "
    "--use-checkpoint-args --use-checkpoint-opt_param-scheduler --use-coordinator --use-distributed-optimizer "
    "--use-flashinfer-fused-rope --use-legacy-static-engine --use-mcore-models --use-megatron-fsdp --use-mup "
    "--use-persistent-ckpt-worker --use-rotary-position-embeddings --use-torch-fsdp2 --use-tp-pp-dp-mapping "
    "--v-head-dim --verify-integrity --vocab-file --vocab-size --wandb-entity --wandb-exp-name --wandb-project "
    "--wandb-save-dir --weight-decay --wgrad-deferral-limit"
).split())
