"""Activation memory of a mixture-of-experts layer (``megatron.moe``) on one rank: what its forward saves for
the backward in place of the MLP's ``fc1 input`` and ``mlp`` terms, and the token dispatch's buffers.

Routing is assumed UNIFORM: each of the E experts gets ``k T / E`` of the (token, expert) pairs of the ``T``
tokens routed (dropless; a capacity factor f caps an expert at ``ceil(k T / E x f)``). The saved bytes of the
experts depend only on the total rows they compute, so at ep 1 the figure is exact whatever the routing; with
expert parallelism a rank's experts compute on ``k T etp`` rows on average, more on a rank whose experts are
popular (the sum over the ep ranks is exact).

Sizes on one rank (``megatron.memory.activations`` notation; ``T`` tokens routed by this rank's router, ``k``
top-k, ``E`` experts, ``r`` bytes of the router dtype (4 fp32, 8 fp64), ``d`` activation bytes, ``etp`` the
experts' tensor-parallel size, ``f_e = moe_ffn_hidden_size / etp``, ``f_s`` the shared expert's width / tp):

- the tokens routed: every tensor-parallel rank routes its own share, ``T = n / tp`` (its sequence shard under
  sequence parallelism; without it the layer cuts the sequence itself), and its experts compute on ``R = k T
  etp`` rows (the pairs the ep ranks send them, gathered over etp; uniform routing);
- ``router input``: the norm's output the router's matmul keeps when it is in the router dtype (``T h d``;
  under tp without sp the share is a view of the whole output, ``n h d``), else its copy ``T h r`` and the
  weight's ``r E h``;
- ``router``: softmax (default) the top-k indices (int64, ``8 T k``) and the softmax of the top k logits
  (``r T k``); ``pre_softmax`` the softmax over all experts (``r T E``) and the indices; sigmoid the scores
  (``r T E``), the indices and, for k > 1, the chosen scores and their sums (``r T k + r T``). Group-limited
  routing (``G`` groups, each token's best ``g``) adds the indices of each group's top ``k / g`` (``8 T G k / g``)
  and of the groups (``8 T g``) and the bool mask of the experts outside them (``T E``). The balancing loss
  (only with a coefficient): the full score distribution (``r T E``; sigmoid's normalised, with its sums
  ``r T``), its top-k indices (``8 T k``: the choice the loss counts, without the expert bias) and the counts
  (``r E``; per sequence ``r b E``); the z-loss the logits and their log-sum-exp
  (``r T E + r T``); the auxiliary loss the layer's output keeps (``r``);
- ``dispatch indices``: alltoall the (expert, token) indices of this rank's ``k T`` pairs (int64, ``16 k T``)
  and, when chunks from several ranks arrive for several local experts, their expert-major order (``8 R``);
  allgather (at any ep) the indices of the gathered pairs of this rank's experts and their shifted expert ids
  (``24 R``);
- ``expert inputs``: the rows sorted by expert, ``R h d``;
- ``experts``: GELU ``2 R f_e d`` (fc1 output, GELU output), SwiGLU ``4 R f_e d``;
- ``expert outputs (reordered)``: alltoall with that order, the outputs put back in arrival order (``R h d``);
- ``combine``: the pairs' outputs back on this rank (alltoall ``k T``, allgather ``R``) in fp32 and their
  probability-weighted copy (``8 h`` per pair) and the probabilities in fp32 (``4`` per pair);
- ``shared expert``: its input (the norm output, when not the router's already: ``n' h d``) and ``2 n f_s d``
  (GELU) or ``4 n f_s d`` (SwiGLU).

Temporaries (``dispatch_temporary_bytes``), with expert parallelism only: the all-to-all's send and receive
buffers of the tokens (``R h d`` each way) and of the experts' output (the same); the allgather dispatcher
gathers every token of the ep x etp group (``T ep etp h d``) and reduce-scatters their output (the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.config.schema import Config
from megatron.config.validate_moe import balancing_coefficients
from megatron.memory.model_states import expert_grid

ROUTER_BYTES = {None: 4, "fp32": 4, "fp64": 8}


@dataclass(frozen=True)
class MoEDims:
    """What the MoE terms read from a configuration (sizes on one rank)."""

    experts: int
    topk: int
    f_e: int  # an expert's width on this rank (/ etp)
    f_s: int  # the shared expert's width on this rank (/ tp); 0 without one
    r: int  # router dtype bytes
    ep: int
    etp: int
    tp: int
    score: str  # softmax or sigmoid
    pre_softmax: bool
    balancing: bool  # a balancing loss with a coefficient
    seq_aux: bool  # the per-sequence one
    z_loss: bool
    capacity: float | None
    pad: bool  # every expert computes on exactly its capacity
    dispatcher: str
    groups: int | None = None  # group-limited routing: the expert groups
    group_topk: int | None = None  # and the groups each token picks
    gate: bool = False  # the shared expert's output scaled by its sigmoid gate


def moe_dims(config: Config) -> MoEDims | None:
    """The MoE sizes of a validated configuration; None for a dense model."""
    m = config.model
    if not m.num_experts:
        return None
    ep, etp, _ = expert_grid(config)
    tp = config.distributed.mp_degree
    return MoEDims(experts=m.num_experts, topk=m.moe_router_topk,
                   f_e=(m.moe_ffn_hidden_size or m.ffn_hidden_size) // etp,
                   f_s=(m.moe_shared_expert_intermediate_size or 0) // tp, r=ROUTER_BYTES[m.moe_router_dtype],
                   ep=ep, etp=etp, tp=tp, score=m.moe_router_score_function, pre_softmax=m.moe_router_pre_softmax,
                   balancing=bool(balancing_coefficients(m)), seq_aux="seq_aux_loss" in balancing_coefficients(m),
                   pad=m.moe_pad_expert_input_to_capacity, gate=m.moe_shared_expert_gate,
                   z_loss=bool(m.moe_z_loss_coeff), capacity=m.moe_expert_capacity_factor,
                   dispatcher=m.moe_token_dispatcher_type, groups=m.moe_router_num_groups,
                   group_topk=m.moe_router_group_topk)


def exchanges(M: MoEDims) -> bool:
    """Whether the layer's tokens travel between ranks (ep > 1 or etp > 1)."""
    return M.ep * M.etp > 1


