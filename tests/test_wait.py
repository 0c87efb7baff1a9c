"""The transport's one wait policy (``transport/wait.py``), in one process: the polling loop's
ladder, ``wait_all`` climbing it, and the compiled counter wait handed the same rungs."""

from __future__ import annotations

import os
import socket
import time
import types

import pytest

from gradsync.transport import base, wait
from gradsync.transport.base import Expect, Pair, Recv, Send, wait_all


def _record(monkeypatch, clock: "list | None" = None) -> list:
    """Replaces the ladder's yield and nap by records of them, and its clock by ``clock[0]``,
    which moves only when the test moves it (frozen where no list is given)."""
    steps: list = []
    clock = clock if clock is not None else [1000.0]
    monkeypatch.setattr(wait.os, "sched_yield", lambda: steps.append("yield"))
    monkeypatch.setattr(wait.time, "sleep", lambda s: steps.append(s))
    monkeypatch.setattr(wait.time, "monotonic", lambda: clock[0])
    return steps


def test_backoff_spins_then_yields_then_naps_doubling_to_the_cap(monkeypatch):
    steps = _record(monkeypatch)
    backoff = wait.Backoff()
    for _ in range(wait.SPINS - 1):
        backoff.idle()
    assert steps == []  # spinning
    for _ in range(wait.YIELDS):
        backoff.idle()
    assert steps == ["yield"] * wait.YIELDS
    del steps[:]
    for _ in range(12):
        backoff.idle()
    naps = [min(wait.FIRST_NAP * 2 ** i, wait.MAX_NAP) for i in range(12)]
    assert steps == naps and naps[-1] == wait.MAX_NAP
    backoff.reset()
    backoff.idle()
    assert steps == naps  # progress: spinning again


def test_the_yields_end_at_PY_YIELD_FOR_after_the_last_progress_however_few(monkeypatch):
    """With more ranks than cores each yield lasts another rank's turn, and a rank that
    yields stays runnable: the rung ends by the clock, not only by its count."""
    clock = [1000.0]
    steps = _record(monkeypatch, clock)
    backoff = wait.Backoff()
    for _ in range(wait.SPINS - 1 + 5):
        backoff.idle()
    assert steps == ["yield"] * 5
    clock[0] += wait.PY_YIELD_FOR
    backoff.idle()
    assert steps[5:] == [wait.FIRST_NAP]  # 5 yields, not YIELDS: the nap rung
    backoff.reset()  # progress: the rung's time counts from here
    for _ in range(wait.SPINS):
        backoff.idle()
    assert steps[6:] == ["yield"]


def test_a_long_wait_naps_longer_but_ends_at_most_LATE_SHARE_late(monkeypatch):
    """Past ``MAX_NAP / LATE_SHARE`` without progress a nap may last ``LATE_SHARE`` of the wait
    so far (up to ``LONG_NAP``): a rank that waits on a peer bound by a slow link wakes
    hundreds of times a second, not thousands, and finds the peer at most 2% late."""
    clock = [1000.0]
    steps = _record(monkeypatch, clock)
    nap = wait.Nap()
    for _ in range(12):
        nap()
    assert steps[-1] == wait.MAX_NAP and wait.MAX_NAP / wait.LATE_SHARE >= 0.02
    del steps[:]
    clock[0] += 0.1  # 100 ms without progress: naps of up to 2 ms
    for _ in range(4):
        nap()
    assert steps == pytest.approx([wait.MAX_NAP, 2 * wait.MAX_NAP, 0.1 * wait.LATE_SHARE,
                                   0.1 * wait.LATE_SHARE])
    del steps[:]
    clock[0] += 100  # far longer: up to LONG_NAP, no further
    for _ in range(5):
        nap()
    assert steps[-2:] == [wait.LONG_NAP] * 2 and max(steps) == wait.LONG_NAP
    nap.reset()  # progress: the next wait starts at the first nap again
    nap()
    assert steps[-1] == wait.FIRST_NAP


def test_nap_doubles_to_the_cap_for_the_waits_outside_the_transport(monkeypatch):
    steps = _record(monkeypatch)
    nap = wait.Nap()
    for _ in range(12):
        nap()
    assert steps == [min(wait.FIRST_NAP * 2 ** i, wait.MAX_NAP) for i in range(12)]
    # The waits that nap with their own loop take this one, not a figure of their own.
    from gradsync.data import slots
    from gradsync.torch.backend import p2p
    from gradsync.transport import segment_sync

    for module in (slots, p2p, segment_sync):
        assert module.Nap is wait.Nap, module.__name__


