"""``--compile``: torch.compile applied to a built model, in place (a step of ``megatron.parallelize_gpt``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron import tensor_parallel as tp
from megatron.model.gpt import GPTModel
from megatron.model.mla import MultiLatentAttention
from megatron.model.transformer import SelfAttention, TransformerDecoderLayer
from megatron.moe.layer import MoELayer


def compile_model(chunks: list[GPTModel], device_type: str = "cpu", attention_eager: bool = False,
                  tp_size: int = 1) -> None:
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

    problem = dev.compile_problem(device_type)
    state = _CompileState()
    if problem is not None:
        state.fail(problem)
        return
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
    mlp_half = [(layer.post_attention_layernorm, "forward", False), (layer.mlp, "forward", False)] \
        if layer.mlp is not None else []  # (a hybrid model's mixer layer has no MLP, its MLP layer no mixer)
    if layer.input_layernorm is None:
        return mlp_half
    if layer.recompute in ("only_attn", "full_attn") and not attention_eager:
        return [(layer, "_attention_block", True), *mlp_half]
    return [(layer.input_layernorm, "forward", False), *mlp_half]


def _head_and_loss(model: GPTModel, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``GPTModel.loss`` on one tensor-parallel rank in plain operations that torch.compile fuses
    (the eager path's chunked cross entropy would be unrolled): ``logsumexp(z) - z_y`` over the real
    vocabulary, in fp32. x [s, b, h], labels [b, s] -> [b, s]."""
    logits = F.linear(x, model.head_weight)[..., :model.cfg.vocab_size]
    if model.logit_multiplier != 1.0:  # muP's output multiplier (GPTModel.parallel_logits)
        logits = logits * model.logit_multiplier
    logits = logits.float()  # [s, b, V]
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
