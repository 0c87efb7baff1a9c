"""Emulated multi-host clusters for tests: ``gradsync.testbed.netns`` plus the tests' conventions.

    with cluster([("h0", 2), ("h1", 2)], host_rate="1gbit") as c:
        for r in run_ranks(c, "sweep.py", timeout=60, placement="alternate"):
            assert r.returncode == 0, r

``cluster`` skips the test when network namespaces cannot be made (not root, no ``ip``).
``run_ranks`` starts ``tests/ranks/<script>`` as every rank, torchrun-style, in its host's
namespace, like ``harness.spawn``: GRADSYNC_* settings of the test process are dropped, each
rank's own deadline (GS_TEST_DEADLINE, see ``ranks/common.py``) dumps its stacks and exits 8 s
before ``timeout``, and at ``timeout`` every rank still running is killed and the test fails
with every rank's output. ``run_forked`` gives the same results for one interpreter per host,
which forks that host's ranks (``tests/ranks/forked.py``, as ``forked_jobs.spawn`` does on
one host): a rank started on its own spent most of a sweep's time importing torch.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pytest

from gradsync.run.processes import start
from gradsync.testbed.netns import (Cluster, NetnsError, RankResult, cleanup_stale,  # noqa: F401
                                    measure_goodput, place, rank_env, run, unavailable_reason)

RANKS = Path(__file__).parent / "ranks"


def require_netns() -> None:
    """Skips the calling test when network namespaces are unavailable, saying why."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"needs root for network namespaces: {reason}")


@contextmanager
def cluster(hosts: Sequence[tuple[str, int]], groups: Mapping[str, Sequence[str]] | None = None,
            **shaping) -> Iterator[Cluster]:
    """An emulated cluster for the duration of the ``with`` (arguments: ``Cluster``'s)."""
    require_netns()
    with Cluster(hosts, groups, **shaping) as c:
        yield c


def run_ranks(c: Cluster, script: str, args: Sequence[str] = (), timeout: float = 60,
              env: Mapping[str, str] | None = None,
              placement: str | Sequence[str] = "host") -> list[RankResult]:
    """Runs ``tests/ranks/<script> args`` as every rank of ``c``; results in rank order.

    Raises:
        AssertionError: a rank was still running at ``timeout`` (the message has every
            rank's output, with the stacks the rank deadline dumped).
    """
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    environ.update({"GS_TEST_DEADLINE": str(max(5.0, timeout - 8)), "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": "1"})
    argv = [sys.executable, str(RANKS / script), *args]
    results = run(c, argv, timeout=timeout, placement=placement, env=env, environ=environ)
    if any(r.timed_out for r in results):
        raise AssertionError(f"{script} {' '.join(args)} passed its {timeout}s deadline:\n"
                             + "\n".join(f"--- {r}" for r in results))
    return results


def run_forked(c: Cluster, script: str, args: Sequence[str] = (), timeout: float = 60,
               env: Mapping[str, str] | None = None,
               placement: str | Sequence[str] = "host") -> list[RankResult]:
    """``run_ranks``'s results, each host's ranks forked from one interpreter in its namespace
    (``ip netns exec``: its network and its /etc/hosts) that imported torch once. Each rank
    is still a process of its own with its torchrun-style variables (``rank_env``; rank 0
    hosts the store, as under ``run_ranks``), exit status and output.

    Raises:
        AssertionError: a rank had not ended at ``timeout`` (every host's process group is
            killed; the message has every rank's output, with the stacks its deadline dumped).
    """
    slots = place(c.hosts, placement)
    port = random.randrange(20000, 32000)  # below the ephemeral range; each ns has its own
    job_id = f"{c.run_id}-{port}"  # shm segment names must differ between runs
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    base.update({"GS_TEST_DEADLINE": str(max(5.0, timeout - 8)), "PYTHONUNBUFFERED": "1",
                 "OMP_NUM_THREADS": "1"})
    with tempfile.TemporaryDirectory(prefix="gs-netns-") as logs:
        hosts = []
        for host in c.hosts:
            mine = [s for s in slots if s.host.name == host.name]
            given = [{**rank_env(c, s, slots, port, job_id),
                      "TORCHELASTIC_USE_AGENT_STORE": "False", **(env or {})} for s in mine]
            argv = [sys.executable, str(RANKS / "forked.py"), str(len(mine)), str(len(mine)),
                    logs, str(RANKS / script), *args]
            hosts.append(start(c.exec_argv(host.name, argv),
                               {**base, "GS_TEST_RANKS_ENV": json.dumps(given),
                                "GS_TEST_FORK_LEAN": "1"},  # the scripts train nothing
                               merge_stderr=True, text=True))
        end, said, late = time.monotonic() + timeout, {}, False
        try:
            for host, proc in zip(c.hosts, hosts):
                try:
                    said[host.name] = proc.proc.communicate(
                        timeout=max(0.0, end - time.monotonic()))[0]
                except subprocess.TimeoutExpired:
                    late = True
        finally:
            for host, proc in zip(c.hosts, hosts):
                if proc.poll() is None:
                    proc.signal(signal.SIGKILL)  # its group: the host's forked ranks too
                    said[host.name] = proc.proc.communicate()[0]
        statuses = {int(r): int(code) for r, code in
                    re.findall(r"EXIT rank=(\d+) status=(-?\d+)", "".join(said.values()))}
        results = []
        for s in slots:
            log = Path(logs) / f"{s.rank}.log"
            output = log.read_text(errors="replace") if log.exists() else ""
            if s.rank not in statuses:  # its host's process may say why (it died first)
                output += f"\n[no exit status; {s.host.name}'s process said:]\n" \
                          f"{said[s.host.name]}"
            # -9 where no status was reported: the rank was killed (here or with its host's)
            results.append(RankResult(s.rank, s.host.name, statuses.get(s.rank, -9), output,
                                      timed_out=late and s.rank not in statuses))
    if late:
        raise AssertionError(f"{script} {' '.join(args)} passed its {timeout}s deadline:\n"
                             + "\n".join(f"--- {r}" for r in results))
    return results
