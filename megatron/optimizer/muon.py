"""Muon: momentum SGD whose update of a matrix is its momentum orthogonalised (Jordan et al. 2024), as Megatron-LM's
``--optimizer muon`` steps it (``megatron/core/optimizer/muon.py`` over NVIDIA's emerging_optimizers 0.1.0).

Which parameters: every 2-D parameter but the word embedding and the output layer (Megatron's
``is_embedding_or_output_parameter``): the attention and MLP matrices, the experts', the router's, multi-latent
attention's projections, multi-token prediction's ``eh_proj``, and learned absolute position embeddings. Everything
else (the word embedding, the output layer, norms, biases) is AdamW's, at the same learning rate and schedule.

One step of a matrix ``W`` (fp32 master) with gradient ``G`` and momentum ``M``, at ``lr`` and weight decay ``wd``::

    W <- W - lr wd W                        decoupled weight decay
    M <- beta M + (1 - beta) G              (``lerp``)
    U <- (1 - beta) G + beta M  if Nesterov, else M
    W <- W - lr  s(out, in)  f  NS(U)       s: the scale mode; f: muon_extra_scale_factor

``NS(U)`` (``newton_schulz``): ``X = U / ||U||_F`` (on the wider orientation: transposed when ``out > in``), then
``steps`` times ``X <- a X + (b A + c A A) X`` with ``A = X X^T`` and ``(a, b, c)`` the quintic coefficients in a
cycle of five; in bf16 at precision medium. A fused QKV weight (rows ``[groups, q | k | v, in]``) is orthogonalised
per block: every group's queries together, the keys, the values (``muon_split_qkv``).

Tensor parallelism (``orthogonalize``): a matrix cut over the group along ``partition_dim`` is orthogonalised
``blockwise`` (each rank its own block, scaled by the block's shape: not the one-process update), ``duplicated``
(the blocks all-gathered, the whole orthogonalised on every rank, this rank's block kept: the one-process update),
or ``distributed`` (the whole, its Frobenius norm and Gram matrices ``X X^T`` all-reduced over the group: the
one-process update up to rounding).

ZeRO (``Muon.step``): the elementwise part runs on this rank's slice of the buffer; the update ``U`` of every bucket
holding a Muon matrix is all-gathered over the bucket's sharding group, each rank orthogonalises the matrices its
slice touches and applies its part. The update equals the unsharded one exactly (docs/architecture.md).
"""

from __future__ import annotations

import re
from collections import ChainMap
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.optimizer.param_groups import is_embedding_or_output
from megatron.tensor_parallel.mappings import _all_gather_flat

# The quintic coefficient sets (a, b, c), used in a cycle (emerging_optimizers' "quintic", from modded-nanogpt)
QUINTIC = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
EPS = 1e-7  # the Frobenius norm's floor
_QKV = re.compile(r"(^|\.)self_attention\.query_key_value\.weight$")


def is_muon_param(name: str, param: nn.Parameter) -> bool:
    """Whether Megatron's Muon steps ``param`` (named ``name`` in its model chunk): a 2-D parameter other than
    the word embedding and the output layer (and Gated DeltaNet's convolution, 3-D ``[C, 1, K]`` in Megatron Core,
    stored ``[C, K]`` here: AdamW's)."""
    return param.dim() == 2 and not is_embedding_or_output(name) and not name.endswith("conv1d_weight")


def is_qkv_param(name: str) -> bool:
    return bool(_QKV.search(name))


