"""An operation that the last rank never issues fails on the others after GRADSYNC_TIMEOUT
with CollectiveMismatchError naming that rank (never a hang), after rank 0 warned about it;
then every rank goes on. Two names at once, so that the test waits for one timeout, not two:
a name never seen (described in full, into rank 0's table) and a name that ran before (voted
for as a cache bit, which says nothing of who is missing, until it has waited long enough to go
in full). Prints "ok stall <rank>" and "ok cached-stall <rank>".

    negotiation_stall.py DIR

The last rank issues nothing until the others have seen both errors (each writes a file in
DIR): an operation it issued earlier would be waiting as long as the orphans, and expire too.
"""

import common  # noqa: F401  (deadline)

import os
import sys
import time

import torch

import gradsync.torch as hvd
from gradsync.errors import CollectiveMismatchError
from gradsync.torch import process_sets

hvd.init()
R, N = hvd.rank(), hvd.size()
last = N - 1


def orphans(names: list[str]) -> None:
    """Every rank but the last issues ``names`` at once; the last waits until they all failed.
    Each name's wait is GRADSYNC_TIMEOUT, so they expire together: one wait for all."""
    if R != last:
        start = time.monotonic()
        handles = {name: hvd.allreduce_async(torch.ones(4), name=name) for name in names}
        for name, handle in handles.items():
            try:
                hvd.synchronize(handle)
            except CollectiveMismatchError as exc:
                waited = time.monotonic() - start
                text = str(exc)
                assert f"not by ranks [{last}]" in text and name in text, text
                assert 3.0 <= waited < 30, waited  # GRADSYNC_TIMEOUT=4 (rank 0's clock first)
            else:
                raise AssertionError(f"an operation the last rank never issued completed: {name}")
        open(os.path.join(sys.argv[1], f"failed.{R}"), "w").close()
    else:
        while sum(f.startswith("failed") for f in os.listdir(sys.argv[1])) < N - 1:
            time.sleep(0.05)


# 'cached' runs once everywhere, so it is in the response cache; then the last rank skips it
# and a name never seen, 'orphan', at the same time
assert (hvd.allreduce(torch.ones(4), name="cached") == 1).all()  # as orphans() issues it
ctl = process_sets.controller(hvd.global_process_set)
orphans(["orphan", "cached"])
assert R == last or ctl.stats["demoted"] >= 1, ctl.stats  # 'cached' was voted for as a bit first
# the names are free again and the job goes on
out = hvd.allreduce(torch.full((3,), float(R)), name="after", op=hvd.Sum)
assert (out == N * (N - 1) / 2).all(), out
hvd.barrier()
print(f"ok stall {R}", flush=True)
print(f"ok cached-stall {R}", flush=True)
hvd.shutdown()
