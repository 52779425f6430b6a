"""A Hugging Face config.json read by ``convert_checkpoint.py from-hf`` is bounded, unambiguous and read as transformers
5 reads it (megatron/checkpoint/hf/config_checks.py), before any mapping builds anything from it: every size of every
family is bounded by our field's maximum and named as the file names it (10^9 layers grew the process to the
machine's memory), a value of the wrong type, a non-finite number, nesting too deep for the parser or what
transformers itself refuses is one line, exit 2, nothing written (they were tracebacks, or read silently otherwise);
two keys naming one setting are refused where transformers' reading depends on their order or its version, and
followed where it does not (``rope_scaling`` over ``rope_parameters``: the import then computes transformers'
logits); a key left out is transformers' default for the family; a YaRN factor below 1 or ``beta_fast`` below
``beta_slow`` is refused, in a config.json and in our flags. In process, tiny configs; one slow test runs the tool
under an address-space limit."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from megatron.checkpoint.convert import open_checkpoint
from megatron.checkpoint.hf import config_checks as checks
from megatron.config import ConfigError, validate
from megatron.config.bounds import MAXIMA
from tests.functional.launch import ROOT, program_module
from tests.functional.processes import run_tools_in_bounded_memory
from tests.unit.test_config import valid_config

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402  (installed with transformers)

convert = program_module("tools/convert_checkpoint.py")
PREFIX = "convert_checkpoint.py: error: "
DROP = object()  # a change that removes the key
_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=250, max_position_embeddings=32, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None)
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 32}
TINY = {  # family -> the keyword arguments of its tiny transformers config
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=32, vocab_size=250, bos_token_id=None,
                                eos_token_id=None)),
    "llama": ("LlamaConfig", dict(_LLAMA, head_dim=16)),
    "qwen3": ("Qwen3Config", dict(_LLAMA, head_dim=16)),
    "mixtral": ("MixtralConfig", dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, qkv_bias=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        _LLAMA, num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, n_group=4,
        topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 8})),
    "gpt_oss": ("GptOssConfig", dict(
        _LLAMA, num_hidden_layers=3, intermediate_size=32, head_dim=24, max_position_embeddings=128, sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], num_local_experts=4,
        num_experts_per_tok=2, swiglu_limit=1.0, rope_parameters=YARN, pad_token_id=None)),
    "nemotron_h": ("NemotronHConfig", dict(
        hidden_size=64, intermediate_size=96, layers_block_type=["mamba", "mlp", "attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=250, max_position_embeddings=32, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, ssm_state_size=8, bos_token_id=None, eos_token_id=None, pad_token_id=None)),
    "qwen3_next": ("Qwen3NextConfig", dict(
        _LLAMA, num_hidden_layers=4, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8)),
}


def tiny(family: str, **changes) -> dict:
    """The config.json transformers 5 writes for a tiny model of ``family`` (every key), ``changes`` on top."""
    name, settings = TINY[family]
    config = json.loads(getattr(transformers, name)(**settings).to_json_string(use_diff=False))
    config.update(changes)
    return {k: v for k, v in config.items() if v is not DROP}


def from_hf(tmp_path, config=None, raw: str | None = None, weights: dict | None = None) -> int:
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(raw if raw is not None else json.dumps(config))
    if weights is not None:
        save_file(weights, str(folder / "model.safetensors"))
    return convert.main(["from-hf", str(folder), str(tmp_path / "out")])


def refused(tmp_path, capsys, config=None, raw: str | None = None) -> str:
    """The one line from-hf says about ``config`` (exit 2, nothing written), without its prefix."""
    code = from_hf(tmp_path, config, raw)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(PREFIX) and "\n" not in err and len(err) < 600, err
    assert not (tmp_path / "out").exists()
    return err[len(PREFIX):]


# ---------------------------------------------------------------- sizes


@pytest.mark.slow
def test_a_billion_layers_is_one_line_in_bounded_memory(tmp_path):
    """gpt-oss built its window pattern (layer_types' default) and Qwen-MoE its expert pattern for every layer
    before any bound: a MemoryError traceback under 3 GiB, the machine's memory without a limit."""
    families = ("gpt_oss", "qwen2_moe")
    for family in families:
        (tmp_path / family).mkdir()
        (tmp_path / family / "config.json").write_text(json.dumps(tiny(family, num_hidden_layers=10**9,
                                                                       layer_types=DROP)))
    done = run_tools_in_bounded_memory([["tools/convert_checkpoint.py", "from-hf", tmp_path / family,
                                         tmp_path / f"{family}-out"] for family in families], cwd=ROOT)
    for family, one in zip(families, done):
        assert one.returncode == 2, (family, one.stderr[-2000:])
        assert one.stderr.strip() == (f"{PREFIX}config.json: num_hidden_layers is 1,000,000,000, above the largest "
                                      f"this framework accepts (16,384, far beyond any published model); check the "
                                      f"value."), family
        assert not (tmp_path / f"{family}-out").exists()


FAMILY_OF = {  # each size of checks.SIZES (a KeyError below for one left out) -> a family whose config.json holds it
    **dict.fromkeys(("n_layer", "n_embd", "n_inner", "n_head", "n_positions"), "gpt2"),
    **dict.fromkeys(("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"), "llama"),
    **dict.fromkeys(("num_local_experts", "num_experts_per_tok"), "mixtral"),
    **dict.fromkeys(("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "decoder_sparse_step", "max_window_layers"), "qwen2_moe"),
    **dict.fromkeys(("n_routed_experts", "n_shared_experts", "n_group", "topk_group", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_nextn_predict_layers",
                     "num_mtp_layers", "first_k_dense_replace", "original_max_position_embeddings"), "deepseek_v3"),
    "sliding_window": "gpt_oss",
    **dict.fromkeys(("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads"), "qwen3_next"),
    **dict.fromkeys(("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size"), "nemotron_h"),
}


@pytest.mark.parametrize("key", sorted(checks.SIZES))
def test_every_size_of_every_family_is_bounded_and_named_as_the_file_names_it(tmp_path, capsys, key):
    """Each is refused above the maximum of our field of its meaning (most went on to our field's bound, named as
    ours, or were not bounded at all: n_group, sliding_window, decoder_sparse_step, max_window_layers)."""
    value = MAXIMA[checks.SIZES[key][0]] + 1
    config = tiny(FAMILY_OF[key], **{key: value})
    assert refused(tmp_path, capsys, config).startswith(f"config.json: {key} is {value:,}, above the largest this "
                                                        f"framework accepts")


@pytest.mark.parametrize("family, change, message", [
    ("deepseek_v3", {"n_group": 0}, "n_group is 0, below 1"),  # read as 1 (no groups); transformers divides by it
    ("llama", {"num_key_value_heads": 0}, "num_key_value_heads is 0, below 1"),  # read as num_attention_heads
    ("llama", {"head_dim": 0}, "head_dim is 0, below 1"),  # read as hidden_size / heads
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step is 0, below 1"),  # read as 1
    ("gpt2", {"n_inner": 0}, "n_inner is 0, below 1"),  # read as 4 x n_embd
    ("deepseek_v3", {"q_lora_rank": 0}, "q_lora_rank is 0, below 1"),
    ("qwen2_moe", {"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size is -1, below 0"),
    ("deepseek_v3", {"rope_parameters": {**YARN, "original_max_position_embeddings": 10**12}},
     "rope_parameters.original_max_position_embeddings is 1,000,000,000,000, above the largest"),
])
def test_a_size_below_what_a_model_can_have_is_one_line(tmp_path, capsys, family, change, message):
    assert refused(tmp_path, capsys, tiny(family, **change)).startswith(f"config.json: {message}")


# ---------------------------------------------------------------- types, and what transformers refuses


@pytest.mark.parametrize("family, change, message", [
    ("llama", {"hidden_size": "64"}, "config.json: hidden_size is '64', not a whole number"),
    ("llama", {"num_hidden_layers": True}, "config.json: num_hidden_layers is True, not a whole number"),
    ("llama", {"max_position_embeddings": 64.5}, "config.json: max_position_embeddings is 64.5, not a whole"),
    ("mixtral", {"num_local_experts": float("inf")}, "config.json: num_local_experts is inf, not a whole number"),
    ("llama", {"rms_norm_eps": float("nan")}, "config.json: rms_norm_eps is nan, not a finite number"),
    ("deepseek_v3", {"routed_scaling_factor": "2.5"}, "config.json: routed_scaling_factor is '2.5', not a finite"),
    ("llama", {"tie_word_embeddings": "false"}, "config.json: tie_word_embeddings is 'false', not true or false"),
    ("llama", {"hidden_act": ["silu"] * 100000}, "config.json: hidden_act is ['silu', 'silu', "),
    ("llama", {"architectures": 5}, "config.json: architectures is 5, not a list of names"),
    ("qwen2_moe", {"mlp_only_layers": [[1]]}, "config.json: mlp_only_layers is [[1]], not a list of layer numbers"),
    ("gpt_oss", {"rope_parameters": [1, 2]}, "config.json: rope_parameters is [1, 2], not a dict"),
    ("gpt_oss", {"rope_parameters": {**YARN, "factor": float("inf")}}, "rope_parameters.factor is inf, not a finite"),
    ("gpt_oss", {"rope_parameters": {**YARN, "truncate": "no"}}, "rope_parameters.truncate is 'no', not true or"),
    ("llama", {"rope_theta": -1.0, "rope_parameters": None}, "rope_parameters.rope_theta is -1.0, not a positive"),
    # what transformers refuses, or cannot run
    ("gpt_oss", {"layer_types": ["full_attention"] * 4}, "config.json's layer_types has 4 entries but "
                                                         "num_hidden_layers is 3"),
    ("llama", {"layer_types": ["full_attention"] * 100000}, "config.json's layer_types has 100,000 entries"),
    ("gpt_oss", {"layer_types": ["x" * 1000] * 3}, "config.json's layer_types must give num_hidden_layers (3) "
                                                   "entries, each 'sliding_attention' or 'full_attention'; got 3"),
    ("qwen3", {"layer_types": ["sliding_attention"] * 2}, "config.json turns Qwen3's sliding-window layers on"),
    ("deepseek_v3", {"n_group": None}, "config.json sets n_group to null"),
    ("gpt_oss", {"rope_parameters": {k: v for k, v in YARN.items() if k != "factor"}}, "config.json's "
     "rope_parameters is YaRN without its factor"),
    ("gpt_oss", {"rope_parameters": {"full_attention": YARN, "sliding_attention": YARN}}, "config.json's "
     "rope_parameters gives rotary settings per layer type (full_attention, sliding_attention)"),
    ("deepseek_v3", {"rope_parameters": {**YARN, "partial_rotary_factor": 0.5}}, "config.json sets "
     "partial_rotary_factor 0.5"),
])
def test_a_value_transformers_would_not_read_as_we_do_is_one_line(tmp_path, capsys, family, change, message):
    """Each was a traceback (a string or NaN met by arithmetic, a list as a key), read silently otherwise (a string
    for a size, 'false' for true, a null group count as 1), or a line holding the whole list."""
    assert message in refused(tmp_path, capsys, tiny(family, **change))


@pytest.mark.parametrize("raw, message", [
    ("[" * 100000 + "]" * 100000, "nests its JSON too deeply to read"),
    ('{"model_type": "llama", "x": ' + "[" * 100000 + "]" * 100000 + "}", "nests its JSON too deeply to read"),
    ("[1, 2]", "config.json holds a list, not a JSON object of settings"),
], ids=["nested", "nested-in-a-key", "a-list"])
def test_a_file_that_is_not_a_readable_object_is_one_line(tmp_path, capsys, raw, message):
    assert message in refused(tmp_path, capsys, raw=raw)


def test_a_config_json_over_64_mib_is_one_line_before_it_is_read(tmp_path, capsys):
    """A sparse file: its size is said, none of its bytes read."""
    path = tmp_path / "hf" / "config.json"
    path.parent.mkdir()
    with open(path, "wb") as f:
        f.truncate(64 * 2**20 + 1)
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"config.json: it is {64 * 2**20 + 1:,} bytes, more than any model's config.json "
                        f"({64 * 2**20:,}); check the file."), err
    assert "\n" not in err and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- two keys, one setting


@pytest.mark.parametrize("family, change, message", [
    ("gpt2", {"num_hidden_layers": 3}, "gives n_layer 2 and num_hidden_layers 3, two names of one setting"),
    ("mixtral", {"num_experts": 8}, "gives num_local_experts 4 and num_experts 8"),
    ("qwen3_moe", {"num_experts": 8}, "gives num_local_experts 4 and num_experts 8"),
    ("gpt_oss", {"num_experts": 8}, "gives num_local_experts 4 and num_experts 8"),
    ("deepseek_v3", {"num_local_experts": 16}, "gives n_routed_experts 8 and num_local_experts 16"),
    ("deepseek_v3", {"num_mtp_layers": 1}, "gives num_nextn_predict_layers 0 and num_mtp_layers 1"),
    ("gpt_oss", {"rope_theta": 10000.0}, "gives rope_theta 10000.0 beside rope_parameters and 150000.0 in it"),
    ("gpt_oss", {"partial_rotary_factor": 0.5, "rope_parameters": {**YARN, "partial_rotary_factor": 1.0}},
     "gives partial_rotary_factor 0.5 beside rope_parameters and 1.0 in it"),
    ("deepseek_v3", {"original_max_position_embeddings": 16}, "gives original_max_position_embeddings 16 beside "
                                                               "rope_parameters and 8 in it"),
    ("gpt_oss", {"rope_parameters": {**YARN, "type": "linear"}}, "gives type 'linear' and rope_type 'yarn'"),
])
def test_two_keys_of_one_setting_that_readers_take_differently_are_one_line(tmp_path, capsys, family, change,
                                                                           message):
    """Transformers takes an alias or its field by the order of the keys in the file (gpt2's num_hidden_layers over
    n_layer, deepseek's num_nextn_predict_layers over num_mtp_layers), a value beside the rope dict or in it by its
    version; the mappings took one of each."""
    assert message in refused(tmp_path, capsys, tiny(family, **change))


def test_two_keys_of_one_setting_that_agree_are_one_key_and_checking_again_changes_nothing():
    config = tiny("gpt2", num_hidden_layers=2, hidden_size=64.0)  # a whole float is the number
    once = checks.checked(config)
    assert (once["n_layer"], once["n_embd"], "num_hidden_layers" in once, type(once["n_embd"])) == (2, 64, False, int)
    exported = tiny("gpt_oss", rope_theta=150000.0, rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"})
    once = checks.checked(exported)  # our export's form for transformers 4 and 5: both keys, the same rotary
    assert once["rope_parameters"] == {**YARN} and "rope_scaling" not in once and "rope_theta" not in once
    assert checks.checked(once) == once


# ---------------------------------------------------------------- as transformers builds it


def _imported(tmp_path, config: dict):
    """(our ModelConfig imported from ``config`` with the weights transformers builds for it, transformers' config,
    its model)."""
    theirs = transformers.AutoConfig.for_model(**copy.deepcopy(config))  # it fills the rope dict it is given
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(theirs).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    state = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"
             or not theirs.tie_word_embeddings}
    assert from_hf(tmp_path, config, weights=state) == 0
    return open_checkpoint(str(tmp_path / "out"))[2].model, theirs, model


def _without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


@pytest.mark.parametrize("family, config, ours, expected", [
    # Mixtral's own defaults (epsilon 1e-5, rope_theta 1e6), not Llama's (were 1e-6, 10000)
    ("mixtral", lambda: _without(tiny("mixtral"), "rms_norm_eps", "rope_parameters", "rope_theta"),
     lambda m: (m.layernorm_epsilon, m.rotary_base), lambda t: (t.rms_norm_eps, t.rope_parameters["rope_theta"])),
    # DeepSeek-V3's query LoRA of 1536 and 8 groups of which 4 (were one query projection and no groups)
    ("deepseek_v3", lambda: _without(tiny("deepseek_v3", n_routed_experts=16, num_experts_per_tok=8), "q_lora_rank",
                                     "n_group", "topk_group"),
     lambda m: (m.q_lora_rank, m.moe_router_num_groups, m.moe_router_group_topk),
     lambda t: (t.q_lora_rank, t.n_group, t.topk_group)),
    # Qwen3's 32 key/value heads of 128 channels (were one per query head, hidden_size / heads wide)
    ("qwen3", lambda: _without(tiny("qwen3", num_attention_heads=32), "num_key_value_heads", "head_dim"),
     lambda m: ((m.num_query_groups or m.num_attention_heads) if m.group_query_attention else m.num_attention_heads,
                m.kv_channels), lambda t: (t.num_key_value_heads, t.head_dim)),
    # gpt-oss with an empty rope_parameters: plain rope at its rope_theta (was its default YaRN)
    ("gpt_oss", lambda: tiny("gpt_oss", rope_parameters={}),
     lambda m: (m.position_embedding_type, m.rotary_base),
     lambda t: ({"default": "rope"}[t.rope_parameters["rope_type"]], t.rope_parameters["rope_theta"])),
], ids=["mixtral-defaults", "deepseek-defaults", "qwen3-defaults", "gpt-oss-empty-rope"])
def test_a_key_left_out_is_transformers_default_for_the_family(tmp_path, family, config, ours, expected):
    model_cfg, theirs, _ = _imported(tmp_path, config())
    assert ours(model_cfg) == expected(theirs)


def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_builds_the_model(tmp_path):
    """transformers 5 builds the model from rope_scaling (YaRN x8 over 16 positions) and ignores rope_parameters (x4
    over 32): the import was built from the latter, its logits far from transformers'."""
    from tests.functional.test_hf_llama import VOCAB, our_logits, tokens

    config = tiny("gpt_oss", vocab_size=VOCAB, rope_scaling={**YARN, "factor": 8.0,
                                                             "original_max_position_embeddings": 16})
    model_cfg, theirs, model = _imported(tmp_path, config)
    assert (theirs.rope_parameters["factor"], theirs.rope_parameters["original_max_position_embeddings"]) == (8.0, 16)
    assert (model_cfg.rotary_scaling_factor, model_cfg.original_max_position_embeddings) == (8.0, 16)
    _, _, ours_config = open_checkpoint(str(tmp_path / "out"))
    ids = tokens()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(our_logits(ours_config, tmp_path / "out", ids)[..., :VOCAB], expected, rtol=0,
                               atol=1e-5)


def test_our_defaults_are_transformers_own():
    """Every default of checks.DEFAULTS is its family's transformers class default (a field's, else the attribute a
    config built without it has), and its rope_theta the class's default_theta."""
    from megatron.checkpoint.hf.config_checks import FAMILIES

    for family, defaults in checks.DEFAULTS.items():
        cls = getattr(transformers, TINY[family][0])
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        built = cls()
        for key, value in defaults.items():
            if key == "default_theta":
                assert cls.default_theta == value, family
            elif key == "rope_parameters":
                assert _without(built.rope_parameters, "rope_theta") == value, family
            else:
                assert (fields[key] if key in fields else getattr(built, key)) == value, (family, key)
        assert family in FAMILIES


# ---------------------------------------------------------------- YaRN's factor and betas


@pytest.mark.parametrize("change, message", [
    ({"factor": 0.5}, "config.json: rope_parameters.factor 0.5 is below 1: YaRN extends the original context by "
                      "this factor"),
    ({"beta_fast": 1.0, "beta_slow": 32.0}, "config.json: rope_parameters.beta_fast 1.0 is below "
                                            "rope_parameters.beta_slow 32.0"),
])
def test_a_yarn_factor_below_1_or_swapped_betas_in_a_config_json_is_one_line(tmp_path, capsys, change, message):
    """transformers only warns ('must be ... >= 1', 'must be greater than beta_slow') and builds the model."""
    assert refused(tmp_path, capsys, tiny("gpt_oss", rope_parameters={**YARN, **change})).startswith(message)


@pytest.mark.parametrize("flags, message", [
    (["--rotary-scaling-factor", "0.5"], "rotary_scaling_factor 0.5 is below 1: YaRN extends the original context"),
    (["--yarn-beta-fast", "1", "--yarn-beta-slow", "32"], "yarn_beta_fast 1.0 is below yarn_beta_slow 32.0"),
])
def test_our_yarn_flags_refuse_them_too(flags, message):
    yarn = ["--position-embedding-type", "yarn", "--original-max-position-embeddings", "32"]
    validate(valid_config(*yarn, "--rotary-scaling-factor", "1", "--yarn-beta-fast", "4", "--yarn-beta-slow", "4"))
    with pytest.raises(ConfigError, match="^" + message):
        validate(valid_config(*yarn, *flags))
