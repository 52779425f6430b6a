"""GPT-2: embedding, decoder layers, final LayerNorm, LM head tied to the word embedding.

The model is a flat sequence (embedding, ``num_layers`` decoder layers, final norm, head)
so that pipeline parallelism can cut it into stages; layers keep their global index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron import tensor_parallel as tp
from megatron.config.schema import Config, ModelConfig
from megatron.model.init import init_parameters
from megatron.model.transformer import TransformerDecoderLayer, parallel_dropout


class GPTEmbedding(nn.Module):
    """``drop(word[tokens] + position[position_ids])``: tokens [b, s] -> [s, b, h].

    The word embedding is vocabulary-parallel (rows split over the tensor-parallel group, looked
    up and summed across it); under sequence parallelism the output is this rank's ``s / tp``
    positions."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.word_embeddings = tp.VocabParallelEmbedding(padded_vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.dropout = cfg.hidden_dropout_prob
        self._desc = (f"vocab_size={padded_vocab_size}, hidden_size={cfg.hidden_size}, "
                      f"hidden_dropout_prob={cfg.hidden_dropout_prob}, "
                      f"max_position_embeddings={cfg.max_position_embeddings}, "
                      f"type_vocab_size={cfg.type_vocab_size}, initializer_range={cfg.initializer_range}")

    def extra_repr(self) -> str:
        return self._desc

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # Transposing the (small) index tensors gives [s, b, h] without copying activations.
        x = self.word_embeddings(tokens.t()) + self.position_embeddings(position_ids.t())
        if self.sequence_parallel:
            x = tp.scatter_to_sequence_region(x)
        return parallel_dropout(x, self.dropout, self.training, self.sequence_parallel)


class GPTModel(nn.Module):
    """GPT-2 language model.

    ``forward(tokens [b, s], position_ids [b, s] | None, labels [b, s] | None)`` returns
    per-token losses [b, s] (fp32) when labels are given, else logits [b, s, V_padded].
    The LM head is a column-parallel matmul against this rank's shard of the tied word
    embedding; the loss is the vocabulary-parallel cross entropy (full logits never exist on
    one rank).
    """

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, recompute: str | None = None,
                 no_recompute_layers: list[int] | None = None, sequence_parallel: bool = False):
        super().__init__()
        self.cfg, self.sequence_parallel = cfg, sequence_parallel
        skip = set(no_recompute_layers or [])
        self.embedding = GPTEmbedding(cfg, padded_vocab_size, sequence_parallel)
        self.layers = nn.ModuleList(TransformerDecoderLayer(cfg, i, None if i in skip else recompute, sequence_parallel)
                                    for i in range(cfg.num_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        if sequence_parallel:
            tp.mark_sequence_parallel(self.final_layernorm)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.embedding(tokens, position_ids)
        for layer in self.layers:
            x = layer(x)
        x = self.final_layernorm(x)
        x = tp.gather_from_sequence_region(x) if self.sequence_parallel else tp.copy_to_tp_region(x)
        logits = F.linear(x, self.embedding.word_embeddings.weight)  # tied head: [s, b, V/tp]
        if labels is None:
            return tp.gather_from_tp_region(logits).transpose(0, 1)
        return tp.vocab_parallel_cross_entropy(logits, labels.t(), self.cfg.vocab_size).t()


def build_model(config: Config, device: torch.device | str = "cpu") -> GPTModel:
    """The GPT of ``config``, initialised layout-invariantly, in the training dtype."""
    recompute = config.recompute_granularity if config.use_recompute else None
    model = GPTModel(config.model, config.padded_vocab_size, recompute, config.no_recompute_layers,
                     config.distributed.sequence_parallel)
    init_parameters(model, config.seed, config.model)
    dtype = getattr(torch, config.params_dtype_name)
    return model.to(device=device, dtype=dtype)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
