"""Local SGD, DiLoCo and streaming DiLoCo (gradsync/compress/diloco.py), and the compressors'
and DiLoCo's state in an elastic State (gradsync/compress/elastic.py), on threads as ranks.

The ranks are threads over the in-memory group of test_compress.py: DiLoCo reaches the other
ranks only through a ``Comm``, so processes add nothing here. The real front doors (a gloo
group, the Horovod API) are tests/ranks/diloco_train.py, run by test_diloco_multiprocess.py.
Every rank trains the same tiny model on its own data (fixed by rank and step), so ranks
drift apart between syncs and meet at each one.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gradsync.compress import DiLoCo, Int8
from gradsync.compress.diloco import fragments_of
from gradsync.elastic.state import ObjectState
from test_compress import ThreadComm, ThreadGroup, run_ranks, run_threads


def _net():
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


# The start every rank copies (threads share torch's global generator: draw it once).
_START = [p.detach().clone() for p in _net().parameters()]


def fresh_model():
    model = _net()
    with torch.no_grad():
        for p, q in zip(model.parameters(), _START):
            p.copy_(q)
    return model


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def inner_step(model, opt, rank, step):
    x, y = batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


# ---------------------------------------------------------------------------- local SGD
def test_h1_lr1_equals_synchronous_parameter_averaging():
    """H=1, outer SGD lr 1, no momentum: after every step each rank holds the mean of the
    ranks' parameters, as averaging them every step does -- to float tolerance (anchor -
    mean(anchor - theta) rounds differently from mean(theta)); bitwise equal across ranks."""
    size, steps = 3, 6

    def job(comm):
        model = fresh_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = DiLoCo(model, opt, sync_every=1, outer_lr=1.0, outer_momentum=0.0, comm=comm)
        for step in range(steps):
            x, y = batch(comm.rank, step)
            outer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            outer.step()
        return flat(model)

    results, _ = run_ranks(size, job)
    # The reference: data-parallel training that averages parameters after every step.
    models = [fresh_model() for _ in range(size)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(steps):
        for r in range(size):
            inner_step(models[r], opts[r], r, step)
        mean = sum(flat(m) for m in models) / size
        for m in models:
            torch.nn.utils.vector_to_parameters(mean.clone(), m.parameters())
    for r in range(size):
        assert torch.equal(results[r], results[0])
    torch.testing.assert_close(results[0], flat(models[0]), rtol=0, atol=1e-6)
    assert not torch.equal(results[0], flat(fresh_model()))  # it trained


def test_local_sgd_averages_every_h_steps():
    """H=4, lr 1, no momentum: between syncs the ranks drift apart; at steps 4, 8, 12 each
    rank's parameters become the mean of the ranks' parameters just before the sync, the
    same bytes on every rank."""
    size, H, steps = 2, 4, 12

    def job(comm):
        model = fresh_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = DiLoCo(model, opt, sync_every=H, outer_lr=1.0, outer_momentum=0.0, comm=comm)
        before, after = [], []
        for step in range(steps):
            inner_step(model, opt, comm.rank, step)
            before.append(flat(model))
            outer.outer_step()
            after.append(flat(model))
        return before, after, outer.landed

    results, _ = run_ranks(size, job)
    landed = results[0][2]
    assert landed == [(4, 0), (8, 0), (12, 0)]
    for step in range(steps):
        t = step + 1
        befores = [results[r][0][step] for r in range(size)]
        afters = [results[r][1][step] for r in range(size)]
        if t % H == 0:
            assert all(torch.equal(a, afters[0]) for a in afters), f"step {t}"
            torch.testing.assert_close(afters[0], sum(befores) / size, rtol=0, atol=1e-6)
        else:
            assert not torch.equal(afters[0], afters[1]), f"ranks equal at step {t}"
            assert all(torch.equal(a, b) for a, b in zip(afters, befores))  # no sync


def test_outer_nesterov_step_matches_hand_computed_reference():
    """One scalar parameter, inner SGD lr 1 with gradients set by hand, H=2, outer lr 0.5,
    Nesterov momentum 0.9, two windows, worked out below."""
    grads = {0: [0.5, 0.25, 0.125, 0.0], 1: [0.125, 0.375, 0.25, 0.5]}

    def job(comm):
        w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
        opt = torch.optim.SGD([w], lr=1.0)
        outer = DiLoCo([w], opt, sync_every=2, outer_lr=0.5, outer_momentum=0.9, comm=comm)
        seen = []
        for step in range(4):
            w.grad = torch.tensor([grads[comm.rank][step]], dtype=torch.float64)
            outer.step()
            seen.append(w.item())
        return seen, [float(m) for m in outer.momenta]

    results, _ = run_ranks(2, job)
    # Window 1: rank 0 goes 1 -> 0.25 (delta 0.75), rank 1 -> 0.5 (delta 0.5); mean 0.625.
    # buf = 0.625; Nesterov update = 0.625 + 0.9 * 0.625 = 1.1875; anchor = 1 - 0.5 * 1.1875.
    a1 = 1 - 0.5 * 1.1875                                   # 0.40625
    # Window 2 from a1: rank 0 moves by 0.125, rank 1 by 0.75: mean delta 0.4375.
    buf2 = 0.9 * 0.625 + 0.4375                             # 1.0
    a2 = a1 - 0.5 * (0.4375 + 0.9 * buf2)                   # 0.40625 - 0.66875 = -0.2625
    for seen, momenta in results:
        assert seen[1] == pytest.approx(a1, abs=1e-12) and seen[3] == pytest.approx(a2, abs=1e-12)
        assert seen[0] != seen[1]  # step 1 is an inner step only
        assert momenta == [pytest.approx(buf2, abs=1e-12)]


# ---------------------------------------------------------------------------- streaming
def test_streaming_syncs_fragments_in_turn_overlapped():
    """H=4, F=2, delay 1: fragment 0 starts at steps 2, 6, 10 and lands a step later;
    fragment 1 starts at 4, 8, 12. Right after a landing the ranks hold the same bytes on
    that fragment (and still differ on the other one); every parameter is synced."""
    size, steps = 2, 12

    def job(comm):
        model = fresh_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = DiLoCo(model, opt, sync_every=4, fragments=2, delay=1, outer_lr=0.7,
                       outer_momentum=0.9, compressor=Int8(block=8), comm=comm)
        snaps = []
        for step in range(steps):
            inner_step(model, opt, comm.rank, step)
            outer.outer_step()
            snaps.append([p.detach().clone() for p in model.parameters()])
        outer.finish()
        return snaps, outer.landed, outer.groups, [p.detach().clone() for p in
                                                   model.parameters()]

    results, _ = run_ranks(size, job)
    snaps0, landed, groups, _ = results[0]
    assert landed == [(3, 0), (5, 1), (7, 0), (9, 1), (11, 0), (12, 1)]  # 12: finish()
    assert sorted(i for g in groups for i in g) == list(range(4)) and len(groups) == 2
    for t, fragment in landed[:-1]:
        other = 1 - fragment
        for i in groups[fragment]:
            assert torch.equal(results[1][0][t - 1][i], snaps0[t - 1][i]), (t, i)
        assert any(not torch.equal(results[1][0][t - 1][i], snaps0[t - 1][i])
                   for i in groups[other]), (t, "the other fragment is synced too")
    # At the step a fragment starts, nothing lands: it is in flight, the ranks still differ.
    for i in groups[0]:
        assert not torch.equal(results[1][0][1][i], snaps0[1][i])
    # finish() lands fragment 1 (started at 12); fragment 0 took an inner step since 11.
    final = [results[r][3] for r in range(size)]
    assert all(torch.equal(final[1][i], final[0][i]) for i in groups[1])
    assert not all(torch.equal(final[1][i], final[0][i]) for i in groups[0])


def test_carry_on_one_rank_keeps_every_inner_step():
    """One rank, outer lr 1, no momentum: the outer gradient is the rank's own delta, so the
    new anchor is where the parameters were when the sync started. With ``carry`` the steps
    taken in flight are kept on top of it: the parameters follow the inner optimizer alone
    (to float rounding); without it, those steps are thrown away at every landing."""
    steps = 12

    def run(**kw):
        model = fresh_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = DiLoCo(model, opt, sync_every=4, delay=2, outer_lr=1.0, outer_momentum=0.0,
                       comm=ThreadComm(ThreadGroup(1), 0), **kw)
        for step in range(steps):
            inner_step(model, opt, 0, step)
            outer.outer_step()
        outer.finish()
        return flat(model), outer.landed

    alone = fresh_model()
    opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    for step in range(steps):
        inner_step(alone, opt, 0, step)
    carried, landed = run(carry=True)
    assert landed == [(6, 0), (10, 0), (12, 0)]  # started at 4, 8, 12; 12: finish()
    assert torch.allclose(carried, flat(alone), rtol=0, atol=1e-6)
    replaced, _ = run()
    assert not torch.allclose(replaced, flat(alone), rtol=0, atol=1e-3)


def test_carry_lands_the_new_anchor_plus_the_steps_in_flight():
    """Two ranks, Nesterov outer step, int8 syncs, delay 1: at each landing a rank's
    parameters are the new anchor (equal on every rank) plus what that rank moved since the
    sync started; the anchors stay equal across ranks."""
    size, steps = 2, 9

    def job(comm):
        model = fresh_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = DiLoCo(model, opt, sync_every=4, delay=1, outer_lr=0.7, outer_momentum=0.9,
                       carry=True, compressor=Int8(block=8), comm=comm)
        seen = []
        for step in range(steps):
            inner_step(model, opt, comm.rank, step)
            before = flat(model)
            landing = outer.step_count + 1 in {p.land for p in outer.pending}
            outer.outer_step()
            if landing:
                seen.append((before, torch.cat([a.reshape(-1) for a in outer.anchors]).clone(),
                             flat(model)))
            if outer.pending:
                started = outer.pending[0]
                seen.append(("started", (torch.cat([a.reshape(-1) for a in outer.anchors])
                                         - started.delta).clone()))
        return seen

    results, _ = run_ranks(size, job)
    for rank in range(size):
        seen = results[rank]
        starts = [s[1] for s in seen if s[0] == "started"]
        lands = [s for s in seen if not isinstance(s[0], str)]
        assert len(lands) == 2 and len(starts) == 2
        for (before, anchor, after), theta_start in zip(lands, starts):
            assert torch.allclose(after, anchor + (before - theta_start), atol=1e-6)
            assert not torch.allclose(after, anchor, atol=1e-6)  # the in-flight step kept
    for (_, a0, _), (_, a1, _) in zip([s for s in results[0] if not isinstance(s[0], str)],
                                      [s for s in results[1] if not isinstance(s[0], str)]):
        assert torch.equal(a0, a1)


def test_a_caller_keeping_its_own_schedule_starts_and_counts_the_syncs():
    """``sync_now(d)`` starts every fragment's sync, landing at the d-th ``tick`` after it
    (``sync_now(0)``: at once); ``tick`` lands, never starts; a second sync while one is in
    flight is refused. Each landed reduction's seconds come back, timed on the thread."""
    size = 2

    def job(comm):
        model = fresh_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = DiLoCo(model, None, sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                       carry=True, comm=comm)
        got = []
        for step in range(6):
            inner_step(model, opt, comm.rank, step)
            got.append(("tick", step, outer.tick()))
            if step == 1:
                got.append(("at once", step, outer.sync_now(0)))
            if step == 2:
                assert outer.sync_now(2) == []
                with pytest.raises(RuntimeError, match="in flight"):
                    outer.sync_now(0)
        return got, outer.landed

    results, _ = run_ranks(size, job)
    got, landed = results[0]
    assert landed == [(2, 0), (5, 0)]  # its 2nd tick at once; started at 3, landed at 5
    landings = [(what, step) for what, step, seconds in got if seconds]
    assert landings == [("at once", 1), ("tick", 4)]
    assert all(s >= 0.0 for _, _, seconds in got for s in seconds)


