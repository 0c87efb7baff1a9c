"""Allreduces in a loop until stopped; prints 'ready' once the shared memory is set up."""

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs

gs.init()
x = np.ones(1 << 20, dtype=np.float32)
gs.allreduce_(x, name="first")
print("ready", flush=True)
while True:
    gs.allreduce_(x, op=gs.Max, name="loop")
