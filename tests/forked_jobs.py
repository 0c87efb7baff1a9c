"""Ranks forked from one process that has imported torch once: ``harness.spawn``'s results for
one interpreter's start-up.

``harness.spawn`` starts each rank as an interpreter of its own, as torchrun does, and each one
imports torch for the rendezvous store: 2-3 s of CPU per rank on an idle core, so a 4-rank job
on 2 cores spends about 5 s before its first collective, and 15-45 s on a loaded machine.
``spawn`` here starts the ranks as forks of tests/ranks/forked.py, which imports torch (and
gradsync) once; each rank is still a process of its own, with its own runtime, connections,
shared memory, exit status and signals (SIGSTOP, SIGKILL), found through a store that this
process hosts, as torchrun's agent does. All ranks play one host (shared memory among them
unless a script asks for TCP), or ``per_host`` ranks each of several (TCP between them).
The result is the same as ``harness.spawn``'s: a ``harness.Rank`` per rank, its exit status
(negative: the signal that ended it) and everything it wrote, stdout and stderr together.

A job that runs several checks one after the other may give each its own store (``stores``):
a run that hosts torch.distributed's groups on the store (gloo's keys are named by the group's
number, which starts again after ``destroy_process_group``) must not meet the keys of the run
before it. The ranks find the stores' ports in ``GS_TEST_STORE_PORTS`` (the first is
``MASTER_PORT``).

Deadlines are the harness's: the whole job is stopped at ``timeout`` (``harness.run_job``), and
each rank dumps every thread's stack 8 s before (``GS_TEST_DEADLINE``), which the error shows.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import loopback
from harness import RANKS, REPORT_CHARS, Rank, Result, report, run_job

__all__ = ["spawn", "job", "lines", "BenchRuns", "bench_runs"]


def spawn(n: int, script: str, *args: str, timeout: float, env: dict | None = None,
          stores: int = 1, per_host: int | None = None, per_rank_env=None,
          lean: bool = False) -> list[Rank]:
    """Runs ``n`` ranks of tests/ranks/``script`` with ``args``, forked from one process;
    returns each rank's end (``harness.Rank``: ``returncode`` None if it never reported one).

    Args:
        timeout: the whole job's deadline in seconds.
        env: more variables for every rank (``GRADSYNC_*`` of this process are dropped).
        stores: how many stores to host (``GS_TEST_STORE_PORTS``).
        per_host: ranks per host, in rank order (tests/ranks/forked.py's PER_HOST: 2 of 3
            ranks is hosts ``h0 h0 h1``); default all ``n`` on one host.
        per_rank_env: ``per_rank_env(r)`` is more variables for rank ``r``, after the
            others (``GS_TEST_RANKS_ENV``), as ``harness.spawn``'s.
        lean: fork from a process that imported torch, NumPy and gradsync only
            (``GS_TEST_FORK_LEAN``: 1.5 s of CPU less), for scripts that build no optimizer
            and use no Horovod API.
    """
    hosted = [loopback.store(timeout) for _ in range(stores)]  # IPv4: no DNS wait per client
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    full_env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(hosted[0].port),
                     "GS_TEST_STORE_PORTS": ",".join(str(store.port) for store in hosted),
                     "GS_TEST_DEADLINE": str(max(5.0, timeout - 8)), "PYTHONUNBUFFERED": "1",
                     "OMP_NUM_THREADS": "1"})
    if lean:
        full_env["GS_TEST_FORK_LEAN"] = "1"
    if per_rank_env is not None:
        full_env["GS_TEST_RANKS_ENV"] = json.dumps([per_rank_env(r) for r in range(n)])
    full_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="gs-forked-") as logs:
        try:
            done = run_job([sys.executable, str(RANKS / "forked.py"), str(n),
                            str(per_host or n), logs, str(RANKS / script), *args],
                           timeout=timeout, env=full_env,
                           what=f"{script} with {n} forked ranks")
        except AssertionError as exc:  # the deadline: where each rank was (its stack dump)
            dumps = "\n".join(report(f"--- rank {r} ---", _log(logs, r), REPORT_CHARS // n)
                              for r in range(n))
            raise AssertionError(f"{exc}\n{dumps}") from None
        finally:
            del hosted  # the stores close with their last reference
        outputs = [_log(logs, r) for r in range(n)]
    statuses = {int(r): int(s) for r, s in re.findall(r"EXIT rank=(\d+) status=(-?\d+)",
                                                      done.output)}
    return [Rank(r, statuses.get(r), outputs[r]) for r in range(n)]


def job(n: int, script: str, *args: str, timeout: float, env: dict | None = None,
        lean: bool = False) -> Result:
    """``spawn``'s ranks as one job's end, as ``harness.launch`` gives it for the same script
    under ``gradsync run``: ``returncode`` 0 when every rank exited 0, else the first other
    status in rank order (None: a rank that never reported one); ``output`` every rank's,
    whole, in rank order. For the checks that read a job's lines and its status, not the
    launcher's doing (which stops the other ranks once one fails, and prefixes the lines).

    ``lean``: ``spawn``'s.
    """
    ranks = spawn(n, script, *args, timeout=timeout, env=env, lean=lean)
    status = next((rank.returncode for rank in ranks if rank.returncode != 0), 0)
    output = "".join(rank.output + ("" if rank.output.endswith("\n") else "\n")
                     for rank in ranks if rank.output)
    return Result(status, output, args=[script, *args])


def lines(ranks: list[Rank], tag: str) -> list[str]:
    """Every line that starts with ``[tag] `` in the ranks' outputs, without it, rank by rank
    in order: what a script that tags its lines (one tag per check) printed for one check."""
    prefix = f"[{tag}] "
    return [line[len(prefix):] for rank in ranks for line in rank.output.splitlines()
            if line.startswith(prefix)]


@dataclass(repr=False)
class BenchRuns:
    """The end of a job of tests/ranks/bench_runs.py: each rank's exit and output (``ranks``)
    and what each run printed (``stdout``), in ``folder``."""

    ranks: list
    folder: Path

    def stdout(self, name: str, rank: int = 0) -> str:
        """What run ``name`` printed to stdout on ``rank``: the module's own output."""
        path = self.folder / f"{name}.{rank}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def ran(self, name: str) -> bool:
        """Whether run ``name`` returned on every rank (what its job's exit status 0 said
        when it was a job of its own)."""
        return all(f"bench_runs: {name} done" in rank.output for rank in self.ranks)

    def __str__(self) -> str:  # an assertion's message: every rank's report
        return "\n".join(str(rank) for rank in self.ranks)

    __repr__ = __str__


def bench_runs(n: int, runs: list[dict], folder: Path, timeout: float,
               env: dict | None = None, per_host: int | None = None) -> BenchRuns:
    """Runs ``runs`` (tests/ranks/bench_runs.py's RUNS.json: name, module, args, env) one
    after the other in ``n`` forked ranks, a store for each; their output goes to
    ``folder``. ``env`` and ``per_host``: ``spawn``'s."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "runs.json").write_text(json.dumps(runs))
    ranks = spawn(n, "bench_runs.py", str(folder / "runs.json"), timeout=timeout,
                  stores=len(runs), env=env, per_host=per_host)
    return BenchRuns(ranks, folder)


def _log(logs: str, rank: int) -> str:
    path = Path(logs) / f"{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""
