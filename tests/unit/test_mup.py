"""muP (Megatron-LM's --use-mup and --mup-*): the derived numbers, the initialisation's stds, the forward and the
per-group learning rates against Megatron-LM's newer main (not in the pinned megatron-core 0.16.1), and the
coordinate check (activations' scale after a few steps does not grow with the width).

The reference: Megatron-LM's main at the mirrored commit, transcribed where 0.16.1 lacks it —
``TransformerConfig.__post_init__``'s muP block and ``utils.mup_scaled_init_method_normal`` (``megatron_mup``),
``LanguageModelEmbedding.forward``'s and ``LanguageModule._scale_logits``' multipliers (hooked into 0.16.1's GPTModel,
whose ``DotProductAttention`` takes the softmax scale), ``optimizer.get_mup_config_overrides`` and the muP marks of
``LanguageModule.setup_embeddings_and_output_layer`` (``megatron_mup_overrides``), applied by 0.16.1's own
``_get_param_groups`` (the same ParamKey machinery as main's) and ``OptimizerParamScheduler``."""

from __future__ import annotations

import math

import pytest
import torch

import pretrain_gpt
from megatron.checkpoint.hf.common import ConversionError
from megatron.checkpoint.hf.models import converter_for_model
from megatron.checkpoint.megatron_lm.args import model_flags, to_args
from megatron.config import ConfigError, parse_config, validate
from megatron.config.validate_mup import attention_scale, embedding_multiplier, output_multiplier, width_mult
from megatron.data.loader import build_batch
from megatron.data.mock_dataset import MockGPTDataset
from megatron.distributed.parallelize import parallelize, plan_sharding
from megatron.model.gpt import GPTModel
from megatron.model.init import init_parameters, init_std
from megatron.optimizer import build_optimizer, build_param_schedule, mup_schedule
from megatron.optimizer.muon import is_muon_param
from megatron.optimizer.param_groups import group_of, mup_scaled
from megatron.parallel_state import single_process_state
from megatron.parallelize_gpt import build_model, parallelize_gpt
from megatron.training import train_step
from tests.unit.megatron_core_reference import (
    CORE_WARNINGS,
    LLAMA,
    assert_close_to_scale,
    build_pair,
    core_forward,
    megatron_core,
    tokens_and_labels,
)

pytestmark = CORE_WARNINGS
LR, MIN_LR, EPS = 1e-3, 1e-5, 1e-8
TINY = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--vocab-size", "128", "--max-seq-len", "8", "--max-position-embeddings", "8", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--max-steps", "100", "--global-batch-size", "4", "--micro-batch-size", "4"]


def config_of(*flags: str, base: list[str] = TINY):
    config = parse_config([*base, *flags])
    validate(config)
    return config


def megatron_mup(hidden, heads, layers, std, base=None, emb_std=None, output_mult=1.0, base_head_dim=None,
                 power=1.0, kv_channels=None):
    """Megatron-LM main's ``TransformerConfig.__post_init__`` under use_mup: (width_mult, softmax_scale,
    mup_output_mult, {init method: std}) with ``init_method_normal`` / ``mup_scaled_init_method_normal``'s stds."""
    base = hidden if base is None else base
    width = hidden / base
    kv = kv_channels or hidden // heads
    softmax_scale = (1.0 if base_head_dim is None else base_head_dim ** 0.5) / (kv ** power)
    if output_mult == 1.0 and width != 1.0:
        output_mult = 1.0 / width
    emb = std if emb_std is None else emb_std
    stds = {"init_method": std / math.sqrt(width), "embedding_init_method": emb,
            "output_layer_init_method": std / (math.sqrt(2.0 * layers) * math.sqrt(width))}
    return width, softmax_scale, output_mult, stds


