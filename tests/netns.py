"""Emulated multi-host clusters for tests: ``gradsync.testbed.netns`` plus the tests' conventions.

    with cluster([("h0", 2), ("h1", 2)], host_rate="1gbit") as c:
        for r in run_ranks(c, "sweep.py", timeout=60, placement="alternate"):
            assert r.returncode == 0, r

``cluster`` skips the test when network namespaces cannot be made (not root, no ``ip``).
``run_ranks`` starts ``tests/ranks/<script>`` as every rank, torchrun-style, in its host's
namespace, like ``harness.spawn``: GRADSYNC_* settings of the test process are dropped, each
rank's own deadline (GS_TEST_DEADLINE, see ``ranks/common.py``) dumps its stacks and exits 8 s
before ``timeout``, and at ``timeout`` every rank still running is killed and the test fails
with every rank's output.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pytest

from gradsync.testbed.netns import (Cluster, NetnsError, RankResult, cleanup_stale,  # noqa: F401
                                    measure_goodput, place, run, unavailable_reason)

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
