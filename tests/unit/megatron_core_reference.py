"""NVIDIA's Megatron Core (``megatron-core``, the test extra's pinned version) run on the CPU in this process as a
test-only reference (../shared/MEGATRON_CORE_ON_CPU.md): ``megatron_core()`` imports and patches it (skipping the
test when it is absent), ``build_pair`` builds our GPT and its ``GPTModel`` with the same weights,
``core_model_from_args`` its ``GPTModel`` of a checkpoint's ``args`` as Megatron-LM builds it.

``megatron-core`` installs ``megatron/core`` into site-packages' ``megatron`` folder, which this project's own
``megatron`` package shadows: ``megatron_core()`` adds that folder to our package's search path while it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import megatron
from megatron import moe, parallel_state
from megatron.checkpoint.megatron_lm.core_names import is_gated, to_megatron_core_state
from megatron.config import parse_config, validate
from megatron.config.schema_model import attention_shape
from megatron.config.validate_moe import moe_layer_pattern
from megatron.model.gpt import GPTModel

PINNED = "0.16.1"  # setup.py's test extra
TOLERANCE = 1e-5  # of the largest |value| of the compared tensor
# Megatron Core's and DCP's own deprecation notices (tp_group None, ffn_hidden_size, ...): not ours to act on;
# a test module using the reference sets ``pytestmark = CORE_WARNINGS``
CORE_WARNINGS = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.core"),
                 pytest.mark.filterwarnings("ignore::UserWarning:megatron.core"),
                 pytest.mark.filterwarnings("ignore::FutureWarning")]
SEQ, BATCH, VOCAB = 8, 2, 128

TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
        "--ffn-hidden-size", "24", "--vocab-size", str(VOCAB), "--max-seq-len", str(SEQ),
        "--max-position-embeddings", str(SEQ), "--hidden-dropout-prob", "0", "--attention-probs-dropout-prob", "0"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[1,0]",
       "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.1",
       "--moe-token-dispatcher-type", "allgather"]


@contextlib.contextmanager
def megatron_core():
    """Megatron Core imported and runnable on the CPU in this process (see the module's docstring); the patches,
    the process group and both parallel states undone after."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"megatron-core is not installed (pip install megatron-core=={PINNED} --no-deps: the test extra)")
    if version != PINNED:
        pytest.skip(f"megatron-core {version} is installed; the reference is pinned to {PINNED}")
    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group was left behind by an earlier test"
    folder = str(Path(importlib.metadata.distribution("megatron-core").locate_file("megatron")))
    megatron.__path__.append(folder)
    patches, rng = pytest.MonkeyPatch(), torch.get_rng_state()  # building either model draws from the default RNG
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Apex is not installed. Falling back to Torch Norm", and others
            from megatron.core import parallel_state as core_state
            from megatron.core.models.gpt import GPTModel as CoreGPTModel
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
            from megatron.core.tensor_parallel import random as core_random
            from megatron.core.transformer.moe import moe_utils
            from megatron.core.transformer.transformer_config import TransformerConfig
        patches.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
        patches.setattr(core_random.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())
        patches.setattr(moe_utils, "te_general_gemm", None, raising=False)
        parallel_state.initialize()  # ours: one process (before the group exists)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        core_state.initialize_model_parallel(1, 1)
        yield {"GPTModel": CoreGPTModel, "block_spec": get_gpt_decoder_block_spec, "config": TransformerConfig,
               "scaler": moe_utils.MoEAuxLossAutoScaler, "tracker": moe_utils}
    finally:
        if "TransformerConfig" in locals():  # every import succeeded
            moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
            moe_utils.clear_aux_losses_tracker()
            core_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        parallel_state.destroy()
        moe.set_aux_loss_scale(1.0)
        patches.undo()
        torch.set_rng_state(rng)
        megatron.__path__.remove(folder)


def build_pair(mcore, *flags: str):
    """(our config, our GPT with random weights, Megatron Core's GPTModel holding the same weights)."""
    config = parse_config([*TINY, *flags])
    validate(config)
    m = config.model
    assert config.padded_vocab_size == VOCAB  # no padding rows: both heads give the same V columns
    ours = GPTModel(m, config.padded_vocab_size)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():  # O(1) weights, norms around 1: every parameter matters
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3 + (1.0 if "layernorm" in name else 0.0))
    nq, ng, hd = attention_shape(m)
    moe_kwargs = {}
    if m.num_experts:
        moe_kwargs = dict(
            num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk, moe_grouped_gemm=False,
            moe_layer_freq=[int(x) for x in moe_layer_pattern(m.moe_layer_freq, m.num_layers)],
            moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
            moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
            moe_router_load_balancing_type=m.moe_router_load_balancing_type, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
            moe_router_score_function=m.moe_router_score_function, moe_router_pre_softmax=m.moe_router_pre_softmax,
            moe_z_loss_coeff=m.moe_z_loss_coeff or None, moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
            moe_expert_capacity_factor=m.moe_expert_capacity_factor, moe_token_drop_policy=m.moe_token_drop_policy,
            moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity,
            moe_router_num_groups=m.moe_router_num_groups, moe_router_group_topk=m.moe_router_group_topk,
            moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
            moe_shared_expert_gate=m.moe_shared_expert_gate, moe_token_dispatcher_type="allgather",
            moe_router_dtype="fp32")
    core_config = mcore["config"](
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=nq, num_query_groups=ng,
        kv_channels=hd, ffn_hidden_size=m.ffn_hidden_size, normalization=m.normalization,
        layernorm_epsilon=m.layernorm_epsilon, gated_linear_unit=bool(m.swiglu),
        activation_func=F.silu if m.swiglu else _squared_relu() if m.squared_relu else _megatron_gelu(m),
        add_bias_linear=not m.disable_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, qk_layernorm=m.qk_layernorm, **moe_kwargs)
    spec = mcore["block_spec"](core_config, use_transformer_engine=False, normalization=m.normalization)
    theirs = mcore["GPTModel"](core_config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                               position_embedding_type=m.position_embedding_type,
                               share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                               rotary_base=m.rotary_base, rotary_percent=m.rotary_percent)
    mapped = to_megatron_core_state({n: p.detach() for n, p in ours.named_parameters()}, is_gated(m))
    params = dict(theirs.named_parameters())
    assert set(mapped) == set(params), set(mapped) ^ set(params)
    with torch.no_grad():
        for name, p in params.items():
            assert p.shape == mapped[name].shape, name
            p.copy_(mapped[name])
        for i, layer in ours.layers.items():  # the expert bias (a buffer): the same, chosen to change choices
            if isinstance(layer.mlp, moe.MoELayer) and layer.mlp.router.expert_bias is not None:
                bias = torch.tensor([0.2, -0.1, 0.05, -0.15])
                layer.mlp.router.expert_bias.copy_(bias)
                theirs.decoder.layers[int(i)].mlp.router.expert_bias.copy_(bias)
    return config, ours.train(), theirs.train()


