"""Rank 1 never issues the allreduce that rank 0 waits in: a hang that only the test's
deadline can end (the collective timeout is set far beyond it)."""

import time

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs

gs.init(timeout=600)
print(f"rank {gs.rank()} pid started", flush=True)
if gs.rank() == 1:
    time.sleep(600)
gs.allreduce(np.ones(4), name="never-matched")
