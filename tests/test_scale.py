"""The runtime at scale: 64 and 128 ranks on emulated hosts, correct, failing fast, recovering.

Issue 27's item 5 and the scale half of its on-demand connection tests, all in the slow tier:

- every collective, the Horovod API's ``DistributedOptimizer`` and the torch backend, correct at
  128 ranks over 16 emulated hosts of 8 (tests/ranks/scale.py, one job);
- a rank SIGKILLed among 128 while every other rank waits for it in an allreduce: every other
  rank ends with an error naming it within 5 s of the kill;
- among 64 ranks on 16 hosts: a peer lost before anyone first talks to it, every pair's first
  contact at once, a rank with the wrong secret (tests/ranks/scale_faults.py);
- the TCP sockets a rank holds after a few allreduces at 64 ranks, one per host: at most
  2·log2(N) + 4 (store and listener included);
- elastic recovery among 64 workers within 1 s (tests/ranks/scale_elastic.py).

Ranks play hosts by name (``GRADSYNC_HOSTNAME``): shared memory among the ranks of one name,
TCP between names. The jobs that need no launcher fork their ranks from one process that has
imported torch (tests/ranks/forked.py says why: 128 ranks started on their own need more memory
than this machine has); each rank is a process with its own runtime, and the test hosts the
store, as torchrun's agent does. Every test checks behaviour (results, errors, times), not how
the runtime gets there. Each prints what it measured (``pytest -s``): the job's wall time, the
machine's peak memory in use above its level at the start (other processes' changes included)
and the times checked.
"""

import math
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from harness import MARK, RANKS, launch, marked, new_mark, run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


class _Memory:
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


@dataclass(repr=False)  # pytest shows an assertion's message by repr: the rank's output
class Job:
    returncode: int
    output: str        # the forking process's: one EXIT line per rank
    logs: dict         # rank -> everything it wrote
    wall: float        # seconds, start to the last rank's end
    memory: str        # the peaks of memory in use (_Memory.stop)

    def status(self, rank: int) -> int:
        found = re.search(rf"EXIT rank={rank} status=(-?\d+)", self.output)
        return int(found.group(1)) if found else None

    def __str__(self) -> str:
        tails = "\n".join(f"--- rank {r} ---\n{text[-1500:]}" for r, text in self.logs.items()
                          if "RESULT" not in text and "SCALE OK" not in text)
        return f"exit {self.returncode}\n{self.output[-3000:]}\n{tails[-12000:]}"

    __repr__ = __str__


def forked(n: int, per_host: int, script: str, *args: str, tmp_path: Path,
           timeout: float, env: dict | None = None) -> Job:
    """Runs ``n`` ranks of tests/ranks/``script`` over hosts of ``per_host`` ranks, forked
    from one process (tests/ranks/forked.py), with a store hosted here; the whole job is
    stopped at ``timeout`` (``harness.run_job``) and each rank dumps its stacks 10 s before.
    ``env``: more variables for every rank."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout),
                     wait_for_workers=False)
    logs = tmp_path / "logs"
    logs.mkdir()
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
    memory, start = _Memory(mark), time.monotonic()
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


def results(job: Job) -> dict:
    """Each rank's RESULT line, less its prefix; a rank without one shows its output."""
    out = {}
    for r, text in job.logs.items():
        found = re.search(r"RESULT rank=\d+ (.*)", text)
        out[r] = found.group(1) if found else f"<no result, exit {job.status(r)}>\n{text[-2000:]}"
    return out


def wall_of(line: str) -> float:
    return float(re.search(r"wall=([\d.]+)", line).group(1))


