"""GPT: embedding, decoder layers, final norm, LM head (tied to the word embedding by default).

The model is a flat sequence (embedding, ``num_layers`` decoder layers, final norm, head)
so that pipeline parallelism can cut it into stages; layers keep their global index. GPT-2 is the
default; Megatron-LM's flags give the Llama family (rotary positions, RMSNorm, SwiGLU,
grouped-query attention, an untied output layer, no linear biases): see ``transformer.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megatron import parallel_state
from megatron import tensor_parallel as tp
from megatron.config.cli import ConfigError
from megatron.config.layer_split import recompute_plan
from megatron.config.schema import Config, ModelConfig
from megatron.config.schema_model import attention_shape
from megatron.context_parallel.attention import AttentionPlan
from megatron.model.init import defer_initialization, init_parameters
from megatron.model.mtp import MTPInputs, MultiTokenPrediction
from megatron.model.rotary import RotaryEmbedding, yarn_of
from megatron.model.transformer import (
    Rotary,
    SelfAttention,
    TransformerDecoderLayer,
    attention_needs_plan,
    make_norm,
    parallel_dropout,
)


class GPTEmbedding(nn.Module):
    """``drop(word[tokens] + position[position_ids])``: tokens [b, s] -> [s, b, h]; the position term
    only with ``position_embedding_type`` learned_absolute (rope rotates inside attention; none has no
    positions).

    The word embedding is vocabulary-parallel (rows split over the tensor-parallel group, looked
    up and summed across it); under sequence parallelism the output is this rank's ``s / tp``
    positions."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.word_embeddings = tp.VocabParallelEmbedding(padded_vocab_size, cfg.hidden_size)
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        else:
            self.position_embeddings = None
        self.dropout = cfg.hidden_dropout_prob
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
        if self.sequence_parallel:
            x = tp.scatter_to_sequence_region(x)
        return parallel_dropout(x, self.dropout, self.training, self.sequence_parallel)


