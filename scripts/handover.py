"""How fast bytes move from one core to another here, the ordinary way and streamed.

    python3 scripts/handover.py [ROUNDS]

Two processes, pinned to the first two CPUs this process may use, take ROUNDS rounds
(default 20) of three phases, each timed on both and printed by the first:

    private   each copies 1 MiB within its own memory and adds it up (no byte crosses)
    ordinary  the handover of the host segment's pieces road: each writes 1 MiB into a slot
              of a shared mapping, then (after a barrier) reads the other's slot and adds it
    streamed  the same, the slot written by ``_shmfast.c``'s streaming copy (non-temporal
              stores, as ``transport/segment_stores.py`` may choose)
    latency   a barrier of the two (one cache line each, written by one and read by the
              other), as a small allreduce's arrival is: microseconds per barrier, times 100

and prints microseconds per MiB for each, one column per round:
``private/ordinary/streamed/latency``.
On the 2-vCPU AMD virtual machines of docs/benchmarks.md ("The 64 MiB row's two states") the
ordinary handover moved between 60-90 us and 440-750 us every few seconds while the private
copies stayed at about 50 us: that is the slow state the pieces road measures its way around.
"""

from __future__ import annotations

import mmap
import os
import sys
import time

import numpy as np

from gradsync import _native

MIB = 1 << 20
HANDOVERS = 200  # per phase
BARRIERS = 20000


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    module = _native.load("_shmfast")
    if module is None:
        print("handover: the compiled module did not build (gradsync build-native)")
        return 1
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("handover: needs two CPUs")
        return 1
    seg = mmap.mmap(-1, 4 * MIB + 4096, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    words = np.frombuffer(seg, np.int64, count=16)  # one cache line each: the barrier's counts
    slots = np.frombuffer(seg, np.float32, offset=4096).reshape(2, 2, MIB // 4)
    child = os.fork()
    me = 0 if child else 1
    os.sched_setaffinity(0, {cpus[me]})
    count = 0

    def barrier() -> None:
        nonlocal count
        count += 1
        words[me * 8] = count
        while words[(1 - me) * 8] < count:
            pass

    a, b = np.ones(MIB // 4, np.float32), np.ones(MIB // 4, np.float32)
    columns = []
    for _ in range(rounds):
        row = []
        for phase in ("private", "ordinary", "streamed", "latency"):
            barrier()
            start = time.perf_counter()
            if phase == "latency":
                for _ in range(BARRIERS):
                    barrier()
                row.append((time.perf_counter() - start) / BARRIERS * 1e8)
                continue
            for i in range(HANDOVERS):
                if phase == "private":
                    np.copyto(b, a)
                    np.add(a, b, out=b)
                    continue
                mine, theirs = slots[me][i & 1], slots[1 - me][i & 1]
                if phase == "streamed":
                    module.stream(mine, a)
                else:
                    np.copyto(mine, a)
                barrier()
                np.add(a, theirs, out=b)
            row.append((time.perf_counter() - start) / HANDOVERS * 1e6)
        columns.append("/".join(f"{v:.0f}" for v in row))
    if child:
        os.waitpid(child, 0)
        print("us per MiB, private/ordinary/streamed, and 100 x us per barrier, one column "
              "per round:")
        print(" ".join(columns))
        return 0
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
