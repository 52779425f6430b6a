"""FP8 training: the checks of its settings (part of ``validate``). What runs is ``megatron/tensor_parallel/fp8.py``;
whether the GPU has FP8 tensor cores is asked at start-up (``megatron.device.fp8_problem``), on every rank."""

from __future__ import annotations

from megatron.config.cli import fail as _fail
from megatron.config.megatron_flags import fp8_recipe_refusal
from megatron.config.schema import Config
from megatron.config.schema_model import attention_shape
from megatron.config.validate_moe import moe_layer_flags


def check_fp8_settings(config: Config, cuda_available: bool, warnings: list[str]) -> None:
    """First of all the checks: a CPU run, or a recipe not built, is refused before anything else is said."""
    mp = config.mix_precision
    if mp.fp8_amax_history_len < 1:
        _fail(f"fp8_amax_history_len must be at least 1, got {mp.fp8_amax_history_len}.")
    if mp.fp8_format is not None and (config.device or ("gpu" if cuda_available else "cpu")) == "cpu":
        _fail("--fp8-format needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
              "Blackwell); on the CPU torch's FP8 matmul is emulated and slower than bf16: drop --fp8-format (bf16 "
              "trains the same model; --fp8-format none where a YAML file or a resumed run sets it).")
    if mp.fp8_param_gather:  # with FP8 or without: never a default, and never built
        _fail("--fp8-param-gather is not built here (ZeRO gathers parameters in the training dtype); drop it.")
    if mp.fp8_format is None:
        if fp8_recipe_refusal(mp.fp8_recipe) and mp.fp8_recipe != "delayed":  # delayed: Megatron-LM's default, unused
            _fail(fp8_recipe_refusal(mp.fp8_recipe))
        return
    if fp8_recipe_refusal(mp.fp8_recipe):
        _fail(fp8_recipe_refusal(mp.fp8_recipe))
    if (mp.fp8_amax_history_len, mp.fp8_amax_compute_algo) != (1, "most_recent"):
        warnings.append("--fp8-amax-history-len and --fp8-amax-compute-algo shape delayed scaling's history; under "
                        "--fp8-recipe tensorwise each tensor is scaled by its own amax and they have no effect.")


def check_fp8_sizes(config: Config) -> None:
    """After the batch sizes and the model's widths are resolved: ``torch._scaled_mm`` wants multiples of 16."""
    mp, m, d = config.mix_precision, config.model, config.distributed
    if mp.fp8_format is None:
        return
    tp, cp = d.mp_degree, d.context_parallel_size
    nq, ng, hd = attention_shape(m)
    widths = {"hidden_size": m.hidden_size,
              "the tokens of a micro-batch (micro_batch_size x max_seq_len / context_parallel_size)":
                  config.batch_size.micro_batch_size * config.dataset.max_seq_len // cp}
    if not all(moe_layer_flags(m)):  # a dense MLP somewhere
        widths["ffn_hidden_size / mp_degree"] = m.ffn_hidden_size // tp  # resolved by _check_model
    if m.multi_latent_attention:  # its projections (megatron/model/mla.py)
        widths.update({"kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank or 16,
                       "the queries' width / mp_degree": nq * (m.qk_head_dim + m.qk_pos_emb_head_dim) // tp,
                       "the keys' and values' up-projection / mp_degree": nq * (m.qk_head_dim + m.v_head_dim) // tp,
                       "the values' width / mp_degree": nq * m.v_head_dim // tp})
    else:
        widths.update({"the attention heads' width / mp_degree": nq * hd // tp,
                       "the query-key-value width / mp_degree": (nq + 2 * ng) * hd // tp})
    if m.moe_shared_expert_intermediate_size:
        widths["moe_shared_expert_intermediate_size / mp_degree"] = m.moe_shared_expert_intermediate_size // tp
    for what, size in widths.items():
        if size % 16:
            _fail(f"--fp8-format: FP8 matmuls need sizes that are multiples of 16, and {what} is {size}; change "
                  f"the model or the batch, or drop --fp8-format.")
