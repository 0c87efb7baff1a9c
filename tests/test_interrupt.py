"""Ctrl-C on `gradsync run` in the middle of shared-memory allreduces: every rank stops, the
launcher exits 130, and nothing is left in /dev/shm."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import MARK, RANKS, kill_marked, marked, new_mark

pytestmark = pytest.mark.multiprocess


def segments(job: str) -> set[str]:
    """The shared-memory segments of the job ``job`` (only its own: another job may run beside
    it, tests/parallel.py)."""
    return {p.name for p in Path("/dev/shm").glob(f"gradsync-{job}*")}


def job_of(pids: set[int]) -> str:
    """The job id that the launcher gave the ranks ``pids`` (GRADSYNC_JOB_ID)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                for item in f.read().split(b"\0"):
                    if item.startswith(b"GRADSYNC_JOB_ID="):
                        return item.split(b"=", 1)[1].decode()
        except OSError:
            continue
    raise AssertionError(f"no rank of {sorted(pids)} has GRADSYNC_JOB_ID")


@pytest.mark.parametrize("n", [2, 3])
def test_ctrl_c_mid_allreduce_stops_every_rank_and_leaks_no_segment(n):
    mark = new_mark()  # finds this job's processes, and no other job's on the machine
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env.update({"GS_TEST_DEADLINE": "40", "PYTHONUNBUFFERED": "1", MARK: mark})
    proc = subprocess.Popen([sys.executable, "-m", "gradsync", "run", "-np", str(n),
                             sys.executable, str(RANKS / "busy.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        ready = 0
        deadline = time.monotonic() + 30
        while ready < n and time.monotonic() < deadline:
            line = proc.stdout.readline()
            ready += line.rstrip().endswith("ready")
        assert ready == n, "ranks did not start"
        # every rank prints 'ready' just before its loop of allreduces: they are in it now
        ranks = set(marked(mark)) - {proc.pid}
        assert len(ranks) >= n, f"the mark finds {sorted(ranks)}, not the {n} ranks"
        job = job_of(ranks)
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = marked(mark)
        kill_marked(mark)  # never leave them running, even when the test fails
    assert proc.returncode == 130
    assert left == [], f"ranks still running: {left}"
    assert segments(job) == set()
