"""An operation that the last rank never issues fails on the others after GRADSYNC_TIMEOUT
with CollectiveMismatchError naming that rank (never a hang), after rank 0 warned about it;
then every rank goes on. Prints "ok stall <rank>".

    negotiation_stall.py DIR

The last rank issues nothing until the others have seen their error (each writes a file in
DIR): an operation it issued earlier would be waiting as long as the orphan, and expire too.
"""

import common  # noqa: F401  (deadline)

import os
import sys
import time

import torch

import gradsync.torch as hvd
from gradsync.errors import CollectiveMismatchError

hvd.init()
R, N = hvd.rank(), hvd.size()
last = N - 1

if R != last:
    start = time.monotonic()
    handle = hvd.allreduce_async(torch.ones(4), name="orphan")
    try:
        hvd.synchronize(handle)
    except CollectiveMismatchError as exc:
        waited = time.monotonic() - start
        text = str(exc)
        assert f"not by ranks [{last}]" in text and "orphan" in text, text
        assert 3.0 <= waited < 30, waited  # GRADSYNC_TIMEOUT=4 (rank 0's clock started first)
    else:
        raise AssertionError("an operation the last rank never issued completed")
    open(os.path.join(sys.argv[1], f"failed.{R}"), "w").close()
else:
    while len(os.listdir(sys.argv[1])) < N - 1:
        time.sleep(0.05)
# the name is free again and the job goes on
out = hvd.allreduce(torch.full((3,), float(R)), name="after", op=hvd.Sum)
assert (out == N * (N - 1) / 2).all(), out
hvd.barrier()
print(f"ok stall {R}", flush=True)
hvd.shutdown()