MUP_CASES = {  # flags over TINY (hidden 32, 4 heads, 2 layers) -> megatron_mup's arguments
    "base-width": (["--use-mup"], {}),
    "4x": (["--use-mup", "--mup-base-hidden-size", "8"], {"base": 8}),
    "narrower": (["--use-mup", "--mup-base-hidden-size", "64"], {"base": 64}),
    "own-multipliers": (["--use-mup", "--mup-base-hidden-size", "16", "--mup-output-mult", "0.3",
                         "--mup-embedding-mult", "2.5", "--embedding-init-method-std", "0.05"],
                        {"base": 16, "output_mult": 0.3, "emb_std": 0.05}),
    "base-head-dim": (["--use-mup", "--mup-base-hidden-size", "16", "--mup-base-head-dim", "4",
                       "--mup-attn-scale-power", "0.5", "--kv-channels", "16"],
                      {"base": 16, "base_head_dim": 4, "power": 0.5, "kv_channels": 16}),
}


@pytest.mark.parametrize("case", list(MUP_CASES))
def test_derived_numbers_and_init_stds_are_megatrons(case):
    flags, kwargs = MUP_CASES[case]
    config = config_of(*LLAMA, *flags)
    m = config.model
    width, scale, out_mult, stds = megatron_mup(32, 4, 2, 0.02, **kwargs)
    assert width_mult(m) == width and output_multiplier(m) == out_mult
    assert embedding_multiplier(m) == (2.5 if case == "own-multipliers" else 1.0)
    model = GPTModel(m, config.padded_vocab_size)
    assert model.logit_multiplier == out_mult and model.embedding.multiplier == embedding_multiplier(m)
    assert all(layer.self_attention.softmax_scale == scale for layer in model.layers.values())
    # which init method Megatron Core draws each of our weights with (the untied head: the embedding's under muP)
    for name, _ in model.named_parameters():
        if "layernorm" in name or name.endswith(".bias"):
            continue
        kind = ("embedding_init_method" if "embedding" in name or "output_layer" in name else
                "output_layer_init_method" if name.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight"))
                else "init_method")
        assert init_std(name, m) == stds[kind], name


def test_the_drawn_weights_have_those_stds():
    """Drawn by name (the same values under any tensor-parallel layout), at the width's std: a 256-wide model with a
    base of 64 (m = 4)."""
    config = config_of("--use-mup", "--mup-base-hidden-size", "64", "--untie-embeddings-and-output-weights",
                       base=[*TINY[:6], "256", *TINY[7:]])
    model = GPTModel(config.model, config.padded_vocab_size)
    init_parameters(model, 1234, config.model)
    _, _, _, stds = megatron_mup(256, 4, 2, 0.02, base=64)
    params = dict(model.named_parameters())
    for name, want in (("layers.0.self_attention.query_key_value.weight", stds["init_method"]),
                       ("layers.1.mlp.dense_4h_to_h.weight", stds["output_layer_init_method"]),
                       ("output_layer.weight", stds["embedding_init_method"])):
        assert float(params[name].std()) == pytest.approx(want, rel=0.03), name


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_the_forward_is_megatron_cores_with_mains_mup(shape):
    """Our logits equal Megatron Core's GPTModel given main's muP: its softmax scale, the embedding's multiplier
    after the lookup (``LanguageModelEmbedding.forward``) and the logits' (``_scale_logits``)."""
    flags = ["--use-mup", "--mup-base-hidden-size", "8", "--mup-embedding-mult", "1.7"]
    with megatron_core() as mcore:
        config, ours, theirs = build_pair(mcore, *(LLAMA if shape == "llama" else []), *flags)
        width, scale, out_mult, _ = megatron_mup(16, 4, 2, 0.02, base=8)
        assert out_mult == 0.5
        for layer in theirs.decoder.layers:
            layer.self_attention.core_attention.softmax_scale = scale
        theirs.embedding.register_forward_hook(lambda module, args, out: out * 1.7)
        theirs.output_layer.register_forward_hook(lambda module, args, out: (out[0] * out_mult, out[1]))
        tokens, _ = tokens_and_labels()
        with torch.no_grad():
            assert_close_to_scale(core_forward(theirs.eval(), tokens), ours.eval()(tokens), f"{shape} logits")