class GPTModel(nn.Module):
    """GPT language model.

    ``forward(tokens [b, s], position_ids [b, s] | None, labels [b, s] | None)`` returns
    per-token losses [b, s] (fp32) when labels are given, else logits [b, s, V_padded].
    The LM head is a column-parallel matmul against this rank's vocabulary shard of the tied word
    embedding, or of ``output_layer.weight`` [V_padded, h] when ``untie_embeddings_and_output_weights``;
    the loss is the vocabulary-parallel cross entropy (full logits never exist on one rank).

    Recompute (``recompute`` granularity, Megatron-LM's ``recompute_method`` with ``full``): see
    ``recompute_plan``; a unit of several layers is checkpointed as one (``_checkpointed_unit``).
    """

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, recompute: str | None = None,
                 no_recompute_layers: list[int] | None = None, sequence_parallel: bool = False,
                 layers: range | None = None, pre_process: bool = True, post_process: bool = True,
                 recompute_method: str | None = None, recompute_num_layers: int | None = None,
                 cp_comm_type: str = "p2p"):
        super().__init__()
        self.cfg, self.sequence_parallel, self.cp_comm_type = cfg, sequence_parallel, cp_comm_type
        self.pre_process, self.post_process = pre_process, post_process
        self.untied = cfg.untie_embeddings_and_output_weights
        layers = range(cfg.num_layers) if layers is None else layers
        per_layer, units = recompute_plan(layers, recompute, no_recompute_layers, recompute_method,
                                          recompute_num_layers)
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
        mtp = post_process and bool(cfg.mtp_num_layers)  # multi-token prediction: on the last stage, embedding too
        if pre_process:
            self.embedding = GPTEmbedding(cfg, padded_vocab_size, sequence_parallel)
        elif mtp:  # a later stage holding the MTP modules: its own copy of the whole embedding
            self.embedding = GPTEmbedding(cfg, padded_vocab_size, sequence_parallel)
            for param in self.embedding.parameters():
                param.tied_copy = True  # counted once (on the first stage) in the grad norm and checkpoints
        elif post_process and not self.untied:  # a later stage holding the tied head: its own copy of the weight
            self.embedding = TiedHeadWeight(padded_vocab_size, cfg.hidden_size)
        # Keyed by global layer index, so parameter names are those of the whole model on every stage.
        self.layers = nn.ModuleDict({str(i): TransformerDecoderLayer(cfg, i, per_layer[i], sequence_parallel)
                                     for i in layers})
        self.recompute_units = [[str(i) for i in unit] for unit in units]
        if post_process:
            self.final_layernorm = make_norm(cfg, sequence_parallel)
            if self.untied:  # only its weight is used, by parallel_logits: [V_padded / tp, h] on this rank
                self.output_layer = tp.ColumnParallelLinear(cfg.hidden_size, padded_vocab_size, bias=False)
        if (not self.untied or cfg.mtp_num_layers) and (pre_process or post_process):
            # the two copies (first and last pipeline stage) have their gradients summed: finalize_grads
            shared = self.embedding.parameters() if cfg.mtp_num_layers else [self.embedding.word_embeddings.weight]
            for param in shared:
                param.shared_embedding = True
        self.mtp = MultiTokenPrediction(cfg, recompute, sequence_parallel) if mtp else None
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
        gathered = tp.gather_from_sequence_region(x) if self.sequence_parallel else x
        if labels is None:
            return tp.gather_from_tp_region(self.parallel_logits(gathered)).transpose(0, 1)
        losses = self.loss(gathered, labels)
        if self.mtp is not None and mtp is not None and self.training:
            losses = self.mtp(self, x, mtp, losses, rotary, plan)
        return losses

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token losses [b, s] (fp32) of the final hidden states x [s, b, h] against labels [b, s]:
        the LM head on this rank's vocabulary shard, then the vocabulary-parallel cross entropy."""
        return tp.vocab_parallel_cross_entropy(self.parallel_logits(x), labels.t(), self.cfg.vocab_size).t()

    def hidden_states(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                      kv_cache=None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's output [s, b, h]: after the final norm on the last stage (the whole
        sequence, gathered under sequence parallelism), else for the next stage. ``position_ids``
        [b, s] (default 0..s-1) place each token for the position embedding or the rotary one (every
        stage receives them). ``kv_cache`` (inference): see ``SelfAttention.forward``. Under context
        parallelism ``tokens`` and ``position_ids`` are this rank's chunks (``megatron.context_parallel``)."""
        x, _, _ = self._decode(tokens, position_ids, kv_cache, document_ids)
        if self.post_process and self.sequence_parallel:
            return tp.gather_from_sequence_region(x)
        return x

    def _decode(self, tokens: torch.Tensor, position_ids: torch.Tensor | None, kv_cache,
                document_ids: torch.Tensor | None) -> tuple[torch.Tensor, Rotary, AttentionPlan | None]:
        """(``hidden_states`` before the sequence-parallel gather, the rotary (cos, sin), the attention plan)."""
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.embedding(tokens, position_ids) if self.pre_process else self.input_tensor
        rotary = self.rotary(position_ids, x.dtype) if self.rotary is not None else None
        plan = self.attention_plan(document_ids) if kv_cache is None else None
        for unit in self.recompute_units:
            layers = [self.layers[key] for key in unit]
            if len(layers) > 1 and kv_cache is None and torch.is_grad_enabled():
                x = tp.checkpoint(_checkpointed_unit(layers), x, rotary, plan)
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
        ps = parallel_state.get()
        positional = self.cfg.attention_dropout_masks == "positional" and self.cfg.attention_probs_dropout_prob > 0
        if ps.cp_size == 1 and document_ids is None and not attention_needs_plan(self.cfg) and not positional:
            return None
        return AttentionPlan(ps.cp_size, ps.cp_rank, ps.group("cp"), self.cp_comm_type, document_ids, positional)

    def parallel_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head on this rank's vocabulary shard: [..., h] -> [..., V/tp] (the padded
        vocabulary split over the tensor-parallel group; never gathered here)."""
        if not self.sequence_parallel:
            x = tp.copy_to_tp_region(x)
        return F.linear(x, self.head_weight)

    @property
    def head_weight(self) -> torch.Tensor:
        """[V_padded / tp, h]: the output layer's weight, or the (tied) word embedding's."""
        return self.output_layer.weight if self.untied else self.embedding.word_embeddings.weight


TIED_EMBEDDING = "embedding.word_embeddings.weight"  # the tied word embedding's name, on every stage holding it


def shared_embedding_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The parameters the first and last pipeline stages both hold, their gradients summed (``shared_embedding``):
    the tied word embedding; the whole embedding with multi-token prediction (the last stage's modules embed)."""
    if cfg.mtp_num_layers and cfg.position_embedding_type == "learned_absolute":
        return TIED_EMBEDDING, "embedding.position_embeddings.weight"
    return (TIED_EMBEDDING,)


class TiedHeadWeight(nn.Module):
    """The last pipeline stage's copy of the word embedding, named like the first stage's
    (``embedding.word_embeddings.weight``) so it is initialised identically; the two copies'
    gradients are summed over the embedding group before every optimizer step."""

    def __init__(self, padded_vocab_size: int, hidden_size: int):
        super().__init__()
        self.word_embeddings = tp.VocabParallelEmbedding(padded_vocab_size, hidden_size)
        self.word_embeddings.weight.tied_copy = True  # counted once (on the first stage) in the grad norm


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


