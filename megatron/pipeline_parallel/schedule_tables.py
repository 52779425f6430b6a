"""Pipeline schedules as data: one list of :class:`Action` per pipeline rank, plus a pure simulator.

A table says, in order, what one rank does in one training step: compute a forward (``F``) or a
backward (``B``) of one micro-batch on one model chunk, or exchange a tensor with a neighbour.
Virtual stage ``v = chunk * pp + rank`` (``pp`` ranks, ``vpp`` chunks per rank): a micro-batch's
forward runs through virtual stages ``0 .. pp*vpp-1``, its backward back down to ``0``. ``SEND_F`` /
``SEND_B`` carry a compute's *output* (activation to ``v+1``, input gradient to ``v-1``), labelled with
the sender's chunk; ``RECV_F`` / ``RECV_B`` carry a compute's *input*, labelled with the receiver's
chunk. Chunks of one rank pass tensors locally (only when ``pp == 1``), without actions.

Executing a table: post each run of consecutive communication actions as one ``batch_isend_irecv``
(:func:`megatron.pipeline_parallel.p2p.communicate`) and wait for it. Every table here is free of
deadlock under those blocking semantics as well as with buffered sends (``simulate`` checks both),
and posts the messages between two ranks in the same order on both sides (p2p matches them in order).

:func:`simulate` checks tables without processes: deadlock freedom, send/receive matching, data
dependencies, exactly-once compute, and measures the makespan, bubble and activation memory.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

COMPUTE = ("F", "B")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_HOPS = {"SEND_F": (0, 1), "RECV_F": (-1, 0), "SEND_B": (0, -1), "RECV_B": (1, 0)}  # (src, dst) - virtual stage


class DeadlockError(RuntimeError):
    """No rank can make progress although some tables are unfinished."""


class ScheduleError(ValueError):
    """A table is inconsistent: unmatched or duplicate message, violated dependency, bad chunk..."""


@dataclass(frozen=True)
class Action:
    kind: str  # one of COMPUTE + COMM
    micro_batch: int
    chunk: int = 0  # model chunk on this rank (interleaved schedule); virtual stage = chunk * pp + rank


def _with_comm(pp: int, rank: int, order: list[tuple[str, int]]) -> list[Action]:
    """Turn a compute order ``[(kind, micro_batch)]`` (one chunk) into a table: each compute is right
    after the receive of its input and right before the send of its output (when that stage exists)."""
    table = []
    for kind, k in order:
        recv, send = (rank > 0, rank < pp - 1) if kind == "F" else (rank < pp - 1, rank > 0)
        table += [Action("RECV_" + kind, k)] * recv + [Action(kind, k)] + [Action("SEND_" + kind, k)] * send
    return table


def _check(pp: int, rank: int, m: int, vpp: int = 1) -> None:
    if pp < 1 or vpp < 1 or m < 1 or not 0 <= rank < pp:
        raise ValueError(f"need pp >= 1, vpp >= 1, m >= 1 and 0 <= rank < pp; got {pp=}, {rank=}, {m=}, {vpp=}")


def gpipe(pp: int, rank: int, m: int) -> list[Action]:
    """GPipe: the forwards of micro-batches 0..m-1, then their backwards in the same order 0..m-1
    (FIFO, like Megatron's all-warm-up case; reverse order gives the same makespan). Every rank holds
    the activations of all ``m`` micro-batches at the peak. Bubble fraction (pp-1)/(m+pp-1)."""
    _check(pp, rank, m)
    return _with_comm(pp, rank, [("F", k) for k in range(m)] + [("B", k) for k in range(m)])


def one_f_one_b(pp: int, rank: int, m: int) -> list[Action]:
    """Megatron-LM's non-interleaved 1F1B (PipeDream-flush): ``w = min(pp - rank - 1, m)`` warm-up
    forwards, then ``m - w`` steady steps of one forward and one backward, then ``w`` cool-down
    backwards. Same bubble as GPipe, (pp-1)/(m+pp-1), but rank ``r`` holds at most
    ``min(pp - r, m)`` micro-batches' activations instead of ``m``. Each compute is right after the
    receive of its input and right before the send of its output, so the steady state's runs
    ``SEND_F, RECV_B`` and ``SEND_B, RECV_F`` are the two combined calls of ``p2p``."""
    _check(pp, rank, m)
    w = min(pp - rank - 1, m)
    order = [("F", k) for k in range(w)]
    for i in range(m - w):
        order += [("F", w + i), ("B", i)]
    order += [("B", k) for k in range(m - w, m)]
    return _with_comm(pp, rank, order)


def interleaved_one_f_one_b(pp: int, rank: int, m: int, vpp: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: each rank holds ``vpp`` model chunks (virtual stage
    ``chunk * pp + rank``), so a micro-batch visits every rank ``vpp`` times.

    The ``m * vpp`` forwards of a rank go in groups of ``pp`` micro-batches per chunk: forward number
    ``j`` is chunk ``(j % (pp*vpp)) // pp`` of micro-batch ``(j // (pp*vpp)) * pp + j % pp``; backward
    number ``j`` is the same with chunks in reverse order. Warm-up ``(pp - rank - 1) * 2 +
    (vpp - 1) * pp`` forwards (capped at ``m * vpp``), then one forward and one backward per step, then
    the remaining backwards. The bubble shrinks to (pp-1)/(vpp*m + pp-1) while the peak memory is
    ``warm-up + 1`` chunk activations (each 1/vpp of a stage's): on rank 0 ``pp * (1 + 1/vpp) - 1/vpp``
    stages' worth, against ``pp`` for 1F1B. Needs ``m % pp == 0``.

    Communication is placed as Megatron-LM does: after each step's computes (F, or F then B) one batch
    sends the outputs and *prefetches* the next inputs: ``[SEND_F] [SEND_B] [RECV_F] [RECV_B]``. A
    received tensor is always the input of the next compute of its kind, but another compute may run in
    between (``RECV_B`` of the next B before the next F). Receiving each input right before its use
    instead (as 1F1B does) deadlocks when sends block until received (gloo, NCCL): the receives are
    labelled by matching, in order, the neighbours' sends, as Megatron's flags ``recv_prev``/``recv_next``
    do, and ``simulate(..., rendezvous=True)`` checks the result.
    """
    _check(pp, rank, m, vpp)
    if m % pp:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({m}) to be a multiple "
                         f"of the pipeline size ({pp}): m % pp == 0")
    return list(_interleaved_tables(pp, m, vpp)[rank])