def megatron_mup_overrides(core, width: float, optimizer: str) -> dict:
    """Megatron-LM main's ``get_mup_config_overrides(config, mup_width_mult, optimizer_type)``, transcribed."""
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

    kind = optimizer.lower()
    sgd, adam, muon, decoupled = kind == "sgd", "adam" in kind, "muon" in kind, core.decoupled_lr is not None
    if width == 1.0:
        return {}

    def is_embedding(p, n):
        if getattr(p, "shared_embedding", False):
            return True
        if hasattr(p, "is_embedding_parameter"):
            return bool(p.is_embedding_parameter)
        return "embedding" in n.lower()

    def vector_like(p, n):
        return is_embedding(p, n) or p.dim() <= 1

    def muon_managed(p, n):  # layer_wise_optimizer.is_managed_by_layer_wise_optimizer
        return muon and getattr(p, "use_muon", True) and p.dim() == 2 and \
            not getattr(p, "is_embedding_or_output_parameter", False)

    def decoupled_param(p):
        return decoupled and getattr(p, "is_embedding_or_output_parameter", False)

    def key(name, fn):
        return ParamKey(with_name_predicate=ParamWithNamePredicate(name=name, fn=fn))

    if sgd:
        return {key("sgd_vector", lambda p, n: not decoupled_param(p) and vector_like(p, n)):
                {"max_lr": core.lr * width, "min_lr": core.min_lr * width}}
    lr = {"max_lr": core.lr / width, "min_lr": core.min_lr / width}
    eps = {"eps": core.adam_eps / width} if adam else {}
    scale_eps = key("hidden_eps", lambda p, n: not vector_like(p, n) and not muon_managed(p, n))
    if not decoupled:
        return {scale_eps: {**lr, **eps}}
    hidden = key("hidden", lambda p, n: not decoupled_param(p) and not muon_managed(p, n) and not vector_like(p, n))
    return {hidden: lr, **({scale_eps: eps} if eps else {})}


def mark_embedding_class(theirs) -> None:
    """``LanguageModule.setup_embeddings_and_output_layer`` under use_mup: the embedding's and the head's parameters
    are muP's "embedding class"."""
    for p in theirs.embedding.parameters():
        p.is_embedding_parameter = True
    if getattr(theirs, "output_layer", None) is not None and theirs.output_layer.weight is not None:
        theirs.output_layer.weight.is_embedding_parameter = True


@pytest.mark.parametrize("optimizer, decoupled", [("adam", False), ("adam", True), ("sgd", False), ("sgd", True),
                                                  ("muon", False)])
def test_the_groups_and_their_rates_are_megatrons(optimizer, decoupled):
    """Every parameter of Megatron Core's GPT (learned positions, an untied head) lands in a group of main's muP
    rates (peak, floor, eps) that ours gives it, at m = 2."""
    dec = ["--decoupled-lr", "5e-3"] if decoupled else []
    shape = ["--untie-embeddings-and-output-weights", "--qk-layernorm"]
    ours = config_of(*shape, "--use-mup", "--mup-base-hidden-size", "16", "--optimizer", optimizer, *dec,
                     "--lr", str(LR), "--min-lr", str(MIN_LR), "--adam-eps", str(EPS)).optimizer
    with megatron_core() as mcore:
        from megatron.core.optimizer import OptimizerConfig, _get_param_groups, get_standard_config_overrides

        _, _, theirs = build_pair(mcore, *shape)
        mark_embedding_class(theirs)
        core = OptimizerConfig(optimizer="sgd" if optimizer == "sgd" else "adam", lr=LR, min_lr=MIN_LR, adam_eps=EPS,
                               decoupled_lr=5e-3 if decoupled else None)
        overrides = {**get_standard_config_overrides(core), **megatron_mup_overrides(core, 2.0, optimizer)}
        groups = _get_param_groups([theirs], core, overrides)
        rates = {id(p): (g["max_lr"], g["min_lr"], g.get("eps", EPS)) for g in groups for p in g["params"]}
        named = list(theirs.named_parameters())
    factor = 2.0 if optimizer == "sgd" else 0.5
    scaled_any = False
    for name, param in named:
        _, own_lr = group_of(name, param.shape, ours)
        scaled = mup_scaled(name, param.shape, ours) and not (optimizer == "muon" and is_muon_param(name, param))
        scaled_any |= scaled
        peak = 5e-3 if own_lr else LR * factor if scaled else LR
        floor = MIN_LR if own_lr else MIN_LR * factor if scaled else MIN_LR
        eps = EPS / 2.0 if scaled and optimizer == "adam" else EPS
        assert rates[id(param)] == pytest.approx((peak, floor, eps), rel=1e-12), name
    assert scaled_any == (optimizer != "muon")  # Muon steps every hidden matrix at its own rate