def build_model(config: Config, device: torch.device | str = "cpu", meta_init: bool = False) -> nn.Module:
    """This rank's part of the GPT of ``config``, initialised layout-invariantly, in the training
    dtype: the whole model, a pipeline stage, or (interleaved schedule) a ModuleList of chunks.

    ``meta_init`` (ZeRO stage 3: ``ShardingPlan.meta_init``): built on the meta device, each parameter
    initialised later by the buffer, bucket by bucket, straight into the shards."""
    recompute = config.recompute_granularity if config.use_recompute else None
    ps, d, m = parallel_state.get(), config.distributed, config.model
    dtype = getattr(torch, config.params_dtype_name)
    chunks = []
    for layers, pre, post in _chunk_specs(config, ps):
        with torch.device("meta") if meta_init else nullcontext():
            chunk = GPTModel(m, config.padded_vocab_size, recompute, config.no_recompute_layers, d.sequence_parallel,
                             layers, pre, post, config.recompute_method if recompute else None,
                             config.recompute_num_layers, d.cp_comm_type)
        if meta_init:
            defer_initialization(chunk.to(dtype=dtype), config.seed, m, device, dtype)
            _materialize_expert_biases(chunk, device)
            chunks.append(chunk)
        else:
            init_parameters(chunk, config.seed, m)
            chunks.append(chunk.to(device=device, dtype=dtype))
    if config.mix_precision.fp8_format is not None:
        _enable_fp8(chunks, config, torch.device(device), ps)
    if config.compile:
        compile_model(chunks, torch.device(device).type,
                      attention_eager=d.context_parallel_size > 1 or config.dataset.reset_attention_mask)
    return chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)


def _enable_fp8(chunks: list[nn.Module], config: Config, device: torch.device, ps) -> None:
    """The tensor-parallel linear layers' matmuls in FP8 (``tensor_parallel.fp8``); refused, in one line on every
    rank, on a device without FP8 tensor cores."""
    from megatron import device as dev

    problem = dev.fp8_problem(device)
    if problem is not None:
        raise ConfigError(f"--fp8-format: {problem}; drop --fp8-format (bf16 trains the same model).")
    recipe = tp.FP8Recipe(config.mix_precision.fp8_format)
    for chunk in chunks:
        tp.enable_fp8(chunk, recipe, ps.group("cp") if ps.cp_size > 1 else None)


def _materialize_expert_biases(chunk: nn.Module, device: torch.device | str) -> None:
    """A model built on the meta device (ZeRO stage 3): its MoE routers' expert biases (buffers, not parameters:
    no deferred initialisation) start at 0 on ``device``."""
    for module in chunk.modules():
        bias = getattr(module, "expert_bias", None)
        if isinstance(bias, torch.Tensor) and bias.is_meta:
            module.expert_bias = torch.zeros(bias.shape, dtype=torch.float32, device=device)


def _chunk_specs(config: Config, ps) -> list[tuple[range, bool, bool]]:
    """(global layer indices, pre_process, post_process) of each model chunk this rank holds."""
    from megatron.config.layer_split import chunk_layers, segment, stage_layers

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


# ----------------------------------------------------------------------------- --compile

def compile_model(chunks: list[GPTModel], device_type: str = "cpu", attention_eager: bool = False) -> None:
    """``--compile``: torch.compile, in place, what runs without collectives or checkpoints, as
    torchtitan compiles each block: per decoder layer, the function ``tp.checkpoint`` recomputes.

    - recompute none or ``full`` (any ``recompute_method``): the layer's ``_layer``;
    - ``only_attn`` / ``full_attn``: ``_attention_block``, the second norm and the MLP;
    - ``core_attn``: the two norms and the MLP;
    - on one tensor-parallel rank, the LM head and the cross entropy (``GPTModel.loss``; with more,
      their collectives stay eager).

    A MoE layer (``megatron.moe``) always runs eager, its token counts being data-dependent: the compiled
    code breaks its graph around it.

    ``attention_eager`` (context parallelism, packed documents): attention runs eager whatever the
    recompute (its exchanges and per-document calls), the two norms and the MLP compiled.

    A compiled part never contains a checkpoint (dynamo cannot trace ``tp.checkpoint``, whose
    ``context_fn`` replays the RNG tracker): it is what the checkpoint runs, so the recompute runs the
    same compiled code (and draws the same dropout masks) as the forward.

    With tensor parallelism, the column- and row-parallel layers run eager (``torch.compiler.disable``):
    their collectives fall between compiled pieces. Layers share one compiled graph. KV-cache calls
    (inference) run eager. Module hooks stay outside the compiled code, so ZeRO stage 3's gathers
    run before it reads the weights. Where torch.compile does not work (``device.compile_problem``)
    or fails at a first call, everything runs eager after one warning naming the reason."""
    from megatron import device as dev
    from megatron import parallel_state

    problem = dev.compile_problem(device_type)
    state = _CompileState()
    if problem is not None:
        state.fail(problem)
        return
    tp_size = parallel_state.get().tp_size
    for chunk in chunks:
        mtp_layers = [module.transformer_layer for module in chunk.mtp.layers] if chunk.mtp is not None else []
        for layer in [*chunk.layers.values(), *mtp_layers]:
            for module in layer.modules():
                _keep_eager(module, tp_size)
            for owner, name, kv in _compiled_parts(layer, attention_eager):
                setattr(owner, name, _Compiled(getattr(type(owner), name), owner, state, kv))
        if chunk.post_process and tp_size == 1:
            chunk.loss = _Compiled(_head_and_loss, chunk, state)


