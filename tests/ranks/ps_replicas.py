"""Replicated parameter servers under faults: ``ps_replicas.py MODE FAULT STEPS``.

Run with ``--servers S --ps-replicas R``. Workers train the MLP of ps_check.py on its
closed-form batches. At step ``STEPS // 3`` worker 0 hits the primary of shard 0 with FAULT:

    none   nothing (the fault-free run that a sync run with a fault must equal bit for bit)
    kill   SIGKILL
    stop   SIGSTOP; found silent after GRADSYNC_HEARTBEAT_TIMEOUT; SIGCONT once training is
           over if it still exists (the launcher kills a fenced server it finds silent, which
           may come first), when the server must find itself fenced out and end
    stopjoin   SIGSTOP, never SIGCONT while the others train: worker 0 trains on until the
           shard has its copies again (at most 30 s), which it may only because the launcher
           killed the stopped server and started its replacement; that server must be gone
    join   SIGKILL; the launcher starts the rank again and it joins with a copy while the
           others train; worker 0 waits for it (at most 60 s), then SIGKILLs that
           replacement too (now a backup, with its copy's names still in /dev/shm) and waits
           for the third process of the rank to join; then all train on
    stopjoin+join   stopjoin, then join with the primary of the shard's view then (server 1,
           whose copy took over) as the victim: one job for both, each the other's start-up
    joinbackup   the same with shard 0's first backup as the victim
    partition    (root; tests/test_ps_partition.py) shard 0's backup runs on a namespace host
           that worker 0 cuts off: this side's end of its veth (PART_OUTER) goes down, so the
           host loses its carrier but keeps its address, routes and sockets, and every packet
           is dropped, as behind a dead switch port. The backup is found silent and fenced;
           the launcher kills it (a kill that, as over ssh, reaches it late) and starts its
           replacement on that host, behind the cut. Once that replacement runs (at most
           40 s) worker 0 joins the host again, trains on until the shard has its copies
           again (60 s at most), and waits for the old process, awake again beside its
           replacement, to end (40 s at most)

With ``PS_LAST_DIES=1`` in the environment the last worker SIGKILLs itself once every worker
has left training, before it closes its client: a server that this worker never reached
(a replacement) must still learn that the workers are done.

At the end worker 0 checks what the mode guarantees from the surviving copies' counters and
prints ``digest <hex>`` of shard 0's parameters (one line per shard) for the test to compare:

- every acknowledged push is applied exactly once: the pushes that returned ``applied``,
  summed over the workers, equal the ``applied`` counter of every shard's primary
  (``sync``, ``async``, ``ssp``: every push; ``backup``: the rounds' gradients);
- every live copy of a shard holds the same version, clocks and parameter bits;
- ``ssp``'s clock gap stays within its bound; ``sync`` makes one version per step.
"""

import common  # deadline; until, gone
from checks import Checks

import os
import signal
import subprocess
import sys
import time

import numpy as np

import gradsync as gs
import gradsync.ps
from ps_check import model, train_step

fail = Checks(os.environ.get("GRADSYNC_RANK"), label="FAIL worker").fail