def test_the_mup_schedule_is_megatron_cores():
    """The hidden matrices' schedule: the run's with the peak and floor / m, the warm-up from warmup_init."""
    config = config_of("--use-mup", "--mup-base-hidden-size", "8", "--lr", "1e-3", "--min-lr", "1e-5",
                       "--lr-warmup-iters", "10", "--lr-warmup-init", "1e-6", "--lr-decay-style", "cosine")
    ours = mup_schedule(config, build_param_schedule(config))
    assert mup_schedule(config_of("--use-mup"), build_param_schedule(config)) is None  # m = 1: no group of its own
    with megatron_core():
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        class Holder:
            param_groups = [{"max_lr": 1e-3 / 4, "min_lr": 1e-5 / 4}]

        theirs = OptimizerParamScheduler(Holder(), init_lr=1e-6, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=10 * 4,
                                         lr_decay_steps=100 * 4, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                         wd_incr_steps=100 * 4, wd_incr_style="constant")
        for samples in (0, 8, 40, 44, 200, 396, 400, 480):
            theirs.num_steps = samples
            assert ours.lr(samples) == pytest.approx(theirs.get_lr(Holder.param_groups[0]), rel=1e-12), samples


def test_one_step_moves_each_parameter_at_its_rate():
    """One AdamW step at lr 1e-3, m = 4: the hidden matrices as torch's AdamW alone at lr / 4 and eps / 4, the rest
    at the run's."""
    torch.manual_seed(0)
    config = config_of(*LLAMA, "--use-mup", "--mup-base-hidden-size", "8", "--weight-decay", "0.1")
    parallel = parallelize_gpt(config, torch.device("cpu"))
    model, optimizer = parallel.model, parallel.optimizer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn(p.shape) * 1e-7 for n, p in model.named_parameters()}  # eps matters at this size
    optimizer.zero_grad()
    for name, p in model.named_parameters():
        p.main_grad.copy_(grads[name])
    optimizer.mup_lr = 2.5e-4  # the trainer's, from mup_schedule
    assert optimizer.step(1e-3, 0.1).applied
    scaled = 0
    for name, p in model.named_parameters():
        decays, _ = group_of(name, p.shape, config.optimizer)
        hidden = mup_scaled(name, p.shape, config.optimizer)
        scaled += hidden
        ref = before[name].clone().requires_grad_(True)
        ref.grad = grads[name].clone()
        torch.optim.AdamW([ref], lr=2.5e-4 if hidden else 1e-3, eps=EPS / 4 if hidden else EPS,
                          weight_decay=0.1 if decays else 0.0).step()
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-6, atol=1e-7, msg=name)
    assert scaled == 2 * 4  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h of two layers


