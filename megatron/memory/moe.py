"""Activation memory of a mixture-of-experts layer (``megatron.moe``) on one rank: what its forward saves for
the backward in place of the MLP's ``fc1 input`` and ``mlp`` terms, and the token dispatch's buffers.

Routing is assumed UNIFORM: each of the E experts gets ``k T / E`` of the (token, expert) pairs of the ``T``
tokens routed (dropless; a capacity factor f caps an expert at ``ceil(k T / E x f)``). The saved bytes of the
experts depend only on the total rows they compute, so on one expert-parallel rank (every expert here) the
figure is exact whatever the routing; with expert parallelism a rank's experts compute on ``k T`` rows on
average (``ep`` ranks each send ``k T / ep`` pairs to each rank), more on a rank whose experts are popular.

Sizes on one rank (``megatron.memory.activations`` notation; ``T`` tokens routed by this rank's router, ``k``
top-k, ``E`` experts, ``r`` bytes of the router dtype (4 fp32, 8 fp64), ``d`` activation bytes, ``etp`` the
experts' tensor-parallel size, ``f_e = moe_ffn_hidden_size / etp``, ``f_s`` the shared expert's width / tp):

- the tokens routed: under tensor parallelism on one expert-parallel rank (``ep`` 1 and ``etp`` = tp) every
  rank routes the whole micro-batch's ``n`` tokens (gathered under sequence parallelism); with expert
  parallelism (``ep`` > 1 or ``etp`` != tp) each rank routes its ``n / tp`` (its sequence shard) and the rows
  its experts compute are ``R = k T etp`` (the pairs received from the ``ep`` ranks, gathered over ``etp``);
- ``router input``: the norm's output the router's matmul keeps (``T h r``: the output itself when the
  activations are in the router dtype, else its copy in that dtype, with the weight's copy ``r E h``);
- ``router``: softmax (default) the top-k indices (int64, ``8 T k``) and the softmax of the top k logits
  (``r T k``); ``pre_softmax`` the softmax over all experts (``r T E``) and the indices; sigmoid the scores
  (``r T E``), the indices and, for k > 1, the chosen scores and their sums (``r T k + r T``). The balancing loss
  (only with a coefficient): the full score distribution (``r T E``; sigmoid's normalised, with its sums
  ``r T``) and the routed counts (``r E``; per sequence ``r b E``); the z-loss the logits and their log-sum-exp
  (``r T E + r T``); the auxiliary loss the layer's output keeps (``r``);
- ``dispatch indices``: the (expert, token) pairs, int64, ``16 R``;
- ``expert inputs``: the rows sorted by expert, ``R h d``;
- ``experts``: GELU ``2 R f_e d`` (fc1 output, GELU output), SwiGLU ``4 R f_e d``;
- ``combine``: the experts' output in fp32 and its probability-weighted copy (``8 R h``) and the gathered
  probabilities in fp32 (``4 R``);
- ``shared expert``: its input (the norm output, when not already kept) and ``2 n f_s d`` (GELU) or
  ``4 n f_s d`` (SwiGLU).

Temporaries (``dispatch_temporary_bytes``), with expert parallelism only: the all-to-all's send and receive
buffers of the tokens (``R h d`` each way) and of the experts' output (the same); the allgather dispatcher
gathers every token of the ep x etp group (``T ep etp h d``) and reduce-scatters their output (the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.config.schema import Config
from megatron.optimizer.memory import expert_grid

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
                   balancing=m.moe_router_load_balancing_type != "none" and (m.moe_aux_loss_coeff or 0) > 0,
                   seq_aux=m.moe_router_load_balancing_type == "seq_aux_loss", pad=m.moe_pad_expert_input_to_capacity,
                   z_loss=bool(m.moe_z_loss_coeff), capacity=m.moe_expert_capacity_factor,
                   dispatcher=m.moe_token_dispatcher_type)


def expert_parallel(M: MoEDims) -> bool:
    """Whether the layer takes the expert-parallel path (its tokens exchanged between ranks)."""
    return M.ep > 1 or M.etp != M.tp


def routed_tokens(M: MoEDims, n: int) -> int:
    """``T``: the tokens this rank's router routes, of the micro-batch's ``n`` on this rank."""
    return n // M.tp if expert_parallel(M) else n


def expert_rows(M: MoEDims, n: int) -> int:
    """``R``: the rows this rank's experts compute on (uniform routing; with a capacity ``c`` per expert, at most
    ``E c``, exactly ``E c`` when padded to it)."""
    pairs = M.topk * routed_tokens(M, n)
    if M.capacity is not None:
        capacity = math.ceil(pairs / M.experts * M.capacity)  # megatron.moe.router.get_capacity
        pairs = M.experts * capacity if M.pad else min(pairs, M.experts * capacity)
    return pairs * (M.etp if expert_parallel(M) else 1)


def moe_terms(M: MoEDims, n: int, b: int, h: int, d: int, swiglu: bool) -> dict[str, int]:
    """Bytes a MoE layer's forward saves in place of the MLP's (``fc1 input`` and ``mlp``); ``n`` the tokens
    of the micro-batch of ``b`` samples on this rank (``b s / cp``)."""
    T, R, E, k, r = routed_tokens(M, n), expert_rows(M, n), M.experts, M.topk, M.r
    router_input = T * h * r  # the norm output itself when it is in the router dtype, else a copy
    weight_copy = r * E * h if d != r else 0  # the router weight in the router dtype
    if M.score == "sigmoid":  # the scores, the top-k indices, the chosen scores and their sum (k > 1)
        router = r * T * E + 8 * T * k + (r * T * k + r * T if k > 1 else 0)
    elif M.pre_softmax:  # the softmax over all experts, the top-k indices
        router = r * T * E + 8 * T * k
    else:  # the top-k indices, the softmax of the top k logits
        router = 8 * T * k + r * T * k
    if M.balancing:  # the full score distribution (sigmoid: normalised, with its sums), the routed counts
        router += r * T * E + (r * T if M.score == "sigmoid" and k > 1 else 0)
        router += r * b * E if M.seq_aux else r * E
    if M.z_loss:  # the logits and their log-sum-exp
        router += r * T * E + r * T
    if M.balancing or M.z_loss:  # the auxiliary loss the layer's output keeps
        router += r
    terms = {"router input": router_input + weight_copy, "router": router,
             "dispatch indices": 16 * R, "expert inputs": R * h * d, "experts": (4 if swiglu else 2) * R * M.f_e * d,
             "combine": 8 * R * h + 4 * R}
    if M.f_s:
        shared_input = 0 if d == r else n * h * d  # fp32: the router's input is the same storage
        terms["shared expert"] = shared_input + (4 if swiglu else 2) * n * M.f_s * d
    return terms


def dispatch_temporary_bytes(M: MoEDims, n: int, h: int, d: int) -> int:
    """The token exchange's buffers of one MoE layer (0 without expert parallelism): see the module docstring."""
    if not expert_parallel(M):
        return 0
    if M.dispatcher == "allgather":
        return 2 * routed_tokens(M, n) * M.ep * M.etp * h * d
    return 2 * expert_rows(M, n) * h * d
