"""The pipeline schedule tables, checked by the pure simulator (no processes).

Bubble tolerance: none beyond float round-off. In the simulator's time model (communication free,
every forward costs 1 and every backward ``backward_cost``) the only idle time of GPipe and 1F1B is
the fill and drain ramp of ``pp - 1`` forwards and ``pp - 1`` backwards, so their bubble fraction is
exactly ``(pp-1)/(m+pp-1)``; in the interleaved schedule each ramp step is one chunk, ``1/vpp`` of a
stage, so its bubble is exactly ``(pp-1)/(vpp*m+pp-1)`` -- which the simulation confirms for every
case below, so any deviation would be a schedule bug, not noise.
"""

from __future__ import annotations

from collections import Counter

import pytest

from megatron.pipeline_parallel.schedule_tables import (
    Action,
    DeadlockError,
    ScheduleError,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    simulate,
)

TOL = 1e-9  # float round-off only (see the module docstring)
PPS, MS, VPPS = range(1, 7), range(1, 13), range(1, 4)


def _tables(schedule, pp, m, vpp=1):
    if schedule is interleaved_one_f_one_b:
        return [schedule(pp, r, m, vpp) for r in range(pp)]
    return [schedule(pp, r, m) for r in range(pp)]


def _check(tables, pp, m, vpp=1, backward_cost=2.0, rendezvous=False):
    """Simulate (which checks matching, dependencies and deadlock) and check exactly-once compute
    independently of the simulator."""
    counts = Counter((a.kind, a.micro_batch, a.chunk * pp + r) for r, t in enumerate(tables) for a in t
                     if a.kind in ("F", "B"))
    assert counts == Counter({(kind, k, v): 1 for kind in "FB" for k in range(m) for v in range(pp * vpp)})
    result = simulate(tables, pp, vpp, backward_cost=backward_cost, rendezvous=rendezvous)
    assert result["micro_batches"] == list(range(m))
    return result


def _check_neighbours(table, pp, rank):
    """Each F/B is immediately preceded by the receive of its input and followed by the send of its
    output (when there is a neighbouring stage), with the same micro-batch and chunk."""
    for i, a in enumerate(table):
        if a.kind not in ("F", "B"):
            continue
        first, last = rank == 0, rank == pp - 1
        need_recv, need_send = (not first, not last) if a.kind == "F" else (not last, not first)
        if need_recv:
            assert table[i - 1] == Action(f"RECV_{a.kind}", a.micro_batch, a.chunk)
        if need_send:
            assert table[i + 1] == Action(f"SEND_{a.kind}", a.micro_batch, a.chunk)
    assert len(table) == sum(1 for a in table if a.kind in ("F", "B")) * (1 + (rank > 0) + (rank < pp - 1))


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("rendezvous", [False, True])
def test_gpipe_and_1f1b(pp, rendezvous):
    for m in MS:
        bubble = (pp - 1) / (m + pp - 1)
        for backward_cost in (1.0, 2.0):
            g = _check(_tables(gpipe, pp, m), pp, m, backward_cost=backward_cost, rendezvous=rendezvous)
            f = _check(_tables(one_f_one_b, pp, m), pp, m, backward_cost=backward_cost, rendezvous=rendezvous)
            assert g["bubble_fraction"] == pytest.approx(bubble, abs=TOL)
            assert f["bubble_fraction"] == pytest.approx(bubble, abs=TOL)
            assert f["makespan"] == pytest.approx((m + pp - 1) * (1 + backward_cost))
        assert g["peak_in_flight"] == [m] * pp
        assert f["peak_in_flight"] == [min(pp - r, m) for r in range(pp)]
        for r in range(pp):
            _check_neighbours(gpipe(pp, r, m), pp, r)
            _check_neighbours(one_f_one_b(pp, r, m), pp, r)