def run(mode: str, fault: str, steps: int) -> None:
    m = model()
    ps = gradsync.ps.ParameterClient(m, optimizer="adam", lr=0.01, mode=mode, backup=2,
                                     staleness=1)
    victim = ps.copies[ps.view[0].backups[0]].pid if fault in ("joinbackup", "partition") \
        else ps.peers[0].pid
    acked = 0
    for step in range(steps):
        if ps.rank == 0 and step == steps // 3 and fault == "partition":
            link("down")
            print(f"worker 0: cut the host of server pid {victim} at step {step}", flush=True)
        elif ps.rank == 0 and step == steps // 3 and fault != "none":
            os.kill(victim, signal.SIGSTOP if fault.startswith("stop") else signal.SIGKILL)
            print(f"worker 0: {fault} server pid {victim} at step {step}", flush=True)
        if ps.rank == 0 and step == steps // 3 + 1 and fault == "partition":
            # Step steps // 3 returned: its forward found the backup silent, view 1 left it
            # out. Only a launcher that replaces it without waiting for it to end starts one
            # while the old process runs on behind the cut.
            try:
                common.until(lambda: replacement(victim) is not None,  # a walk of /proc each
                             "no replacement of the cut-off server started behind the cut",
                             40, 0.2)
                print(f"worker 0: replacement pid {replacement(victim)} runs beside the cut-off "
                      f"server pid {victim}; the host joins again", flush=True)
            finally:
                link("up")
            acked += wait_for_join(m, ps, 1, limit=60)
            common.until(lambda: common.gone(victim), "the old copy did not end", 40)
        if ps.rank == 0 and step == steps // 3 + 1 and fault.startswith("stopjoin"):
            # Not woken by this script before the copies are back: only a launcher that
            # replaces it while it is stopped can bring them back.
            acked += wait_for_join(m, ps, ps.view[0].epoch, limit=30)
            if not common.gone(victim):
                fail(f"shard 0 has its copies again, but the stopped server (pid {victim}) "
                     f"still exists")
            print(f"worker 0: the stopped server pid {victim} was killed while stopped",
                  flush=True)
            if fault == "stopjoin+join":
                # This worker's own view may still be view 1 (a join moves no worker), and
                # view 2 already holds both copies: the join to wait for comes after it.
                primary, since = ps.view[0].primary, ps.views[0].newest(ps.view[0]).epoch
                print(f"worker 0: kill the primary, server {primary} pid {ps.peers[0].pid}",
                      flush=True)
                os.kill(ps.peers[0].pid, signal.SIGKILL)
                acked += join_twice(m, ps, primary, since)
        if ps.rank == 0 and step == steps // 3 + 1 and fault.startswith("join"):
            if fault == "join":
                acked += join_twice(m, ps, 0, ps.view[0].epoch)
            else:
                acked += wait_for_join(m, ps, ps.view[0].epoch)
        if ps.rank == ps.workers - 1 and mode != "sync":
            time.sleep(0.02)  # a slower worker: backup drops some, ssp waits for it
        acked += int(train_step(m, ps, ps.rank, step))
    ps.leave()
    total = int(gs.allreduce(np.array([acked], np.int64), op=gs.Sum)[0])
    gs.barrier()  # every worker has left: the counters are final
    if ps.rank == 0:
        check(ps, mode, steps, total)
        if fault.startswith("stop") and not common.gone(victim):
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass  # the launcher killed it meanwhile
            # A woken server finds itself fenced out and ends: wait for that, not a fixed
            # 3 s; the job's end would stop it otherwise.
            common.until(lambda: common.gone(victim), "the woken server did not end")
    gs.barrier()
    if os.environ.get("PS_LAST_DIES") and ps.rank == ps.workers - 1:
        os.kill(os.getpid(), signal.SIGKILL)  # its client never closes: no ``ps/closed``
    ps.close()


def link(state: str) -> None:
    """Cuts the namespace host off ("down") or joins it again ("up") at this side's end of its
    veth. Not its own end: that would take the host's routes with it, and a replacement's
    connect would fail at once (ENETUNREACH) instead of waiting, as it does behind a pulled
    cable or a dead switch port."""
    subprocess.run(["ip", "link", "set", os.environ["PART_OUTER"], state], check=True)


def replacement(old: int) -> int | None:
    """The pid of another server process of this job with the rank of process ``old``."""
    def environ(pid) -> list[bytes]:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")

    try:
        mine = [v for v in environ(old) if v.startswith((b"GRADSYNC_RANK=", b"GRADSYNC_JOB_ID="))]
    except OSError:
        return None
    if len(mine) != 2:
        return None
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == old:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if b"gradsync.ps" not in f.read():
                    continue
            if all(v in environ(name) for v in mine):
                return int(name)
        except OSError:
            continue  # it ended meanwhile
    return None