def test_carry_and_mix_are_exclusive():
    with pytest.raises(ValueError, match="carry"):
        DiLoCo(fresh_model(), None, sync_every=4, delay=1, mix=0.5, carry=True,
               comm=ThreadComm(ThreadGroup(1), 0))


def test_fragments_cover_every_parameter_once():
    assert fragments_of([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert fragments_of([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert fragments_of([1, 2, 3], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError):
        fragments_of([1, 2], 3)


# ---------------------------------------------------------------------------- state
def _run(comm, steps, model, opt, outer, start=0, record=None):
    for step in range(start, steps):
        inner_step(model, opt, comm.rank, step)
        outer.outer_step()
        if record is not None:
            record.append(flat(model))


def _streaming(model, opt, comm):
    return DiLoCo(model, opt, sync_every=4, fragments=2, delay=1, outer_lr=0.7,
                  outer_momentum=0.9, compressor=Int8(block=8), comm=comm)


def test_state_dict_round_trip_continues_bit_for_bit():
    """The state taken at step 6 (fragment 0 in flight: it started at 6, lands at 7), loaded
    into a new model, optimizer and DiLoCo, continues as the uninterrupted run, bit for bit,
    int8 residuals and momentum included."""

    def job(comm):
        model = fresh_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        outer = _streaming(model, opt, comm)
        _run(comm, 6, model, opt, outer)
        assert outer.pending, "a sync must be in flight when the state is taken"
        saved = copy.deepcopy((model.state_dict(), opt.state_dict(), outer.state_dict()))
        straight = []
        _run(comm, 14, model, opt, outer, 6, straight)
        outer.finish()  # its last sync must not share the group with the second run's
        model2 = fresh_model()
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.5)
        outer2 = _streaming(model2, opt2, comm)
        model2.load_state_dict(saved[0])
        opt2.load_state_dict(saved[1])
        outer2.load_state_dict(saved[2])
        again = []
        _run(comm, 14, model2, opt2, outer2, 6, again)
        return straight, again

    results, _ = run_ranks(2, job)
    for straight, again in results:
        assert len(straight) == 8
        for a, b in zip(straight, again):
            assert torch.equal(a, b)


def _object_state(**values):
    return ObjectState(lambda obj, root_rank=0, name=None: obj, lambda: 0, **values)


def test_compressor_in_elastic_state_restores_bit_for_bit():
    """Item 6: an Int8 compressor given to an elastic State: commit, reduce on, restore, and
    the same reductions give the same bytes as after the commit (the residuals came back)."""

    def job(comm):
        c = Int8(block=8)
        state = _object_state(compressor=c)
        g = [torch.randn(40, generator=torch.Generator().manual_seed(s + 10 * comm.rank))
             for s in range(6)]
        for s in range(3):
            c.reduce(g[s], [(40,)], comm, "b", average=True)
        state.commit()
        first = [c.reduce(g[s], [(40,)], comm, "b", average=True) for s in range(3, 6)]
        state.restore()
        second = [c.reduce(g[s], [(40,)], comm, "b", average=True) for s in range(3, 6)]
        return first, second

    results, _ = run_ranks(2, job)
    for first, second in results:
        assert all(torch.equal(a, b) for a, b in zip(first, second))
        assert not torch.equal(first[0], first[1])


class FailingComm(ThreadComm):
    """A ThreadComm whose ``fail_at``-th collective raises on every rank (a lost peer)."""

    def __init__(self, group, rank, fail_at):
        super().__init__(group, rank)
        self.calls, self.fail_at = 0, fail_at

    def _exchange(self, t):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError(f"rank {self.rank}: peer lost")
        return super()._exchange(t)


def test_fault_mid_window_costs_only_the_fragment_in_flight():
    """3 ranks, H=4, F=2, delay 1, committing (the model by hand, DiLoCo through an elastic
    ObjectState) whenever no sync is in flight. Fragment 1's reduction started at step 8
    fails in flight (every rank's 7th collective: int8 issues two per sync); the fault
    surfaces at its landing, step 9. Every rank restores its commit of step 7 (the window's
    inner steps up to there are kept: steps 8-9 and the fragment in flight are what is
    lost), rank 2 leaves, and the two survivors go on over a new group to step 16, their
    outer state equal bit for bit."""
    group, survivors = ThreadGroup(3), ThreadGroup(2)

    def body(r):
        comm = FailingComm(group, r, fail_at=7)
        model = fresh_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = _streaming(model, opt, comm)
        state = _object_state(diloco=outer)
        saved = flat(model)
        with pytest.raises(ConnectionError):
            for step in range(16):
                inner_step(model, opt, r, step)
                outer.outer_step()
                if not outer.pending:
                    state.commit()
                    saved = flat(model)
        assert outer.step_count == 9
        if r == 2:
            return None
        state.restore()
        torch.nn.utils.vector_to_parameters(saved.clone(), model.parameters())
        assert outer.step_count == 7 and not outer.pending and outer.landed[-1] == (7, 0)
        outer.use_comm(ThreadComm(survivors, r))
        _run(outer._reducer.comm, 16, model, opt, outer, 7)
        return flat(model), outer.state_dict(), outer.landed

    results = run_threads(3, body, survivors.barrier.abort)
    (m0, s0, landed), (m1, s1, _) = results[0], results[1]
    assert landed[-4:] == [(9, 1), (11, 0), (13, 1), (15, 0)]
    for a, b in zip(s0["anchors"] + s0["momenta"], s1["anchors"] + s1["momenta"]):
        assert torch.equal(a, b)
    assert s0["step"] == s1["step"] == 16
    assert not torch.equal(m0, m1)  # inner steps on their own data since step 15


def thread_bcast(comm):
    """``bcast_object`` over the in-memory group: every rank gets a copy of the root's."""
    def bcast(obj, root_rank=0, name=None):
        g = comm.group
        g.slots[comm.rank] = obj
        g.barrier.wait()
        got = copy.deepcopy(g.slots[root_rank])
        g.barrier.wait()
        return got
    return bcast


def test_a_new_worker_takes_the_live_outer_state_and_the_cut_sync_is_redone():
    """Rank 1 is replaced by a new worker while fragment 0's sync (started at step 6) is in
    flight. Both take rank 0's live state (``sync_from``): the joiner gets the anchors,
    momentum, residuals and the step counter, the cut sync keeps its delta, and at the next
    step it is reduced again over the new group and lands: ranks equal on fragment 0."""
    old, new = ThreadGroup(2), ThreadGroup(2)

    def body(r):
        comm = ThreadComm(old, r)
        model = fresh_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = _streaming(model, opt, comm)
        _run(comm, 6, model, opt, outer)
        assert [p.fragment for p in outer.pending] == [0]
        outer.settle()  # the old group's reduction ends before the new one is used
        if r == 1:  # the new worker: a fresh process state
            model = fresh_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            outer = _streaming(model, opt, comm)
        for p in outer.pending:  # the fault: the reduction's result never arrived
            p.result = None
        handler = outer.elastic_handler(thread_bcast(ThreadComm(new, r)))
        handler.sync_from(0)
        mine = [t.detach().clone() for t in model.parameters()]
        live = thread_bcast(ThreadComm(new, r))(mine, 0)  # the model's handler does this
        torch.nn.utils.vector_to_parameters(torch.cat([t.reshape(-1) for t in live]),
                                            model.parameters())
        assert outer.step_count == 6 and [p.fragment for p in outer.pending] == [0]
        outer.use_comm(ThreadComm(new, r))
        _run(outer._reducer.comm, 7, model, opt, outer, 6)
        return outer.state_dict(), [p.detach().clone() for p in model.parameters()], \
            outer.groups, outer.landed

    results = run_threads(2, body, lambda: (old.barrier.abort(), new.barrier.abort()))
    (s0, p0, groups, landed0), (s1, p1, _, landed1) = results
    assert landed1 == [(7, 0)] and landed0[-1] == (7, 0)
    assert s0["step"] == s1["step"] == 7
    for a, b in zip(s0["anchors"] + s0["momenta"], s1["anchors"] + s1["momenta"]):
        assert torch.equal(a, b)
    assert all(torch.equal(p0[i], p1[i]) for i in groups[0])
    assert s1["compressor"]["state"]["tensors"]  # the joiner took the residuals