def _keep_eager(module: nn.Module, tp_size: int) -> None:
    """Mark what must run eager inside a compiled part (``torch.compiler.disable`` on the instance, so that
    importing the model does not import dynamo): tensor-parallel linears under tp (their collectives), a MoE
    layer (data-dependent token counts), and the context-parallel / packed-document attention (its exchanges and
    per-document calls)."""
    from megatron.model.mla import MultiLatentAttention
    from megatron.moe.layer import MoELayer

    if tp_size > 1 and isinstance(module, (tp.ColumnParallelLinear, tp.RowParallelLinear)):
        module.forward = torch.compiler.disable(module.forward)
    elif isinstance(module, MoELayer):
        module.forward = torch.compiler.disable(module.forward)
    elif isinstance(module, (SelfAttention, MultiLatentAttention)):
        module.planned_attention = torch.compiler.disable(module.planned_attention)


def _compiled_parts(layer: TransformerDecoderLayer, attention_eager: bool = False) -> list[tuple[nn.Module, str, bool]]:
    """(owner, method name, whether its 2nd argument is the KV cache) of what ``compile_model`` compiles."""
    if layer.recompute in (None, "full") and not attention_eager:
        return [(layer, "_layer", True)]
    mlp_half = [(layer.post_attention_layernorm, "forward", False), (layer.mlp, "forward", False)]
    if layer.recompute in ("only_attn", "full_attn") and not attention_eager:
        return [(layer, "_attention_block", True), *mlp_half]
    return [(layer.input_layernorm, "forward", False), *mlp_half]


def _head_and_loss(model: GPTModel, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``GPTModel.loss`` on one tensor-parallel rank in plain operations that torch.compile fuses
    (the eager path's chunked cross entropy would be unrolled): ``logsumexp(z) - z_y`` over the real
    vocabulary, in fp32. x [s, b, h], labels [b, s] -> [b, s]."""
    logits = F.linear(x, model.head_weight)[..., :model.cfg.vocab_size].float()  # [s, b, V]
    target = logits.gather(-1, labels.t().unsqueeze(-1)).squeeze(-1)
    return (torch.logsumexp(logits, dim=-1) - target).t()


def _compile_errors() -> tuple[type[Exception], ...]:
    """Errors of torch.compile's tracing and code generation (not of the computation itself)."""
    exc = torch._dynamo.exc
    return exc.BackendCompilerFailed, exc.InternalTorchDynamoError, exc.Unsupported


class _CompileState:
    """Shared by a model's compiled parts: once one fails, all run eager (one warning)."""

    def __init__(self):
        self.problem: str | None = None

    def fail(self, reason: str) -> None:
        if self.problem is None:
            self.problem = reason
            from megatron.metrics import get_logger

            get_logger().warning(f"--compile: torch.compile failed ({reason}); the model runs eager")


class _Compiled:
    """``fn(owner, ...)`` under torch.compile, in place of the method ``owner.fn``: compiled from the
    function, so every layer shares its code (one graph). Eager for a KV-cache call (``kv``: the 2nd
    argument is the cache) and once compiling failed; a compile error raised by a call is caught
    and the call rerun eager. The error comes before the compiled code runs; at tp > 1 an eager piece
    before it (a column-parallel layer and its collective) may have run, and runs again: on every
    rank alike, as the same graphs fail alike."""

    def __init__(self, fn: Callable, owner: nn.Module, state: _CompileState, kv: bool = False):
        self.fn, self.compiled, self.owner, self.state, self.kv = fn, torch.compile(fn), owner, state, kv

    def __call__(self, *args, **kwargs):
        if self.state.problem is None and not (self.kv and len(args) > 1 and args[1] is not None):
            try:
                return self.compiled(self.owner, *args, **kwargs)
            except _compile_errors() as err:
                from megatron.device import first_line

                self.state.fail(first_line(err))
        return self.fn(self.owner, *args, **kwargs)
