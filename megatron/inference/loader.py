"""A checkpoint's model, ready to generate: its parameters only (no optimizer state is read), cut
for this launch's tensor-parallel size, in the dtype asked for, and the run's tokenizer.

The checkpoint format is layout-free, so a model saved under any (tp, pp, dp, sharding) loads under
any tensor-parallel size here: each rank reads its slice of each parameter (``CheckpointReader.
local_range``: only the saved pieces it needs when the cut is the same, else the tensor is
reassembled one at a time). Pipeline parallelism is not used for generation.

A weight that is not finite (``foreign_numbers``: NaN or infinite in the checkpoint, or beyond fp16's range once
cast) is refused in one line naming it, on every rank, before a token is generated or a request served: such a
model would print one token forever.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.checkpoint.convert import open_checkpoint
from megatron.checkpoint.foreign_numbers import check_weight, first_wrong
from megatron.checkpoint.format import CheckpointError
from megatron.checkpoint.run_dir import on_every_rank
from megatron.checkpoint.save_load import check_compatible, slice_of
from megatron.config import Config
from megatron.initialize import die_with_launcher, launch_env, launched_by_torchrun
from megatron.tokenizer import Tokenizer, build_tokenizer, configured_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def initialize(tp: int | None = None, device: str = "cpu",
               timeout_minutes: float = 30.0) -> parallel_state.ParallelState:
    """Join torchrun's ranks as one tensor-parallel group (``tp`` = the world size; a plain ``python``
    launch is one rank). ValueError when ``tp`` is not the number of ranks (generation uses tensor
    parallelism only)."""
    world, rank, _ = launch_env()
    tp = world if tp is None else tp
    if tp != world:
        raise ValueError(f"--tp {tp} needs {tp} processes but {world} were launched: run under "
                         f"'torchrun --nproc-per-node {tp}' (generation uses tensor parallelism only).")
    if world > 1 and not dist.is_initialized():
        if launched_by_torchrun():
            die_with_launcher()
        backend = "nccl" if device == "gpu" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    return parallel_state.initialize(tp=tp, pp=1, dp=1, timeout_minutes=timeout_minutes)


def torch_device(device: str) -> torch.device:
    """``cpu`` or ``gpu`` (this process's GPU under torchrun)."""
    if device == "gpu":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def collective_device(device: torch.device) -> torch.device:
    """Where this process's collectives' tensors live: the GPU under NCCL, else the CPU."""
    return device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")


def tokenizer_for(config: Config, tokenizer_type: str | None = None, vocab_file: str | None = None,
                  merge_file: str | None = None, tokenizer_model: str | None = None) -> Tokenizer | None:
    """The tokenizer given by the arguments, else the one the run was trained with (its saved
    config's ``tokenizer:`` section); None when neither names one (a run on synthetic data)."""
    if tokenizer_type is not None:
        t = config.tokenizer
        return build_tokenizer(tokenizer_type, vocab_file, merge_file, tokenizer_model, t.eod_token,
                               vocab_size=config.model.vocab_size, tiktoken_pattern=t.tiktoken_pattern,
                               tiktoken_num_special_tokens=t.tiktoken_num_special_tokens)
    return configured_tokenizer(config.tokenizer, config.model.vocab_size)


def load_model(path: str, dtype: str = "fp32", device: torch.device | str = "cpu"):
    """(model, config) of the checkpoint at ``path`` (a run folder: its latest step; or a step folder)
    for this rank of the tensor-parallel group, in eval mode. Collective: a problem on any rank is the
    same one-line CheckpointError on every rank."""
    ps = parallel_state.get()
    device = torch.device(device)
    if ps.pp_size > 1:
        raise CheckpointError("generation does not use pipeline parallelism: load the checkpoint with --tp "
                              "instead (checkpoints are layout-free).")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    return on_every_rank(lambda: _load(path, DTYPES[dtype], device, ps), collective_device(device),
                         f"cannot load {path} for generation", "check the path, or load an earlier checkpoint")


def _load(path: str, dtype: torch.dtype, device: torch.device, ps):
    from megatron.model.init import materialize
    from megatron.parallelize_gpt import model_to_load

    reader, common, config = open_checkpoint(path)
    try:
        m = config.model
        if m.num_attention_heads % ps.tp_size or (m.ffn_hidden_size or 4 * m.hidden_size) % ps.tp_size:
            raise CheckpointError(f"--tp {ps.tp_size} must divide num_attention_heads ({m.num_attention_heads}) "
                                  f"and ffn_hidden_size ({m.ffn_hidden_size}).")
        d = config.distributed
        d.mp_degree, d.pp_degree, d.dp_degree, d.sequence_parallel = ps.tp_size, 1, 1, False
        d.sharding.sharding_degree = 1
        config.use_recompute = False
        # on the meta device (no memory, no initialisation: every value comes from the checkpoint), then allocated
        model = materialize(model_to_load(config), "cpu")
        error = check_compatible(reader, model, ps, m.vocab_size, {n for n, _ in model.named_parameters()})
        if error is not None:
            raise CheckpointError(error)
        with torch.no_grad():
            for name, p in model.named_parameters():
                where = slice_of(p, ps)
                p.copy_(reader.local_range("param", name, where.global_shape, where.partition_dim, where.tp_rank,
                                           where.tp_size, 0, p.numel()).view(p.shape))
                check_weight(name, p, reader.step_dir, "a model whose weights are not finite cannot generate (it "
                             "would print one token forever): load an earlier checkpoint")
            _set_expert_biases(model, (common.get("train_state") or {}).get("moe_expert_bias") or {})
    finally:
        reader.close()
    model = model.to(device=device, dtype=dtype).eval()
    if dtype != torch.float32:
        _check_cast(model, dtype, reader.step_dir)
    if device.type == "cpu" and dtype == torch.float32:
        lay_out_for_decoding(model)
    return model, config


def _check_cast(model: torch.nn.Module, dtype: torch.dtype, step_dir: str) -> None:
    """CheckpointError when a weight, finite in the checkpoint, is not once cast to ``dtype`` (fp16 ends at 65504)."""
    found = first_wrong(model.named_parameters())
    if found is not None:
        flag = next(flag for flag, d in DTYPES.items() if d == dtype)
        others = " or ".join(f for f in DTYPES if f != flag)
        raise CheckpointError(f"{step_dir}: the weight {found[0]} {found[1]} once cast to {flag} (it holds values "
                              f"beyond {flag}'s largest, {torch.finfo(dtype).max:g}); load it with --dtype {others}.")


def _set_expert_biases(model: torch.nn.Module, saved: dict) -> None:
    """The MoE routers' expert biases (buffers, not parameters: ``to_empty`` left them unset) from the
    checkpoint's train state, zero where it has none."""
    from megatron import moe

    for layer in moe.moe_layers(model):
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.zero_()
    moe.set_expert_biases(model, saved)


def lay_out_for_decoding(model: torch.nn.Module) -> None:
    """Store each weight matrix with more outputs than inputs (QKV, the MLP's first matmul, the tied
    word embedding that is the LM head) column-major: the same values and shape, the transpose
    contiguous; ``F.linear`` is unchanged.

    Why: a decode step at batch 1 multiplies one row by every matrix, so it is bound by reading the
    weights from memory, and MKL's one-row fp32 product streams an [out, in] row-major matrix with
    short rows at about half the bandwidth of the same matrix stored [in, out] (10 against 17-22 GB/s
    on the benchmark's CPU: benchmarks/generation.py measures each matrix both ways; batch-1 decoding
    goes from 0.98x to about 1.4x transformers). Products of many rows (prefill, larger batches) are
    unaffected; the position embeddings are only looked up, and stay as they are."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and p.shape[0] > p.shape[1] and "position_embeddings" not in name:
                p.data = p.data.t().contiguous().t()
