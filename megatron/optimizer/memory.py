"""Per-rank bytes of model states: parameters, gradients, fp32 master weights, AdamW states.

With P parameters on a rank (its tensor/pipeline share of the model), N = sharding degree:

| state | fp32 training | bf16 / fp16 training |
| --- | --- | --- |
| parameters | 4P | 2P |
| gradients (fp32 main grads) | 4P | 4P |
| master weights (fp32) | 0 (the parameters are the masters) | 4P / N |
| AdamW exp_avg + exp_avg_sq (fp32) | 8P / N | 8P / N |

ZeRO's 2Psi + 2Psi + K Psi with K = 12 (Adam, mixed precision) is this table with fp32 gradients
(4P rather than 2P: main grads are accumulated in fp32 here, as Megatron-LM does). Stage 1 shards
the master weights and optimizer states (the /N above); stage 2 also the gradients between
backwards (4P/N; the full 4P buffer exists during the backward). Stage 3 and CPU offload are not
built yet, so they are refused rather than estimated.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.schema import Config


@dataclass(frozen=True)
class ModelStateBytes:
    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_states


def model_state_bytes(num_params: int, precision: str = "fp32", sharding: int = 1, stage: int = 1,
                      offload: bool = False) -> ModelStateBytes:
    """Bytes one rank holds for ``num_params`` parameters (its share after tp/pp)."""
    if stage not in (1, 2) or offload:
        raise ValueError("sharding stages 1 and 2 without offload are built; stage 3 and offload are not yet")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"unknown precision {precision!r}")
    shard = -(-num_params // sharding)  # shards are padded to equal size
    low = precision != "fp32"
    gradients = 4 * (shard if stage >= 2 and sharding > 1 else num_params)  # stage 2: between backwards
    return ModelStateBytes(parameters=num_params * (2 if low else 4), gradients=gradients,
                           master_weights=4 * shard if low else 0, optimizer_states=8 * shard)


def parameters_per_rank(config: Config, tp: int = 1, pp: int = 1, pp_rank: int = 0) -> int:
    """Parameters held by a rank at (tp, pp): its stage's layers with the tensor-parallel matrices
    split over tp, the word embedding (split over tp) on the first stage and its tied copy on the last."""
    from megatron.pipeline_parallel.partition import segment, stage_layers

    m = config.model
    h, f = m.hidden_size, m.ffn_hidden_size or 4 * m.hidden_size
    per_layer = (3 * h * h + 3 * h + h * f + f) // tp + (h * h + f * h) // tp + h + h + 4 * h  # split + replicated
    layers = len(stage_layers(segment(m.num_layers, pp), pp_rank)) if pp > 1 else m.num_layers
    vocab = -(-m.vocab_size // (128 * tp)) * 128 * tp
    total = layers * per_layer
    if pp_rank == 0:
        total += vocab // tp * h + m.max_position_embeddings * h
    if pp_rank == pp - 1:
        total += 2 * h + (vocab // tp * h if pp > 1 else 0)  # final LayerNorm, tied head copy
    return total
