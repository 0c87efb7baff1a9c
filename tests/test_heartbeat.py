"""Heartbeats: a stopped rank is a lost rank within the bound; a busy one is not."""

import re
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from gradsync.config import Config
from gradsync.heartbeat import Heartbeat, watched_peers
from gradsync.rendezvous import Store
from harness import launch

pytestmark = pytest.mark.multiprocess

TIMEOUT, INTERVAL = 3.0, 0.5
ENV = {"GRADSYNC_HEARTBEAT_TIMEOUT": str(TIMEOUT), "GRADSYNC_HEARTBEAT_INTERVAL": str(INTERVAL)}


def test_watched_peers_are_ring_neighbours_and_everyone_is_watched():
    assert watched_peers(0, 1) == []
    assert watched_peers(1, 2) == [0]
    assert watched_peers(0, 3) == [2, 1]
    assert watched_peers(0, 4) == [3, 1, 2]
    assert watched_peers(5, 100) == [4, 6, 3, 7]
    for size in range(2, 12):
        watchers = {r: 0 for r in range(size)}
        for rank in range(size):
            for peer in watched_peers(rank, size):
                watchers[peer] += 1
        assert min(watchers.values()) >= min(size - 1, 4), (size, watchers)


def test_the_default_bound_is_at_most_30_seconds():
    config = Config()
    assert 0 < config.heartbeat_timeout + config.heartbeat_interval <= 30


@pytest.mark.parametrize("n, victim, transport", [
    (3, 1, "tcp"),
    pytest.param(4, 2, "auto", marks=pytest.mark.slow),  # shared memory: pids exist, sockets none
    pytest.param(2, 0, "auto", marks=pytest.mark.slow),  # rank 0 stopped
])
def test_a_stopped_rank_is_lost_on_every_other_rank_within_the_bound(n, victim, transport):
    result = launch(n, "silent.py", str(victim), transport, "stop", timeout=60, env=ENV)
    assert result.returncode == 17, result
    got = dict(re.findall(r"RESULT rank=(\d+) (.*)", result.output))
    elapsed = [float(e) for e in re.findall(r"ELAPSED rank=\d+ ([\d.]+)", result.output)]
    assert sorted(int(r) for r in got) == [r for r in range(n) if r != victim], result
    for line in got.values():
        assert line.startswith("PeerLostError"), result
        assert f"rank {victim} on host" in line and "heartbeat" in line, result
    assert len(elapsed) == n - 1, result
    # timeout + one interval (the look that notices) + a poll; 2 s of slack for a loaded host
    assert max(elapsed) < TIMEOUT + INTERVAL + 2.0, elapsed
    assert min(elapsed) > TIMEOUT - INTERVAL, elapsed  # it was the heartbeat, not a socket


def test_a_busy_rank_is_not_lost():
    result = launch(3, "silent.py", "1", "auto", "busy", timeout=60, env=ENV)
    assert result.returncode == 0, result
    assert len(re.findall(r"RESULT rank=\d+ no error", result.output)) == 3, result


def _watch_a_peer_that_never_beats(store, rank: int, root):
    """Rank ``rank`` of a two-rank World over ``store`` watches a peer that never beats,
    until it declares it lost (timeout 0.3 s); returns the PeerLostError."""
    beat = Heartbeat(store, rank, 2, interval=0.05, timeout=0.3, root=root).start()
    try:
        deadline = time.monotonic() + 10
        while beat.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        beat.stop(goodbye=False)
    assert beat.lost is not None, "the silent peer was not found within 10 s"
    return beat.lost


def _store_server():
    return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))


def _posted(monkeypatch) -> list:
    """Every abort record posted from now on, in order, with the job it was posted in (the
    first post wins the record, so reading the record alone cannot show a second one)."""
    posted = []
    post = Store.post_abort

    def spy(self, record):
        posted.append((self.job, record))
        return post(self, record)

    monkeypatch.setattr(Store, "post_abort", spy)
    return posted


def test_a_sub_worlds_silent_peer_is_also_reported_in_the_root_worlds_record(monkeypatch):
    # The launcher watches only the root World's abort record; an elastic job whose silent
    # worker was found first by the heartbeat of a sub-world (the Horovod API's process-set
    # Worlds) waited for ever. Here rank 0 of a two-rank sub-world, root ranks [5, 3], watches
    # a peer that never beats.
    server = _store_server()
    root = Store.over(server, "job", 10.0)
    sub = Store.over(server, "job/sub", 10.0)
    posted = _posted(monkeypatch)
    assert _watch_a_peer_that_never_beats(sub, 0, ("job", [5, 3])).peer == 1
    own, top = sub.read_abort(), root.read_abort()
    assert (own["rank"], own["peer"], own["silent"]) == (0, 1, True), own
    assert (top["rank"], top["peer"], top["silent"]) == (5, 3, True), top
    assert top["kind"] == "PeerLostError" and "in sub-world job/sub" in top["message"], top
    assert [job for job, _ in posted] == ["job/sub", "job"], posted


def test_a_root_worlds_heartbeat_does_not_report_twice(monkeypatch):
    root = Store.over(_store_server(), "job", 10.0)
    posted = _posted(monkeypatch)
    assert _watch_a_peer_that_never_beats(root, 1, ("job", [0, 1])).peer == 0
    record = root.read_abort()
    assert (record["rank"], record["peer"]) == (1, 0), record
    assert "sub-world" not in record["message"], record
    assert [job for job, _ in posted] == ["job"], posted