def routed_tokens(M: MoEDims, n: int) -> int:
    """``T``: the tokens this rank's router routes, its share of the micro-batch's ``n`` on this rank (every
    tensor-parallel rank routes its own ``n / tp``, with or without sequence parallelism)."""
    return n // M.tp


def expert_rows(M: MoEDims, n: int) -> int:
    """``R``: the rows this rank's experts compute on (uniform routing: the ``k T`` pairs of each of the ep ranks
    spread evenly, gathered over etp; a capacity ``c`` per expert caps them at ``E c``, exactly ``E c`` when padded
    to it)."""
    pairs = M.topk * routed_tokens(M, n)
    if M.capacity is not None:
        capacity = math.ceil(pairs / M.experts * M.capacity)  # megatron.moe.router.get_capacity
        pairs = M.experts * capacity if M.pad else min(pairs, M.experts * capacity)
    return pairs * M.etp


def moe_terms(M: MoEDims, D) -> dict[str, int]:
    """Bytes a MoE layer's forward saves in place of the MLP's (``fc1 input`` and ``mlp``), for the sizes ``D``
    (``megatron.memory.activations.Dims``: ``n = b s / cp`` tokens on this rank, ``n_sp``, ``h``, ``d``)."""
    T, R, E, k, r, h, d = routed_tokens(M, D.n), expert_rows(M, D.n), M.experts, M.topk, M.r, D.h, D.d
    if d == r:  # the router keeps the norm's output itself: under tp without sp its share is a view of it all
        router_input = (D.n if M.tp > 1 and not D.sp else T) * h * d
    else:  # a copy in the router dtype, and of the weight
        router_input = T * h * r + r * E * h
    if M.score == "sigmoid":  # the scores, the top-k indices, the chosen scores and their sum (k > 1)
        router = r * T * E + 8 * T * k + (r * T * k + r * T if k > 1 else 0)
    elif M.pre_softmax:  # the softmax over all experts, the top-k indices
        router = r * T * E + 8 * T * k
    else:  # the top-k indices, the softmax of the top k logits
        router = 8 * T * k + r * T * k
    if M.group_topk:  # each group's top k / g and the groups' top g indices, the mask of the experts left out
        router += 8 * T * M.groups * (k // M.group_topk) + 8 * T * M.group_topk + T * E
    if M.balancing:  # the full score distribution (sigmoid: normalised, with its sums), its top-k, the counts
        router += r * T * E + (r * T if M.score == "sigmoid" and k > 1 else 0) + 8 * T * k
        router += r * D.b * E if M.seq_aux else r * E
    if M.z_loss:  # the logits and their log-sum-exp
        router += r * T * E + r * T
    if M.balancing or M.z_loss:  # the auxiliary loss the layer's output keeps
        router += r
    pairs, reordered = k * T, exchanges(M) and E // M.ep > 1  # this rank's (token, expert) pairs (no drop)
    if M.dispatcher == "allgather":  # the (gathered) pairs of this rank's experts, their indices (also at ep 1)
        indices, combined, order = 24 * R, R, 0
    else:  # this rank's pairs; the expert-major order of the received chunks and the outputs put back in it
        indices, combined, order = 16 * pairs + (8 * R if reordered else 0), pairs, R * h * d if reordered else 0
    terms = {"router input": router_input, "router": router, "dispatch indices": indices,
             "expert inputs": R * h * d, "experts": D.mlp_saves * R * M.f_e * d,
             "expert outputs (reordered)": order, "combine": 8 * combined * h + 4 * combined}
    if M.f_s:  # its input is the norm's output: the router's already when in the router dtype
        shared_input = 0 if d == r else D.n_sp * h * d
        terms["shared expert"] = shared_input + D.mlp_saves * D.n * M.f_s * d
        if M.gate:  # its output and the gate's sigmoid, which scales it
            terms["shared expert"] += D.n_sp * h * d + D.n_sp * d
    return {key: value for key, value in terms.items() if value}


def dispatch_temporary_bytes(M: MoEDims, n: int, h: int, d: int) -> int:
    """The token exchange's buffers of one MoE layer (0 on one rank): see the module docstring."""
    if not exchanges(M):
        return 0
    if M.dispatcher == "allgather":
        return 2 * routed_tokens(M, n) * M.ep * M.etp * h * d
    return 2 * expert_rows(M, n) * h * d
