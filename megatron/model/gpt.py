"""GPT-2: embedding, decoder layers, final LayerNorm, LM head tied to the word embedding.

The model is a flat sequence (embedding, ``num_layers`` decoder layers, final norm, head)
so that pipeline parallelism can cut it into stages; layers keep their global index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import Config, ModelConfig
from megatron.model.cross_entropy import token_cross_entropy
from megatron.model.init import init_parameters
from megatron.model.transformer import TransformerDecoderLayer


class GPTEmbedding(nn.Module):
    """``drop(word[tokens] + position[position_ids])``: tokens [b, s] -> [s, b, h]."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab_size, cfg.hidden_size)
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
        return F.dropout(x, self.dropout, self.training)


class GPTModel(nn.Module):
    """GPT-2 language model.

    ``forward(tokens [b, s], position_ids [b, s] | None, labels [b, s] | None)`` returns
    per-token losses [b, s] (fp32) when labels are given, else logits [b, s, V_padded].
    """

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, recompute: str | None = None,
                 no_recompute_layers: list[int] | None = None):
        super().__init__()
        self.cfg = cfg
        skip = set(no_recompute_layers or [])
        self.embedding = GPTEmbedding(cfg, padded_vocab_size)
        self.layers = nn.ModuleList(
            TransformerDecoderLayer(cfg, i, None if i in skip else recompute) for i in range(cfg.num_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.embedding(tokens, position_ids)
        for layer in self.layers:
            x = layer(x)
        x = self.final_layernorm(x)
        logits = F.linear(x, self.embedding.word_embeddings.weight)  # tied head: [s, b, V]
        if labels is None:
            return logits.transpose(0, 1)
        return token_cross_entropy(logits, labels.t(), self.cfg.vocab_size).t()


def build_model(config: Config, device: torch.device | str = "cpu") -> GPTModel:
    """The GPT of ``config``, initialised layout-invariantly, in the training dtype."""
    recompute = config.recompute_granularity if config.use_recompute else None
    model = GPTModel(config.model, config.padded_vocab_size, recompute, config.no_recompute_layers)
    init_parameters(model, config.seed, config.model)
    dtype = getattr(torch, config.params_dtype_name)
    return model.to(device=device, dtype=dtype)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