def test_1f1b_shape():
    # pp=4, rank 1, m=5: 2 warm-up forwards, 3 steady (F, B) pairs, 2 cool-down backwards
    computes = [(a.kind, a.micro_batch) for a in one_f_one_b(4, 1, 5) if a.kind in ("F", "B")]
    assert computes == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2),
                        ("B", 3), ("B", 4)]
    # the steady state pairs SEND_F with RECV_B and SEND_B with RECV_F: what the combined p2p calls post
    assert one_f_one_b(2, 0, 2)[:4] == [Action("F", 0), Action("SEND_F", 0), Action("F", 1), Action("SEND_F", 1)]
    assert one_f_one_b(3, 1, 3)[4:10] == [Action("F", 1), Action("SEND_F", 1), Action("RECV_B", 0), Action("B", 0),
                                          Action("SEND_B", 0), Action("RECV_F", 2)]


def _comm_runs(table):
    """The runs of consecutive communication actions of a table (what an executor posts as one batch)."""
    runs, run = [], []
    for a in table + [Action("F", -1)]:
        if a.kind in ("F", "B"):
            runs += [run] if run else []
            run = []
        else:
            run.append(a.kind)
    return runs


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("rendezvous", [False, True])
def test_interleaved(pp, rendezvous):
    for m in range(pp, 13, pp):
        flat = (pp - 1) / (m + pp - 1)
        for vpp in VPPS:
            tables = _tables(interleaved_one_f_one_b, pp, m, vpp)
            for backward_cost in (1.0, 2.0):
                res = _check(tables, pp, m, vpp, backward_cost, rendezvous)
                assert res["bubble_fraction"] == pytest.approx((pp - 1) / (vpp * m + pp - 1), abs=TOL)
                if pp > 1 and vpp > 1:
                    assert res["bubble_fraction"] < flat - TOL
            warmups = [min((pp - r - 1) * 2 + (vpp - 1) * pp, m * vpp) for r in range(pp)]
            assert res["peak_in_flight"] == [min(w + 1, m * vpp) for w in warmups]
            for table in tables:
                # the first pp * vpp forwards: pp micro-batches on chunk 0, then pp on chunk 1...
                chunks = [a.chunk for a in table if a.kind == "F"]
                assert chunks[:pp * vpp] == [c for c in range(vpp) for _ in range(pp)]
                # Megatron's batches: [SEND_F] [SEND_B] [RECV_F] [RECV_B], at most one of each
                order = ["SEND_F", "SEND_B", "RECV_F", "RECV_B"]
                for run in _comm_runs(table):
                    assert run == sorted(set(run), key=order.index)
                # a received tensor feeds the next compute of its kind, with at most one compute between
                for i, a in enumerate(table):
                    if a.kind.startswith("RECV"):
                        computes = [b for b in table[i:] if b.kind in ("F", "B")]
                        use = next(j for j, b in enumerate(computes) if b.kind == a.kind[-1])
                        assert computes[use] == Action(a.kind[-1], a.micro_batch, a.chunk) and use <= 1


def test_interleaved_receive_right_before_use_deadlocks_with_blocking_sends():
    """The subtlety behind Megatron's placement: with the same computes, receiving each input right
    before its use (as 1F1B does) works with buffered sends but deadlocks when sends block."""
    pp, m, vpp = 2, 4, 2
    tables = []
    for r in range(pp):
        table = []
        for a in interleaved_one_f_one_b(pp, r, m, vpp):
            if a.kind in ("F", "B"):
                v, forward = a.chunk * pp + r, a.kind == "F"
                recv, send = (v > 0, v < pp * vpp - 1) if forward else (v < pp * vpp - 1, v > 0)
                kind, k, c = a.kind, a.micro_batch, a.chunk
                table += [Action("RECV_" + kind, k, c)] * recv + [a] + [Action("SEND_" + kind, k, c)] * send
        tables.append(table)
    assert simulate(tables, pp, vpp)["bubble_fraction"] == pytest.approx((pp - 1) / (vpp * m + pp - 1))
    with pytest.raises(DeadlockError, match="no rank can progress"):
        simulate(tables, pp, vpp, rendezvous=True)