def check_every_survivor_names(job: Job, victim: int, within: float) -> list[float]:
    """Every rank but ``victim`` caught a PeerLostError naming it, ``within`` seconds of the
    victim's death; returns those seconds."""
    assert job.status(victim) == -9, job
    dying = wall_of(re.search(r"DYING wall=\S+", job.logs[victim]).group(0))
    got, delays, seen = results(job), [], []
    for r, line in got.items():
        if r == victim:
            continue
        assert line.startswith("wall=") and "PeerLostError" in line, f"rank {r}: {line}"
        assert re.search(rf"\brank {victim}\b", line.split(":", 1)[1]), f"rank {r}: {line}"
        assert job.status(r) == 17, f"rank {r}: {line}"
        delays.append(wall_of(line) - dying)
        seen.append((delays[-1], r, line.split(":", 1)[1][:160]))
    print(f"kill -> error on the {len(delays)} survivors: median "
          f"{sorted(delays)[len(delays) // 2]:.2f} s, max {max(delays):.2f} s")
    seen.sort()
    for d, r, m in seen[-3:]:  # the slowest, whole (an assertion's message is cut short)
        print(f"  {d:.2f} s rank {r}:{m}\n{job.logs[r][-1500:]}")
    assert max(delays) < within, [f"{d:.2f} s rank {r}:{m}" for d, r, m in seen[:2] + seen[-3:]]
    return delays


def test_every_collective_the_optimizer_and_the_backend_at_128_ranks_on_16_hosts(tmp_path):
    job = forked(128, 8, "scale.py", tmp_path=tmp_path, timeout=540)
    assert job.returncode == 0, job
    done = {r: re.search(r"SCALE OK rank=\d+ checks=(\d+) .*private_mib=(\d+)", text)
            for r, text in job.logs.items()}
    assert all(done.values()), job
    assert len({m.group(1) for m in done.values()}) == 1, "ranks made different checks"
    print("rank 0's phases: " + "; ".join(re.findall(r"rank 0: (.* ok at [\d.]+ s)", job.logs[0])))
    private = sorted(int(m.group(2)) for m in done.values())
    print(f"{done[0].group(1)} checks per rank; private memory per rank at the end: median "
          f"{private[len(private) // 2]} MiB, max {private[-1]} MiB")


def test_a_rank_killed_among_128_ends_every_other_rank_naming_it_within_5_s(tmp_path):
    # Rank 37: host 4's sixth rank, neither a host's first rank nor the job's.
    job = forked(128, 8, "scale_faults.py", "kill", "37", tmp_path=tmp_path, timeout=300)
    check_every_survivor_names(job, 37, within=5.0)


def test_a_peer_lost_before_its_first_contact_among_64_is_named_by_every_rank(tmp_path):
    """The victim dies right after init(); the others' first collective needs every peer, so
    it meets the dead one (with connections made on first use: while connecting to it).

    Within the issue's 5 s of the kill (the victim dies once every rank's init() returned,
    counted in the store; the others begin the collective once its process has exited). The last
    survivor took 5-11 s while a wait's first round dialed all its peers before any liveness
    check (tcp handshakes of 60 peers on 2 cores) and a handshake with a busy peer hid the
    abort (and while the victim died before the slowest ranks' init() had returned); 1.0-1.4 s
    since the checks run between dials and during handshakes.
    """
    job = forked(64, 4, "scale_faults.py", "lost", "21", tmp_path=tmp_path, timeout=240)
    check_every_survivor_names(job, 21, within=5.0)


def test_every_pair_first_talks_at_once_among_64_and_all_is_correct(tmp_path):
    job = forked(64, 4, "scale_faults.py", "first-use", tmp_path=tmp_path, timeout=240)
    assert job.returncode == 0, job
    assert all(v == "ok: first use" for v in results(job).values()), job


def test_a_wrong_secret_among_64_fails_every_rank(tmp_path):
    job = forked(64, 4, "scale_faults.py", "secret", "42", tmp_path=tmp_path, timeout=240)
    got = results(job)
    for r, line in got.items():
        assert job.status(r) == 17 and line.startswith("wall="), f"rank {r}: {line}"
    assert any("AuthenticationError" in line for line in got.values()), got


