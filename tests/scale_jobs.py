"""Jobs of 64 and 128 ranks forked from one process, and the 64-rank job that several files share.

A rank of 64 or 128 started on its own imports torch by itself: 150 MiB and 2-3 s of CPU each,
a minute and a half only to start 64 of them on 2 cores. ``forked`` starts N ranks of a rank
script as forks of one process that has imported torch once (tests/ranks/forked.py says why),
with the store hosted here, as torchrun's agent does; each rank is still a process with its
own runtime, connections and shared memory.

Even forked, a 64-rank job's start-up (64 runtimes meeting at the store, on 2 cores) is most of
a check's time there. So the 64-rank checks that leave the job usable run one after the other
in one job (``sixty_four``), each in a fresh ``init()`` (tests/ranks/suite.py runs each entry as
a fresh ``__main__``), the one that ends the job (a rank killed) last:

    connections.py:sockets        the sockets each rank holds, algorithm by algorithm, and the
                                  store requests of its init() (test_connections.py)
    scale_faults.py:sockets       the sockets after allreduces of every size's algorithm
                                  (test_scale.py)
    scale_faults.py:first-use     every pair's first contact at once (test_scale.py)
    scale_faults.py:secret=42     rank 42 with another secret: every rank fails, shuts down and
                                  goes on to the next entry (test_scale.py)
    scale_faults.py:lost=21       rank 21 dies after init(), before any collective: every other
                                  rank's first one names it (test_scale.py)

The sockets' counts come first: nothing before them in the process to count (the first
counts exactly). Both play every rank on a host of its own by name, the others on 16 hosts
of 4 (the job's ``GRADSYNC_HOSTNAME``). A check that fails ends its entry on that rank, so its
test and those of the entries after it fail, never pass (``ran``); the job is run once per
pytest process, and its time is charged to test_scale.py's line of the budgets, whichever file
asks first.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import loopback
from budgets import charged_to
from harness import RANKS, marked, new_mark, run_job

SIXTY_FOUR = ("connections.py:sockets", "scale_faults.py:sockets", "scale_faults.py:first-use",
              "scale_faults.py:secret=42", "scale_faults.py:lost=21")
"""The entries of the shared 64-rank job, in order (tests/ranks/suite.py's ``SCRIPT:ARG``)."""

DONE = "suite: script done"
"""What tests/ranks/suite.py prints (tagged) once an entry has returned on a rank."""


class Memory:
    """Samples, every second, the memory of one job: the sum of its processes' proportional
    set sizes (Pss: shared pages divided among the processes that share them), and the
    machine's memory in use (MemTotal - MemAvailable, which other processes move too)."""

    def __init__(self, mark: str):
        self.mark, self.job_peak = mark, 0
        self.start = self.machine_peak = self._used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _used() -> int:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) >> 10

    def _pss(self) -> int:
        total = 0
        for pid in marked(self.mark):
            try:
                with open(f"/proc/{pid}/smaps_rollup") as rollup:
                    total += int(re.search(r"^Pss:\s+(\d+)", rollup.read(), re.M).group(1))
            except (OSError, AttributeError):  # gone meanwhile
                pass
        return total >> 10

    def _run(self):
        while not self._stop.wait(1.0):
            self.machine_peak = max(self.machine_peak, self._used())
            self.job_peak = max(self.job_peak, self._pss())

    def stop(self) -> str:
        """Stops sampling; says the peaks, in MiB."""
        self._stop.set()
        self._thread.join()
        return (f"peak memory {self.job_peak} MiB (the job's Pss), machine in use "
                f"+{self.machine_peak - self.start} MiB over its start")


_TROUBLE = ("Traceback (most recent call last)", "Timeout (", "Fatal Python error")


@dataclass(repr=False)  # pytest shows an assertion's message by repr: the rank's output
class Job:
    returncode: int
    output: str        # the forking process's: one EXIT line per rank
    logs: dict         # rank -> everything it wrote
    wall: float        # seconds, start to the last rank's end
    memory: str        # the peaks of memory in use (Memory.stop)

    def status(self, rank: int) -> int:
        found = re.search(rf"EXIT rank={rank} status=(-?\d+)", self.output)
        return int(found.group(1)) if found else None

    def __str__(self) -> str:
        # The ranks that show an error (a traceback, a stack dump), else those that ended
        # without a result: a failed check names itself there.
        shown = [r for r, text in self.logs.items() if any(m in text for m in _TROUBLE)] or \
            [r for r, text in self.logs.items() if "RESULT" not in text and "SCALE OK" not in text]
        tails = "\n".join(f"--- rank {r} ---\n{self.logs[r][-1500:]}" for r in shown[:8])
        return f"exit {self.returncode}\n{self.output[-3000:]}\n{tails[-12000:]}"

    __repr__ = __str__