def test_interleaved_order_and_wrap():
    # pp=2, m=4, vpp=2, rank 0: warm-up 2 + 2 = 4 forwards in groups of pp per chunk
    table = interleaved_one_f_one_b(2, 0, 4, 2)
    computes = [(a.kind, a.micro_batch, a.chunk) for a in table if a.kind in ("F", "B")]
    assert computes[:6] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0), ("B", 0, 1)]
    # rank 0 chunk 1 (virtual stage 2) receives from rank 1 chunk 0 (virtual stage 1) and sends its
    # gradient back there; rank 1 chunk 0 sends to rank 0 chunk 1
    assert Action("RECV_F", 0, 1) in table and Action("SEND_B", 0, 1) in table
    assert Action("SEND_F", 0, 0) in interleaved_one_f_one_b(2, 1, 4, 2)
    # the last virtual stage (rank 1, chunk 1) neither sends forward nor receives a gradient
    last = interleaved_one_f_one_b(2, 1, 4, 2)
    assert not [a for a in last if a.chunk == 1 and a.kind in ("SEND_F", "RECV_B")]


def test_interleaved_vpp1_matches_1f1b_bubble_but_warms_up_more():
    pp, m = 4, 8
    inter = simulate(_tables(interleaved_one_f_one_b, pp, m, 1), pp)
    plain = simulate(_tables(one_f_one_b, pp, m), pp)
    assert inter["makespan"] == plain["makespan"]
    assert inter["peak_in_flight"] == [7, 5, 3, 1] and plain["peak_in_flight"] == [4, 3, 2, 1]


@pytest.mark.parametrize("pp, m", [(2, 3), (4, 6), (3, 1)])
def test_interleaved_refuses_m_not_multiple_of_pp(pp, m):
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        interleaved_one_f_one_b(pp, 0, m, 2)


def test_no_pipelining_and_time_model():
    for m in MS:
        table = one_f_one_b(1, 0, m)  # one stage: forward then backward of each micro-batch in turn
        assert table == [Action(kind, k) for k in range(m) for kind in ("F", "B")]
        res = _check([table], 1, m)
        assert res["peak_in_flight"] == [1] and res["bubble_fraction"] == 0 and res["makespan"] == 3 * m
    # pp=2, m=1: F on rank 0 [0,1], F on rank 1 [1,2], B on rank 1 [2,4], B on rank 0 [4,6]
    res = simulate(_tables(one_f_one_b, 2, 1), 2, backward_cost=2.0)
    assert [(a.kind, s, e) for a, s, e in res["timeline"][0]] == [("F", 0, 1), ("B", 4, 6)]
    assert [(a.kind, s, e) for a, s, e in res["timeline"][1]] == [("F", 1, 2), ("B", 2, 4)]
    assert res["makespan"] == 6 and res["busy"] == [3, 3] and res["bubble_fraction"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        one_f_one_b(2, 2, 4)


def A(kind, k=0, chunk=0):
    return Action(kind, k, chunk)


@pytest.mark.parametrize("tables, error, match", [
    ([[A("RECV_B"), A("F"), A("SEND_F"), A("B")], [A("SEND_B"), A("RECV_F"), A("F"), A("B")]], ScheduleError, "before"),
    ([[A("F"), A("RECV_B"), A("SEND_F"), A("B")], [A("RECV_F"), A("F"), A("B"), A("SEND_B")]], DeadlockError,
     "rank 0 at .*RECV_B.*rank 1 at .*RECV_F"),
    ([[A("F"), A("SEND_F"), A("B")], [A("F"), A("B")]], ScheduleError, "never received"),
    ([[A("F"), A("B")], [A("RECV_F"), A("F"), A("B")]], ScheduleError, "never sent"),
    ([[A("F"), A("SEND_F"), A("B")], [A("F"), A("RECV_F"), A("B")]], ScheduleError, "runs before its input"),
    ([[A("F"), A("B"), A("B")]], ScheduleError, "twice"),
    ([[A("B"), A("F")]], ScheduleError, "before its forward"),
    ([[A("F", 0, 1)]], ScheduleError, "bad action"),
    ([[A("F"), A("SEND_B")]], ScheduleError, "no neighbouring"),
    ([[A("F", 0), A("SEND_F", 0), A("F", 1), A("SEND_F", 1), A("RECV_B", 0), A("B", 0), A("RECV_B", 1), A("B", 1)],
      [A("RECV_F", 1), A("F", 1), A("RECV_F", 0), A("F", 0), A("B", 0), A("SEND_B", 0), A("B", 1), A("SEND_B", 1)]],
     ScheduleError, "another order"),
])
def test_simulator_rejects_bad_tables(tables, error, match):
    with pytest.raises(error, match=match):
        simulate(tables, len(tables))