@contextmanager
def matmul_precision(precision: str):
    """torch's fp32 matmul precision for the Newton-Schulz iteration (emerging_optimizers' context): ``high``
    (TF32 on GPUs) or ``medium``; ``low``, which torch ignores, leaves the current setting."""
    before = torch.get_float32_matmul_precision()
    if precision in ("high", "medium"):
        torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def newton_schulz(x: torch.Tensor, steps: int, precision: str = "medium", group: dist.ProcessGroup | None = None,
                  transpose: bool | None = None) -> torch.Tensor:
    """The orthogonalisation ``~ U V^T`` of ``x`` [m, n] fp32 (``x = U S V^T``), by ``steps`` quintic
    Newton-Schulz iterations on ``x / ||x||_F`` (``transpose`` None: iterate on the orientation whose Gram matrix
    is the smaller). ``precision`` medium: the iterations in bf16. ``group``: ``x`` is this rank's block of a
    matrix cut along the dimension ``transpose`` leaves as columns; its squared norm and every Gram matrix
    ``X X^T`` are all-reduced over the group (emerging_optimizers' distributed mode)."""
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    if group is None:
        X = F.normalize(x, p=2, dim=(-2, -1), eps=EPS)
    else:
        squares = (x * x).sum()
        dist.all_reduce(squares, group=group)
        X = x / torch.sqrt(squares).clamp_min(EPS)
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)  # torch has no fp32-in, bf16-compute kernel: bf16 in and out, as theirs
    for i in range(steps):
        a, b, c = QUINTIC[i % len(QUINTIC)]
        A = X @ X.mT
        if group is not None:
            dist.all_reduce(A, group=group)
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """The update's scale for a ``rows x cols`` matrix (emerging_optimizers' ``get_muon_scale_factor``)."""
    if mode == "shape_scaling":  # Jordan's
        return max(1, rows / cols) ** 0.5
    if mode == "spectral":  # Kimi's (Moonlight): AdamW's learning rates carry over
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":  # Scion's, Bernstein's
        return (rows / cols) ** 0.5
    raise ValueError(f"unknown Muon scale mode {mode!r}")