def forked(n: int, per_host: int, script: str, *args: str, timeout: float,
           env: dict | None = None) -> Job:
    """Runs ``n`` ranks of tests/ranks/``script`` over hosts of ``per_host`` ranks, forked
    from one process (tests/ranks/forked.py), with a store hosted here; the whole job is
    stopped at ``timeout`` (``harness.run_job``) and each rank dumps its stacks 10 s before.
    ``env``: more variables for every rank."""
    store = loopback.store(timeout)  # IPv4 only: no client of it waits on DNS (loopback.py)
    settings, env = env, {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                "GS_TEST_DEADLINE": str(timeout - 10), "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
                # 64 or 128 ranks that all start at once on 2 busy cores may take longer than
                # the default minute to meet, and a rank may wait its turn on a core past the
                # heartbeat's 15 s (measured: false losses at load 100): what is checked here is
                # what the ranks do once met, and a dead rank is found by its closed
                # connections, not by its silence.
                "GRADSYNC_CONNECT_TIMEOUT": str(timeout), "GRADSYNC_HEARTBEAT_TIMEOUT": "120",
                **(settings or {})})
    mark = new_mark()
    memory, start = Memory(mark), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gs-forked-") as logs:
        logs = Path(logs)
        try:
            done = run_job([sys.executable, str(RANKS / "forked.py"), str(n), str(per_host),
                            str(logs), str(RANKS / script), *args], timeout=timeout, env=env,
                           mark=mark, what=f"{script} {' '.join(args)} with {n} ranks")
        except AssertionError as exc:  # the deadline: show where the ranks were (their dumps)
            stacks = "\n".join(f"--- rank {r} ---\n{_log(logs, r)[-2500:]}"
                               for r in sorted({0, n // 2, n - 1}))
            raise AssertionError(f"{exc}\n{stacks}") from None
        finally:
            wall, peak = time.monotonic() - start, memory.stop()
            del store
        texts = {r: _log(logs, r) for r in range(n)}
    job = Job(done.returncode, done.stdout, texts, wall, peak)
    print(f"\n{script} {' '.join(args)}: {n} ranks, {n // per_host} hosts: wall {wall:.1f} s, "
          f"{peak}")
    return job


def _log(logs: Path, rank: int) -> str:
    path = logs / f"{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def entry_logs(job: Job, entry: str) -> dict:
    """Each rank's lines of one entry of a job of tests/ranks/suite.py, untagged."""
    tag = f"{entry}| "
    return {r: "".join(line.replace(tag, "", 1) for line in text.splitlines(keepends=True)
                       if tag in line)
            for r, text in job.logs.items()}


def ran(job: Job, entry: str) -> bool:
    """Whether ``entry`` returned without error on every rank of ``job``."""
    return all(DONE in text for text in entry_logs(job, entry).values())


def results(job: Job, entry: str | None = None) -> dict:
    """Each rank's RESULT line (of ``entry``, in a suite's job), less its prefix; a rank
    without one shows its output."""
    logs = job.logs if entry is None else entry_logs(job, entry)
    out = {}
    for r, text in logs.items():
        found = re.search(r"RESULT rank=\d+ (.*)", text)
        out[r] = found.group(1) if found else \
            f"<no result, exit {job.status(r)}>\n{job.logs[r][-2000:]}"
    return out


@functools.lru_cache(maxsize=None)
def sixty_four() -> Job:
    """The job of ``SIXTY_FOUR`` at 64 ranks on 16 hosts of 4 (run once, then remembered).

    Timeout: each entry alone had a job of 240 s (the sockets' under ``harness.spawn``, 252 s);
    together they took 36 s on the 2-core machine at a load of 8-22 and 70 s at 77-117
    (2026-11-29)."""
    with charged_to("test_scale.py"):
        return forked(64, 4, "suite.py", *SIXTY_FOUR, timeout=420)