def join_twice(m, ps, server: int, since: int) -> int:
    """(``join``.) ``server`` was killed in view ``since``: trains on until its replacement has
    joined shard 0, SIGKILLs that replacement (a backup now, its copy's names in /dev/shm) and
    trains on until the rank's third process has joined; returns the pushes acknowledged
    meanwhile."""
    acked = wait_for_join(m, ps, since)
    epoch, again = ps.views[0].newest(ps.view[0]).epoch, ps._copy(server).pid
    os.kill(again, signal.SIGKILL)
    print(f"worker 0: kill the replacement, server pid {again}", flush=True)
    return acked + wait_for_join(m, ps, epoch)


def wait_for_join(m, ps, since: int, limit: float = 60) -> int:
    """Trains on (this worker too) until a view of shard 0 newer than ``since`` holds all its
    copies again (at most ``limit`` seconds); returns the pushes acknowledged meanwhile."""
    end, acked, step = time.monotonic() + limit, 0, 1000 + 1000 * since

    def whole():
        newest = ps.views[0].newest(ps.view[0])
        return newest.epoch > since and len(newest.members) == ps.replicas

    while not whole():
        if time.monotonic() > end:
            fail(f"no replacement joined shard 0 within {limit:g} s")
        acked += int(train_step(m, ps, ps.rank, step))  # training goes on meanwhile
        step += 1
        time.sleep(0.05)
    print(f"worker 0: shard 0 has {ps.replicas} copies again after {step - 1000 - 1000 * since} "
          f"more steps: "
          f"{ps.views[0].newest(ps.view[0])}", flush=True)
    return acked


def counters(ps, limit: float = 20) -> tuple[dict[int, dict], list[dict]]:
    """Every copy's counters and every primary's, read in one view of each shard. The
    launcher's replacement of a killed server (``kill``) may join a shard at any time, after
    training too, and then between the two reads: reads again until every primary reports the
    view whose members the copies were asked in."""
    end = time.monotonic() + limit
    while True:
        copies = ps.replica_stats()  # in the newest views, which it records in ps.view
        primaries = ps.stats()
        if all(p["view"] == [v.epoch, list(v.members)] for p, v in zip(primaries, ps.view)):
            return copies, primaries
        if time.monotonic() > end:
            fail(f"the shards' views kept changing for {limit:g} s: primaries "
                 f"{[p['view'] for p in primaries]}, copies asked in {ps.view}")
        time.sleep(0.1)


def check(ps, mode: str, steps: int, total: int) -> None:
    copies, primaries = counters(ps)
    for s, primary in enumerate(primaries):
        shard = [st for st in copies.values() if st["lo"] == primary["lo"]]
        print(f"shard {s}: primary {primary['server']} view {primary['view']}; copies "
              f"{[(st['server'], st['version'], st['digest']) for st in shard]}")
        if len(shard) != len(primary["view"][1]):
            fail(f"shard {s}: {len(shard)} live copies, the view has {primary['view'][1]}")
        for st in shard:
            for key in ("version", "clocks", "applied", "digest"):
                if st[key] != primary[key]:
                    fail(f"shard {s}: copy on server {st['server']} has {key} {st[key]}, the "
                         f"primary {primary[key]}")
        if primary["applied"] != total:
            fail(f"shard {s}: {primary['applied']} gradients applied, the workers had "
                 f"{total} pushes acknowledged")
        if mode == "sync" and primary["version"] != steps:
            fail(f"shard {s}: sync made {primary['version']} versions in {steps} steps")
        if mode == "ssp" and primary["max_clock_gap"] > 1:
            fail(f"shard {s}: ssp let a worker run {primary['max_clock_gap']} clocks ahead")
        if mode == "backup" and primary["max_staleness"] != 0:
            fail(f"shard {s}: backup applied a stale gradient: {primary}")
        print(f"digest {s} {primary['digest']}")
    print(f"{mode}: {total} acknowledged pushes, all applied once, copies agree")


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
