"""Per-rank model-state memory of a configuration, before launching it.

    python tools/estimate_memory.py -c examples/configs/gpt_175b_mp8_pp16.yaml
    python tools/estimate_memory.py --num-layers 24 --hidden-size 2048 --bf16 --sharding 8

Takes the same configuration as pretrain_gpt.py. Prints, for each pipeline stage, the bytes of
parameters, fp32 gradients, fp32 master weights and AdamW states one rank holds between steps,
and how much of it is on the device and on the CPU (offload); see megatron/optimizer/memory.py
for the rules. Activations are not included.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint import CheckpointError, resumed_config  # noqa: E402
from megatron.config import ConfigError, validate  # noqa: E402
from megatron.optimizer.memory import model_state_bytes, parameters_per_rank  # noqa: E402
from megatron.tokenizer import TokenizerError, configured_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    try:
        config = resumed_config(argv)  # as pretrain_gpt.py: over a resumed run's saved configuration
        d = config.distributed
        world = (d.dp_degree or 1) * d.mp_degree * d.pp_degree * d.sharding.sharding_degree
        tokenizer = configured_tokenizer(config.tokenizer, config.model.vocab_size)
        validate(config, world_size=world, cuda_available=config.device == "gpu",
                 tokenizer_vocab_size=None if tokenizer is None else tokenizer.vocab_size)
    except (ConfigError, CheckpointError, TokenizerError) as err:
        print(f"estimate_memory.py: error: {err}", file=sys.stderr)
        return 2
    precision = "bf16" if config.mix_precision.bf16 else "fp16" if config.mix_precision.use_pure_fp16 else "fp32"
    sharding = d.sharding.sharding_degree
    print(f"tp {d.mp_degree} x pp {d.pp_degree} x dp {d.dp_degree} x sharding {sharding} (stage "
          f"{d.sharding.sharding_stage}), {precision}; GiB per rank:")
    print(f"{'stage':>5} {'params (M)':>11} {'parameters':>11} {'gradients':>10} {'master':>8} {'AdamW':>8} "
          f"{'device':>8} {'CPU':>8}")
    for stage in range(d.pp_degree):
        n = parameters_per_rank(config, d.mp_degree, d.pp_degree, stage)
        b = model_state_bytes(n, precision, sharding, d.sharding.sharding_stage, d.sharding.sharding_offload)
        gib = [x / 2**30 for x in (b.parameters, b.gradients, b.master_weights, b.optimizer_states, b.device_total,
                                   b.cpu_total)]
        print(f"{stage:>5} {n / 1e6:>11.1f} {gib[0]:>11.2f} {gib[1]:>10.2f} {gib[2]:>8.2f} {gib[3]:>8.2f} "
              f"{gib[4]:>8.2f} {gib[5]:>8.2f}")
    if d.sharding.sharding_offload:
        print("master weights and AdamW states (and a copy of the gradient shard) are on the CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
