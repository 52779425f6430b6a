"""GPT-2: embedding, decoder layers, final LayerNorm, LM head tied to the word embedding.

The model is a flat sequence (embedding, ``num_layers`` decoder layers, final norm, head)
so that pipeline parallelism can cut it into stages; layers keep their global index.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megatron import tensor_parallel as tp
from megatron.config.schema import Config, ModelConfig
from megatron.model.init import defer_initialization, init_parameters
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
                 no_recompute_layers: list[int] | None = None, sequence_parallel: bool = False,
                 layers: range | None = None, pre_process: bool = True, post_process: bool = True):
        super().__init__()
        self.cfg, self.sequence_parallel = cfg, sequence_parallel
        self.pre_process, self.post_process = pre_process, post_process
        skip = set(no_recompute_layers or [])
        layers = range(cfg.num_layers) if layers is None else layers
        if pre_process:
            self.embedding = GPTEmbedding(cfg, padded_vocab_size, sequence_parallel)
        elif post_process:  # a later pipeline stage holding the head: its own copy of the tied weight
            self.embedding = TiedHeadWeight(padded_vocab_size, cfg.hidden_size)
        # Keyed by global layer index, so parameter names are those of the whole model on every stage.
        self.layers = nn.ModuleDict({str(i): TransformerDecoderLayer(cfg, i, None if i in skip else recompute,
                                                                     sequence_parallel) for i in layers})
        if post_process:
            self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
            if sequence_parallel:
                tp.mark_sequence_parallel(self.final_layernorm)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The activation received from the previous pipeline stage (used instead of the embedding)."""
        self.input_tensor = tensor

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.hidden_states(tokens, position_ids)
        if not self.post_process:
            return x  # [s, b, h] for the next stage
        logits = self.parallel_logits(x)  # [s, b, V/tp]
        if labels is None:
            return tp.gather_from_tp_region(logits).transpose(0, 1)
        return tp.vocab_parallel_cross_entropy(logits, labels.t(), self.cfg.vocab_size).t()

    def hidden_states(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                      kv_cache=None) -> torch.Tensor:
        """The decoder's output [s, b, h]: after the final LayerNorm on the last stage (the whole
        sequence, gathered under sequence parallelism), else for the next stage. ``kv_cache``
        (inference): see ``SelfAttention.forward``."""
        if self.pre_process:
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            x = self.embedding(tokens, position_ids)
        else:
            x = self.input_tensor
        for layer in self.layers.values():
            x = layer(x, kv_cache)
        if not self.post_process:
            return x
        x = self.final_layernorm(x)
        return tp.gather_from_sequence_region(x) if self.sequence_parallel else x

    def parallel_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The tied LM head on this rank's vocabulary shard: [..., h] -> [..., V/tp] (the padded
        vocabulary split over the tensor-parallel group; never gathered here)."""
        if not self.sequence_parallel:
            x = tp.copy_to_tp_region(x)
        return F.linear(x, self.embedding.word_embeddings.weight)


TIED_EMBEDDING = "embedding.word_embeddings.weight"  # the tied word embedding's name, on every stage holding it


class TiedHeadWeight(nn.Module):
    """The last pipeline stage's copy of the word embedding, named like the first stage's
    (``embedding.word_embeddings.weight``) so it is initialised identically; the two copies'
    gradients are summed over the embedding group before every optimizer step."""

    def __init__(self, padded_vocab_size: int, hidden_size: int):
        super().__init__()
        self.word_embeddings = tp.VocabParallelEmbedding(padded_vocab_size, hidden_size)
        self.word_embeddings.weight.tied_copy = True  # counted once (on the first stage) in the grad norm


def build_model(config: Config, device: torch.device | str = "cpu", meta_init: bool = False) -> nn.Module:
    """This rank's part of the GPT of ``config``, initialised layout-invariantly, in the training
    dtype: the whole model, a pipeline stage, or (interleaved schedule) a ModuleList of chunks.

    ``meta_init`` (ZeRO stage 3: ``ShardingPlan.meta_init``): built on the meta device, each parameter
    initialised later by the buffer, bucket by bucket, straight into the shards."""
    from megatron import parallel_state

    recompute = config.recompute_granularity if config.use_recompute else None
    ps, d, m = parallel_state.get(), config.distributed, config.model
    dtype = getattr(torch, config.params_dtype_name)
    chunks = []
    for layers, pre, post in _chunk_specs(config, ps):
        with torch.device("meta") if meta_init else nullcontext():
            chunk = GPTModel(m, config.padded_vocab_size, recompute, config.no_recompute_layers, d.sequence_parallel,
                             layers, pre, post)
        if meta_init:
            defer_initialization(chunk.to(dtype=dtype), config.seed, m, device, dtype)
            chunks.append(chunk)
        else:
            init_parameters(chunk, config.seed, m)
            chunks.append(chunk.to(device=device, dtype=dtype))
    return chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)


def _chunk_specs(config: Config, ps) -> list[tuple[range, bool, bool]]:
    """(global layer indices, pre_process, post_process) of each model chunk this rank holds."""
    from megatron.pipeline_parallel.partition import chunk_layers, segment, stage_layers

    d, m = config.distributed, config.model
    if ps.pp_size == 1:
        return [(range(m.num_layers), True, True)]
    if d.virtual_pp_degree == 1:
        bounds = segment(m.num_layers, ps.pp_size, d.pipeline_partition)
        return [(stage_layers(bounds, ps.pp_rank), ps.is_first_stage, ps.is_last_stage)]
    vpp = d.virtual_pp_degree
    return [(chunk_layers(m.num_layers, ps.pp_size, vpp, ps.pp_rank, c), ps.is_first_stage and c == 0,
             ps.is_last_stage and c == vpp - 1) for c in range(vpp)]


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