def _coordinates(width: int, mup: bool, steps: int = 4) -> dict[str, float]:
    """RMS of how far each layer's output and the logits moved from their initial values on a fixed batch after
    ``steps`` AdamW steps at lr 1e-2 (the muP coordinate check)."""
    argv = ["--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", str(width),
            "--num-attention-heads", "4", "--vocab-size", "128", "--max-seq-len", "16", "--max-position-embeddings",
            "16", "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "8",
            "--micro-batch-size", "8", "--grad-clip", "0", "--weight-decay", "0",
            "--untie-embeddings-and-output-weights", "--seed", "3"]
    config = config_of(*(["--use-mup", "--mup-base-hidden-size", "64"] if mup else []), base=argv)
    plan = plan_sharding(config, single_process_state())
    model, buffer, _ = parallelize(build_model(config), plan)
    optimizer = build_optimizer(buffer, plan, config)
    data = MockGPTDataset(8 * (steps + 1), 16, 128, seed=1)
    probe = build_batch([data[j] for j in range(8)], data.eod_id)["tokens"]
    gpt = model.module if hasattr(model, "module") else model

    def activations() -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        hooks = [layer.register_forward_hook(lambda mod, args, y, k=k: out.__setitem__(k, y.detach()))
                 for k, layer in gpt.layers.items()]
        with torch.no_grad():
            out["logits"] = gpt.eval()(probe)
        for hook in hooks:
            hook.remove()
        return out

    start = activations()
    for step in range(steps):
        batch = build_batch([data[8 * (step + 1) + j] for j in range(8)], data.eod_id)
        assert train_step(pretrain_gpt.forward_step, batch, model, buffer, optimizer, 1e-2, 8)[1].applied
    end = activations()
    return {k: float((end[k] - start[k]).pow(2).mean().sqrt()) for k in start}


def test_coordinate_check_activations_do_not_grow_with_width():
    """Widths 64, 128, 256 over a base of 64: under muP each layer's output and the logits move by about as much
    at every width (within 2x of each other); the standard parametrisation's grow with the width (the last layer's
    by more than 5x from 64 to 256 here, ~50x measured)."""
    mup = {w: _coordinates(w, True) for w in (64, 128, 256)}
    for coordinate in mup[64]:
        moved = [mup[w][coordinate] for w in mup]
        assert max(moved) < 2.0 * min(moved), (coordinate, moved)
    standard = {w: _coordinates(w, False) for w in (64, 256)}
    assert standard[256]["1"] > 5.0 * standard[64]["1"], standard


@pytest.mark.parametrize("flags, message", [
    (["--mup-base-hidden-size", "0"], "mup_base_hidden_size must be positive, got 0"),
    (["--mup-output-mult", "-1"], "mup_output_mult must be a positive number, got -1"),
    (["--mup-embedding-mult", "0"], "mup_embedding_mult must be a positive number, got 0"),
    (["--mup-base-head-dim", "0"], "mup_base_head_dim must be a positive number, got 0"),
    (["--mup-attn-scale-power", "nan"], "mup_attn_scale_power must be a finite number"),
], ids=["base", "output", "embedding", "head-dim", "power"])
def test_bad_settings_are_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        config_of("--use-mup", *flags)


def test_settings_without_use_mup_are_warned_about_and_change_nothing():
    config = parse_config([*TINY, "--mup-base-hidden-size", "8"])
    warnings = validate(config)
    assert any(w.startswith("mup_base_hidden_size set without use_mup") for w in warnings)
    assert width_mult(config.model) == 1.0 and attention_scale(config.model) is None


def test_hugging_face_export_is_refused_with_multipliers_and_megatron_args_carry_them():
    with pytest.raises(ConversionError, match="muP's multipliers.*logits x 0.25.*to-megatron"):
        converter_for_model(config_of("--use-mup", "--mup-base-hidden-size", "8").model)
    base = config_of("--use-mup", "--mup-base-head-dim", "8").model  # m = 1, scale 1 / sqrt(8): the plain function
    assert converter_for_model(base).__name__.endswith("gpt2")
    m = config_of("--use-mup", "--mup-base-hidden-size", "8", "--mup-embedding-mult", "3").model
    args = to_args(m, tp=1, pp=1, seq_length=8, iteration=0, consumed_train_samples=0)
    assert (args.use_mup, args.mup_base_hidden_size, args.mup_embedding_mult) == (True, 8, 3.0)
    back = config_of(*model_flags(args)).model
    assert (back.use_mup, back.mup_base_hidden_size, back.mup_embedding_mult) == (True, 8, 3.0)