@functools.lru_cache(maxsize=32)
def _interleaved_tables(pp: int, m: int, vpp: int) -> tuple[tuple[Action, ...], ...]:
    group, total, last = pp * vpp, m * vpp, pp * vpp - 1

    def unit(j: int, forward: bool) -> tuple[int, int]:  # Python's % also gives j < 0 a chunk, as in Megatron
        chunk = (j % group) // pp
        return (j // group) * pp + j % pp, chunk if forward else vpp - 1 - chunk

    plans = []  # per rank, per step: (computes, receive from previous rank?, receive from next rank?)
    for rank in range(pp):
        first, final = rank == 0, rank == pp - 1
        w = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
        plan = [((), not first, False)]  # the input of the first forward
        for j in range(w):
            plan.append(((("F", j),), j + 1 < total and not (first and unit(j + 1, True)[1] == 0),
                         j == w - 1 and not final))
        for i in range(total - w):
            plan.append(((("F", w + i), ("B", i)),
                         i < total - w - 1 and not (first and unit(w + i - pp + 1, True)[1] == vpp - 1),
                         not (final and unit(i - pp + 1, False)[1] == 0)))
        for j in range(total - w, total):
            plan.append(((("B", j),), False, j + 1 < total and not (final and unit(j + 1, False)[1] == vpp - 1)))
        plans.append(plan)

    sends: list[list[list[Action]]] = []  # per rank, per step: the sends after the step's computes
    for rank, plan in enumerate(plans):
        sends.append([])
        for computes, _, _ in plan:
            step = []
            for kind, j in computes:
                k, c = unit(j, kind == "F")
                v = c * pp + rank
                if pp > 1 and (v < last if kind == "F" else v > 0):
                    step.append(Action("SEND_" + kind, k, c))
            sends[-1].append(step)
    tables = []
    for rank, plan in enumerate(plans):  # a receive gets the neighbour's next send of that kind (FIFO)
        from_prev = (a for step in sends[rank - 1] for a in step if a.kind == "SEND_F")
        from_next = (a for step in sends[(rank + 1) % pp] for a in step if a.kind == "SEND_B")
        table = []
        for (computes, recv_prev, recv_next), step in zip(plan, sends[rank]):
            for kind, j in computes:
                table.append(Action(kind, *unit(j, kind == "F")))
            table += step
            if pp > 1 and recv_prev:
                a = next(from_prev)
                table.append(Action("RECV_F", a.micro_batch, (a.chunk * pp + (rank - 1) % pp + 1) // pp))
            if pp > 1 and recv_next:
                a = next(from_next)
                table.append(Action("RECV_B", a.micro_batch, (a.chunk * pp + (rank + 1) % pp - 1) // pp))
        tables.append(tuple(table))
    return tuple(tables)


def simulate(tables: list[list[Action]], pp: int, vpp: int = 1, backward_cost: float = 2.0,
             rendezvous: bool = False) -> dict:
    """Run every rank's table and check it; raise :class:`ScheduleError` or :class:`DeadlockError`.

    Semantics: a rank executes its table in order. ``F`` costs 1 and ``B`` costs ``backward_cost``;
    communication costs 0. With ``rendezvous=False`` a ``SEND`` is buffered (never blocks, like an
    ``isend`` whose handle is waited later) and a ``RECV`` blocks until the matching ``SEND`` has been
    executed. With ``rendezvous=True`` each maximal run of consecutive communication actions is posted
    as one batch (``batch_isend_irecv`` on NCCL) and the rank waits until every message of the batch has
    met its partner in the peer's posted batch -- the stricter semantics of unbuffered sends.

    Checks: each message is sent exactly once and received exactly once by the neighbouring virtual
    stage (same micro-batch); a ``SEND`` follows the compute that produced it; ``F`` of ``(k, v)`` runs
    after ``F`` of ``(k, v-1)`` and after receiving it; ``B`` of ``(k, v)`` after ``F`` of ``(k, v)`` on
    this rank and after ``B`` of ``(k, v+1)``; each micro-batch seen is forwarded and backwarded
    exactly once at every virtual stage.

    Returns ``makespan`` (time when the last rank finishes), ``busy`` (compute time per rank),
    ``bubble_fraction`` (``1 - sum(busy) / (pp * makespan)``), ``peak_in_flight`` (per rank, the most
    (micro-batch, chunk) activations held at once: forwarded, not yet backwarded), ``micro_batches``
    (sorted ids) and ``timeline`` (per rank, ``(action, start, end)`` of each compute).
    """
    if len(tables) != pp:
        raise ScheduleError(f"{len(tables)} tables for pp={pp}")
    return _Simulation(tables, pp, vpp, backward_cost, rendezvous).run()


def _message(a: Action, r: int, pp: int, last: int) -> tuple[tuple, tuple]:
    """The message of communication action ``a`` of rank ``r`` -- (direction, micro-batch, receiving
    virtual stage) -- and its channel (``"SEND"``/``"RECV"``, source rank, destination rank)."""
    v = a.chunk * pp + r
    src, dst = (v + hop for hop in _HOPS[a.kind])
    if not (0 <= src <= last and 0 <= dst <= last):
        raise ScheduleError(f"rank {r}: {a} has no neighbouring virtual stage")
    return (a.kind[-1], a.micro_batch, dst), (a.kind[:4], src % pp, dst % pp)


def _index_messages(tables: list[list[Action]], pp: int, vpp: int) -> tuple[dict, dict]:
    """The static checks: every action is valid and every message is sent exactly once and received
    exactly once, in the same order on both sides of a rank pair (p2p matches them in order).

    Returns ``msg``: (rank, index) -> message of a communication action, and ``where``:
    ("SEND"/"RECV", *message) -> (rank, index) of the action."""
    last = pp * vpp - 1
    msg: dict[tuple[int, int], tuple] = {}
    where: dict[tuple, tuple[int, int]] = {}
    channels: dict[tuple, list] = {}  # ("SEND"/"RECV", src rank, dst rank) -> messages in table order
    for r, table in enumerate(tables):
        for i, a in enumerate(table):
            if a.kind not in COMPUTE + COMM or not 0 <= a.chunk < vpp:
                raise ScheduleError(f"rank {r}: bad action {a}")
            if a.kind in COMM:
                message, channel = _message(a, r, pp, last)
                key = (a.kind[:4], *message)
                if key in where:
                    raise ScheduleError(f"rank {r}: {a} duplicates the message at rank/index {where[key]}")
                where[key], msg[(r, i)] = (r, i), message
                channels.setdefault(channel, []).append(message)
    for key in where:
        if key[0] == "SEND" and ("RECV", *key[1:]) not in where:
            raise ScheduleError(f"message {key[1:]} sent but never received")
        if key[0] == "RECV" and ("SEND", *key[1:]) not in where:
            raise ScheduleError(f"message {key[1:]} received but never sent")
    for (what, src, dst), messages in channels.items():
        if what == "SEND" and messages != channels[("RECV", src, dst)]:
            raise ScheduleError(f"rank {src} sends to rank {dst} in another order than rank {dst} receives")
    return msg, where


class _Simulation:
    """The dynamic part of :func:`simulate`: each rank's position in its table and clock, advanced in
    turn until every table is done (or no rank can move: deadlock)."""

    def __init__(self, tables: list[list[Action]], pp: int, vpp: int, backward_cost: float, rendezvous: bool):
        self.tables, self.pp, self.last = tables, pp, pp * vpp - 1
        self.backward_cost, self.rendezvous = backward_cost, rendezvous
        self.msg, self.where = _index_messages(tables, pp, vpp)
        self.pc, self.t, self.busy, self.peak = [0] * pp, [0.0] * pp, [0.0] * pp, [0] * pp
        self.held: list[set] = [set() for _ in range(pp)]  # (micro-batch, chunk) forwarded, not backwarded
        self.done: dict[tuple, float] = {}  # (kind, k, v) -> finish time of the compute
        self.sent: dict[tuple, float] = {}  # message -> time its SEND was posted
        self.got: set[tuple] = set()  # messages received
        self.posted: list[tuple[int, int, float] | None] = [None] * pp  # rendezvous: (start, end, time) of a batch
        self.matched: dict[tuple, float] = {}  # rendezvous: (rank, index) -> completion time
        self.timeline: list[list] = [[] for _ in range(pp)]

    def run(self) -> dict:
        tables, pp = self.tables, self.pp
        while any(self.pc[r] < len(tables[r]) for r in range(pp)):
            if not any([self._step(r) for r in range(pp)]):
                stuck = ", ".join(f"rank {r} at {tables[r][self.pc[r]]}" for r in range(pp)
                                  if self.pc[r] < len(tables[r]))
                raise DeadlockError(f"no rank can progress: {stuck}")
        micro_batches = sorted({k for (_, k, _) in self.done})
        missing = [(c, k, v) for k in micro_batches for v in range(self.last + 1) for c in COMPUTE
                   if (c, k, v) not in self.done]
        if missing:
            raise ScheduleError(f"never computed (kind, micro-batch, virtual stage): {missing[:4]}")
        makespan = max(self.t)
        return {"makespan": makespan, "busy": self.busy, "peak_in_flight": self.peak, "micro_batches": micro_batches,
                "bubble_fraction": 1.0 - sum(self.busy) / (pp * makespan) if makespan else 0.0,
                "timeline": self.timeline}

    def _step(self, r: int) -> bool:
        """Advance rank r as far as it can; return whether it moved."""
        moved, table = False, self.tables[r]
        while self.pc[r] < len(table):
            a = table[self.pc[r]]
            if a.kind in COMPUTE:
                self._compute(r, a)
            elif self.rendezvous:
                finished, progressed = self._exchange_batch(r)
                if not finished:
                    return moved or progressed
            elif not self._exchange_buffered(r, a):
                return moved
            self.pc[r] += 1
            moved = True
        return moved

    def _compute(self, r: int, a: Action) -> None:
        v = a.chunk * self.pp + r
        me = (a.kind, a.micro_batch, v)
        if me in self.done:
            raise ScheduleError(f"rank {r}: {a} computed twice")
        ready = self._ready(r, a, v)
        if a.kind == "B":
            self.held[r].discard((a.micro_batch, a.chunk))
        else:
            self.held[r].add((a.micro_batch, a.chunk))
            self.peak[r] = max(self.peak[r], len(self.held[r]))
        cost = 1.0 if a.kind == "F" else self.backward_cost
        self.t[r] = self.done[me] = ready + cost
        self.busy[r] += cost
        self.timeline[r].append((a, ready, self.t[r]))

    def _ready(self, r: int, a: Action, v: int) -> float:
        """When compute ``a`` (virtual stage ``v``) can start: after its input, computed by the previous
        virtual stage (``F``) or the next (``B``) and received when that is another rank."""
        step = -1 if a.kind == "F" else 1
        dep = (a.kind, a.micro_batch, v + step)
        ready = self.t[r]
        if 0 <= v + step <= self.last:
            if dep not in self.done:
                raise ScheduleError(f"rank {r}: {a} runs before its input {dep}")
            if (v + step) % self.pp != r and (a.kind, a.micro_batch, v) not in self.got:
                raise ScheduleError(f"rank {r}: {a} without receiving its input")
            ready = max(ready, self.done[dep])
        if a.kind == "B" and ("F", a.micro_batch, v) not in self.done:
            raise ScheduleError(f"rank {r}: {a} before its forward")
        return ready

    def _post(self, r: int, i: int) -> tuple:
        """The message of communication action i of rank r; a SEND must follow what it sends."""
        a = self.tables[r][i]
        if a.kind.startswith("SEND") and (a.kind[-1], a.micro_batch, a.chunk * self.pp + r) not in self.done:
            raise ScheduleError(f"rank {r}: {a} before computing what it sends")
        return self.msg[(r, i)]

    def _exchange_buffered(self, r: int, a: Action) -> bool:
        """A buffered SEND never waits; a RECV waits for its SEND. Return whether ``a`` completed."""
        key = self._post(r, self.pc[r])
        if a.kind.startswith("SEND"):
            self.sent[key] = self.t[r]
        elif key in self.sent:
            self.got.add(key)
            self.t[r] = max(self.t[r], self.sent[key])
        else:
            return False
        return True

    def _exchange_batch(self, r: int) -> tuple[bool, bool]:
        """Rendezvous: post the run of communication actions at rank r's position as one batch (once),
        match its messages with the peers' posted batches, and complete it when all are matched.
        Return (completed, whether anything moved)."""
        table, progressed = self.tables[r], False
        if self.posted[r] is None:
            end = self.pc[r]
            while end < len(table) and table[end].kind in COMM:
                self._post(r, end)
                end += 1
            self.posted[r], progressed = (self.pc[r], end, self.t[r]), True
        start, end, when = self.posted[r]
        progressed |= self._match(r, start, end, when)
        if any((r, i) not in self.matched for i in range(start, end)):
            return False, progressed
        self.got.update(self.msg[(r, i)] for i in range(start, end) if table[i].kind.startswith("RECV"))
        self.t[r] = max([when] + [self.matched[(r, i)] for i in range(start, end)])
        self.pc[r], self.posted[r] = end - 1, None  # the caller steps past the batch's last action
        return True, True

    def _match(self, r: int, start: int, end: int, when: float) -> bool:
        """Match the messages of rank r's batch ``[start, end)`` (posted at ``when``) whose partner is in
        the peer's posted batch; a match completes when the later of the two was posted."""
        moved = False
        for i in range(start, end):
            kind = "RECV" if self.tables[r][i].kind.startswith("SEND") else "SEND"
            peer_r, peer_i = self.where[(kind, *self.msg[(r, i)])]
            peer = self.posted[peer_r]
            if (r, i) not in self.matched and peer is not None and peer[0] <= peer_i < peer[1]:
                self.matched[(r, i)] = self.matched[(peer_r, peer_i)] = max(when, peer[2])
                moved = True
        return moved
