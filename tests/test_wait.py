"""The transport's one wait policy (``transport/wait.py``), in one process: the polling loop's
ladder, ``wait_all`` climbing it, and the compiled counter wait handed the same rungs."""

from __future__ import annotations

import os
import time
import types

import pytest

from gradsync.transport import base, wait
from gradsync.transport.base import Pair, Send, wait_all


def _record(monkeypatch) -> list:
    """Replaces the ladder's yield and nap by records of them."""
    steps: list = []
    monkeypatch.setattr(wait.os, "sched_yield", lambda: steps.append("yield"))
    monkeypatch.setattr(wait.time, "sleep", lambda s: steps.append(s))
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
                                 call=None, fold=None)
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