class _Slow(Pair):
    """A polled pair (no descriptor) whose one send completes after ``rounds`` advances."""

    fileno = -1

    def __init__(self, rounds: int):
        self.peer, self.left = 1, rounds

    def advance_send(self, op: Send) -> bool:
        self.left -= 1
        return self.left <= 0

    def close(self) -> None:
        pass


def test_wait_all_on_a_polled_pair_climbs_the_one_ladder(monkeypatch):
    steps = _record(monkeypatch)
    monkeypatch.setattr(wait, "SPINS", 2)
    monkeypatch.setattr(wait, "YIELDS", 3)
    send = Send(_Slow(10), b"", memoryview(b""))
    wait_all([send], time.monotonic() + 10, lambda waited: None, lambda: "a test send")
    assert send.done
    # 10 advances: the first round, then 8 idle rounds (1 spin, 3 yields, 4 naps), then done.
    assert steps == ["yield"] * 3 + [1e-6, 2e-6, 4e-6, 8e-6]
    assert base.CHECK_EVERY is wait.CHECK_EVERY  # the liveness looks' interval is the policy's


class _Trickle(Pair):
    """A socket pair (a descriptor to select on) whose receive takes one byte a round."""

    is_socket = True

    def __init__(self, fileno: int, length: int):
        self.peer, self.fileno, self.length = 2, fileno, length

    def advance_recv(self, op: Recv) -> bool:
        op.offset += 1
        return op.offset >= self.length

    def close(self) -> None:
        pass


def test_bytes_on_a_socket_do_not_hold_a_polled_wait_on_its_spinning_rungs(monkeypatch):
    """A ring step over both kinds of pair (a same-host neighbour on one side, a slow link on
    the other): the socket's trickle is no news of the polled peer, so the ladder climbs as
    if nothing moved, and its naps sleep in ``select`` on the socket, which wakes them when
    bytes come. Before, each byte reset the ladder: the rank spun and yielded for as long as
    the link took."""
    steps = _record(monkeypatch)
    selects: list = []
    monkeypatch.setattr(base.select, "select",
                        lambda rd, wr, ex, timeout: selects.append((rd, wr, timeout)) or
                        ([], [], []))
    monkeypatch.setattr(wait, "SPINS", 2)
    monkeypatch.setattr(wait, "YIELDS", 3)
    a, b = socket.socketpair()
    fd = a.fileno()
    with a, b:
        send = Send(_Slow(12), b"", memoryview(b""))
        recv = Recv(_Trickle(fd, 50), Expect(0, 0, 0, lambda: "x"), memoryview(b""))
        wait_all([send, recv], time.monotonic() + 10, lambda waited: None, lambda: "a test")
    assert send.done and recv.done
    # 12 advances of the send: the first round, then 10 idle rounds (1 spin, 3 yields, 6 naps
    # in select on the socket), then done; the receive's last 38 bytes without sleeping.
    assert steps == ["yield"] * 3
    assert selects == [([fd], [], wait.FIRST_NAP * 2 ** i) for i in range(6)]


def test_the_compiled_wait_is_handed_the_policys_rungs(monkeypatch):
    """``ShmGroup`` opens the compiled road with ``native_ladder``: _shmfast.c keeps no
    duration of its own, so a change here reaches the C wait."""
    assert wait.native_ladder(True) == (int(wait.MAX_SPIN * 1e9), int(wait.YIELD_FOR * 1e9),
                                        int(wait.CHECK_EVERY * 1e9), int(wait.MAX_NAP * 1e9),
                                        int(wait.BARRIER_YIELD_FOR * 1e9))
    assert wait.native_ladder(False)[0] == int(wait.MIN_SPIN * 1e9)
    from gradsync.transport import host_segment

    opened: list = []
    fake = types.SimpleNamespace(open=lambda *args: opened.append(args) or object(),
                                 call=None, fold=None, stream=None, Prepared=None)
    monkeypatch.setattr(host_segment._native, "load", lambda name, build=True: fake)
    name = f"gradsync-test-wait-{os.getpid()}"
    segment = host_segment.create_group_segment(name, 1, 4096)
    host_segment.unlink_segment(name)
    group = host_segment.ShmGroup(segment, 0)
    try:
        assert group.fast and len(opened) == 1
        assert opened[0][-5:] == wait.native_ladder(wait.may_spin(1))
    finally:
        group.close()


@pytest.mark.parametrize("ranks, cores, spins", [(2, {0, 1}, True), (3, {0, 1}, False)])
def test_a_counter_wait_spins_only_when_every_rank_can_have_a_core(monkeypatch, ranks, cores,
                                                                   spins):
    monkeypatch.setattr(wait.os, "sched_getaffinity", lambda pid: cores)
    assert wait.may_spin(ranks) is spins
