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
imported torch (tests/scale_jobs.py, tests/ranks/forked.py says why: 128 ranks started on their
own need more memory than this machine has); each rank is a process with its own runtime, and
the test hosts the store, as torchrun's agent does.

Two such jobs for seven checks (start-up is most of a check's time at this scale): one of 128
ranks runs scale.py, then the kill (tests/ranks/suite.py, each entry in an ``init()`` of its
own); the 64-rank job that tests/scale_jobs.py shares with test_connections.py runs the
sockets' counts, the first contacts, the wrong secret (every rank fails and goes on) and, last,
the lost peer (a dead rank ends the job). A check that fails ends its entry, so the checks
after it in the job fail too, never pass.

Every test checks behaviour (results, errors, times), not how the runtime gets there. Each prints
what it measured (``pytest -s``): the job's wall time, the machine's peak memory in use above
its level at the start (other processes' changes included) and the times checked.
"""

import functools
import math
import os
import re
import time

import pytest

from harness import MARK, launch, new_mark
from scale_jobs import Job, Memory, entry_logs, forked, ran, results, sixty_four

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.alone]


def wall_of(line: str) -> float:
    return float(re.search(r"wall=([\d.]+)", line).group(1))


def check_every_survivor_names(job: Job, victim: int, within: float,
                               entry: "str | None" = None) -> list[float]:
    """Every rank but ``victim`` caught a PeerLostError naming it, ``within`` seconds of the
    victim's death (in ``entry`` of a suite's job); returns those seconds."""
    assert job.status(victim) == -9, job
    dying = wall_of(re.search(r"DYING wall=\S+", job.logs[victim]).group(0))
    got, delays, seen = results(job, entry), [], []
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


@functools.lru_cache(maxsize=None)
def one_twenty_eight() -> Job:
    """128 ranks on 16 hosts of 8: scale.py's checks, then, in a fresh ``init()``, rank 37
    (host 4's sixth rank, neither a host's first rank nor the job's) SIGKILLed while every
    other rank waits for it in an allreduce. Each was a job of its own (540 s and 300 s
    deadlines; 197 s and 32 s idle, most of the second its start-up)."""
    return forked(128, 8, "suite.py", "scale.py", "scale_faults.py:kill=37", timeout=600)


def test_every_collective_the_optimizer_and_the_backend_at_128_ranks_on_16_hosts():
    job = one_twenty_eight()  # the kill after it ends the job: its status is the kill's
    assert ran(job, "scale.py"), job
    done = {r: re.search(r"SCALE OK rank=\d+ checks=(\d+) .*private_mib=(\d+)", text)
            for r, text in entry_logs(job, "scale.py").items()}
    assert all(done.values()), job
    assert len({m.group(1) for m in done.values()}) == 1, "ranks made different checks"
    print("rank 0's phases: " + "; ".join(re.findall(r"rank 0: (.* ok at [\d.]+ s)", job.logs[0])))
    private = sorted(int(m.group(2)) for m in done.values())
    print(f"{done[0].group(1)} checks per rank; private memory per rank at the end: median "
          f"{private[len(private) // 2]} MiB, max {private[-1]} MiB")


def test_a_rank_killed_among_128_ends_every_other_rank_naming_it_within_5_s():
    job = one_twenty_eight()
    assert ran(job, "scale.py"), job  # the kill runs after scale.py's checks, or not at all
    check_every_survivor_names(job, 37, within=5.0, entry="scale_faults.py:kill=37")


def test_a_peer_lost_before_its_first_contact_among_64_is_named_by_every_rank():
    """The victim dies right after init(); the others' first collective needs every peer, so
    it meets the dead one (with connections made on first use: while connecting to it).

    Within the issue's 5 s of the kill (the victim dies once every rank's init() returned,
    counted in the store; the others begin the collective once its process has exited). The last
    survivor took 5-11 s while a wait's first round dialed all its peers before any liveness
    check (tcp handshakes of 60 peers on 2 cores) and a handshake with a busy peer hid the
    abort (and while the victim died before the slowest ranks' init() had returned); 1.0-1.4 s
    since the checks run between dials and during handshakes.

    The last entry of the shared 64-rank job (tests/scale_jobs.py; its own job until
    2026-11-30, of the same 16 hosts of 4): after the wrong secret's, its ``init()`` is a fresh
    job of the same 64 processes.
    """
    job = sixty_four()
    assert ran(job, "scale_faults.py:secret=42"), job  # the entry before it returned
    check_every_survivor_names(job, 21, within=5.0, entry="scale_faults.py:lost=21")


def test_every_pair_first_talks_at_once_among_64_and_all_is_correct():
    job = sixty_four()  # an entry after the sockets' counts (tests/scale_jobs.py)
    entry = "scale_faults.py:first-use"
    assert ran(job, entry), job
    assert all(v == "ok: first use" for v in results(job, entry).values()), job


def test_a_wrong_secret_among_64_fails_every_rank():
    job = sixty_four()  # every rank reports its error, shuts down and goes on to the lost peer
    entry = "scale_faults.py:secret=42"
    got = results(job, entry)
    for r, line in got.items():
        assert line.startswith("wall=") and "Error" in line.split(":", 1)[0], f"rank {r}: {line}"
    assert ran(job, entry), job  # and shut down on every rank
    # The first connection to meet the wrong secret names it, and its record is what the
    # others report: a pair of the alltoall (AuthenticationError), or a heartbeat link, whose
    # PeerLostError ("broke its heartbeat link: ...") carries the AuthenticationError's
    # message, which names the secret. Which comes first is a race: in the shared job, its
    # ranks warm from three init()s before, a heartbeat link won it (2026-11-29).
    assert any("AuthenticationError" in line or "GRADSYNC_SECRET" in line
               for line in got.values()), got


def test_sockets_per_rank_after_allreduces_at_64_ranks_are_at_most_2_log2_n_plus_4():
    """Every rank on a host of its own, so every peer is a TCP connection; after allreduces
    of three sizes (each size's own algorithm, as the planner picks it) each rank counts the
    sockets in /proc/self/fd. A full mesh held 66 at 64 ranks, against the limit of 16 (ring:
    2 peers, halving-doubling and doubling: log2 N).

    Not the same check as test_connections.py's sockets at 64 ranks, which forces the ring and
    then recursive doubling and counts exactly; both run in the one 64-rank job of
    tests/scale_jobs.py, this one second (after one ``shutdown()``: what a World leaves behind
    would count here).
    """
    n = 64
    job = sixty_four()
    entry = "scale_faults.py:sockets"
    assert ran(job, entry), f"{job}\nranks that failed: " + str(
        {r: line for r, line in results(job, entry).items() if not line.startswith("ok")})
    counts = {r: int(re.search(r"SOCKETS rank=\d+ count=(\d+)", text).group(1))
              for r, text in entry_logs(job, entry).items()}
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
    memory, start = Memory(mark), time.monotonic()
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