@dataclass(frozen=True)
class MuonSettings:
    """What a Muon step needs of the configuration (``from_config``)."""

    momentum: float = 0.9
    nesterov: bool = False
    steps: int = 5
    precision: str = "medium"
    scale_mode: str = "spectral"
    extra_scale: float = 1.0
    tp_mode: str = "blockwise"
    qkv_split: tuple[int, int, int] | None = None  # rows of a group's (queries, key, value); None: not split

    @classmethod
    def from_config(cls, config) -> MuonSettings:
        from megatron.config.schema_model import attention_shape

        m = config.optimizer.muon
        nq, ng, hd = attention_shape(config.model)
        return cls(m.muon_momentum, m.muon_use_nesterov, m.muon_num_ns_steps, m.muon_fp32_matmul_prec,
                   m.muon_scale_mode, m.muon_extra_scale_factor, m.muon_tp_mode,
                   (nq // ng * hd, hd, hd) if m.muon_split_qkv else None)


def orthogonalize(u: torch.Tensor, settings: MuonSettings, is_qkv: bool = False, partition_dim: int | None = None,
                  group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The scaled orthogonalised update of ``u``, this rank's block [out, in] of a matrix cut over ``group`` along
    ``partition_dim`` (None or no group: the whole matrix), by the tensor-parallel mode of ``settings``."""
    size = dist.get_world_size(group) if group is not None and partition_dim is not None else 1
    with matmul_precision(settings.precision):
        if size > 1 and settings.tp_mode == "duplicated":
            blocks = [torch.empty_like(u) for _ in range(size)]
            dist.all_gather(blocks, u.contiguous(), group=group)
            whole = _orthogonalize(torch.cat(blocks, dim=partition_dim), settings, is_qkv, None, None, 1)
            return whole.chunk(size, dim=partition_dim)[dist.get_rank(group)]
        if size > 1 and settings.tp_mode == "distributed":
            return _orthogonalize(u, settings, is_qkv, partition_dim, group, size)
        return _orthogonalize(u, settings, is_qkv, None, None, 1)


def _orthogonalize(u: torch.Tensor, settings: MuonSettings, is_qkv: bool, partition_dim: int | None,
                   group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    def one(block: torch.Tensor) -> torch.Tensor:
        shape = list(block.shape)
        if group is not None:
            shape[partition_dim] *= size
        transpose = None if group is None else partition_dim == 0
        orth = newton_schulz(block, settings.steps, settings.precision, group, transpose)
        return orth * scale_factor(shape[0], shape[1], settings.scale_mode) * settings.extra_scale

    if not (is_qkv and settings.qkv_split):
        return one(u)
    split, cols = settings.qkv_split, u.shape[-1]
    groups = u.shape[0] // sum(split)
    parts = torch.split(u.view(groups, sum(split), cols), list(split), dim=1)
    return torch.cat([one(p.reshape(-1, cols)).view(groups, -1, cols) for p in parts], dim=1).view(u.shape)


@dataclass
class MuonMatrix:
    """A Muon parameter of a bucket: its place ``[start, end)`` in the buffer and how it is orthogonalised."""

    param: nn.Parameter
    start: int
    end: int
    is_qkv: bool
    partition_dim: int | None
    group: dist.ProcessGroup | None  # its tensor-parallel group (an expert's: etp); None: one rank


class Muon:
    """Muon over flat fp32 master pieces, each ``(master, bucket, lo, hi)``: this rank's ``[lo, hi)`` of a bucket,
    holding (parts of) ``matrices`` only. The interface of ``adamw.AdamW``: ``param_groups`` (``lr``,
    ``weight_decay``), ``state`` (per master: ``step``, ``momentum_buffer``), ``state_for``, ``step``."""

    def __init__(self, pieces: list[tuple], decays: list[bool], matrices: list[MuonMatrix], buckets: list,
                 settings: MuonSettings, weight_decay: float, device: torch.device):
        self.settings, self.device, self.state = settings, device, {}
        self.pieces = {id(master): (bucket, lo, hi) for master, bucket, lo, hi in pieces}
        groups = [{"params": [p[0] for p, d in zip(pieces, decays) if d == decay], "lr": 0.0,
                   "weight_decay": weight_decay if decay else 0.0, "decays": decay} for decay in (True, False)]
        self.param_groups = [g for g in groups if g["params"]]
        # (bucket, the matrices this rank's slice touches, its master pieces) for every bucket holding a matrix, on
        # every rank of its sharding group alike (the gather is a collective), in buffer order
        self.buckets = []
        for bucket in buckets:
            inside = [m for m in matrices if bucket.start <= m.start < bucket.end]
            if inside:
                mine = [m for m in inside if m.start < bucket.shard[1] and m.end > bucket.shard[0]]
                self.buckets.append((bucket, mine, [p[0] for p in pieces if p[1] is bucket]))

    def state_for(self, master: torch.Tensor, step: float = 0.0) -> dict:
        state = self.state.get(master)
        if state is None:
            state = self.state[master] = {
                "step": torch.tensor(float(step), dtype=torch.float32, device=master.device),
                "momentum_buffer": torch.zeros_like(master)}
        return state

    @torch.no_grad()
    def step(self) -> None:
        """Decay, momentum and the (Nesterov) update on this rank's slices; the updates of each bucket gathered,
        orthogonalised matrix by matrix, and applied to this rank's slices."""
        beta, hyper = self.settings.momentum, {}
        updates = {}
        for group in self.param_groups:
            for master in group["params"]:
                hyper[id(master)] = (group["lr"], group["weight_decay"])
                state = self.state_for(master)
                state["step"] += 1
                lr, wd = hyper[id(master)]
                if wd != 0:
                    master.add_(master, alpha=-wd * lr)
                momentum = state["momentum_buffer"]
                momentum.lerp_(master.grad, 1 - beta)
                updates[id(master)] = master.grad.lerp(momentum, beta) if self.settings.nesterov else momentum
        for bucket, matrices, masters in self.buckets:
            whole = self._gathered(bucket, [(self.pieces[id(m)], updates[id(m)]) for m in masters])
            for matrix in matrices:
                u = whole[matrix.start - bucket.start:matrix.end - bucket.start].view(matrix.param.shape)
                orth = orthogonalize(u, self.settings, matrix.is_qkv, matrix.partition_dim, matrix.group).flatten()
                for master in masters:
                    _, lo, hi = self.pieces[id(master)]
                    a, b = max(lo, matrix.start), min(hi, matrix.end)
                    if a < b:
                        part = orth[a - matrix.start:b - matrix.start].to(master.device)
                        master[a - lo:b - lo].add_(part, alpha=-hyper[id(master)][0])

    def _gathered(self, bucket, updates: list[tuple]) -> torch.Tensor:
        """The bucket's whole update (zero outside the Muon pieces): this rank's shard written, all-gathered over
        the bucket's sharding group."""
        a, b = bucket.shard
        shard = torch.zeros(b - a, dtype=torch.float32, device=self.device)
        for (_, lo, hi), update in updates:
            shard[lo - a:hi - a].copy_(update)
        group = bucket.groups.sharding if getattr(bucket, "groups", None) is not None else None
        if group is None or dist.get_world_size(group) == 1:
            return shard
        whole = torch.empty(bucket.end - bucket.start, dtype=torch.float32, device=self.device)
        _all_gather_flat(whole, shard, group=group)
        return whole


class ChainedInner:
    """AdamW and Muon as the one inner optimizer the mixed-precision optimizer and the checkpoints see: their
    param groups in one list, their states in one mapping, ``state_for`` by owner, one ``step``."""

    def __init__(self, adamw, muon: Muon):
        self.adamw, self.muon = adamw, muon
        self.param_groups = adamw.param_groups + muon.param_groups
        self.state = ChainMap(adamw.state, muon.state)
        self._muon_masters = {id(m) for g in muon.param_groups for m in g["params"]}

    def state_for(self, param: torch.Tensor, step: float = 0.0) -> dict:
        owner = self.muon if id(param) in self._muon_masters else self.adamw
        return owner.state_for(param, step)

    def step(self) -> None:
        self.adamw.step()
        self.muon.step()


def muon_matrices(buffer, tp_group: dist.ProcessGroup | None, etp_group: dist.ProcessGroup | None) -> list[MuonMatrix]:
    """The Muon parameters of ``buffer`` (``is_muon_param`` by their names in the model chunk), in buffer order,
    each with its tensor-parallel cut (an expert's over ``etp_group``, any other's over ``tp_group``)."""
    matrices = []
    for span, bucket in zip(buffer.layout.buckets, buffer.buckets):
        for named, (param, start, end) in zip(span.params, bucket.params):
            if is_muon_param(named.name, param):
                cut = getattr(param, "tensor_model_parallel", False)
                group = etp_group if getattr(param, "expert_parallel", False) else tp_group
                matrices.append(MuonMatrix(param, start, end, is_qkv_param(named.name),
                                           param.partition_dim if cut else None, group if cut else None))
    return matrices


def cut_pieces(pieces: list[tuple], matrices: list[MuonMatrix]) -> list[tuple]:
    """``pieces`` (bucket, lo, hi, decay) cut where the parameters change from Muon's to AdamW's: (bucket, lo, hi,
    decay, muon); padding goes with the run before it."""
    starts = {m.start: m.end for m in matrices}
    out = []
    for bucket, lo, hi, decay in pieces:
        runs: list[list] = []
        for _, start, end in bucket.params:
            a, b = max(start, lo), min(end, hi)
            if a >= b:
                continue
            muon = starts.get(start) == end
            if runs and runs[-1][2] == muon:
                runs[-1][1] = b
            else:
                runs.append([a, b, muon])
        if not runs:
            out.append((bucket, lo, hi, decay, False))
            continue
        runs[0][0], runs[-1][1] = lo, hi
        for (a, _, muon), nxt in zip(runs, runs[1:] + [None]):
            out.append((bucket, a, nxt[0] if nxt else hi, decay, muon))
    return out
