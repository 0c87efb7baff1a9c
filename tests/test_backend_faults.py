"""The "gradsync" torch backend under faults: ``abort()`` and ``shutdown()`` on one rank end the
collectives in flight on every rank, and a stopped rank fails DDP on the others within the
heartbeat's bound, so that ``torchrun --max-restarts`` restarts a job in seconds rather than
after the group's 30-minute timeout. The ranks are started as torchrun starts them, each its
own process with its own exit status, forked from one that imported torch once
(``forked_jobs.spawn``)."""

import re

import pytest

from gradsync.torch.backend.group import SHUTDOWN_GRACE_S
import forked_jobs

pytestmark = pytest.mark.multiprocess


def _after(rank, what: str = "AFTER") -> float:
    """Seconds from the agreed moment to the error that this rank caught (or to ``what``)."""
    return float(re.search(what + r" rank=\d+ ([\d.]+)", rank.output).group(1))


@pytest.mark.parametrize("mode, ender, words", [
    ("abort", 0, "the process group was aborted by rank 0"),
    ("abort", 2, "the process group was aborted by rank 2"),
    ("shutdown", 0, "rank 0 shut the process group down with all_reduce in flight"),
])
def test_abort_or_shutdown_on_one_rank_ends_every_ranks_collective(mode, ender, words):
    # Ranks 0 and 1 have an all_reduce in flight that rank 2 does not join; at T rank 0 (with
    # the all_reduce in flight) or rank 2 (with nothing in flight) aborts, or rank 0 shuts
    # down; rank 2 issues its own all_reduce at T + 0.5 s, after shutdown's grace.
    # lean: no optimizer here, so no torch._dynamo to import first (1.5 s of CPU)
    ranks = forked_jobs.spawn(3, "pg_abort.py", mode, str(ender), timeout=60, lean=True)
    for r in ranks:
        assert r.returncode == 3, f"rank {r.rank}: exit {r.returncode}\n{r.output[-4000:]}"
        assert words in r.output, r.output[-4000:]
    # The abort's own rank at once, the peers within a look at the record (0.1 s); shutdown
    # first gives its queue SHUTDOWN_GRACE_S. 1.5 s of slack for a loaded machine.
    grace = SHUTDOWN_GRACE_S if mode == "shutdown" else 0.0
    assert _after(ranks[0]) < grace + 0.1 + 1.5, ranks[0].output
    assert _after(ranks[1]) < grace + 0.1 + 1.5, ranks[1].output
    assert _after(ranks[2]) < grace + 0.5 + 0.1 + 1.5, ranks[2].output


def test_a_stopped_rank_fails_ddp_on_every_other_rank_within_the_heartbeat_bound(tmp_path):
    bound = 3.0  # issue 28's detection bound for the defaults (2.6 s: heartbeat.py)
    # The stopped rank is killed once both survivors have caught their error (pg_abort.py)
    ranks = forked_jobs.spawn(3, "pg_abort.py", "stop", str(tmp_path), timeout=90)
    assert ranks[2].returncode == -9, ranks[2]  # stopped, then ended by its lifeline
    for r in ranks[:2]:
        assert r.returncode == 3, f"rank {r.rank}: exit {r.returncode}\n{r.output[-4000:]}"
        assert "PeerLostBackendError" in r.output and "rank 2 on host" in r.output, r.output
        assert "sent no heartbeat" in r.output, r.output  # the heartbeat found it
        # 1 s of slack for a loaded machine
        assert _after(r) - _after(ranks[2], "STOP") < bound + 1.0, r.output
