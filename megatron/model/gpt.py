"""GPT: embedding, decoder layers, final norm, LM head (tied to the word embedding by default).

The model is a flat sequence (embedding, ``num_layers`` decoder layers, final norm, head)
so that pipeline parallelism can cut it into stages; layers keep their global index. GPT-2 is the
default; Megatron-LM's flags give the Llama family (rotary positions, RMSNorm, SwiGLU,
grouped-query attention, an untied output layer, no linear biases): see ``transformer.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron.attention.plan import AttentionPlan
from megatron.config.schema import ModelConfig
from megatron.config.schema_model import attention_shape
from megatron.config.validate_mup import embedding_multiplier, output_multiplier
from megatron.model.blocks import dropout, make_norm
from megatron.model.mtp import MTPInputs, MultiTokenPrediction
from megatron.model.rotary import RotaryEmbedding, yarn_of
from megatron.model.transformer import Rotary, TransformerDecoderLayer, attention_needs_plan
from megatron.ops.seams import LOCAL


class GPTEmbedding(nn.Module):
    """``drop(mult x (word[tokens] + position[position_ids]))``: tokens [b, s] -> [s, b, h]; the position term
    only with ``position_embedding_type`` learned_absolute (rope rotates inside attention; none has no
    positions); ``mult`` muP's ``mup_embedding_mult`` (1 without muP).

    Under tensor parallelism the word embedding is vocabulary-parallel (rows split over the group, looked up and
    summed across it); under sequence parallelism the output is this rank's ``s / tp`` positions
    (``seams.scatter_sequence``)."""

    seams = LOCAL

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab_size, cfg.hidden_size)
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        else:
            self.position_embeddings = None
        self.dropout = cfg.hidden_dropout_prob
        self.multiplier = embedding_multiplier(cfg)  # muP's mup_embedding_mult (1: none)
        self._desc = (f"vocab_size={padded_vocab_size}, hidden_size={cfg.hidden_size}, "
                      f"hidden_dropout_prob={cfg.hidden_dropout_prob}, "
                      f"max_position_embeddings={cfg.max_position_embeddings}, "
                      f"type_vocab_size={cfg.type_vocab_size}, initializer_range={cfg.initializer_range}")
        if cfg.position_embedding_type != "learned_absolute":
            self._desc += f", position_embedding_type={cfg.position_embedding_type}"

    def extra_repr(self) -> str:
        return self._desc

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # Transposing the (small) index tensors gives [s, b, h] without copying activations.
        x = self.word_embeddings(tokens.t())
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids.t())
        if self.multiplier != 1.0:
            x = x * self.multiplier
        return dropout(self.seams.scatter_sequence(x), self.dropout, self.training, self.seams.sequence_rng)


class GPTModel(nn.Module):
    """GPT language model.

    ``forward(tokens [b, s], position_ids [b, s] | None, labels [b, s] | None)`` returns
    per-token losses [b, s] (fp32) when labels are given, else logits [b, s, V_padded].
    The LM head is a column-parallel matmul against this rank's vocabulary shard of the tied word
    embedding, or of ``output_layer.weight`` [V_padded, h] when ``untie_embeddings_and_output_weights``;
    the loss is the vocabulary-parallel cross entropy (full logits never exist on one rank).

    Built whole, from its configuration alone; ``megatron.parallelize_gpt`` cuts it to a pipeline stage
    (``pre_process``: it holds the embedding, ``post_process``: the head), splits it over the tensor-parallel ranks
    (``seams``), sets the context-parallel split of its attention (``cp_size``, ``cp_rank``, ``cp_group``,
    ``cp_comm_type``) and what recomputes (``recompute_units``: layers checkpointed together,
    ``_checkpointed_unit``; ``megatron.recompute``).
    """

    seams = LOCAL
    # the context-parallel split and how its ranks meet (context_parallel.parallelize.apply_context_parallel)
    cp_size, cp_rank, cp_group, cp_comm_type, cp_exchange = 1, 0, None, "p2p", None

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.pre_process = self.post_process = True  # the whole model (pipeline_parallel.partition.cut_stage)
        self.untied = cfg.untie_embeddings_and_output_weights
        self.logit_multiplier = output_multiplier(cfg)  # muP's (1 / m by default; 1 without muP)
        if cfg.multi_latent_attention:  # the rotary channels of its queries and shared key (megatron.model.mla)
            from megatron.model.mla import yarn_settings

            self.rotary = RotaryEmbedding(cfg.qk_pos_emb_head_dim, 1.0, cfg.rotary_base, cfg.max_position_embeddings,
                                          interleaved=True, yarn=yarn_settings(cfg))
        elif cfg.position_embedding_type in ("rope", "yarn"):
            _, _, head_dim = attention_shape(cfg)
            self.rotary = RotaryEmbedding(head_dim, cfg.rotary_percent, cfg.rotary_base, cfg.max_position_embeddings,
                                          cfg.rotary_interleaved,
                                          yarn_of(cfg) if cfg.position_embedding_type == "yarn" else None)
        else:
            self.rotary = None
        self.embedding = GPTEmbedding(cfg, padded_vocab_size)
        # Keyed by global layer index, so parameter names are those of the whole model on every stage.
        self.layers = nn.ModuleDict({str(i): TransformerDecoderLayer(cfg, i) for i in range(cfg.num_layers)})
        self.recompute_units: list[list[str]] | None = None  # None: each layer its own unit
        self.final_layernorm = make_norm(cfg)
        if self.untied:  # only its weight is used, by parallel_logits: [V_padded / tp, h] on this rank
            self.output_layer = nn.Linear(cfg.hidden_size, padded_vocab_size, bias=False)
        if not self.untied or cfg.mtp_num_layers:
            # under pipelining, the copies of the first and last stages have their gradients summed: finalize_grads
            shared = self.embedding.parameters() if cfg.mtp_num_layers else [self.embedding.word_embeddings.weight]
            for param in shared:
                param.shared_embedding = True
        # multi-token prediction (on the last stage: the embedding too)
        self.mtp = MultiTokenPrediction(cfg) if cfg.mtp_num_layers else None
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The activation received from the previous pipeline stage (used instead of the embedding)."""
        self.input_tensor = tensor

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                mtp: MTPInputs | None = None) -> torch.Tensor:
        """``document_ids`` [b, s] (packed documents, the whole sequence even under context parallelism):
        attention stays inside each document; None: each sample is one document. ``mtp``: the tokens further on
        for multi-token prediction (``megatron.model.mtp``), whose losses join the backward of the returned ones
        in training."""
        x, rotary, plan = self._decode(tokens, position_ids, None, document_ids)
        if not self.post_process:
            return x  # [s, b, h] for the next stage
        gathered = self.seams.gather_sequence(x)
        if labels is None:
            return self.seams.gather_heads(self.parallel_logits(gathered)).transpose(0, 1)
        losses = self.loss(gathered, labels)
        if self.mtp is not None and mtp is not None and self.training:
            losses = self.mtp(self, x, mtp, losses, rotary, plan)
        return losses

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token losses [b, s] (fp32) of the final hidden states x [s, b, h] against labels [b, s]:
        the LM head on this rank's vocabulary shard, then the vocabulary-parallel cross entropy."""
        return self.seams.cross_entropy(self.parallel_logits(x), labels.t(), self.cfg.vocab_size).t()

    def hidden_states(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                      kv_cache=None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's output [s, b, h]: after the final norm on the last stage (the whole
        sequence, gathered under sequence parallelism), else for the next stage. ``position_ids``
        [b, s] (default 0..s-1) place each token for the position embedding or the rotary one (every
        stage receives them). ``kv_cache`` (inference): see ``SelfAttention.forward``. Under context
        parallelism ``tokens`` and ``position_ids`` are this rank's chunks (``megatron.context_parallel``)."""
        x, _, _ = self._decode(tokens, position_ids, kv_cache, document_ids)
        return self.seams.gather_sequence(x) if self.post_process else x

    def _decode(self, tokens: torch.Tensor, position_ids: torch.Tensor | None, kv_cache,
                document_ids: torch.Tensor | None) -> tuple[torch.Tensor, Rotary, AttentionPlan | None]:
        """(``hidden_states`` before the sequence-parallel gather, the rotary (cos, sin), the attention plan)."""
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.embedding(tokens, position_ids) if self.pre_process else self.input_tensor
        rotary = self.rotary(position_ids, x.dtype) if self.rotary is not None else None
        plan = self.attention_plan(document_ids) if kv_cache is None else None
        for unit in self.recompute_units or [[key] for key in self.layers]:
            layers = [self.layers[key] for key in unit]
            if len(layers) > 1 and kv_cache is None and torch.is_grad_enabled():
                x = self.seams.checkpoint(_checkpointed_unit(layers), x, rotary, plan)
                continue
            for layer in layers:
                x = layer(x, kv_cache, rotary, plan)
        if self.post_process:
            x = self.final_layernorm(x)
        return x, rotary, plan

    def attention_plan(self, document_ids: torch.Tensor | None) -> AttentionPlan | None:
        """What this micro-batch's attention respects beyond causality (one plan for every layer): the
        context-parallel split of the launch and the packed documents; None for neither, unless layers have sliding
        windows or sinks (their blocks are planned whatever the layout)."""
        positional = self.cfg.attention_dropout_masks == "positional" and self.cfg.attention_probs_dropout_prob > 0
        if self.cp_size == 1 and document_ids is None and not attention_needs_plan(self.cfg) and not positional:
            return None
        return AttentionPlan(self.cp_size, self.cp_rank, self.cp_group, self.cp_comm_type, document_ids, positional,
                             exchange=self.cp_exchange)

    def parallel_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head on this rank's vocabulary shard: [..., h] -> [..., V/tp] (the padded
        vocabulary split over the tensor-parallel group; never gathered here); times muP's output multiplier."""
        logits = F.linear(self.seams.head_input(x), self.head_weight)
        # in place: the matmul's backward does not read its output, and no second [.., V/tp] tensor is allocated
        return logits.mul_(self.logit_multiplier) if self.logit_multiplier != 1.0 else logits

    @property
    def head_weight(self) -> torch.Tensor:
        """[V_padded / tp, h]: the output layer's weight, or the (tied) word embedding's."""
        return self.output_layer.weight if self.untied else self.embedding.word_embeddings.weight


def _checkpointed_unit(layers: list[nn.Module]) -> Callable:
    """The function ``tp.checkpoint`` runs for a unit of several layers: ``(x, rotary) -> x``.

    Its first call is the forward: the layers run as modules, hooks included. Later calls are the
    backward's recompute: each layer's forward pre-hooks run (ZeRO stage 3 gathers the layer's
    parameters) but not its forward hooks, which would free the parameters the backward is about to
    read, to be gathered once more (FSDP likewise keeps parameters gathered when it re-runs a forward
    inside the backward)."""
    calls = 0

    def run(x: torch.Tensor, rotary: Rotary, plan: AttentionPlan | None) -> torch.Tensor:
        nonlocal calls
        calls += 1
        for layer in layers:
            if calls == 1:
                x = layer(x, None, rotary, plan)
                continue
            args = (x, None, rotary, plan)
            for hook in layer._forward_pre_hooks.values():
                result = hook(layer, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
            x = layer.forward(*args)
        return x

    return run


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
