"""One parallel layout of the planner: its name in the table, its pretrain_gpt.py flags, and the configuration it
makes. The name and the flags say the same numbers: ``zero3x2`` is ``--sharding 2 --sharding-stage 3``, the
sharding degree the flag sets (under cp > 1 the shards also span the cp ranks, ``Config.zero_shards``: the run
decides that from the flag, and the name keeps to the flag's number)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

from megatron.config import Config
from megatron.distributed.sharding_rule import sharding_stage

# The axes a layout is made of, as ``--only`` / ``--exclude`` name them (``Layout.axes``).
AXES = ("tp", "cp", "cp-comm", "pp", "vpp", "dp", "sharding", "zero", "offload", "recompute", "mb", "ep", "etp")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int
    dp: int
    sharding_degree: int
    sharding_stage: int
    offload: bool
    recompute: str  # off, core_attn, only_attn, full, or block: full on block_layers of each model chunk
    micro_batch_size: int
    sequence_parallel: bool = False
    block_layers: int = 0
    cp: int = 1  # context-parallel size
    cp_comm: str = "p2p"  # its communication type (p2p with cp 1)
    ep: int = 1  # expert-parallel size (a MoE model)
    etp: int = 0  # the experts' tensor-parallel size; 0: tp's
    moe: bool = False  # a MoE model: its flags name ep and etp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def zero(self) -> int:
        """The ZeRO stage of the optimizer, 0 when it is not sharded (sharding degree 1)."""
        return self.sharding_stage if self.sharding_degree > 1 else 0

    def axes(self) -> dict[str, int | str]:
        """The value of each of ``AXES``: what ``--only`` and ``--exclude`` compare (offload ``on`` / ``off``,
        recompute ``block`` for a block recompute, etp the experts' tensor-parallel size itself)."""
        return {"tp": self.tp, "cp": self.cp, "cp-comm": self.cp_comm, "pp": self.pp, "vpp": self.vpp, "dp": self.dp,
                "sharding": self.sharding_degree, "zero": self.zero, "offload": "on" if self.offload else "off",
                "recompute": self.recompute, "mb": self.micro_batch_size, "ep": self.ep, "etp": self.expert_tp}

    def describe(self) -> str:
        """``tp2 cp2:p2p pp4 vpp2 dp1 ep4 etp1 zero2x4 offload mb1 rc:full``: what is not the default is named
        (``zero2x4``: stage 2 with ``--sharding 4``)."""
        parts = [f"tp{self.tp}"] + ([f"cp{self.cp}:{self.cp_comm}"] if self.cp > 1 else []) + [f"pp{self.pp}"]
        parts += ([f"vpp{self.vpp}"] if self.vpp > 1 else []) + [f"dp{self.dp}"]
        parts += ([f"ep{self.ep}"] if self.ep > 1 else []) + ([f"etp{self.etp}"] if self.etp else [])
        if self.sharding_degree > 1:
            parts.append(f"zero{self.sharding_stage}x{self.sharding_degree}")
        if self.offload:
            parts.append("offload")
        parts.append(f"mb{self.micro_batch_size}")
        if self.recompute != "off":
            parts.append("rc:" + (f"block{self.block_layers}" if self.recompute == "block" else self.recompute))
        return " ".join(parts)

    def flags(self) -> str:
        """The command-line flags of pretrain_gpt.py that run this layout, given after the configuration's own
        (``-c config.yaml FLAGS``): every setting of the layout is explicit, the ones it turns off too (a
        configuration's ``use_recompute: True`` or ``sharding_degree: 8`` would otherwise stay)."""
        out = [f"--tp {self.tp}", f"--context-parallel-size {self.cp}"]
        out += [f"--cp-comm-type {self.cp_comm}"] if self.cp > 1 else []
        out += [f"--pp {self.pp}", f"--vpp {self.vpp}", f"--dp {self.dp}"]
        if self.moe:
            out.append(f"--expert-model-parallel-size {self.ep} --expert-tensor-parallel-size {self.expert_tp}")
        out.append(f"--sharding {self.sharding_degree}"
                   + (f" --sharding-stage {self.sharding_stage}" if self.sharding_degree > 1 else ""))
        out += ["--sharding-offload" if self.offload else "--no-sharding-offload"]
        out += ["--sequence-parallel" if self.sequence_parallel else "--no-sequence-parallel"]
        out.append(f"--micro-batch-size {self.micro_batch_size}")
        if self.recompute == "block":
            out.append(f"--use-recompute --recompute-granularity full --recompute-method block "
                       f"--recompute-num-layers {self.block_layers}")
        elif self.recompute != "off":
            out.append(f"--use-recompute --recompute-granularity {self.recompute}")
        else:
            out.append("--no-use-recompute")
        return " ".join(out)

    def apply(self, base: Config) -> Config:
        """A copy of ``base`` (not validated) with this layout; the global batch and the rest kept."""
        c = copy_config(base)
        d, b = c.distributed, c.batch_size
        d.mp_degree, d.pp_degree, d.virtual_pp_degree, d.dp_degree = self.tp, self.pp, self.vpp, self.dp
        d.sharding.sharding_degree, d.sharding.sharding_stage = self.sharding_degree, self.sharding_stage
        d.sharding.sharding_offload, d.use_distributed_optimizer = self.offload, False
        d.sequence_parallel = self.sequence_parallel
        d.context_parallel_size, d.cp_comm_type = self.cp, self.cp_comm
        d.expert_model_parallel_size, d.expert_tensor_parallel_size = self.ep, self.etp or None
        b.local_batch_size, b.micro_batch_size = None, self.micro_batch_size
        c.use_recompute = self.recompute != "off"
        c.recompute_granularity = None if self.recompute == "off" else "full" if self.recompute == "block" \
            else self.recompute
        c.recompute_method = "block" if self.recompute == "block" else None
        c.recompute_num_layers = self.block_layers if self.recompute == "block" else None
        c.no_recompute_layers = None
        c.device = "gpu"
        return c


def copy_config(config):
    """A copy of a Config whose sections and lists are new objects (the leaves are immutable): a
    deepcopy's result at a fraction of its cost, which dominates a planning run. A schema dataclass is a plain
    ``__dict__`` (no slots, no ``__copy__``): copied as ``copy.copy`` would, at a third of its cost."""
    new = object.__new__(type(config))
    new.__dict__.update(config.__dict__)
    sections, lists = _nested_fields(type(config))
    for name in sections:
        setattr(new, name, copy_config(getattr(config, name)))
    for name in lists:
        value = getattr(config, name)
        if isinstance(value, list):  # (a field of one value or a list: moe_aux_loss_coeff)
            setattr(new, name, list(value))
    return new


@functools.cache
def _nested_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The section fields and the list-valued fields of a schema dataclass."""
    return (tuple(f.name for f in fields(cls) if "section" in f.metadata),
            tuple(f.name for f in fields(cls) if str(f.type).startswith("list")))


def configured_layout(config: Config) -> Layout:
    """The layout a validated configuration runs (recompute in the planner's terms; a uniform recompute
    of several layers per unit is counted as ``full``)."""
    d, g = config.distributed, config.recompute_granularity if config.use_recompute else None
    block = config.recompute_num_layers if g == "full" and config.recompute_method == "block" else 0
    recompute = "off" if g is None else "block" if block else "only_attn" if g == "full_attn" else g
    n, cp = d.sharding.sharding_degree, d.context_parallel_size
    etp = d.expert_tensor_parallel_size
    return Layout(d.mp_degree, d.pp_degree, d.virtual_pp_degree, d.dp_degree, n,
                  sharding_stage(n, d.sharding.sharding_stage), d.sharding.sharding_offload, recompute,
                  config.batch_size.micro_batch_size, d.sequence_parallel and d.mp_degree > 1, block, cp,
                  d.cp_comm_type if cp > 1 else "p2p", d.expert_model_parallel_size,
                  0 if etp in (None, d.mp_degree) else etp, bool(config.model.num_experts))