def core_model_from_args(mcore, args):
    """Megatron Core's ``GPTModel`` (local spec, standard attention) of a checkpoint's ``args`` as Megatron-LM builds
    it (``core_transformer_config_from_args``: every ``args`` field that is a field of its ``TransformerConfig``,
    its renames, ``quick_geglu`` as a gated ``quick_gelu``; then ``_apply_yarn_config_from_args`` for YaRN; the
    model provider's ``rotary_base`` / ``rotary_percent``); on the CPU in fp32 without fusions or dropout, the
    allgather dispatcher. ``quick_gelu`` is Megatron Core's own function run eagerly (its ``jit_fuser`` would
    torch.compile it on first use: the same arithmetic, compiled)."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    fields = {f.name for f in dataclasses.fields(mcore["config"])}
    kwargs = {name: value for name, value in vars(args).items() if name in fields}
    if args.swiglu:
        activation = F.silu
    elif getattr(args, "squared_relu", False):
        activation = _squared_relu()
    elif getattr(args, "quick_geglu", False):
        activation = getattr(quick_gelu, "_torchdynamo_orig_callable", quick_gelu)
    else:
        activation = _megatron_gelu(types.SimpleNamespace(bias_gelu_fusion=args.bias_gelu_fusion,
                                                          disable_bias_linear=not args.add_bias_linear))
    kwargs.update(num_moe_experts=args.num_experts, layernorm_epsilon=args.norm_epsilon,
                  gated_linear_unit=is_gated(args), activation_func=activation,
                  num_query_groups=args.num_query_groups if args.group_query_attention else None,
                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1, use_cpu_initialization=True,
                  bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                  persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
                  moe_token_dispatcher_type="allgather", moe_router_dtype="fp32", hidden_dropout=0.0,
                  attention_dropout=0.0)
    config = mcore["config"](**kwargs)
    if args.position_embedding_type == "yarn":  # _apply_yarn_config_from_args: None is YarnRotaryEmbedding's default
        for attr, name, default in (("rotary_scaling_factor", "rotary_scaling_factor", 1.0),
                                    ("original_max_position_embeddings", "yarn_original_max_position_embeddings",
                                     4096), ("beta_fast", "yarn_beta_fast", 32.0), ("beta_slow", "yarn_beta_slow", 1.0),
                                    ("mscale", "mscale", 1.0), ("mscale_all_dim", "mscale_all_dim", 0.0),
                                    ("correction_range_round_to_int", "yarn_correction_range_round_to_int", True)):
            value = getattr(args, name, None)
            setattr(config, f"yarn_{attr}", default if value is None else value)
    spec = mcore["block_spec"](config, use_transformer_engine=False, normalization=args.normalization)
    return mcore["GPTModel"](config, spec, vocab_size=args.padded_vocab_size, max_sequence_length=args.seq_length,
                             position_embedding_type=args.position_embedding_type,
                             share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                             rotary_base=args.rotary_base, rotary_percent=args.rotary_percent)


def _squared_relu():
    """Megatron Core's own ``squared_relu`` (``megatron.core.activations``), what its --squared-relu runs, eagerly
    (its ``jit_fuser`` would torch.compile it on first use, as ``quick_gelu`` below: the same arithmetic)."""
    from megatron.core.activations import squared_relu

    return getattr(squared_relu, "_torchdynamo_orig_callable", squared_relu)


def _megatron_gelu(m):
    """The GELU Megatron-LM runs: its fused bias-GELU kernel (the tanh approximation) when --bias-gelu-fusion is on
    and the linear layers have biases (its arguments.py turns the fusion off without them), else Megatron Core's
    ``activation_func`` default, exact ``F.gelu``. On the CPU the fusion is off here: the tanh is given as the
    function instead."""
    if m.bias_gelu_fusion and not m.disable_bias_linear:
        return lambda x: F.gelu(x, approximate="tanh")
    return F.gelu


def core_forward(theirs, tokens, labels=None):
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    return theirs(tokens, positions, causal, labels=labels)


def assert_close_to_scale(got, want, what):
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert err <= TOLERANCE * scale, f"{what}: max |difference| {err:.3g} > {TOLERANCE:g} x max |value| {scale:.3g}"


def tokens_and_labels():
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator))




def core_optimizer(theirs, lr: float, weight_decay: float):
    """Megatron Core's fp32 optimizer over ``theirs`` as ``get_megatron_optimizer`` builds it without a distributed
    optimizer (inside ``megatron_core()``): ``FP32Optimizer`` around torch's AdamW over ``_get_param_groups``'
    groups (decayed matrices, then biases and norms); a ``ChainedOptimizer`` of the dense parameters' and the
    experts' when experts have ``allreduce`` False (only with expert parallelism > 1: not here). Its constructor's
    one CUDA tensor (the unit loss scale) is made on the CPU."""
    import types

    from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, OptimizerConfig, _get_param_groups
    from megatron.core.optimizer import optimizer as core_optimizer_module

    config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=0.0)
    groups = _get_param_groups([theirs], config, None)

    def init_state_fn(opt, config=None):  # get_megatron_optimizer's, for an optimizer loading a state
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)

    real = torch.tensor
    cpu_torch = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")})
    cpu_torch.tensor = lambda *args, device=None, **kwargs: real(*args, **kwargs)
    chain = []
    with pytest.MonkeyPatch.context() as patches:
        patches.setattr(core_optimizer_module, "torch", cpu_torch)
        for expert in (False, True):
            mine = [g for g in groups if g["is_expert_parallel"] == expert]
            if mine:
                inner = torch.optim.AdamW(mine, lr=lr, weight_decay=weight_decay,
                                          betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
                chain.append(FP32Optimizer(inner, config, init_state_fn))
    return chain[0] if len(chain) == 1 else ChainedOptimizer(chain)


def core_step(theirs, optimizer, tokens, labels, lr: float, weight_decay: float) -> None:
    """One training step of Megatron Core's model and optimizer at ``lr`` and ``weight_decay`` (what its
    scheduler sets: times each group's ``lr_mult`` and ``wd_mult``), the loss the mean over the tokens."""
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = lr * group["lr_mult"], weight_decay * group["wd_mult"]
    optimizer.zero_grad()
    core_forward(theirs.train(), tokens, labels).mean().backward()
    assert optimizer.step()[0]


def save_as_megatron(theirs, args, root: Path, iteration: int, fmt: str) -> None:
    """Megatron Core's ``theirs`` saved in ``root`` as Megatron-LM saves a one-rank run at ``iteration``: legacy (its
    state dict in ``iter_N/mp_rank_00``) or torch_dist (its own ``dist_checkpointing.save``; on the CPU its CUDA
    synchronisation and its writer's memory probe are no-ops), then the tracker file."""
    from megatron.checkpoint.megatron_lm.legacy import FILE, TRACKER

    folder = root / f"iter_{iteration:07d}"
    if fmt == "legacy":
        (folder / "mp_rank_00").mkdir(parents=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": theirs.state_dict()},
                   folder / "mp_rank_00" / FILE)
    else:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        with pytest.MonkeyPatch.context() as patches:
            patches.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
            patches.setattr(filesystem_async, "_process_memory", lambda: 0)
            folder.mkdir(parents=True)
            dist_checkpointing.save({"model": theirs.sharded_state_dict(), "args": args, "iteration": iteration,
                                     "checkpoint_version": 3.0}, str(folder))
    (root / TRACKER).write_text(str(iteration))