def test_sockets_per_rank_after_allreduces_at_64_ranks_are_at_most_2_log2_n_plus_4(tmp_path):
    """Every rank on a host of its own, so every peer is a TCP connection; after allreduces
    of three sizes each rank counts the sockets in /proc/self/fd.

    Expected to FAIL until issue 27's connections on demand land: today every rank connects
    to every other at init() (a full mesh), N - 1 + store + listener sockets and more, 66 at
    64 ranks against the limit of 16 (ring: 2 peers, halving-doubling and doubling: log2 N).
    """
    n = 64
    job = forked(n, 1, "scale_faults.py", "sockets", tmp_path=tmp_path, timeout=240)
    assert job.returncode == 0, f"{job}\nranks that failed: " + str(
        {r: line for r, line in results(job).items() if not line.startswith("ok")})
    counts = {r: int(re.search(r"SOCKETS rank=\d+ count=(\d+)", text).group(1))
              for r, text in job.logs.items()}
    limit = 2 * int(math.log2(n)) + 4
    print(f"sockets per rank: min {min(counts.values())}, max {max(counts.values())}; "
          f"limit {limit}")
    over = {r: c for r, c in counts.items() if c > limit}
    assert not over, f"{len(over)} of {n} ranks hold more than {limit} sockets: {over}"


def test_elastic_recovery_among_64_workers_within_1_s():
    """Correct everywhere, and within 1 s where the 64 workers have cores enough: 0.23 s
    (first survivor 0.22 s) on the 16-core device machine, 2026-11-26. Below 8 cores only the
    time is expected to miss (11.7 s on 2 cores: half of it forming the new generation's World
    (rendezvous, shared-memory groups, heartbeat links of 60 processes on 2 cores), half the
    first collectives (the rollback's sync, connections on first use)); every correctness
    check above the timing runs and must pass on every machine."""
    # As `gradsync bench elastic` measures it: from the victim's death to the last survivor's
    # first completed step in the new generation (detection, re-formation, rollback, sync).
    # 16 hosts of 4 by name: the victim's host is blacklisted and its 3 other workers leave
    # with it, as in Horovod. (64 workers on one host would map 4 MiB of shared memory per
    # pair of them, 16 GiB, more than this machine has.)
    n, per_host, victim, at = 64, 4, 29, 7
    hosts = ",".join(f"127.0.0.{h + 1}:{per_host}" for h in range(n // per_host))
    gone = set(range(victim - victim % per_host, victim - victim % per_host + per_host))
    mark = new_mark()
    memory, start = _Memory(mark), time.monotonic()
    try:
        result = launch(n, "scale_elastic.py", str(victim), str(at), timeout=420,
                        launcher_args=("--min-np", "2", "-H", hosts), env={MARK: mark})
    finally:
        wall, peak = time.monotonic() - start, memory.stop()
    print(f"\nelastic, {n} workers on {n // per_host} hosts: wall {wall:.1f} s, {peak}")
    assert result.returncode == 0, result
    survivors = [w for w in range(n) if w not in gone]
    dying = [float(v) for v in re.findall(r"DYING wall=([\d.]+)", result.output)]
    first = [float(v) for v in re.findall(r"FIRSTSTEP wall=([\d.]+)", result.output)]
    launcher = [line for line in result.output.splitlines() if line.startswith("gradsync run")]
    stepped = sorted(int(w) for w in re.findall(r"^\[(\d+)\]<stdout>:FIRSTSTEP", result.output,
                                                re.M))
    assert len(dying) == 1 and stepped == survivors, (launcher, stepped)
    ends = re.findall(r"RESULT id=(\d+) rank=(\d+) size=(\d+) gen=(\d+) step=(\d+) "
                      r"total=([\d.]+)", result.output)
    assert sorted(int(e[0]) for e in ends) == survivors, result
    assert sorted(int(e[1]) for e in ends) == list(range(len(survivors))), result
    # Committed at step at - at % 5 by all n, everything after it redone by the survivors
    # (each step's allreduce: the sum of every worker's first rank + 1).
    committed = at - at % 5
    total = (n * (n + 1) / 2 * committed
             + sum(w + 1 for w in survivors) * (at + 10 - committed))
    assert {e[2:] for e in ends} == {(str(len(survivors)), "1", str(at + 10),
                                      f"{total:.1f}")}, result
    recovery = max(first) - dying[0]
    print(f"elastic recovery among {n}: {recovery:.2f} s (first survivor "
          f"{min(first) - dying[0]:.2f} s)")
    if recovery >= 1.0 and (os.cpu_count() or 1) < 8:
        pytest.xfail(f"correct, but {recovery:.1f} s to recover: CPU-bound below 8 cores "
                     f"({os.cpu_count()} here; 0.23 s on 16)")
    assert recovery < 1.0, recovery
